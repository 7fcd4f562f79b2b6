"""Calibration: the least-squares fit, storage per machine key, and the default fallback."""

from __future__ import annotations

import json

import pytest

from bigmem.memory import calibration as calibration_module
from bigmem.memory.calibration import (
    SHIPPED,
    SHIPPED_MACHINES,
    EMULATED_BF16_MARGIN_FRACTION,
    FALLBACK_ISA,
    UNMEASURED_MARGIN_BYTES,
    UNMEASURED_MARGIN_FRACTION,
    Calibration,
    calibration_for,
    fit_calibration,
    fit_line,
    knots_from,
    machine_key,
    save_calibration,
    shipped_calibration,
    shipped_shape,
)
from bigmem.sysinfo import isa_class

MODES = [(p, r) for p in ("fp32", "bf16") for r in ("none", "stages")]


def test_fit_line_recovers_a_line():
    slope, intercept = fit_line([1, 2, 3, 4], [7, 9, 11, 13])
    assert (slope, intercept) == pytest.approx((2.0, 5.0))
    with pytest.raises(ValueError, match="at least two different sizes"):
        fit_line([3, 3], [1, 2])


def test_weighted_fit_line_follows_the_heavier_points():
    # three points off one line; weight on the first two makes the line pass through them
    slope, intercept = fit_line([0, 1, 2], [0, 1, 5], weights=[1e6, 1e6, 1e-6])
    assert (slope, intercept) == pytest.approx((1.0, 0.0), abs=1e-4)
    assert fit_line([0, 1, 2], [0, 1, 5]) == pytest.approx((2.5, -0.5))


def _point(volume, counted, overhead, exact=100):
    return {"volume": volume, "counted_activation_bytes": counted, "exact_bytes": exact,
            "measured_peak_bytes": exact + overhead}


def test_knots_interpolate_and_extend_their_end_segments():
    curve = Calibration(0.0, 0, "test", knots=[[100, 1000], [300, 1400], [700, 2200]])
    assert curve.line_for(100) == (2.0, 800)
    assert curve.line_for(200) == (2.0, 800)
    assert curve.line_for(50) == (2.0, 800)  # below the first knot: the first segment
    assert curve.line_for(301) == (2.0, 800)
    curve.knots[2] = [700, 2000]
    assert curve.line_for(500) == (1.5, 950)
    assert curve.line_for(700) == (1.5, 950)
    # beyond: through the last knot, with the least-squares slope of the knots (weights 1/y^2)
    # where it is steeper than the last segment's 1.5
    slope, intercept = curve.line_for(5000)
    assert slope == pytest.approx(1.6927, abs=1e-4)
    assert intercept == 815  # 2000 - 1.6927 * 700
    curve.knots[2] = [700, 3000]
    assert curve.line_for(5000) == (4.0, 200)  # the last segment is the steeper one
    assert Calibration(0.5, 7, "line").line_for(10**9) == (0.5, 7)  # no knots: the scalars
    assert curve.fixed_bytes() == 800
    assert Calibration(0.5, 7, "line").fixed_bytes() == 7


def test_knots_from_points_average_sort_and_never_decrease():
    points = [_point(96, 300, 1400), _point(32, 100, 1000), _point(64, 200, 900),
              _point(96, 300, 1600), _point(128, 700, 2200)]
    assert knots_from(points) == [[100, 1000], [200, 1000], [300, 1500], [700, 2200]]


def test_fit_with_three_sizes_interpolates_and_reports_the_last_segment():
    points = [_point(32, 100, 1000), _point(64, 300, 1400), _point(96, 700, 2000)]
    calibration = fit_calibration("small", "fp32", "none", points)
    assert calibration.knots == [[100, 1000], [300, 1400], [700, 2000]]
    assert (calibration.activation_scale, calibration.framework_bytes) == (1.6927, 815)  # the line beyond
    two = fit_calibration("small", "fp32", "none", points[:2])
    assert two.knots == []
    assert (two.activation_scale, two.framework_bytes) == (2.0, 800)


