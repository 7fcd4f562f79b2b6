"""Training on each scan's own shape: one trace per batch shape, padding left out, slabs planned per shape."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from bigmem.rundir import read_jsonl
from helpers import run_cli

# tiny: 2^depth = 4. Four cases, three shapes, two padded shapes (16x16x6 pads to 16x16x8).
SHAPES = [(16, 16, 6), (16, 16, 8), (24, 8, 8), (16, 16, 8)]


@pytest.fixture(scope="module")
def shaped_store(tmp_path_factory):
    from bigmem.data.synth import write_synthetic_store

    return write_synthetic_store(tmp_path_factory.mktemp("shaped") / "shaped.h5", num_cases=len(SHAPES), volume=0,
                                 shapes=SHAPES, seed=2)


def _train(out, store, capsys, *extra):
    code, stdout, err = run_cli(["train", "--model", "tiny", "--data", store, "--out", out, "--monitor-interval", 0,
                                 "--seed", 3, *extra], capsys)
    assert code == 0, err
    return stdout


def test_each_case_trains_whole_at_its_own_shape(tmp_path, shaped_store, capsys):
    out = tmp_path / "run"
    stdout = _train(out, shaped_store, capsys, "--epochs", 2)
    assert "4 cases whole at their own shape (16..24x8..16x6..8), padded to multiples of 4: 2 distinct shapes" in stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 8
    padded = {(16, 16, 8), (24, 8, 8)}
    assert {tuple(r["shape"]) for r in rows} == padded
    summary = json.loads((out / "summary.json").read_text())
    assert summary["traces"] == 2
    assert set(summary["steps_per_shape"]) == {"16x16x8", "24x8x8"}
    assert sum(summary["steps_per_shape"].values()) == 8
    share = 1 - sum(math.prod(s) for s in SHAPES) / sum(math.prod((s[0], s[1], 8)) for s in SHAPES)
    assert summary["padding_share_per_epoch"] == pytest.approx([share, share], abs=1e-6)
    # the throughput counts the scan's voxels only: the 16x16x6 case's step has 1536, not the 2048 it is padded to
    for row in rows:
        voxels = row["voxels_per_s"] * row["step_s"]
        assert round(voxels) in {math.prod(s) for s in SHAPES}
    plan = json.loads((out / "plan.json").read_text())
    assert plan["chosen"]["spatial_shape"] == [16, 16, 8]  # batch 1: the largest case (2048 voxels; 24x8x8 is 1536)
    assert [(c["case"], c["shape"], c["padded_shape"]) for c in plan["cases"]] == [
        (f"synth_{i:04d}", list(s), [s[0], s[1], -(-s[2] // 4) * 4]) for i, s in enumerate(SHAPES)]
    assert all(c["fits"] for c in plan["cases"])


def test_a_fixed_shape_crops_and_the_run_says_so(tmp_path, shaped_store, capsys):
    stdout = _train(tmp_path / "run", shaped_store, capsys, "--shape", "16,8,8", "--steps", 2)
    kept = sum(math.prod(min(a, b) for a, b in zip(s, (16, 8, 8))) for s in SHAPES)
    cropped = 100 * (1 - kept / sum(math.prod(s) for s in SHAPES))
    assert f"4 cases cropped (random offset)/padded to 16x8x8: {cropped:.1f}% of their voxels cropped away" in stdout
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert {tuple(r["shape"]) for r in rows} == {(16, 8, 8)}


def test_depth_slabs_are_planned_per_shape(tmp_path, capsys, monkeypatch):
    """A long thin case and a wide flat one, each past a lowered kernel limit, train as without the limit."""
    from bigmem.data.synth import write_synthetic_store

    from bigmem.config import resolve_config
    from bigmem.memory.estimate import partitioned_stages
    from bigmem.memory.profile import counts_function
    from bigmem.nets.limits import kernel_element_limit

    shapes = [(128, 8, 8), (16, 24, 24)]
    store = write_synthetic_store(tmp_path / "s.h5", num_cases=2, volume=0, shapes=shapes, seed=4)
    counts_for = counts_function(resolve_config("tiny"))
    limit = 50_000  # dec0's joined input, 8 channels: 65,536 and 73,728 elements; one frame of planes fits
    with kernel_element_limit(limit):
        assert all(partitioned_stages(counts_for(shape), 1) == ["dec0"] for shape in shapes)
    losses = {}
    for name in ("whole", "slabs"):
        if name == "slabs":
            monkeypatch.setenv("BIGMEM_MAX_KERNEL_ELEMENTS", str(limit))
        out = tmp_path / name
        _train(out, store, capsys, "--steps", 4)
        losses[name] = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
        assert {tuple(r["shape"]) for r in read_jsonl(out / "metrics.jsonl")} == set(shapes)
        stages = json.loads((out / "plan.json").read_text())["chosen"]["partitioned_stages"]
        assert stages == (["dec0"] if name == "slabs" else [])
    monkeypatch.delenv("BIGMEM_MAX_KERNEL_ELEMENTS")
    np.testing.assert_allclose(losses["slabs"], losses["whole"], rtol=1e-4)


def test_a_budget_above_the_machine_is_refused_unless_forced(tmp_path, tiny_store, capsys):
    code, out, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--out", tmp_path / "run",
                              "--memory-budget", "100TiB", "--steps", 1], capsys)
    assert code == 3
    assert re.fullmatch(r"bigmem train: error: --memory-budget 100\.00 TiB is more than this machine's memory "
                        r"\(\S+ \S+, MemTotal\): a job planned for it would be killed by the kernel, not stopped by "
                        r"bigmem\. Give at most \S+ \S+, or --force to run anyway\.", err.strip())
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_plan_reads_the_store_and_lists_each_case(tmp_path, shaped_store, capsys):
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(["plan", "--model", "tiny", "--data", shaped_store, "--batch-size", "1", "--out", out,
                                 "--memory-budget", "4GiB"], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["chosen"]["spatial_shape"] == [16, 16, 8]
    assert plan["chosen"]["batch_size"] == 1
    assert len(plan["cases"]) == 4
    assert all(c["fits"] for c in plan["cases"])
    assert "4 cases whole at their own shapes" in stdout
    assert "chosen: --data" in stdout
    assert "predicted on this machine's" in stdout


def test_the_store_replacing_the_presets_channels_is_said_in_one_line(tmp_path, capsys):
    from bigmem.data.synth import write_synthetic_store

    store = write_synthetic_store(tmp_path / "four.h5", num_cases=2, volume=8, channels=4, num_classes=4)
    stdout = _train(tmp_path / "run", store, capsys, "--steps", 1)
    assert "The store has 4 channels and 4 classes; the 'tiny' preset's 1 and 3 are replaced." in stdout
    model = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (model["in_channels"], model["num_classes"]) == (4, 4)
