"""The one pre-flight: the budget's precedence on fake machines, the recomputed stages, the Plan, exit 3."""

from __future__ import annotations

import pytest
from helpers import make_sysfs

from bigmem.cli.common import flag_for
from bigmem.config import resolve_config
from bigmem.errors import EXIT_NO_FIT, ConfigError, InsufficientMemoryError
from bigmem.memory.budget import Budget, resolve_budget
from bigmem.memory.calibration import Calibration
from bigmem.memory.estimate import NetworkCounts, estimate
from bigmem.memory.plans import plan_job, plan_search, recompute_stages, require_fit
from bigmem.nets.unet3d import UNet3D
from bigmem.numa.policy import resolve_placement
from bigmem.numa.topology import NUMATopology
from bigmem.units import format_bytes

GIB = 2**30
MIB = 2**20
FIXED = Calibration(1.0, 100 * MIB, "test")
ALL_STAGES = ["enc0", "enc1", "enc2", "enc3", "dec2", "dec1", "dec0"]  # small: depth 3


@pytest.fixture(autouse=True)
def fixed_calibration(monkeypatch):
    monkeypatch.setattr("bigmem.memory.estimate.calibration_for", lambda preset, precision, mode: FIXED)
    monkeypatch.setattr("bigmem.memory.search.calibration_for", lambda preset, precision, mode: FIXED)


@pytest.fixture
def two_socket(tmp_path):
    """Node 0: 700 GiB free; node 1: 384 GiB free."""
    return make_sysfs(tmp_path, [("0-3", 768, 700), ("4-7", 768, 384)], [[10, 21], [21, 10]])


@pytest.fixture
def full_node(tmp_path):
    """Node 1 has nothing free: any job bound to it is refused."""
    return make_sysfs(tmp_path, [("0-3", 64, 60), ("4-7", 64, 0)], [[10, 21], [21, 10]])


def _placement(root, text):
    topology = NUMATopology.from_sysfs(root)
    return resolve_placement(text, None, None, topology, {c for n in topology.nodes for c in n.cpus}), topology


@pytest.fixture
def no_memavailable(monkeypatch):
    """Fails a test that reads MemAvailable where the rule says it must not."""
    def unread():
        raise AssertionError("MemAvailable was read")

    monkeypatch.setattr("bigmem.memory.budget.available_memory_bytes", unread)


# ---- the budget's precedence ------------------------------------------------------------------

def test_an_explicit_budget_wins_over_memavailable(no_memavailable):
    assert resolve_budget(3 * GIB) == Budget(3 * GIB, "--memory-budget")
    # Above MemAvailable too: a plan for a bigger machine keeps what it was given.
    assert resolve_budget(2**50, flag="--budget") == Budget(2**50, "--budget")


def test_an_explicit_budget_wins_over_a_placement_with_more_memory(two_socket, no_memavailable):
    placement, topology = _placement(two_socket, "bind:1")
    assert resolve_budget(100 * GIB, placement=placement, topology=topology) == Budget(100 * GIB, "--memory-budget")


def test_an_explicit_budget_past_the_placement_is_capped_with_a_note(two_socket, no_memavailable):
    placement, topology = _placement(two_socket, "bind:1")
    budget = resolve_budget(500 * GIB, flag="--budget", placement=placement, topology=topology)
    assert (budget.budget_bytes, budget.source) == (384 * GIB, "free memory of node(s) 1")
    assert budget.note == ("note: --budget 500.00 GiB is more than --numa bind:1 can use; budgeting 384.00 GiB "
                           "(free memory of node(s) 1)")
    assert budget.placement is placement


def test_without_a_budget_the_placement_decides(two_socket, no_memavailable):
    placement, topology = _placement(two_socket, "bind:0-1")
    budget = resolve_budget(None, placement=placement, topology=topology)
    assert (budget.budget_bytes, budget.source, budget.note) == ((700 + 384) * GIB, "free memory of node(s) 0,1", "")
    placement, topology = _placement(two_socket, "interleave")
    budget = resolve_budget(None, placement=placement, topology=topology)
    assert budget.budget_bytes == 2 * 384 * GIB
    assert budget.source == "2 interleaved node(s) x the smallest free 384.00 GiB"


