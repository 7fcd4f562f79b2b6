"""The planner's choices on fake budgets, and the refusal messages."""

from __future__ import annotations

import pytest

from bigmem.config import resolve_config
from bigmem.config.options import Precision, Recompute
from bigmem.errors import InsufficientMemoryError
from bigmem.memory import search as planner_module
from bigmem.memory.calibration import Calibration
from bigmem.memory.estimate import NetworkCounts, estimate
from bigmem.memory.search import Planner, cheapest_fix, check_fits, make_plan
from bigmem.memory.records import Budget
from bigmem.nets.unet3d import UNet3D

FIXED = Calibration(1.0, 100 * 2**20, "test")


@pytest.fixture(autouse=True)
def fixed_calibration(monkeypatch):
    monkeypatch.setattr("bigmem.memory.estimate.calibration_for", lambda preset, precision, mode: FIXED)


@pytest.fixture(scope="module")
def counts_for():
    model = UNet3D(resolve_config("small").model).build_for()
    return lambda shape: NetworkCounts.from_model(model, shape)


def _peak(config, counts_for, volume, batch, precision="fp32", recompute="none"):
    return Planner(config, counts_for, 0).evaluate(volume, batch, Precision(precision),
                                                   Recompute(recompute)).predicted_peak_bytes


def test_largest_volume_per_mode_and_the_choice(counts_for):
    config = resolve_config("small")
    budget = 4 * 2**30
    plan = make_plan(config, counts_for, Budget(budget, "test"), batch_size=1)
    modes = {(c.precision, c.recompute): c for c in plan.best_per_mode}
    assert set(modes) == {("fp32", "none"), ("bf16", "none"), ("fp32", "stages"), ("bf16", "stages")}
    for c in plan.best_per_mode:
        assert c.fits
        assert c.volume % 8 == 0
        assert c.batch_size == 1
        assert c.predicted_peak_bytes <= budget
        assert _peak(config, counts_for, c.volume + 8, 1, c.precision, c.recompute) > budget  # the next size doesn't
    assert modes[("bf16", "stages")].volume >= modes[("fp32", "none")].volume
    assert plan.chosen == max(plan.best_per_mode, key=lambda c: c.volume)
    data = plan.to_dict()
    assert data["fits"]
    assert data["budget_bytes"] == budget
    assert len(data["candidates"]) == len(plan.candidates)
    assert data["chosen"]["volume"] == plan.chosen.volume


def test_fixed_volume_searches_the_batch(counts_for):
    config = resolve_config("small")
    budget = 3 * 2**30
    plan = make_plan(config, counts_for, Budget(budget, "test"), volume=64)
    assert all(c.volume == 64 for c in plan.best_per_mode)
    best = plan.chosen
    assert _peak(config, counts_for, 64, best.batch_size + 1, best.precision, best.recompute) > budget
    assert best.batch_size > 1


def _rates(monkeypatch, fp32: float, bf16: float):
    """This CPU's step rates, per precision (GFLOP/s per core), as if measured here."""
    from bigmem.speed import StepRate

    rates = {"fp32": fp32, "bf16": bf16}
    monkeypatch.setattr(planner_module, "tuned_step_rate", lambda precision, width, native: None)
    monkeypatch.setattr(planner_module, "step_rate",
                        lambda isa, precision, width, native: StepRate(rates[precision], f"test {precision}"))


def test_ties_prefer_full_precision_without_recompute(counts_for, monkeypatch):
    _rates(monkeypatch, fp32=100.0, bf16=100.0)
    config = resolve_config("small")
    plan = make_plan(config, counts_for, Budget(2**50, "huge"), volume=32, batch_size=1)
    assert (plan.chosen.precision, plan.chosen.recompute) == ("fp32", "none")


def test_bf16_is_chosen_for_speed_where_this_cpu_runs_it_faster(counts_for, monkeypatch):
    _rates(monkeypatch, fp32=100.0, bf16=150.0)
    plan = make_plan(resolve_config("small"), counts_for, Budget(2**50, "huge"), volume=32, batch_size=1,
                     allow_bf16=True)
    assert (plan.chosen.precision, plan.chosen.recompute) == ("bf16", "none")
    assert plan.precision_note is None


def test_a_slower_bf16_is_not_chosen_where_fp32_fits_as_much(counts_for, monkeypatch):
    _rates(monkeypatch, fp32=100.0, bf16=50.0)
    plan = make_plan(resolve_config("small"), counts_for, Budget(2**50, "huge"), volume=32, batch_size=1,
                     allow_bf16=True)
    assert plan.chosen.precision == "fp32"