def test_fit_recovers_scale_and_overhead():
    points = [{"volume": v, "counted_activation_bytes": a, "exact_bytes": 100,
               "measured_peak_bytes": 100 + 600_000_000 + int(1.3 * a)}
              for v, a in ((32, 10_000_000), (64, 80_000_000), (96, 270_000_000))]
    calibration = fit_calibration("kits19", "bf16", "stages", points)
    assert calibration.activation_scale == pytest.approx(1.3)
    assert calibration.framework_bytes == pytest.approx(600_000_000, rel=1e-6)
    assert calibration.fitted_on == [32, 64, 96]
    assert calibration.key == machine_key("kits19", "bf16", "stages")
    assert calibration.key["preset"] == "kits19"
    assert calibration.margin_fraction == 0.0


def test_the_step_rate_is_the_largest_timed_volumes():
    points = [dict(_point(v, a, o), step_gflops_per_core=r)
              for v, a, o, r in ((32, 100, 1000, 40.0), (96, 700, 2000, 61.5), (64, 300, 1400, 55.0))]
    assert fit_calibration("small", "fp32", "none", points).step_gflops_per_core == 61.5
    untimed = fit_calibration("small", "fp32", "none", [_point(32, 100, 1000), _point(64, 300, 1400)])
    assert untimed.step_gflops_per_core is None


@pytest.fixture
def on_isa(monkeypatch):
    """Pretend the CPU is of a given ISA class (the machine key and the defaults follow it)."""
    def set_isa(name):
        monkeypatch.setattr(calibration_module, "machine_isa_class", lambda: name)
    set_isa("avx512_bf16")
    return set_isa


def test_saved_calibration_is_found_again_per_preset_and_mode(tmp_path, on_isa):
    path = tmp_path / "calibration.json"
    assert calibration_for("small", "fp32", "none", path=path).source.startswith("default for small")
    points = [{"volume": 32, "counted_activation_bytes": 1, "exact_bytes": 0, "measured_peak_bytes": 5},
              {"volume": 64, "counted_activation_bytes": 3, "exact_bytes": 0, "measured_peak_bytes": 9}]
    saved = fit_calibration("small", "fp32", "none", points)
    assert (saved.activation_scale, saved.framework_bytes) == (2.0, 3)
    save_calibration(saved, path=path)
    save_calibration(fit_calibration("small", "bf16", "none", points), path=path)
    found = calibration_for("small", "fp32", "none", path=path)
    assert found == saved
    assert found.source.startswith("this machine")
    assert len(json.loads(path.read_text())["calibrations"]) == 2
    save_calibration(saved, path=path)  # replaces, does not duplicate
    assert len(json.loads(path.read_text())["calibrations"]) == 2
    assert calibration_for("small", "fp32", "stages", path=path).source.startswith("default")
    # another preset, or another ISA class, does not take this fit
    assert calibration_for("kits19", "fp32", "none", path=path).source.startswith("default for kits19")
    on_isa("avx2")
    assert calibration_for("small", "fp32", "none", path=path).source.startswith("default for small")


@pytest.mark.parametrize("isa", ["avx512_bf16", "amx"])
@pytest.mark.parametrize("preset", ["small", "intelai-brats", "kits19"])
@pytest.mark.parametrize("precision, recompute", MODES)
def test_every_shipped_preset_has_a_default_on_each_measured_isa(isa, preset, precision, recompute):
    found = shipped_calibration(preset, precision, recompute, isa=isa)
    knots = SHIPPED[(isa, preset, precision, recompute)]
    assert found.knots == [[x, y] for _, x, y in knots]
    assert found.fitted_on == [v for v, _, _ in knots]
    # from 32^3 to the largest size each mode fits in 24 GiB, at least 192^3
    assert found.fitted_on[:3] == [32, 64, 96]
    assert found.fitted_on[-1] >= 192
    assert (found.margin_fraction, found.margin_bytes) == (0.0, 0)
    machine = SHIPPED_MACHINES[(isa, preset, precision, recompute)]
    assert found.source.startswith(f"default for {preset} on {isa} ({machine})")