@pytest.mark.parametrize("policy", [None, "none", "local", "preferred:1"])
def test_else_memavailable(two_socket, policy):
    placement, topology = _placement(two_socket, policy) if policy else (None, None)
    budget = resolve_budget(None, placement=placement, topology=topology, available_bytes=123 * GIB)
    assert budget == Budget(123 * GIB, "MemAvailable")


def test_memavailable_is_read_only_when_the_rule_gets_there(monkeypatch):
    monkeypatch.setattr("bigmem.memory.budget.available_memory_bytes", lambda: 77 * GIB)
    assert resolve_budget().budget_bytes == 77 * GIB


# ---- the recomputed stages --------------------------------------------------------------------

@pytest.fixture(scope="module")
def counts_for():
    model = UNet3D(resolve_config("small").model).build_for()
    return lambda shape: NetworkCounts.from_model(model, shape)


def _config(recompute="none"):
    return resolve_config("small", {"data": {"volume": 128}, "train": {"batch_size": 1},
                                    "memory": {"recompute": recompute}})


def _peak(config, counts_for, stages):
    return estimate(config, counts_for((128,) * 3), (128,) * 3, recompute_stages=stages).predicted_peak_bytes


def test_fixed_modes_name_no_stage_or_every_stage(counts_for):
    assert recompute_stages(_config(), counts_for, (128,) * 3) == []
    assert sorted(recompute_stages(_config(recompute="stages"), counts_for, (128,) * 3)) == sorted(ALL_STAGES)


def test_auto_recomputes_the_fewest_stages_that_fit(counts_for):
    none, every = _peak(_config(), counts_for, []), _peak(_config(), counts_for, ALL_STAGES)
    budget = (none + every) // 2
    stages = recompute_stages(_config(recompute="auto"), counts_for, (128,) * 3, budget)
    assert 1 <= len(stages) < 7
    assert stages[0] == "dec0"
    assert _peak(_config(), counts_for, stages) <= budget < _peak(_config(), counts_for, stages[:-1])
    # Nothing fits: every stage, the most it can save.
    assert sorted(recompute_stages(_config(recompute="auto"), counts_for, (128,) * 3, MIB)) == sorted(ALL_STAGES)


def test_auto_needs_a_budget(counts_for):
    # A Python caller reads config fields; the command line shows the flags (ConfigError.render).
    with pytest.raises(ConfigError, match=r"^memory.recompute auto needs a memory budget to fit; give "
                                          r"memory.budget_bytes\.$") as raised:
        recompute_stages(_config(recompute="auto"), counts_for, (128,) * 3)
    assert raised.value.render(flag_for) == ("--recompute auto needs a memory budget to fit; give --memory-budget.")
    anisotropic = recompute_stages(_config(recompute="auto"), counts_for, (128, 128, 64), GIB)  # any shape works
    assert set(anisotropic) <= set(ALL_STAGES)


# ---- the Plan of a job, and exit 3 ------------------------------------------------------------

def test_a_job_that_fits_is_its_own_chosen_candidate(counts_for):
    config = _config()
    plan = plan_job(config, counts_for, Budget(64 * GIB, "--memory-budget"))
    peak = _peak(config, counts_for, [])
    assert plan.fits
    assert not plan.forced
    assert plan.predicted_peak_bytes == peak
    chosen = plan.chosen
    assert (chosen.volume, chosen.batch_size, chosen.precision, chosen.recompute, chosen.recompute_stages) == (
        128, 1, "fp32", "none", [])
    data = plan.to_dict()
    assert data["budget_bytes"] == 64 * GIB
    assert data["budget_source"] == "--memory-budget"
    assert data["predicted_peak_bytes"] == sum(data["components"].values()) == peak
    assert data["calibration"]["source"] == "test"
    assert data["data_parallel"] is None
    assert data["candidates"] == [data["closest"]]
    assert data["candidates"][0]["predicted_peak_bytes"] == peak


