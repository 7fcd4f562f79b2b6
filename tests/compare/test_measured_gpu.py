"""compare --gpu-reference: a real GPU's measurements size the data-parallel path and are reported as measured."""

from __future__ import annotations

import json

import pytest

from bigmem.compare.gpu_reference import gpu_reference_for, load_gpu_reference
from bigmem.compare.render import markdown, provenance, rows
from bigmem.compare.run import Settings, plan_both_paths, scaled_gpu_memory
from bigmem.compare.setup import CompareRequest, _measured_gpu
from bigmem.config.presets import resolve_config
from bigmem.data.derived import with_data_fields
from bigmem.errors import UsageError
from bigmem.memory.profile import counts_function

H200 = 150_754_820_096  # what torch reports as an H200's total memory (140.4 GiB)


def _point(edge: int, steps_per_s: float) -> dict:
    return {"edge": edge, "batch": 2, "peak_bytes": edge**3 * 1000, "steps_per_s": steps_per_s,
            "step_s": {"median": 1 / steps_per_s, "min": 0.9 / steps_per_s, "max": 1.1 / steps_per_s}}


def _measured(tmp_path, **device) -> str:
    """A file as benchmarks/performance/gpu_reference.py writes it on a GPU (its CPU run's keys: see its test)."""
    results = [{"model": "kits19", "precision": "tf32", "mlperf_128": _point(128, 3.5),
                "planner_patch": _point(320, 0.25), "largest_patch_batch2": {"largest_edge": 352, "probes": []}},
               {"model": "tiny", "precision": "tf32", "mlperf_128": _point(128, 40.0), "planner_patch": None,
                "largest_patch_batch2": {"largest_edge": 8, "probes": []}}]
    path = tmp_path / "gpu_reference-cuda-h200.json"
    path.write_text(json.dumps({"schema": 1, "torch": "2.14.1", "results": results,
                                "device": {"kind": "cuda", "name": "NVIDIA H200", "memory_bytes": H200, **device}}))
    return str(path)


def test_a_measured_kits19_patch_proportions_the_phantoms_stand_in(tmp_path):
    from bigmem.distribute.planning import gpu_footprint_bytes

    config = resolve_config("small", {"data": {"volume": 64}})
    counts_for = counts_function(config)
    kits19 = gpu_reference_for(load_gpu_reference(_measured(tmp_path)), "kits19", "fp32")
    assert (kits19.largest_patch, kits19.precision, [r.edge for r in kits19.rates]) == (352, "tf32", [128, 320])
    memory = scaled_gpu_memory(config, counts_for, kits19)
    # 352 of 512 is 0.6875 of the edge: of 64, 44, down to the size contract (8): a 40^3 patch
    assert memory.bytes == gpu_footprint_bytes(config, counts_for, 40, 2)
    assert "measured NVIDIA H200 (140.40 GiB) trains a 352^3 patch of a 512^3 kits19 volume" in memory.stand_in


def test_with_data_the_measured_memory_and_patch_size_the_data_parallel_path(tmp_path, tiny_store):
    config = with_data_fields(resolve_config("tiny", {"data": {"store": str(tiny_store)},
                                                       "train": {"batch_size": 2}}))
    request = CompareRequest(data=str(tiny_store), gpu_reference=str(_measured(tmp_path)))
    memory, patch, reference = _measured_gpu(load_gpu_reference(request.gpu_reference), config, request)
    assert (memory.bytes, memory.stand_in, patch, reference.model) == (H200, None, 8, "tiny")
    settings = Settings(replicas=2, simulate=True, gpu_memory=memory, patch=patch, gpu_reference=reference)
    _, parallel = plan_both_paths(config, counts_function(config), settings)
    assert parallel.patch == (8, 8, 8)
    assert parallel.gpu_memory_bytes == H200
    # a model the file did not measure: the measured memory, the planner's patch, and the report says so
    other = config.updated({"train": {"precision": "bf16"}})
    memory, patch, reference = _measured_gpu(load_gpu_reference(request.gpu_reference), other, request)
    assert (memory.bytes, patch, reference.largest_patch, reference.rates) == (H200, None, None, ())
    assert reference.summary == "NVIDIA H200, PyTorch bf16, no tiny step timed"


def test_the_report_says_what_was_measured_and_what_simulated(tmp_path, make_report):
    import dataclasses

    reference = gpu_reference_for(load_gpu_reference(_measured(tmp_path)), "kits19", "fp32")
    report = dataclasses.replace(make_report([0.9], [0.8]), gpu_reference=reference.to_dict(),
                                 patch_size=(320, 320, 320))
    assert rows(report)[-1] == ("measured on a GPU (PyTorch)", "-", "NVIDIA H200, PyTorch tf32, 0.25 steps/s per "
                                "GPU at 320^3 x 2, largest patch x 2: 352^3")
    text = provenance(report)
    assert text.startswith(f"Measured on a GPU ({reference.file}): NVIDIA H200 (140.40 GiB), PyTorch 2.14.1, kits19 "
                           "tf32; largest patch at batch 2 352^3; on an NVIDIA H200 the patch path runs 0.25 steps/s "
                           "per GPU at 320^3 x 2; the patch and the GPU's memory above come from it.")
    assert text.endswith("Simulated on CPU: the data-parallel run itself (its steps, times, host memory and Dice).")
    assert text in markdown(report)
    assert type(report).from_dict(report.to_dict()).gpu_reference == reference.to_dict()
    plain = make_report([0.9], [0.8])
    assert provenance(plain).startswith("Nothing here was measured on a GPU")
    assert plain.gpu_reference is None


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("{not json", "not JSON"),
    ('{"schema": 1}', "not a gpu_reference.py result"),
    ('{"schema": 1, "device": {"kind": "cpu"}}', "measured on cpu, not a GPU"),
])
def test_a_file_that_is_not_a_gpus_measurement_is_one_line(tmp_path, capsys, content, message):
    from helpers import run_cli

    path = tmp_path / "ref.json"
    if content is not None:
        path.write_text(content)
    code, _, err = run_cli(["compare", "--model", "tiny", "--gpu-reference", path, "--out", tmp_path / "cmp"], capsys)
    assert code == 2
    assert err.count("\n") == 1
    assert "Traceback" not in err
    assert err.startswith(f"bigmem compare: error: --gpu-reference {path}: {message}")
    with pytest.raises(UsageError, match="no kits19 measurement at bf16"):
        _measured_gpu(load_gpu_reference(_measured(tmp_path)), resolve_config("tiny", {"train": {"precision": "bf16"}}),
                      CompareRequest(gpu_reference="ref.json"))


def test_gpu_memory_and_a_reference_are_one_or_the_other(tmp_path, capsys):
    from helpers import run_cli

    code, _, err = run_cli(["compare", "--gpu-memory", "80GiB", "--gpu-reference", _measured(tmp_path),
                            "--out", tmp_path / "cmp"], capsys)
    assert code == 2
    assert err.strip() == ("bigmem compare: error: Give either --gpu-memory or --gpu-reference, not "
                                         "both: the reference file measured its GPU's memory.")
