"""bigmem compare: both paths run, four outputs, marked simulated, figures from the run directories."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bigmem.rundir import read_jsonl

PATH_FIELDS = {"voxels_per_s", "samples_per_s", "step_s", "peak_host_bytes", "max_whole_volume", "dice"}


@pytest.mark.slow
def test_compare_simulated(tmp_path, tiny_store):
    out = tmp_path / "cmp"
    result = subprocess.run([sys.executable, "-m", "bigmem", "compare", "--model", "tiny", "--data", str(tiny_store),
                             "--volume", "16", "--steps", "5", "--simulate-replicas", "2", "--gpu-memory", "2GiB",
                             "--out", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "SIMULATED ON CPU" in result.stdout
    assert {p.name for p in out.iterdir()} >= {"compare.json", "compare.md", "compare.png", "cpu_bigmem",
                                              "data_parallel"}
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SIMULATED ON CPU" in (out / "compare.md").read_text()
    report = json.loads((out / "compare.json").read_text())
    assert report["simulated"] is True and report["replicas"] == 2 and report["held_out_cases"] == ["synth_0003"]
    for name in ("cpu_bigmem", "data_parallel"):
        path = report["paths"][name]
        assert PATH_FIELDS <= set(path)
        rows = read_jsonl(out / name / "metrics.jsonl")
        assert path["steps"] == len(rows) == 5
        assert path["voxels_per_s"] == pytest.approx(np.median([r["voxels_per_s"] for r in rows[1:]]))
        assert path["step_s"] == pytest.approx(np.median([r["step_s"] for r in rows[1:]]))
        summary = json.loads((out / name / "summary.json").read_text())
        assert path["peak_host_bytes"] == summary["peak_rss_bytes"]
        assert 0.0 <= path["dice"] <= 1.0
    dp_plan = json.loads((out / "data_parallel" / "plan.json").read_text())["data_parallel"]
    assert dp_plan["simulated"] and dp_plan["global_batch"] == 2 and report["patch_size"] == dp_plan["patch"]
    assert report["paths"]["data_parallel"]["samples_per_s"] == pytest.approx(2 / report["paths"]["data_parallel"][
        "step_s"])
