"""memory.profile: a calibration is stored under the key its estimates look it up by."""

from __future__ import annotations

import pytest

from bigmem.config import resolve_config
from bigmem.errors import UsageError
from bigmem.memory import profile
from bigmem.memory.measure import Measurement


def _never_measured(*args, **kwargs):
    raise AssertionError("measured before the sizes were checked")


def test_auto_recompute_choosing_both_modes_is_refused_before_measuring(monkeypatch):
    config = resolve_config("tiny", {"memory": {"recompute": "auto"}})
    monkeypatch.setattr(profile, "choose_stages", lambda sized, counts_for, shape: [] if shape[0] == 16 else ["enc0"])
    monkeypatch.setattr(profile, "measure", _never_measured)
    with pytest.raises(UsageError, match=r"^memory\.recompute auto recomputes stages at some calibrate\.shapes "
                                         r"sizes and none"):
        profile.calibrate(config, [16, 32], profile.counts_function(config), save=False)


def test_auto_recompute_that_recomputes_at_every_size_is_a_stages_calibration(monkeypatch):
    config = resolve_config("tiny", {"memory": {"recompute": "auto"}})
    monkeypatch.setattr(profile, "choose_stages", lambda sized, counts_for, shape: ["enc0"])
    peaks = {16: 700 * 2**20, 32: 760 * 2**20, 48: 900 * 2**20}

    def measured(sized, *, steps, recompute_stages):
        assert recompute_stages == ["enc0"]
        return Measurement(peak_bytes=peaks[sized.data.shape[0]], baseline_bytes=0, node_bytes={}, seconds=0.0)

    monkeypatch.setattr(profile, "measure", measured)
    calibration, points = profile.calibrate(config, [16, 32, 48], profile.counts_function(config), save=False)
    assert calibration.key["recompute"] == "stages"  # the key an estimate with recomputed stages looks up
    assert [p["measured_peak_bytes"] for p in points] == [peaks[16], peaks[32], peaks[48]]


def test_a_calibration_point_leaves_the_allocator_growth_to_the_estimate():
    # The tables hold a few steps' peaks: a fit that counted the growth as known would take it back out.
    from bigmem.memory.estimate import estimate

    config = resolve_config("tiny", {"data": {"shape": [16, 16, 16]}})
    counts_for = profile.counts_function(config)
    point = profile.calibration_point(config, counts_for, 10**9)
    raw = estimate(config, counts_for((16, 16, 16)), (16, 16, 16), calibration=profile.UNIT_CALIBRATION)
    assert point["exact_bytes"] + point["counted_activation_bytes"] == raw.first_steps_bytes
