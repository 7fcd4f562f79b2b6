"""Predicted step time: measured rates per ISA class, precision and width; recompute and emulation costs."""

import pytest

from bigmem.speed import (
    EMULATED_BF16_SLOWDOWN,
    MEASURED_RATES,
    MachineSpeed,
    StepRate,
    measured_rate,
    predicted_step_s,
    recomputed_share,
    step_rate,
)


def test_measured_widths_give_their_own_figures():
    assert step_rate("avx512_bf16", "fp32", 32, True).gflops_per_core == MEASURED_RATES[("avx512_bf16", "fp32")][32]
    assert step_rate("avx512_bf16", "bf16", 8, True).gflops_per_core == MEASURED_RATES[("avx512_bf16", "bf16")][8]
    assert step_rate("avx2", "fp32", 8, False).gflops_per_core == MEASURED_RATES[("avx2", "fp32")][8]


def test_widths_between_and_beyond_the_measured_ones():
    fp32 = MEASURED_RATES[("avx512_bf16", "fp32")]
    middle = step_rate("avx512_bf16", "fp32", 16, True).gflops_per_core  # log2 midway between 8 and 32
    assert middle == pytest.approx((fp32[8] * fp32[32]) ** 0.5)
    assert step_rate("avx512_bf16", "fp32", 4, True).gflops_per_core == fp32[8]
    assert step_rate("avx512_bf16", "fp32", 64, True).gflops_per_core == fp32[32]
    # avx2 was measured at 8 filters only: wider nets scale as they do on avx512_bf16
    assert step_rate("avx2", "fp32", 32, False).gflops_per_core == pytest.approx(
        MEASURED_RATES[("avx2", "fp32")][8] * fp32[32] / fp32[8])


def test_unmeasured_classes_borrow_and_say_so_and_emulated_bf16_is_slow():
    avx512 = step_rate("avx512", "fp32", 32, True)
    assert avx512.gflops_per_core == MEASURED_RATES[("avx512_bf16", "fp32")][32]
    assert "avx512 not measured, avx512_bf16's figures used" in avx512.source
    amx = step_rate("amx", "bf16", 32, True)  # measured: its own figures
    assert amx.gflops_per_core == MEASURED_RATES[("amx", "bf16")][32]
    assert "not measured" not in amx.source
    emulated = step_rate("avx512", "bf16", 32, False)
    assert emulated.gflops_per_core == pytest.approx(MEASURED_RATES[("avx512_bf16", "fp32")][32]
                                                     / EMULATED_BF16_SLOWDOWN)
    assert "bf16 emulated" in emulated.source
    assert step_rate("avx2", "bf16", 8, False).gflops_per_core == MEASURED_RATES[("avx2", "bf16")][8]


def test_step_seconds():
    rate = step_rate("avx512_bf16", "fp32", 32, True)
    flops = 3 * 10**12
    plain = predicted_step_s(flops, 0.0, rate, cores=2)
    assert plain == pytest.approx(flops / (rate.gflops_per_core * 1e9 * 2))
    assert predicted_step_s(flops, 1.0, rate, cores=2) == pytest.approx(plain * 4 / 3)  # every stage recomputed
    assert predicted_step_s(flops, 0.0, rate, cores=8) == pytest.approx(plain / 4)


def test_a_measured_rate_fed_back_predicts_the_measured_step():
    flops, share = 7 * 10**12, recomputed_share({"enc0": 300, "enc1": 100, "dec0": 600}, ["enc0", "dec0"])
    assert share == pytest.approx(0.9)
    rate = measured_rate(flops, share, step_s=12.5, cores=4)
    assert rate == pytest.approx(flops * (1 + 0.9 / 3) / 12.5 / 4 / 1e9)
    assert predicted_step_s(flops, share, StepRate(rate, "here"), cores=4) == pytest.approx(12.5)


def test_plan_candidates_carry_a_step_time():
    from bigmem.config import resolve_config
    from bigmem.config.options import Precision, Recompute
    from bigmem.memory.estimate import NetworkCounts
    from bigmem.memory.search import Planner
    from bigmem.nets.unet3d import UNet3D

    model = UNet3D(resolve_config("small").model).build_for()
    planner = Planner(resolve_config("small"), lambda shape: NetworkCounts.from_model(model, shape), 2**40,
                      machine=MachineSpeed("avx2", native_bf16=False, cores=4))
    fp32 = planner.evaluate(64, 1, Precision.FP32, Recompute.NONE)
    stages = planner.evaluate(64, 1, Precision.FP32, Recompute.STAGES)
    bf16 = planner.evaluate(64, 1, Precision.BF16, Recompute.NONE)
    assert fp32.predicted_step_s > 0
    assert "avx2" in fp32.step_rate_source
    assert stages.predicted_step_s == pytest.approx(fp32.predicted_step_s * 4 / 3, rel=1e-2)
    assert bf16.predicted_step_s > 15 * fp32.predicted_step_s  # emulated


def test_a_calibrated_rate_replaces_the_isa_table_for_its_mode(monkeypatch):
    from bigmem.config import resolve_config
    from bigmem.config.options import Precision, Recompute
    from bigmem.memory import estimate as estimate_module
    from bigmem.memory.calibration import Calibration, shipped_calibration
    from bigmem.memory.estimate import NetworkCounts
    from bigmem.memory.search import Planner
    from bigmem.nets.unet3d import UNet3D

    def lookup(preset, precision, recompute):
        found = shipped_calibration(preset, precision, recompute, isa="avx512_bf16")
        if precision == "fp32":  # as `bigmem profile --calibrate` leaves it: timed at 96^3
            return Calibration(found.activation_scale, found.framework_bytes, "this machine, fitted 2026-12-01",
                               found.key, [32, 64, 96], knots=found.knots, step_gflops_per_core=25.0)
        return found

    monkeypatch.setattr(estimate_module, "calibration_for", lookup)
    model = UNet3D(resolve_config("small").model).build_for()
    planner = Planner(resolve_config("small"), lambda shape: NetworkCounts.from_model(model, shape), 2**40,
                      machine=MachineSpeed("avx512_bf16", native_bf16=True, cores=2))
    fp32 = planner.evaluate(64, 1, Precision.FP32, Recompute.NONE)
    bf16 = planner.evaluate(64, 1, Precision.BF16, Recompute.NONE)
    assert fp32.step_rate_source.startswith("calibrated on this machine at 96^3")
    assert "measured (bench_train" in bf16.step_rate_source  # no calibration for bf16: the ISA table
    # the same FLOPs, so the step times are in the inverse ratio of the rates (25 per core for fp32)
    assert fp32.predicted_step_s / bf16.predicted_step_s == pytest.approx(
        step_rate("avx512_bf16", "bf16", 8, True).gflops_per_core / 25.0, rel=1e-2)