def test_one_schema_for_plan_and_for_a_run(counts_for):
    budget = Budget(64 * GIB, "--budget")
    searched = plan_search(_config(), counts_for, budget, volume=128, batch_size=1).to_dict()
    run = plan_job(_config(recompute="auto"), counts_for, budget).to_dict()
    assert list(searched) == list(run)
    assert list(searched["chosen"]) == list(run["chosen"])
    # Every key plan.json's readers use (monitor/report.py, compare/run.py, the tests).
    assert {"fits", "forced", "budget_bytes", "budget_source", "predicted_peak_bytes", "components", "chosen",
            "data_parallel", "candidates"} <= set(run)
    assert {"volume", "batch_size", "precision", "recompute", "recompute_stages", "partitioned_stages"} <= set(
        run["chosen"])


def test_auto_keeps_the_stages_it_tried(counts_for):
    config = _config(recompute="auto")
    budget = (_peak(config, counts_for, []) + _peak(config, counts_for, ALL_STAGES)) // 2
    plan = plan_job(config, counts_for, Budget(budget, "--memory-budget"))
    assert plan.fits
    assert plan.chosen.recompute == "auto"
    assert plan.chosen.recompute_stages[0] == "dec0"
    tried = [c.recompute_stages for c in plan.candidates]
    assert tried == [plan.chosen.recompute_stages[:n] for n in range(len(plan.chosen.recompute_stages) + 1)]
    assert plan.candidates[-1] is plan.chosen


def test_a_job_over_its_budget_is_refused_with_the_cheapest_fix(counts_for):
    config = _config()
    peak = _peak(config, counts_for, [])
    with pytest.raises(InsufficientMemoryError) as info:
        plan_job(config, counts_for, Budget(peak - 1, "--memory-budget"))
    error = info.value
    assert error.exit_code == EXIT_NO_FIT == 3
    assert (error.required_bytes, error.available_bytes) == (peak, peak - 1)
    message = str(error)
    assert message.startswith(f"Predicted peak {format_bytes(peak)} for small at 128^3 x batch 1 "
                              "(fp32) exceeds the memory budget ")
    assert "(--memory-budget): use train.precision bf16 (est. " in message  # the suite fixes native bf16 on
    assert message.endswith("; or pass train.force to try anyway.")


def test_a_job_over_its_placement_is_refused_per_node(full_node, counts_for):
    placement, topology = _placement(full_node, "bind:1")
    budget = resolve_budget(None, placement=placement, topology=topology)
    peak = _peak(_config(), counts_for, [])
    with pytest.raises(InsufficientMemoryError) as info:
        plan_job(_config(), counts_for, budget)
    assert str(info.value) == (f"Predicted peak {format_bytes(peak)} does not fit numa.policy bind:1 "
                               "(node 1: 0 B free; 0 B in all). Bind more nodes, or use numa.policy interleave.")
    assert info.value.exit_code == 3


def test_forced_and_unchecked_jobs_run_past_the_budget(counts_for):
    forced = plan_job(_config(), counts_for, Budget(MIB, "--memory-budget"), force=True)
    assert not forced.fits
    assert forced.forced
    assert forced.chosen.volume == 128
    assert forced.to_dict()["chosen"]["recompute_stages"] == []
    unchecked = plan_job(_config(), counts_for, Budget(MIB, "--memory-budget"), check=False)
    assert not unchecked.fits
    assert not unchecked.forced


def test_fixed_stages_are_kept(counts_for):
    plan = plan_job(_config(recompute="stages"), counts_for, Budget(64 * GIB, "x"), stages=["dec0"])
    assert plan.chosen.recompute_stages == ["dec0"]
    assert plan.predicted_peak_bytes == _peak(_config(), counts_for, ["dec0"])


