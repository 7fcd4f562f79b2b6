"""benchmarks/performance/gpu_reference.py: its CPU run at tiny sizes, its search, and its plan being the planner's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "performance" / "gpu_reference.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_reference  # noqa: E402

# Runs the script's main in a fresh interpreter, then says whether bigmem was imported: on the GPU
# machine there is no TensorFlow, and bigmem's CLI and planner need it.
RUN_AND_LIST_BIGMEM = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name='__main__')
finally:
    print('BIGMEM MODULES:', sorted(m for m in sys.modules if m.split('.')[0] == 'bigmem'))
"""


@pytest.mark.parametrize("first", [4, 20, 40, 64])
@pytest.mark.parametrize("threshold", [3, 4, 28, 64, 100])
def test_the_bisection_finds_the_largest_that_fits_from_any_start(first, threshold):
    candidates = list(range(4, 65, 4))
    tried = []

    def fits(edge):
        tried.append(edge)
        return edge <= threshold

    largest, probes = gpu_reference.largest_fitting(fits, candidates, first)
    expected = max((c for c in candidates if c <= threshold), default=None)
    assert largest == expected
    assert len(set(tried)) == len(tried) <= 6
    assert [edge for edge, fitted in probes if fitted == (edge > threshold)] == []


def test_the_planners_edge_is_the_largest_predicted_to_fit():
    predicted = {"32": 10, "64": 20, "96": 35}
    assert [gpu_reference.planner_edge(predicted, m) for m in (5, 10, 34, 100)] == [None, 32, 64, 96]


def test_the_shipped_plan_is_what_the_planner_predicts_now(tmp_path):
    """The GPU machine cannot run the planner: the file it reads must be current (regenerate: --write-plan)."""
    fresh = gpu_reference.write_plan(tmp_path / "plan.json")
    shipped = json.loads(gpu_reference.PLAN.read_text())
    assert shipped["models"].keys() == fresh["models"].keys()
    for name, entry in fresh["models"].items():
        assert shipped["models"][name] == entry, f"{name}: run gpu_reference.py --write-plan"
    kits = fresh["models"]["kits19"]
    assert kits["architecture"]["filters"] == [32, 64, 128, 256, 320, 320]
    assert kits["divisor"] == 32
    # the planner's answer the comparison quotes: a 256^3 patch on an 80 GiB GPU at batch 2 (fp32)
    assert gpu_reference.planner_edge(kits["predicted"]["tf32"]["train_batch2"], 80 * 2**30) == 256


# The CPU run at small sizes that still reach every phase and the memory limit: a 16^3 first point (--cpu's
# default is 32^3) and a 60 MiB "GPU", so the planner's training patch is 48^3 and the training search
# probes about 48-56^3 (at 100 MiB it trained 56^3 to 64^3, seconds a step). 60 MiB leaves the first point,
# which also pays the kernels' first-call memory (~30 MiB), room to fit. One intra-op thread: the suite
# runs a test per core, and two spinning OpenMP threads on a shared core made steps up to 30x slower (the
# test checks what the figures are, not how fast).
CPU_MEMORY_MIB = 60
FIRST_POINT = 16


