"""``bigmem train`` says what the recipe study measured when a run is as short as the study's shortest."""

from __future__ import annotations

from bigmem.config.presets import resolve_config
from bigmem.train.trainer import SHORT_RUN_STEPS, short_run_note


def _config(**data):
    return resolve_config("small", {"data": {"store": "cases.h5", **data}})


def test_a_short_run_with_rotation_and_scaling_is_told_what_the_study_measured():
    note = short_run_note(_config(), SHORT_RUN_STEPS)
    assert "0.836 with them, 0.882 without" in note


def test_the_note_names_the_flag_that_leaves_them_out():
    assert "--augment intensity" in short_run_note(_config(), 100)


def test_a_longer_run_gets_no_note():
    assert short_run_note(_config(), SHORT_RUN_STEPS + 1) is None


def test_a_run_without_the_spatial_transform_gets_no_note():
    assert short_run_note(_config(augment="intensity"), 100) is None


def test_the_synthetic_set_gets_no_note():
    assert short_run_note(resolve_config("small", {}), 100) is None
