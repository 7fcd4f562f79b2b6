"""Calibration: the least-squares fit, storage per machine key, and the default fallback."""

from __future__ import annotations

import json

import pytest

from bigmem.memory.calibration import (
    DEFAULT_SOURCE, fit_calibration, fit_line, lookup_calibration, machine_key, save_calibration,
)


def test_fit_line_recovers_a_line():
    slope, intercept = fit_line([1, 2, 3, 4], [7, 9, 11, 13])
    assert (slope, intercept) == pytest.approx((2.0, 5.0))
    with pytest.raises(ValueError, match="at least two different sizes"):
        fit_line([3, 3], [1, 2])


def test_fit_recovers_scale_and_overhead():
    points = [{"volume": v, "counted_activation_bytes": a, "exact_bytes": 100,
               "measured_peak_bytes": 100 + 600_000_000 + int(1.3 * a)}
              for v, a in ((32, 10_000_000), (64, 80_000_000), (96, 270_000_000))]
    calibration = fit_calibration("bf16", "stages", points)
    assert calibration.activation_scale == pytest.approx(1.3)
    assert calibration.framework_bytes == pytest.approx(600_000_000, rel=1e-6)
    assert calibration.fitted_on == [32, 64, 96]
    assert calibration.key == machine_key("bf16", "stages")


def test_saved_calibration_is_found_again(tmp_path):
    path = tmp_path / "calibration.json"
    assert lookup_calibration("fp32", "none", path=path).source == DEFAULT_SOURCE
    points = [{"volume": 32, "counted_activation_bytes": 1, "exact_bytes": 0, "measured_peak_bytes": 5},
              {"volume": 64, "counted_activation_bytes": 3, "exact_bytes": 0, "measured_peak_bytes": 9}]
    saved = fit_calibration("fp32", "none", points)
    save_calibration(saved, path=path)
    save_calibration(fit_calibration("bf16", "none", points), path=path)
    found = lookup_calibration("fp32", "none", path=path)
    assert found == saved and found.source.startswith("this machine")
    assert len(json.loads(path.read_text())["calibrations"]) == 2
    save_calibration(saved, path=path)  # replaces, does not duplicate
    assert len(json.loads(path.read_text())["calibrations"]) == 2
    assert lookup_calibration("fp32", "stages", path=path).source == DEFAULT_SOURCE
