"""``bigmem.api.profile``, ``sweep`` and ``calibrate`` from Python, without the command line: the recomputed
stages recompute auto chooses, the refusal of a measurement that cannot fit, and nothing printed."""

from __future__ import annotations

import pytest

from bigmem import api
from bigmem.cli.common import flag_for
from bigmem.errors import InsufficientMemoryError
from bigmem.memory.budget import EXPLICIT_FIELD, check_budget_within_machine
from bigmem.memory.records import Budget

GIB = 2**30
SHAPE = (128, 128, 128)


@pytest.fixture(scope="module")
def auto_config():
    return api.resolve_config("small", {"memory": {"recompute": "auto"}})


@pytest.fixture(scope="module")
def auto_profile(auto_config):
    """The small preset at 128^3 with recompute auto in 2 GiB (which no stage choice fits: every stage)."""
    return api.profile(auto_config, SHAPE, budget_bytes=2 * GIB)


@pytest.fixture
def never_measured(monkeypatch):
    """Fail a test whose call would start a measuring child process."""
    import bigmem.memory.measure as measure_module

    def refuse(*args, **kwargs):
        raise AssertionError("a refused measurement must not start its child process")

    monkeypatch.setattr(measure_module, "run_child", refuse)


def test_recompute_auto_recomputes_stages(auto_profile):
    assert auto_profile.estimate.recompute_stages


def test_recompute_auto_chooses_as_the_planner_does(auto_config, auto_profile):
    from bigmem.memory.plans import recompute_stages
    from bigmem.memory.profile import counts_function

    sized = auto_config.updated({"data": {"shape": list(SHAPE)}})
    chosen = recompute_stages(sized, counts_function(sized), SHAPE, 2 * GIB)
    assert list(auto_profile.estimate.recompute_stages) == chosen


def test_recompute_auto_in_a_large_budget_recomputes_less(auto_config, auto_profile):
    roomy = api.profile(auto_config, SHAPE, budget_bytes=64 * GIB)
    assert len(roomy.estimate.recompute_stages) < len(auto_profile.estimate.recompute_stages)


def test_the_budget_is_kept(auto_profile):
    assert auto_profile.budget.budget_bytes == 2 * GIB


def test_an_explicit_budget_is_named_as_its_setting(auto_profile):
    assert auto_profile.budget.source == "{memory.budget_bytes}"


def test_a_fixed_recompute_mode_asks_no_budget():
    assert api.profile(api.resolve_config("small"), (32, 32, 32)).budget is None


def test_the_budget_defaults_to_the_configs(auto_config):
    config = auto_config.updated({"memory": {"budget_bytes": 3 * GIB}})
    assert api.profile(config, SHAPE).budget.budget_bytes == 3 * GIB


def test_an_unfit_measurement_is_refused(never_measured):
    with pytest.raises(InsufficientMemoryError):
        api.profile(api.resolve_config("small"), (256, 256, 256), measure=True, budget_bytes=2 * GIB)


def _refusal(call) -> InsufficientMemoryError:
    with pytest.raises(InsufficientMemoryError) as caught:
        call()
    return caught.value


@pytest.fixture(scope="module")
def measure_refusal():
    return _refusal(lambda: api.profile(api.resolve_config("small"), (256, 256, 256), measure=True,
                                        budget_bytes=2 * GIB))


def test_the_refusal_names_the_budget_setting(measure_refusal):
    assert "(memory.budget_bytes)" in str(measure_refusal)


def test_the_refusal_names_the_measure_argument(measure_refusal):
    assert str(measure_refusal).startswith("profile.measure would train small at 256^3")


def test_the_refusal_names_no_flag(measure_refusal):
    assert "--" not in str(measure_refusal)


def test_the_refusal_keeps_the_budget(measure_refusal):
    assert measure_refusal.available_bytes == 2 * GIB


def test_the_command_line_renders_the_refusal_as_flags(measure_refusal):
    assert measure_refusal.render(flag_for).endswith(
        "(--memory-budget). Drop --measure for the estimate alone, or measure a smaller --shape.")


def test_a_sweep_too_large_is_refused_naming_its_setting(never_measured):
    refusal = _refusal(lambda: api.sweep(api.resolve_config("small"), [32, 256], budget_bytes=2 * GIB))
    assert "give sweep.shapes smaller sizes" in str(refusal)


@pytest.mark.parametrize("field, flag", [("sweep.shapes", "--sweep"), ("calibrate.shapes", "--calibrate"),
                                         ("profile.measure", "--measure"), ("profile.shape", "--shape")])
def test_the_refusals_settings_render_as_profiles_flags(field, flag):
    assert flag_for(field) == flag


def test_a_calibration_too_large_is_refused_naming_its_setting(never_measured):
    refusal = _refusal(lambda: api.calibrate(api.resolve_config("small"), [32, 256], budget_bytes=2 * GIB))
    assert "give calibrate.shapes smaller sizes" in str(refusal)


def test_a_budget_above_the_machine_is_refused_before_measuring(never_measured):
    refusal = _refusal(lambda: api.profile(api.resolve_config("small"), (32, 32, 32), measure=True,
                                           budget_bytes=2**50))
    assert str(refusal).startswith("memory.budget_bytes 1.00 PiB is more than this machine's memory")


def test_a_budget_named_as_its_setting_is_explicit():
    with pytest.raises(InsufficientMemoryError):
        check_budget_within_machine(Budget(2 * GIB, EXPLICIT_FIELD), machine_bytes=GIB)


def test_nothing_is_printed(capsys, auto_config):
    api.profile(auto_config, SHAPE, budget_bytes=2 * GIB)
    assert capsys.readouterr() == ("", "")


def test_a_refusal_prints_nothing(capsys, never_measured):
    with pytest.raises(InsufficientMemoryError):
        api.profile(api.resolve_config("small"), (256, 256, 256), measure=True, budget_bytes=2 * GIB)
    assert capsys.readouterr() == ("", "")


def test_inference_asks_no_budget():
    assert api.profile(api.resolve_config("small"), (40, 40, 40), inference=True).budget is None
