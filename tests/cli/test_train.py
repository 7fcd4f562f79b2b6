"""``bigmem train``'s argument handling that runs before TensorFlow: ``--config`` and the per-node workers' configs."""

from __future__ import annotations

import json

import pytest

from bigmem.cli.main import build_parser
from bigmem.cli.train import resolve
from bigmem.config.presets import resolve_config
from bigmem.distribute.pernode import Worker, worker_config
from bigmem.errors import DataError, UsageError


def _resolve(*flags: str):
    return resolve(build_parser().parse_args(["train", *flags]))


def _written(tmp_path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    return str(path)


def test_a_config_file_is_trained_as_written(tmp_path):
    config = resolve_config("tiny", {"train": {"steps": 7}, "model": {"deep_supervision": True},
                                     "data": {"augment": "light"}})
    resolved, out = _resolve("--config", _written(tmp_path, config), "--out", str(tmp_path / "run"))
    assert resolved.to_dict() == config.to_dict()
    assert out == tmp_path / "run"


def test_a_config_file_takes_no_setting_beside_it(tmp_path):
    path = _written(tmp_path, resolve_config("tiny"))
    with pytest.raises(UsageError, match=r"leave out --steps, --model\.$|leave out --model, --steps\.$"):
        _resolve("--config", path, "--model", "tiny", "--steps", "3")


def test_an_unreadable_config_file_is_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match=r"^Cannot read the config .*bad\.json: "):
        _resolve("--config", str(tmp_path / "bad.json"))


def test_a_worker_trains_the_job_multiworker_on_its_own_node():
    job = resolve_config("tiny", {"train": {"batch_size": 2}, "model": {"deep_supervision": True}})
    worker = worker_config(job, Worker(1, 3, (8, 9, 10, 11), "127.0.0.1:5000"))
    assert worker.distribute.strategy.value == "multiworker"
    assert worker.numa.policy == "bind:3"
    assert worker.numa.cpus is None  # the whole node: bind:3 runs on its CPUs
    assert worker.updated({"distribute": {"strategy": "none"}, "numa": {"policy": "none"}}).to_dict() == job.to_dict()


def test_a_worker_on_a_split_node_gets_its_own_cpus():
    job = resolve_config("tiny")
    worker = worker_config(job, Worker(1, 0, (2, 3), "127.0.0.1:5001", split=True))
    assert worker.numa.cpus == "2-3"