def test_tiny_uses_smalls_default_without_a_margin():
    tiny = shipped_calibration("tiny", "bf16", "stages", isa="avx512_bf16")
    small = shipped_calibration("small", "bf16", "stages", isa="avx512_bf16")
    assert (tiny.knots, tiny.activation_scale, tiny.margin_fraction) == (small.knots, small.activation_scale, 0.0)


@pytest.mark.parametrize("isa, precision, margin", [
    ("avx2", "fp32", 0.15), ("avx2", "bf16", 1.0),  # bf16 emulated with float32 temporaries
    ("avx512", "fp32", 0.15), ("avx512", "bf16", 1.0),  # AVX-512 without its bf16 instructions
    ("baseline", "bf16", 1.0),
])
def test_an_unmeasured_isa_gets_the_stated_margin_and_says_so(isa, precision, margin):
    found = shipped_calibration("small", precision, "none", isa=isa)
    assert found.margin_fraction == margin
    assert (UNMEASURED_MARGIN_FRACTION, EMULATED_BF16_MARGIN_FRACTION) == (0.15, 1.0)
    assert found.knots == shipped_calibration("small", precision, "none", isa=FALLBACK_ISA).knots
    assert f"no default for ISA class {isa} (measured: amx, avx512_bf16)" in found.source
    assert found.margin_bytes == UNMEASURED_MARGIN_BYTES == 256 * 2**20
    assert f"+{round(100 * margin)}% + 256.00 MiB safety margin" in found.source
    assert ("bf16 is emulated" in found.source) == (margin == 1.0)


def test_an_unknown_model_takes_the_largest_multiplier_with_a_margin():
    found = shipped_calibration("my-net", "fp32", "none", isa="avx512_bf16")
    scales = {k[1]: shipped_calibration(k[1], "fp32", "none", isa="avx512_bf16").activation_scale
              for k in SHIPPED if k[0] == "avx512_bf16" and k[2:] == ("fp32", "none")}
    assert found.activation_scale == max(scales.values())
    assert found.margin_fraction == 0.15
    assert "no default for model 'my-net' in fp32/none" in found.source


