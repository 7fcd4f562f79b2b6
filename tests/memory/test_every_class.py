"""The planner on every ISA class, faked: what must hold whichever CPU builds, checks or runs bigmem.

Each case forces the class (``BIGMEM_ISA_CLASS``, which every lookup reads) and the CPU model the
calibration sees, with nothing tuned and with a fixed term ``bigmem tune`` measured above or below
the shipped table, and checks the properties no class may break: a forward pass never planned above
the training step of the same network, shape and batch; a larger volume never planned smaller; a table
not measured on this CPU always carrying a margin; bf16 emulated where the class has no native bf16.
"""

from __future__ import annotations

import dataclasses

import pytest

from bigmem.config import resolve_config
from bigmem.memory import calibration
from bigmem.memory.estimate import Pass, estimate
from bigmem.memory.profile import counts_function
from bigmem.nets import choices, tuning

CLASSES = ("avx2", "avx512", "avx512_bf16", "amx")
# Each preset at three sizes of its own size contract (a cube edge that is a multiple of model.divisor).
PRESETS = {"tiny": (16, 48, 96), "small": (32, 64, 96), "kits19": (64, 96, 160), "intelai-brats": (32, 64, 144)}
# A CPU no shipped table was measured on, and the AMD EPYC the reference class's tables were.
CPUS = ("a CPU no table was measured on", "AMD EPYC")
TUNED_OFFSETS = (None, 200 * 2**20, -100 * 2**20)  # nothing tuned; a fixed term above, below the table's


@pytest.fixture(scope="module")
def counts():
    """``(preset, precision) -> counts_function``: each network built once."""
    return {(name, precision): counts_function(resolve_config(name, {"train": {"precision": precision}}))
            for name in PRESETS for precision in ("fp32", "bf16")}


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A function (class, cpu, tuned offset) that makes this process see that machine."""
    monkeypatch.delenv("BIGMEM_NATIVE_BF16", raising=False)  # native bf16 follows the forced class
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path / "tuning"))

    def become(isa: str, cpu: str, offset: int | None) -> None:
        monkeypatch.setenv("BIGMEM_ISA_CLASS", isa)
        calibration.machine_isa_class.cache_clear()
        monkeypatch.setattr(calibration, "machine_cpu_model", lambda: cpu)
        choices.kernel_choices.cache_clear()
        if offset is not None:
            from bigmem.tune import fixed_memory_key

            keys = {fixed_memory_key(resolve_config(name, {"train": {"precision": precision},
                                                           "memory": {"recompute": mode}})): offset
                    for name in PRESETS for precision in ("fp32", "bf16") for mode in ("none", "stages")}
            tuning.save_tuning(tuning.Tuning(key=dataclasses.asdict(tuning.key_here()), planewise={},
                                             conv_gflops_per_core={}, overhead_offset_bytes=keys, rows=[],
                                             tuned=[{"model": "small", "shape": [32, 32, 32], "precision": "fp32",
                                                     "seconds": 0.0}]))

    yield become
    calibration.machine_isa_class.cache_clear()
    choices.kernel_choices.cache_clear()


def _peaks(counts, preset: str, precision: str, edge: int) -> tuple[int, int]:
    """(training step at batch 1, nothing recomputed; whole-volume forward pass) predicted peaks."""
    config = resolve_config(preset, {"train": {"precision": precision, "batch_size": 1}})
    shape = (edge,) * 3
    network = counts[(preset, precision)](shape)
    train = estimate(config, network, shape, recompute_stages=[]).predicted_peak_bytes
    forward = estimate(config, network, shape, pass_=Pass.FORWARD).predicted_peak_bytes
    return train, forward


@pytest.mark.parametrize("offset", TUNED_OFFSETS, ids=("untuned", "tuned-above", "tuned-below"))
@pytest.mark.parametrize("cpu", CPUS, ids=("unseen-cpu", "table-cpu"))
@pytest.mark.parametrize("isa", CLASSES)
def test_inference_is_never_planned_above_training(counts, machine, isa, cpu, offset):
    machine(isa, cpu, offset)
    over = {}
    for preset, edges in PRESETS.items():
        for precision in ("fp32", "bf16"):
            for edge in edges:
                train, forward = _peaks(counts, preset, precision, edge)
                if forward > train:
                    over[f"{preset} {precision} {edge}^3"] = (forward, train)
    assert over == {}


@pytest.mark.parametrize("isa", CLASSES)
def test_a_larger_volume_is_never_planned_smaller(counts, machine, isa):
    machine(isa, CPUS[0], None)
    for preset, edges in PRESETS.items():
        trains, forwards = zip(*(_peaks(counts, preset, "fp32", edge) for edge in edges))
        assert list(trains) == sorted(trains), preset
        assert list(forwards) == sorted(forwards), preset


@pytest.mark.parametrize("isa", CLASSES)
def test_a_table_not_measured_on_this_cpu_carries_a_margin(machine, isa):
    machine(isa, CPUS[0], None)
    for preset in PRESETS:
        for mode in ("none", "stages", calibration.INFERENCE_MODE):
            found = calibration.calibration_for(preset, "fp32", mode, path=calibration.calibration_path())
            assert found.has_margin, (preset, mode, found.source)


@pytest.mark.parametrize("isa", CLASSES)
def test_bf16_is_emulated_exactly_where_the_class_has_no_native_bf16(machine, isa):
    from bigmem.sysinfo import native_bf16

    machine(isa, CPUS[0], None)
    found = calibration.calibration_for("small", "bf16", "none", path=calibration.calibration_path())
    native = isa in calibration.NATIVE_BF16_ISA_CLASSES
    assert native_bf16() is native
    assert (found.margin_fraction == calibration.EMULATED_BF16_MARGIN_FRACTION) is not native
