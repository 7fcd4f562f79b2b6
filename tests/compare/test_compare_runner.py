"""compare's child: the request is the config plus the run's options, mapped onto train's settings; failures named."""

from __future__ import annotations

import json

import pytest

from bigmem.compare.runner import MODULE, STEPS_UNTIL_TIME_BUDGET, RunRequest, summarize
from bigmem.compare.run import GpuMemory, Settings, _run_config, _train
from bigmem.config.presets import resolve_config
from bigmem.errors import BigmemError, UsageError
from bigmem.rundir import RunDir


@pytest.fixture
def config(tiny_store):
    return resolve_config("tiny", {"data": {"store": str(tiny_store), "shape": [16, 16, 16]}})


def test_the_run_length_and_checkpoints_are_options_of_the_request(config):
    steps = RunRequest(config, "run", steps=6, time_budget_s=None).training_config().train
    assert (steps.steps, steps.epochs, steps.time_budget_s) == (6, None, None)
    assert steps.checkpoint_every == 6  # no periodic checkpoints: only the one where the run ends
    timed = RunRequest(config, "run", steps=None, time_budget_s=2.5).training_config().train
    assert (timed.steps, timed.time_budget_s, timed.checkpoint_every) == (STEPS_UNTIL_TIME_BUDGET, 2.5,
                                                                          STEPS_UNTIL_TIME_BUDGET)
    periodic = RunRequest(config, "run", steps=6, time_budget_s=None, periodic_checkpoints=True)
    assert periodic.training_config().train.checkpoint_every == config.train.checkpoint_every == 2
    with pytest.raises(UsageError, match="A compare run needs steps or a time budget: got neither."):
        RunRequest(config, "run", steps=None, time_budget_s=None).training_config()


def test_the_request_travels_as_json(config):
    request = RunRequest(config.updated({"train": {"seed": 3}}), "cmp/cpu_bigmem/seed-3", steps=None,
                         time_budget_s=1.5)
    assert RunRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request


def test_each_path_runs_the_compared_job_with_compare_s_settings(config):
    settings = Settings(replicas=3, simulate=True, gpu_memory=GpuMemory(2**30), holdout=2,
                        memory_budget_bytes=8 * 2**30, monitor_interval_s=0.0)
    cpu = _run_config(config, settings, seed=1, val_every=5, data_parallel=False)
    assert (cpu.data.holdout, cpu.train.seed, cpu.train.val_every, cpu.memory.budget_bytes,
            cpu.train.monitor_interval_s) == (2, 1, 5, 8 * 2**30, 0.0)
    assert cpu.distribute == config.distribute
    assert cpu.model == config.model
    assert cpu.data.shape == (16, 16, 16)
    dp = _run_config(config, settings, seed=1, val_every=20, data_parallel=True)
    assert (dp.distribute.strategy.value, dp.distribute.simulate_replicas, dp.distribute.gpus,
            dp.distribute.gpu_memory_bytes, dp.train.val_every) == ("mirrored", 3, None, 2**30, 20)
    gpus = _run_config(config, Settings(replicas=4, simulate=False, gpu_memory=GpuMemory(2**30)), seed=0,
                       val_every=1, data_parallel=True)
    assert (gpus.distribute.gpus, gpus.distribute.simulate_replicas, gpus.memory.budget_bytes) == (4, None, None)


def test_a_run_s_figures_come_from_its_run_directory(tmp_path):
    run = RunDir(tmp_path / "seed-0")
    run.path.mkdir()
    run.append_metrics([{"step": 1, "step_s": 2.0, "voxels_per_s": 10.0, "dice": 0.1},
                        {"step": 2, "step_s": 0.5, "voxels_per_s": 40.0, "dice": 0.2, "val_dice": 0.15},
                        {"step": 3, "step_s": 0.7, "voxels_per_s": 30.0, "dice": 0.3}])
    run.write_summary(steps=3, train_s=9.0, peak_rss_bytes=123, loss=0.5, dice=0.3, input_wait_s=0.0,
                      step_time_s=3.2, input_stall_share=0.0)
    figures = summarize(run.path)
    assert (figures.steps, figures.peak_host_bytes, figures.final_train_dice) == (3, 123, 0.3)
    assert figures.train_s == pytest.approx(3.2)  # the steps' own seconds, not the loop's wall time
    assert (figures.step_s, figures.voxels_per_s) == (0.6, 35.0)  # medians without the first, tracing step
    assert [(p.step, p.val_dice) for p in figures.curve] == [(1, None), (2, 0.15), (3, None)]
    assert figures.curve[1].time_s == pytest.approx(2.5)


def test_a_failed_run_is_reported_with_the_child_s_error(config, tmp_path):
    (tmp_path / "cpu_bigmem").mkdir()
    (tmp_path / "cpu_bigmem" / "seed-0").write_text("in the way")
    with pytest.raises(BigmemError, match=r"^Training cpu_bigmem/seed-0 failed in the child process \(exit 1\): "
                                          r"bigmem.errors.TrainingError: Run directory .* is a file, not a folder"):
        _train(config, tmp_path / "cpu_bigmem" / "seed-0", steps=2, time_budget_s=None)
    assert MODULE == "bigmem.compare.runner"
