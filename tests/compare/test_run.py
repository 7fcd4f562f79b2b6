"""compare's runs: the GPU path tiles, both paths scored as their users would, refusals before training."""

from __future__ import annotations

import json

import pytest

from bigmem.compare.run import GpuMemory, Settings, scaled_gpu_memory
from bigmem.config.presets import resolve_config
from bigmem.infer.evaluate import evaluate
from bigmem.memory.profile import counts_function
from bigmem.rundir import read_jsonl


def test_the_scaled_stand_in_keeps_the_real_proportion():
    from bigmem.distribute.planning import gpu_footprint_bytes, largest_edge

    config = resolve_config("small", {"data": {"volume": 64}})
    counts_for = counts_function(config)
    memory = scaled_gpu_memory(config, counts_for)
    kits19 = resolve_config("kits19", {"train": {"batch_size": 2}})
    real = largest_edge(kits19, counts_function(kits19), 80 * 2**30, 2, 512)
    assert real == 256  # the planner's patch for the headline case: half the edge
    assert largest_edge(config, counts_for, memory.bytes, 2, 64) == 32  # so, half of 64
    assert memory.bytes == gpu_footprint_bytes(config, counts_for, 32, 2)
    assert "scaled stand-in" in memory.stand_in
    assert "256^3 of a 512^3 kits19" in memory.stand_in


def test_settings_refuse_what_no_run_could_use():
    from bigmem.errors import UsageError

    good = dict(replicas=2, simulate=True, gpu_memory=GpuMemory(2**30))
    for bad, message in ((dict(seeds=0), "seeds 0"), (dict(equal="energy"), "equal 'energy'"),
                         (dict(time_budget_s=float("inf")), "time_budget_s inf"), (dict(replicas=0), "replicas 0")):
        with pytest.raises(UsageError, match=message):
            Settings(**{**good, **bad}).check()
    assert Settings(**good).cpu_time_budget_s == 120.0
    assert Settings(**good, steps=5).cpu_time_budget_s is None


@pytest.mark.slow
def test_compare_tiles_and_scores_both_paths_as_their_users_would(tmp_path, tiny_store, capsys):
    from helpers import run_cli

    # The command in this process (as test_a_refusal_comes_before_any_training runs it): each run still
    # trains in a process of its own (compare/runner.py), the simulated replicas' devices with it.
    out = tmp_path / "cmp"
    code, stdout, stderr = run_cli(["compare", "--model", "tiny", "--data", tiny_store, "--volume", "16",
                                    "--steps", "4", "--equal", "flops", "--val-every", "2", "--simulate-replicas", "2",
                                    "--holdout", "1", "--out", out], capsys)
    assert code == 0, stderr
    assert "SIMULATED ON CPU" in stdout
    assert "scaled stand-in" in stderr
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "compare.json").read_text())
    assert report["patch_size"] == [8, 8, 8]
    assert report["volume"] == 16  # the GPU path tiles
    assert report["held_out_cases"] == ["synth_0003"]
    assert report["seeds"] == 1
    assert report["conclusion"]["text"] in stdout
    assert report["conclusion"]["text"] in (
        out / "compare.md").read_text()
    cpu, dp = report["paths"]["cpu_bigmem"], report["paths"]["data_parallel"]
    # equal FLOPs: 4 steps of 1 x 16^3 against 2 x 8^3 per step: 4 x 16^3 / (2 x 8^3) = 16 steps
    assert (cpu["steps"], dp["steps"]) == (4, 16)
    assert cpu["train_flops"] == dp["train_flops"]
    for name, path, mode in (("cpu_bigmem", cpu, "whole"), ("data_parallel", dp, "sliding 8^3, overlap 0.5")):
        run = path["runs"][0]
        assert path["inference_mode"] == mode
        assert run["held_out"]["mode"] == mode
        rows = read_jsonl(out / name / "seed-0" / "metrics.jsonl")
        assert len(rows) == run["steps"]
        assert run["train_s"] == pytest.approx(sum(r["step_s"] for r in rows))
        assert [p["step"] for p in run["curve"] if "val_dice" in p] == [r["step"] for r in rows if "val_dice" in r]
        # scored by evaluate's code on predict's files: the same numbers again from the files left behind
        scored = evaluate(out / name / "seed-0-predictions", tiny_store, allow_missing=True)
        assert path["dice"] == pytest.approx(scored["foreground_mean_defined"]["Dice"], abs=1e-12)
        assert set(path["per_class"]) == {"1", "2"}
    # the data-parallel path validates at the whole-volume path's FLOPs spacing: every 2 x 4 = 8 steps
    assert [r["step"] for r in read_jsonl(out / "data_parallel" / "seed-0" / "metrics.jsonl")
            if "val_dice" in r] == [8, 16]


def test_a_refusal_comes_before_any_training(tmp_path, tiny_store, capsys):
    from helpers import run_cli

    code, _, err = run_cli(["compare", "--model", "tiny", "--data", tiny_store, "--volume", "16", "--steps", "2",
                            "--gpu-memory", "1MiB", "--out", tmp_path / "cmp"], capsys)
    assert code == 3
    assert err.strip().splitlines()[-1].startswith(
        "bigmem compare: error: Not even a 4^3 patch at batch 1 fits one GPU's 1.00 MiB")
    assert not (tmp_path / "cmp" / "cpu_bigmem").exists()


def test_the_whole_volume_path_plans_and_counts_each_case_at_its_own_shape(tmp_path):
    from bigmem.compare.run import mean_step_flops, train_flops, whole_shape
    from bigmem.data.synth import write_synthetic_store

    shapes = [(16, 16, 8), (16, 16, 24), (8, 32, 16)]
    store = write_synthetic_store(tmp_path / "s.h5", num_cases=3, volume=0, shapes=shapes)
    config = resolve_config("tiny", {"data": {"store": str(store)}, "train": {"batch_size": 1}})
    assert whole_shape(config) == (16, 16, 24)  # batch 1: the largest case
    assert whole_shape(config.updated({"train": {"batch_size": 2}})) == (16, 32, 24)  # any two: their bounding shape
    assert mean_step_flops(config) == pytest.approx(sum(train_flops(config, s, 1) for s in shapes) / 3)
    fixed = config.updated({"data": {"shape": [16, 16, 16]}})
    assert whole_shape(fixed) == (16, 16, 16)
    assert mean_step_flops(fixed) == train_flops(fixed, (16, 16, 16), 1)