@pytest.mark.parametrize("flags, expected", [
    ({"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True}, "amx"),
    ({"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False}, "avx512_bf16"),
    ({"avx2": True, "avx512f": True}, "avx512"),
    ({"avx2": True, "avx512f": False}, "avx2"),
    ({}, "baseline"),
])
def test_isa_class_from_cpu_flags(flags, expected):
    assert isa_class(flags) == expected


def test_calibration_round_trips_through_its_dict():
    calibration = Calibration(0.5, 7, "test", {"preset": "small"}, [32, 64], margin_fraction=0.15,
                              knots=[[1, 2], [3, 4]])
    assert Calibration(**calibration.to_dict()) == calibration


SHAPE = [[100, 1000], [300, 1400], [700, 2000], [1500, 3000], [3100, 4600]]  # slope falls: 2, 1.5, 1.25, 1


def test_a_small_calibration_follows_the_shipped_curve_past_its_sizes():
    measured = [_point(32, 100, 1000), _point(64, 300, 1300), _point(96, 700, 1900)]  # 100 under the curve at 700
    shifted = fit_calibration("kits19", "fp32", "none", measured, SHAPE)
    assert shifted.knots == [[100, 1000], [300, 1300], [700, 1900], [1500, 2900], [3100, 4500]]
    assert shifted.line_for(3100) == pytest.approx((1.0, 1400), abs=1e-9)  # the last segment's slope, not 1.5's
    line = fit_calibration("kits19", "fp32", "none", measured)  # without the shape: the line over-predicts
    assert line.line_for(3100)[0] * 3100 + line.line_for(3100)[1] > 4500 * 1.15
    higher = [_point(32, 100, 1000), _point(64, 300, 1500), _point(96, 700, 2200)]  # 200 over at 700: shifted too
    assert fit_calibration("kits19", "fp32", "none", higher, SHAPE).knots[3:] == [[1500, 3200], [3100, 4800]]
    beyond = [_point(32, 100, 1000), _point(64, 300, 1300), _point(96, 4000, 5000)]  # past the shape's end
    assert fit_calibration("kits19", "fp32", "none", beyond, SHAPE).knots == knots_from(beyond)


def test_the_shipped_shape_is_the_presets_own():
    kits = shipped_shape("kits19", "fp32", "none", "avx512_bf16", 1)
    assert kits == [[x, y] for _, x, y in SHIPPED[("avx512_bf16", "kits19", "fp32", "none")]]
    assert shipped_shape("kits19", "fp32", "none", "avx2", 1) == kits  # an unmeasured ISA: the measured class's
    assert shipped_shape("tiny", "fp32", "none", "avx512_bf16", 1) == shipped_shape("small", "fp32", "none",
                                                                                    "avx512_bf16", 1)
    assert shipped_shape("my-net", "fp32", "none", "avx512_bf16", 1) == []
    assert shipped_shape("kits19", "fp32", "none", "avx512_bf16", 2) == []  # measured at batch 1 only


def test_a_fit_records_the_batch_it_was_measured_at():
    from bigmem.memory.calibration import fit_calibration

    points = [{"volume": v, "counted_activation_bytes": v * 10, "exact_bytes": 0, "measured_peak_bytes": 100 + v * 7}
              for v in (32, 64)]
    assert fit_calibration("small", "fp32", "none", points, batch_size=2).batch_size == 2
    assert fit_calibration("small", "fp32", "none", points).batch_size == 1


def test_a_stored_calibration_from_before_batches_reads_as_batch_1():
    from bigmem.memory.calibration import Calibration

    stored = Calibration(0.8, 100, "old").to_dict()
    stored.pop("batch_size")
    assert Calibration(**stored).batch_size == 1


def test_a_network_measured_on_one_class_takes_its_own_curve_there_and_elsewhere():
    own = shipped_calibration("resenc-m", "fp32", "none", isa="avx2")
    assert (own.margin_fraction, own.margin_bytes, own.borrowed) == (0.0, 0, False)
    assert own.knots == [[x, y] for _, x, y in SHIPPED[("avx2", "resenc-m", "fp32", "none")]]
    elsewhere = shipped_calibration("resenc-m", "fp32", "none", isa="avx512")
    assert elsewhere.knots == own.knots
    assert elsewhere.borrowed is False
    assert "no default for ISA class avx512 (measured: amx, avx2)" in elsewhere.source
    assert elsewhere.margin_fraction == UNMEASURED_MARGIN_FRACTION


@pytest.mark.parametrize("isa, nearest", [("avx512_bf16", "amx"), ("avx512", "avx2"), ("baseline", "avx2")])
def test_a_class_without_the_network_takes_the_nearest_measured_class(isa, nearest):
    assert shipped_calibration("resenc-m", "fp32", "none", isa=isa).table_isa == nearest


def test_a_class_that_measured_one_network_does_not_lend_it():
    # avx2 has resenc-m's table only: the presets and an unknown network still come from avx512_bf16's
    small = shipped_calibration("small", "fp32", "none", isa="avx2")
    assert small.table_isa == FALLBACK_ISA
    unknown = shipped_calibration("my-net", "fp32", "none", isa="avx2")
    assert unknown.table_isa == FALLBACK_ISA
    assert "using resenc-m's" not in unknown.source
    assert unknown.borrowed is True


def _entry(date: str, cpu: str, presets_modes: list[tuple[str, str]]) -> dict:
    knots = [{"volume": 32, "counted_activation_bytes": 1, "overhead_bytes": 2}]
    return {"isa_class": "amx", "date": date, "machine": {"cpu": cpu},
            "tables": [{"preset": p, "precision": "fp32", "recompute": m, "knots": knots} for p, m in presets_modes]}


def test_a_later_cpu_model_adds_its_tables_and_keeps_the_earlier_ones():
    from bigmem.memory.calibration import serving_tables

    served = serving_tables({"first": _entry("2026-12-01", "A", [("small", "none"), ("kits19", "none")]),
                             "second": _entry("2026-12-05", "B", [("resenc-m", "none"), ("kits19", "none")])})
    assert {key[1]: entry["machine"]["cpu"] for key, (entry, _) in served.items()} == {
        "small": "A", "kits19": "B", "resenc-m": "B"}
