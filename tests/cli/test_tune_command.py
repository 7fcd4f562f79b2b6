"""``bigmem tune``'s flags, checked before anything is timed."""

from __future__ import annotations

import pytest

from helpers import run_cli


@pytest.mark.parametrize("flags, message", [
    (["--shape", "50,50,50"], "Invalid --shape 50,50,50: axes 1, 2 and 3 (50, 50, 50) are not multiples of 4 (the "
                              "network downsamples 2 times). Try --shape 48,48,48 or 52,52,52."),
    (["--volume", "50"], "Invalid --volume 50: expected a multiple of 4 (the network downsamples 2 times). Try "
                         "--volume 48 or 52."),
])
def test_a_bad_shape_is_named_by_the_flag_given(capsys, flags, message):
    code, _, err = run_cli(["tune", "--model", "tiny", *flags], capsys)
    assert code == 2
    assert err.strip() == f"bigmem tune: error: {message}"


def test_tune_writes_this_machines_file_and_show_reads_it(capsys, tmp_path, monkeypatch):
    from bigmem.nets import choices, tuning

    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    choices.kernel_choices.cache_clear()
    code, out, _ = run_cli(["tune", "--model", "tiny", "--volume", "16", "--precision", "fp32", "--no-memory"], capsys)
    assert code == 0
    assert tuning.tuning_path().exists()
    assert "convolutions timed" in out
    code, out, _ = run_cli(["tune", "--show"], capsys)
    assert "tuned on this machine (tiny 16x16x16 fp32" in out
    choices.kernel_choices.cache_clear()


def test_show_without_a_tuning_says_the_shipped_tables_are_in_force(capsys, tmp_path, monkeypatch):
    from bigmem.nets import tuning

    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    code, out, _ = run_cli(["tune", "--show"], capsys)
    assert code == 0
    assert "not tuned: the shipped tables are in force" in out