def test_a_search_where_nothing_fits_is_refused(counts_for):
    plan = plan_search(_config(), counts_for, Budget(10 * MIB, "--budget"))
    assert not plan.fits
    assert plan.to_dict()["chosen"] is None
    with pytest.raises(InsufficientMemoryError) as info:
        require_fit(plan)
    assert str(info.value).startswith("Nothing fits 10.00 MiB (--budget): the closest candidate, 8^3 x batch 1 ")
    assert info.value.available_bytes == 10 * MIB
    assert info.value.exit_code == 3
    require_fit(plan_search(_config(), counts_for, Budget(64 * GIB, "--budget"), volume=32, batch_size=1))


# ---- a store's own shapes, validation, a budget above the machine -------------------------------

def test_planned_shape_is_the_largest_case_or_the_bounding_shape():
    from bigmem.memory.plans import planned_shape

    shapes = [(240, 240, 160), (256, 256, 48), (160, 192, 128)]
    assert planned_shape(shapes, 1) == (240, 240, 160)  # the most voxels
    assert planned_shape(shapes, 2) == (256, 256, 160)  # any two may share a batch: their bounding shape


def test_a_case_that_does_not_fit_is_refused_by_name(counts_for):
    from bigmem.memory.plans import CaseShape

    cases = [CaseShape("small_one", (64, 64, 40), (64, 64, 40)), CaseShape("long_one", (64, 64, 300), (64, 64, 304))]
    config = resolve_config("small", {"train": {"batch_size": 1}})  # no data.shape: each case at its own
    shape = (64, 64, 304)
    small_peak = estimate(config, counts_for((64, 64, 40)), (64, 64, 40)).predicted_peak_bytes
    big_peak = estimate(config, counts_for(shape), shape).predicted_peak_bytes
    budget = Budget((small_peak + big_peak) // 2, "--memory-budget")
    with pytest.raises(InsufficientMemoryError, match=r"^Predicted peak .* for small at 64x64x304 \(case 'long_one', "
                                                      r"64x64x300 padded\) x batch 1 \(fp32\) exceeds the memory "
                                                      r"budget .*: use .*or pass train\.force to try anyway\.$"):
        plan_job(config, counts_for, budget, shape=shape, cases=cases)
    plan = plan_job(config, counts_for, budget, shape=shape, cases=cases, force=True)
    assert [(c.case, c.fits) for c in plan.cases] == [("small_one", True), ("long_one", False)]
    assert plan.to_dict()["chosen"]["spatial_shape"] == list(shape)


def test_validation_beside_training_is_planned(counts_for):
    config = _config()
    train_shape, held_out = (32, 32, 32), (128, 128, 128)
    alone = plan_job(config, counts_for, Budget(64 * GIB, "--memory-budget"), shape=train_shape)
    plan = plan_job(config, counts_for, Budget(64 * GIB, "--memory-budget"), shape=train_shape,
                    validation_shape=held_out, validation_case="big")
    assert plan.validation.case == "big"
    assert plan.validation.shape == [128, 128, 128]
    extra = plan.chosen.components["validation"]
    assert extra > 0
    assert plan.predicted_peak_bytes == alone.predicted_peak_bytes + extra
    assert plan.validation.predicted_peak_bytes == plan.predicted_peak_bytes
    tight = Budget((alone.predicted_peak_bytes + plan.predicted_peak_bytes) // 2, "--memory-budget")
    with pytest.raises(InsufficientMemoryError, match=r"^Validating held-out case 'big' \(128x128x128\) whole beside "
                                                      r"the model needs .*; training alone would fit .*Drop "
                                                      r"train\.val_every, hold out smaller cases, or pass "
                                                      r"train\.force"):
        plan_job(config, counts_for, tight, shape=train_shape, validation_shape=held_out, validation_case="big")
    small = plan_job(config, counts_for, Budget(64 * GIB, "x"), shape=(128,) * 3, validation_shape=(32, 32, 32))
    assert "validation" not in small.chosen.components
    assert small.validation.excess_bytes == 0


def test_validation_takes_each_parts_margin_not_a_predict_processes(monkeypatch, counts_for):
    """The resident part gets the training calibration's margin, the pass's parts the inference one's fraction;
    the inference estimate's margin (over a framework of its own, plus fixed bytes for it) is not added."""
    from bigmem.memory.calibration import INFERENCE_MODE
    from bigmem.memory.estimate import Pass
    from bigmem.memory.plans import validation_figures

    training_cal = Calibration(1.0, 100 * MIB, "training", margin_fraction=0.02)
    inference_cal = Calibration(1.0, 100 * MIB, "inference", margin_fraction=0.15, margin_bytes=256 * MIB)
    monkeypatch.setattr("bigmem.memory.estimate.calibration_for", lambda preset, precision, mode:
                        inference_cal if mode == INFERENCE_MODE else training_cal)
    config, held_out = _config(), (96, 112, 96)
    training = estimate(config, counts_for((48, 56, 48)), (48, 56, 48))
    figures = validation_figures(config, counts_for, training, held_out, "big")
    forward = estimate(config, counts_for(held_out), held_out, pass_=Pass.FORWARD)
    kept = ("framework", "weights", "gradients", "optimizer_slots", "input_pipeline", "hdf5_chunk_cache")
    resident = sum(training.components[name] for name in kept)
    own = forward.predicted_peak_bytes - sum(forward.components[k] for k in ("framework", "weights", "safety_margin"))
    margin = round(0.02 * resident) + round(0.15 * own)
    assert (figures.resident_bytes, figures.pass_bytes, figures.safety_margin_bytes) == (resident, own, margin)
    assert figures.predicted_peak_bytes == resident + own + margin
    assert forward.components["safety_margin"] > 256 * MIB  # what a predict process of its own would add
    assert figures.excess_bytes == max(0, resident + own + margin - training.predicted_peak_bytes)


def test_a_budget_above_the_machine_is_refused_unless_forced():
    from bigmem.memory.budget import check_budget_within_machine

    with pytest.raises(InsufficientMemoryError, match=r"^--memory-budget 1\.50 TiB is more than this machine's "
                                                      r"memory \(24\.00 GiB, MemTotal\)") as raised:
        check_budget_within_machine(Budget(3 * 2**39, "--memory-budget"), machine_bytes=24 * GIB)
    assert raised.value.exit_code == EXIT_NO_FIT
    check_budget_within_machine(Budget(3 * 2**39, "--memory-budget"), force=True, machine_bytes=24 * GIB)
    check_budget_within_machine(Budget(3 * 2**39, "MemAvailable"), machine_bytes=24 * GIB)  # not the user's
    check_budget_within_machine(Budget(20 * GIB, "--memory-budget"), machine_bytes=24 * GIB)


def test_the_case_table_takes_the_jobs_step_instead_of_estimating_it_again(counts_for, monkeypatch):
    from bigmem.memory import plans
    from bigmem.memory.plans import CaseShape

    cases = [CaseShape("a", (64, 64, 40), (64, 64, 40)), CaseShape("b", (64, 64, 80), (64, 64, 80))]
    config = resolve_config("small", {"train": {"batch_size": 1}})
    expected = [estimate(config, counts_for(tuple(c.trained_shape)), tuple(c.trained_shape)).predicted_peak_bytes
                for c in cases]
    calls = []
    monkeypatch.setattr(plans, "estimate", lambda *a, **k: calls.append(a[2]) or estimate(*a, **k))
    plan = plan_job(config, counts_for, Budget(64 * 2**30, "--memory-budget"), shape=(64, 64, 80), cases=cases)
    assert [row.predicted_peak_bytes for row in plan.cases] == expected
    assert calls == [(64, 64, 40)]  # the larger case is the job's own step, estimated once by the planner
