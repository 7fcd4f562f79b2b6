"""RunDir: the names of a run directory's files, its writers and readers (the writer itself: tests/test_atomic.py)."""

from __future__ import annotations

import errno
import json

import pytest

from bigmem import atomic
from bigmem.errors import DiskFullError
from bigmem.rundir import RunDir

SUMMARY = {"steps": 12, "train_s": 3.5, "peak_rss_bytes": 2**30, "loss": 0.25, "dice": 0.75, "input_wait_s": 0.5,
           "step_time_s": 3.0, "input_stall_share": 0.5 / 3.0}


def test_file_names_are_the_run_directory_contract(tmp_path):
    run = RunDir(tmp_path / "run")
    names = {key: getattr(run, key).relative_to(run.path).as_posix() for key in (
        "config", "sysinfo", "plan", "numa", "metrics", "monitor", "monitor_info", "summary", "checkpoints", "model",
        "report")}
    assert names == {"config": "config.json", "sysinfo": "sysinfo.json", "plan": "plan.json", "numa": "numa.json",
                     "metrics": "metrics.jsonl", "monitor": "monitor.csv", "monitor_info": "monitor.json",
                     "summary": "summary.json", "checkpoints": "checkpoints", "model": "model.keras",
                     "report": "report"}


def test_a_new_run_reads_as_empty(tmp_path):
    run = RunDir(tmp_path / "run")
    assert not run.holds_run()
    assert [run.read_config(), run.read_plan(), run.read_numa(), run.read_summary(), run.read_monitor_info()] == [
        None] * 5
    assert run.read_metrics() == []


@pytest.mark.parametrize("name", ["config", "sysinfo", "plan", "numa"])
def test_json_files_round_trip(tmp_path, name):
    run = RunDir(tmp_path / "run")
    data = {"name": name, "nested": {"bytes": 2**40, "list": [1, 2]}}
    written = getattr(run, f"write_{name}")(data)
    assert written == getattr(run, name)
    assert json.loads(written.read_text()) == data
    if name != "sysinfo":
        assert getattr(run, f"read_{name}")() == data
    assert sorted(p.name for p in run.path.iterdir()) == [written.name]  # no temporary file left


def test_summary_schema(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_summary(**SUMMARY)
    assert list(json.loads(run.summary.read_text())) == list(SUMMARY)  # the keys, in their order
    assert run.read_summary() == SUMMARY


def test_a_write_replaces_the_file_whole(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_plan({"fits": True})
    with open(run.plan) as reader:  # a reader that opened the old file keeps reading the old file
        run.write_plan({"fits": False, "budget_bytes": 2**30})
        assert json.loads(reader.read()) == {"fits": True}
    assert run.read_plan() == {"fits": False, "budget_bytes": 2**30}


def test_metrics_of_a_killed_run(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.append_metrics([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}, {"step": 3, "loss": 0.8}])
    with open(run.metrics, "a") as handle:
        handle.write('{"step": 4, "lo')  # torn by a kill
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    run.truncate_metrics(2)  # a resume from the checkpoint at step 2
    assert [r["step"] for r in run.read_metrics()] == [1, 2]


def test_a_torn_json_file_is_an_error_not_an_absence(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.summary.write_text('{"steps": 1')
    with pytest.raises(json.JSONDecodeError):
        run.read_summary()


def test_a_failed_metrics_append_leaves_no_torn_line(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.append_metrics([{"step": 1, "loss": 1.0}])
    before = run.metrics.read_bytes()
    real_open = open

    class FullFile:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[:7])  # part of a line reaches the disk, then the disk is full
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "free_bytes", lambda path: 16)
    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: FullFile(real_open(path, mode, *a, **k)))
    message = r"^No space left on device writing '.*metrics\.jsonl' \(needed about 25 B, 16 B free\)\. "
    with pytest.raises(DiskFullError, match=message):
        run.append_metrics([{"step": 2, "loss": 0.5}])
    monkeypatch.undo()
    assert run.metrics.read_bytes() == before
