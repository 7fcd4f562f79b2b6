"""``train/job.py``: a job prepared once (its execution, learning rate, loader and memory plan), and the memory
plan as ``bigmem train`` shows and writes it (plan.json), with the recompute savers' equivalence."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from bigmem.config import resolve_config
from bigmem.distribute.execution import SingleProcess, data_parallel
from bigmem.distribute.strategy import Replicas
from bigmem.errors import InsufficientMemoryError
from bigmem.numa.policy import PolicyKind
from bigmem.rundir import read_jsonl
from bigmem.train.job import plan_memory, prepare_job, total_steps_for
from helpers import run_cli


def _quiet() -> Console:
    return Console(file=io.StringIO(), soft_wrap=True)


def _tiny(store, **sections):
    return resolve_config("tiny", {"data": {"store": str(store)}, "train": {"steps": 3, "lr": 0.002},
                                   **sections})


def _two_replicas(simulated: bool) -> Replicas:
    """Two replicas without a strategy: the decisions of ``data_parallel`` need no devices."""
    return Replicas(None, 2, simulated, ("/cpu:0", "/cpu:1") if simulated else ("/gpu:0", "/gpu:1"))


def test_a_job_without_a_strategy_runs_in_this_process_at_the_learning_rate_given(tmp_path, tiny_store):
    console = _quiet()
    job = prepare_job(_tiny(tiny_store), tmp_path / "run", console=console)
    try:
        assert job.execution == SingleProcess(batch_size=1)
        assert (job.learning_rate, job.total_steps, job.resume_from) == (0.002, 3, None)
        assert (job.loader.batch_size, job.loader.patch) == (1, None)
        assert job.placement.kind is PolicyKind.NONE
        assert job.config.data.store == str(tiny_store)
        assert job.config.model.num_classes == 3  # the store's
        plan = job.plan.to_dict()
        assert plan["data_parallel"] is None
        assert plan["fits"] is True
        assert plan["chosen"]["batch_size"] == 1
        assert console.file.getvalue().startswith("Memory: predicted peak ")
        assert not (tmp_path / "run").exists()  # prepared, nothing written: the trainer writes plan.json
    finally:
        job.close()


def test_a_data_parallel_job_loads_its_share_plans_its_host_and_scales_the_learning_rate(tmp_path, tiny_store,
                                                                                        monkeypatch):
    import bigmem.train.job as job_module
    from bigmem.memory.profile import counts_function

    chosen = []

    def mirrored_on_two(config):
        chosen.append(data_parallel(config, _two_replicas(simulated=True), counts_function(config)))
        return chosen[-1]

    monkeypatch.setattr(job_module, "choose_execution", mirrored_on_two)
    job = prepare_job(_tiny(tiny_store, distribute={"strategy": "mirrored", "patch": 8}), tmp_path / "run",
                      console=_quiet())
    try:
        assert job.execution is chosen[0]
        assert job.learning_rate == pytest.approx(0.004)  # linear scaling: a global batch of 2 from one replica's 1
        assert (job.loader.batch_size, job.loader.patch) == (2, (8, 8, 8))
        plan = job.plan.to_dict()
        assert plan["data_parallel"] == chosen[0].to_dict()
        assert plan["data_parallel"]["global_batch"] == 2
        assert plan["chosen"]["batch_size"] == 2
        assert plan["chosen"]["spatial_shape"] == [8, 8, 8]  # the host's load
    finally:
        job.close()


def test_a_host_that_holds_only_the_input_is_not_refused_for_activations(tiny_store):
    from bigmem.memory.profile import counts_function

    config = _tiny(tiny_store, memory={"budget_bytes": 2**20}, distribute={"strategy": "mirrored", "patch": 8})
    real_gpus = data_parallel(config, _two_replicas(simulated=False), counts_function(config))
    plan, _ = plan_memory(config, real_gpus, None, force=False, console=_quiet())
    assert plan.fits is False
    assert plan.data_parallel.to_dict() == real_gpus.to_dict()  # over budget, but not this host's
    with pytest.raises(InsufficientMemoryError, match=r"^Predicted peak .* exceeds the memory budget 1\.00 MiB"):
        plan_memory(config, SingleProcess(1), None, force=False, console=_quiet())


@pytest.mark.parametrize("steps, epochs, expected", [(7, None, 7), (None, 3, 3 * 5), (None, None, 5)])
def test_the_run_length_is_steps_else_epochs_of_the_loader(steps, epochs, expected):
    config = resolve_config("tiny", {"train": {"steps": steps, "epochs": epochs}})
    assert total_steps_for(config, steps_per_epoch=5) == expected


def test_refuses_what_does_not_fit(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--model", "small", "--volume", 128, "--memory-budget", "1GiB",
                            "--out", out], capsys)
    assert code == 3
    assert err.startswith("bigmem train: error: Predicted peak ")
    assert "for small at 128^3 x batch 2 (fp32) exceeds the memory budget 1.00 GiB (--memory-budget): " in err
    assert err.strip().endswith("; or pass --force to try anyway.")
    assert not out.exists()


def test_volume_512_refuses_with_required_and_available(tmp_path):
    result = subprocess.run([sys.executable, "-m", "bigmem", "train", "--volume", "512", "--out",
                             str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "Predicted peak " in result.stderr
    assert "(MemAvailable)" in result.stderr
    assert "Traceback" not in result.stderr


def test_force_trains_anyway_and_plan_json_says_so(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--steps", 1, "--memory-budget",
                                 "1MiB", "--force", "--out", out], capsys)
    assert code == 0, err
    assert "over budget, forced" in stdout
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fits"] is False
    assert plan["forced"] is True
    assert plan["budget_bytes"] == 2**20
    assert plan["predicted_peak_bytes"] == sum(plan["components"].values())


def test_plan_json_in_every_run(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--model", "tiny", "--data", tiny_store, "--steps", 1, "--out", out], capsys)[0] == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fits"] is True
    assert plan["budget_source"] == "MemAvailable"
    chosen = {k: plan["chosen"][k] for k in ("volume", "batch_size", "precision", "recompute", "recompute_stages",
                                             "partitioned_stages")}
    assert chosen == {"volume": 16, "batch_size": 1, "precision": "fp32", "recompute": "none",
                      "recompute_stages": [], "partitioned_stages": []}
    # plan.json is bigmem plan's schema (Plan.to_dict): the chosen candidate's breakdown and step time too.
    assert plan["chosen"]["components"] == plan["components"]
    assert plan["chosen"]["step_rate_source"]
    assert plan["candidates"] == [plan["closest"]]
    assert plan["best_per_mode"] == [plan["closest"]]


def _recompute_base(store) -> list:
    return ["train", "--model", "tiny", "--data", store, "--steps", 3, "--seed", 4]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, tiny_store):
    """The run without recompute that each mode of test_recompute_gives_the_same_training is compared with:
    the same command for both modes, so trained once."""
    from bigmem.cli.main import main

    out = tmp_path_factory.mktemp("recompute") / "plain"
    assert main([str(a) for a in [*_recompute_base(tiny_store), "--out", out]]) == 0
    return out


@pytest.mark.parametrize("mode", ["stages", "auto"])
def test_recompute_gives_the_same_training(tmp_path, tiny_store, capsys, mode, plain_run):
    base = _recompute_base(tiny_store)
    extra = ["--recompute", mode] + (["--memory-budget", "1MiB", "--force"] if mode == "auto" else [])
    code, _, err = run_cli([*base, *extra, "--out", tmp_path / mode], capsys)
    assert code == 0, err
    plan = json.loads((tmp_path / mode / "plan.json").read_text())
    # stages: every stage; auto with a budget nothing fits: it ends up recomputing every stage too.
    assert sorted(plan["chosen"]["recompute_stages"]) == ["dec0", "dec1", "enc0", "enc1", "enc2"]
    assert json.loads((plain_run / "plan.json").read_text())["chosen"]["recompute_stages"] == []
    plain = read_jsonl(plain_run / "metrics.jsonl")
    again = read_jsonl(tmp_path / mode / "metrics.jsonl")
    for a, b in zip(plain, again):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)


def test_bf16_without_native_support_says_it_is_emulated(tmp_path, tiny_store, capsys, monkeypatch):
    from helpers import run_cli

    for native, warned in (("0", True), ("1", False)):
        monkeypatch.setenv("BIGMEM_NATIVE_BF16", native)
        code, out, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--out", tmp_path / native,
                                  "--steps", 1, "--precision", "bf16", "--monitor-interval", 0], capsys)
        assert code == 0, err
        assert ("bf16 is emulated, about 20x slower than fp32" in out) == warned