@pytest.mark.slow
def test_the_cpu_run_measures_every_figure_without_bigmem(tmp_path):
    import os

    result = subprocess.run([sys.executable, "-c", RUN_AND_LIST_BIGMEM, str(SCRIPT), "--cpu", "--minutes", "3",
                             "--steps", "2", "--warmup", "1", "--cpu-memory-limit", str(CPU_MEMORY_MIB),
                             "--mlperf-patch", str(FIRST_POINT), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BIGMEM MODULES: []" in result.stdout
    assert result.stdout.startswith("gpu_reference: tiny x tf32, bf16, within 3 min")
    assert "tiny tf32: largest forward cube (" in result.stdout  # the last phase was reached
    [path] = tmp_path.glob("gpu_reference-cpu-*.json")
    report = json.loads(path.read_text())
    assert report["device"]["kind"] == "cpu"
    assert report["device"]["memory_bytes"] == CPU_MEMORY_MIB * 2**20
    assert [(r["model"], r["precision"]) for r in report["results"]] == [("tiny", "tf32"), ("tiny", "bf16")]
    for r in report["results"]:
        assert r["skipped"] == []
        assert r["failed"] == []
        assert r["parameters"] > 0
        point = r[f"mlperf_{FIRST_POINT}"]
        assert point["edge"] == FIRST_POINT
        assert point["batch"] == 2
        assert len(point["step_s"]["all"]) == 2
        assert point["step_s"]["min"] <= point["step_s"]["median"] <= point["step_s"]["max"]
        assert 0 < point["peak_bytes"] <= CPU_MEMORY_MIB * 2**20
        assert point["predicted_bytes"] > 0
        for key in ("largest_patch_batch2", "largest_inference_cube"):
            record = r[key]
            fitted = [p["edge"] for p in record["probes"] if p["fits"]]
            refused = [p["edge"] for p in record["probes"] if not p["fits"]]
            assert record["largest_edge"] == max(fitted)
            assert record["largest_edge"] % 4 == 0
            assert all(edge > record["largest_edge"] for edge in refused)
    # tf32 training at 64^3 x 2 needs more than 60 MiB here: the planner's patch or a probe met the limit,
    # and the search stopped below it
    tf32 = report["results"][0]
    errors = [p.get("error", "") for p in tf32["largest_patch_batch2"]["probes"]]
    errors.append((tf32["planner_patch"] or {}).get("error", ""))
    assert any(f"over the {CPU_MEMORY_MIB} MiB limit" in error for error in errors), tf32
    assert tf32["largest_patch_batch2"]["largest_edge"] < 64
    assert "largest patch x2" in result.stdout
    assert f"wrote {path}" in result.stdout
    # compare --gpu-reference reads what the script writes (here as if a GPU had written it)
    from bigmem.compare.gpu_reference import gpu_reference_for, load_gpu_reference

    report["device"]["kind"] = "cuda"
    path.write_text(json.dumps(report))
    measured = gpu_reference_for(load_gpu_reference(path), "tiny", "bf16")
    bf16 = report["results"][1]
    assert measured.memory_bytes == CPU_MEMORY_MIB * 2**20
    assert measured.largest_patch == bf16["largest_patch_batch2"]["largest_edge"]
    assert measured.rates[0].edge == FIRST_POINT
    assert measured.rates[0].steps_per_s == bf16[f"mlperf_{FIRST_POINT}"]["steps_per_s"]


def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    import warnings

    import torch  # in the test extra: the CPU run above needs it too

    with warnings.catch_warnings():  # a CUDA build of torch without a GPU warns that it found none
        warnings.simplefilter("ignore")
        has_gpu = torch.cuda.is_available()
    if has_gpu:
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1
    assert list(tmp_path.iterdir()) == []
    assert result.stderr.strip().splitlines() == [
        "gpu_reference: error: no CUDA device (torch.cuda.is_available() is False); --cpu runs the same code on "
        "the CPU at tiny sizes"]


class _FakePair:
    """A Pair whose items succeed, fail as a bug, or lose the GPU, as told."""

    def __init__(self, label: str, failures: dict):
        from types import SimpleNamespace

        self.label, self.failures, self.done = label, failures, []
        self.args, self.planned = SimpleNamespace(mlperf_patch=32), 64
        self.result = {"skipped": [], "failed": []}
        self.bench = SimpleNamespace(drop_state=lambda: None)
        self.device = SimpleNamespace(healthy=lambda: True)

    def _item(self, what: str) -> None:
        if what in self.failures:
            raise self.failures[what]
        self.done.append(what)

    def timed_point(self, label, edge, clock):
        self._item(label)

    def training_search(self, clock):
        self._item("training")

    def inference_search(self, clock):
        self._item("forward")


def test_an_item_that_fails_costs_only_itself_and_a_lost_gpu_stops_the_run_saved():
    import time

    saves = []
    bug = _FakePair("kits19 tf32", {"planner_patch": gpu_reference.ProbeFailed("TypeError: bad dtype")})
    lost = _FakePair("kits19 bf16", {"training": gpu_reference.DeviceLost("illegal memory access")})
    other = _FakePair("intelai-brats tf32", {})
    clock = gpu_reference.Clock(time.monotonic() + 600)
    stopped = gpu_reference.measure([bug, lost, other], clock, lambda: saves.append(1))
    assert bug.done == ["mlperf_32", "training"]
    assert bug.result["failed"] == [
        "planner's patch: ProbeFailed: TypeError: bad dtype"]
    assert lost.done == ["mlperf_32", "planner_patch"]
    assert other.done == ["mlperf_32", "planner_patch"]
    assert stopped == "the GPU's context failed during kits19 bf16's largest training patch: illegal memory access"
    assert lost.result["failed"] == ["largest training patch: the GPU's context failed: illegal memory access"]
    assert len(saves) == 8  # after every item, the last one too


def test_a_size_a_kernel_refuses_does_not_run_and_a_bug_is_a_bug():
    refusals = ["CUDA out of memory. Tried to allocate 20.00 GiB", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
                "Expected canUse32BitIndexMath(input) to be true", "input tensor is too large"]
    assert all(gpu_reference._refusal(RuntimeError(text)) for text in refusals)
    assert not gpu_reference._refusal(RuntimeError("expected scalar type Float but found BFloat16"))