def test_a_slower_bf16_needed_to_fit_says_what_it_costs(counts_for, monkeypatch):
    _rates(monkeypatch, fp32=100.0, bf16=55.0)
    config = resolve_config("small")
    fp32_peak = _peak(config, counts_for, 64, 1)
    bf16_peak = _peak(config, counts_for, 64, 1, "bf16")
    plan = make_plan(config, counts_for, Budget((fp32_peak + bf16_peak) // 2, "test"), volume=64, batch_size=1,
                     allow_bf16=True)
    assert (plan.chosen.precision, plan.chosen.recompute) == ("bf16", "none")
    assert plan.precision_note.startswith("bf16 needed to fit: 1.8x the fp32 step time on this CPU (test bf16)")
    assert plan.to_dict()["precision_note"] == plan.precision_note


def test_nothing_fits(counts_for):
    config = resolve_config("small")
    plan = make_plan(config, counts_for, Budget(10 * 2**20, "test"))
    assert not plan.fits
    assert plan.chosen is None
    assert plan.closest.predicted_peak_bytes == min(c.predicted_peak_bytes for c in plan.candidates)
    assert plan.to_dict()["chosen"] is None


def test_cheapest_fix_names_the_first_mode_that_fits(counts_for):
    config = resolve_config("small", {"train": {"batch_size": 1}})
    fp32 = _peak(config, counts_for, 128, 1)
    bf16 = _peak(config, counts_for, 128, 1, "bf16")
    assert bf16 < fp32
    budget = (bf16 + fp32) // 2
    fix = cheapest_fix(config, counts_for, budget, 128, 1)
    assert fix.startswith("use {train.precision} bf16 (est. ")
    counts = counts_for((128,) * 3)
    with pytest.raises(InsufficientMemoryError) as info:
        check_fits(estimate(config, counts, (128,) * 3), config, counts_for, budget, "test", 128)
    assert info.value.required_bytes == fp32
    assert info.value.available_bytes == budget
    assert str(info.value).startswith("Predicted peak ")
    assert "for small at 128^3 x batch 1 (fp32) exceeds the memory budget" in str(info.value)
    assert info.value.template.endswith("(test): " + fix + "; or pass {train.force} to try anyway.")


def test_cheapest_fix_falls_back_to_a_smaller_volume(counts_for):
    config = resolve_config("small", {"train": {"batch_size": 1}})
    fix = cheapest_fix(config, counts_for, 2 * 2**30, 512, 1)
    assert fix.startswith("the largest volume that fits is {data.volume} ")
    assert "{train.batch_size} 1 {memory.recompute} stages {train.precision} bf16 (est. " in fix
    assert cheapest_fix(config, counts_for, 2**20, 512, 1) == ("nothing fits, not even the smallest volume; raise "
                                                               "{memory.budget_bytes} or free memory")


def test_auto_recomputes_the_fewest_stages(counts_for):
    config = resolve_config("small", {"train": {"batch_size": 1}})
    none = _peak(config, counts_for, 128, 1)
    stages = _peak(config, counts_for, 128, 1, recompute="stages")
    planner = Planner(config, counts_for, (none + stages) // 2)
    chosen = planner.fewest_recomputed_stages(128, 1, Precision.FP32)
    assert chosen.fits
    assert 1 <= len(chosen.recompute_stages) < 7
    assert chosen.recompute_stages[0] == "dec0"
    fewer = planner.evaluate(128, 1, Precision.FP32, Recompute.AUTO, chosen.recompute_stages[:-1])
    assert not fewer.fits


def test_available_memory_is_memavailable():
    import psutil

    assert abs(planner_module.available_memory_bytes() - psutil.virtual_memory().available) < 512 * 2**20


def test_without_native_bf16_the_plan_and_suggestions_keep_fp32(monkeypatch):
    from bigmem.memory.search import FP32_MODES, MODES, allowed_modes

    model = UNet3D(resolve_config("small").model).build_for()

    def counts_for(shape):
        return NetworkCounts.from_model(model, shape)

    config = resolve_config("small", {"train": {"batch_size": 1}})
    monkeypatch.setenv("BIGMEM_NATIVE_BF16", "0")
    assert allowed_modes() == FP32_MODES
    assert allowed_modes(True) == MODES
    plan = make_plan(config, counts_for, Budget(2 * 2**30, "test"), batch_size=1)
    assert plan.fits
    assert {c.precision for c in plan.candidates} == {"fp32"}
    assert plan.chosen.precision == "fp32"
    with_bf16 = make_plan(config, counts_for, Budget(2 * 2**30, "test"), batch_size=1, allow_bf16=True)
    assert {c.precision for c in with_bf16.candidates} == {"fp32", "bf16"}
    assert "bf16" not in cheapest_fix(config, counts_for, 2 * 2**30, 160, 1)
    bf16 = resolve_config("small", {"train": {"batch_size": 1, "precision": "bf16"}})
    assert "bf16" in cheapest_fix(bf16, counts_for, 2 * 2**30, 160, 1)  # asked for: still suggested


def test_largest_fitting_is_the_last_k_that_fits():
    from bigmem.memory.search import largest_fitting

    tried = []

    def make(k):
        tried.append(k)
        return k * 16

    assert largest_fitting(make, 64, lambda edge: edge ** 3 <= 100**3) == 96
    assert len(tried) <= 7  # a binary search: log2(64) + 1 tries, not 64
    assert largest_fitting(lambda k: k, 10, lambda k: False) is None
    assert largest_fitting(lambda k: k, 10, lambda k: True) == 10
