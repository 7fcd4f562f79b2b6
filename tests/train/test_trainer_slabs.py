"""A whole training run with every full-resolution op in depth slabs trains like one without."""

from __future__ import annotations

import json

import numpy as np

from bigmem.rundir import read_jsonl
from helpers import run_cli


def test_training_in_slabs_matches_training_without(tmp_path, tiny_store, capsys, monkeypatch):
    from bigmem.nets.limits import SLAB_CALLS

    runs, calls = {}, {}
    for name, limit in (("whole", None), ("slabs", 12_000)):
        before = SLAB_CALLS.copy()
        if limit:
            # Level-0 tensors (16^3 x 4, 8 joined), the logits (16^3 x 3) and the loss run in slabs of a
            # few planes; 5 planes x 16^2 x 8 (an input-gradient frame) still fit.
            monkeypatch.setenv("BIGMEM_MAX_KERNEL_ELEMENTS", str(limit))
        out = tmp_path / name
        code, stdout, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--out", out, "--steps", 4,
                                     "--seed", 5, "--monitor-interval", 0], capsys)
        assert code == 0, err
        runs[name] = read_jsonl(out / "metrics.jsonl")
        stages = json.loads((out / "plan.json").read_text())["chosen"]["partitioned_stages"]
        assert stages == (["enc0", "enc1", "dec0"] if limit else [])
        assert ("stages run in depth slabs" in stdout) == bool(limit)
        calls[name] = SLAB_CALLS - before  # which slab kernels the layers dispatched to while tracing
    monkeypatch.delenv("BIGMEM_MAX_KERNEL_ELEMENTS")
    assert not calls["whole"]  # equal results alone would pass if dispatch silently stopped partitioning
    assert {"conv3d", "conv3d_transpose", "norm_activation", "loss"} <= set(calls["slabs"]), calls["slabs"]
    whole, slabs = ([r["loss"] for r in runs[k]] for k in ("whole", "slabs"))
    assert len(whole) == len(slabs) == 4
    np.testing.assert_allclose(slabs, whole, rtol=1e-4)
    np.testing.assert_allclose([r["dice"] for r in runs["slabs"]], [r["dice"] for r in runs["whole"]], atol=1e-6)
