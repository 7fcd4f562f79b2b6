"""``bigmem synth``: writes a store; refuses to overwrite; validates its flags."""

from __future__ import annotations

import h5py
import pytest

from helpers import run_cli


def test_synth_writes_a_store(tmp_path, capsys):
    out = tmp_path / "p.h5"
    code, stdout, _ = run_cli(["synth", out, "--cases", 3, "--volume", 12, "--classes", 4, "--seed", 7], capsys)
    assert code == 0
    assert "Wrote 3 phantoms of 12^3 (4 classes)" in stdout
    with h5py.File(out) as handle:
        assert sorted(handle["cases"]) == ["synth_0000", "synth_0001", "synth_0002"]
        assert handle.attrs["num_classes"] == 4
        assert handle["cases/synth_0001/image"].shape == (12, 12, 12, 1)


def test_synth_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "p.h5"
    out.write_text("keep me")
    code, _, err = run_cli(["synth", out, "--cases", 1, "--volume", 8], capsys)
    assert code == 1
    assert err.strip() == f"bigmem synth: error: {str(out)!r} exists: pass --force to overwrite it."
    assert out.read_text() == "keep me"
    code, _, _ = run_cli(["synth", out, "--cases", 1, "--volume", 8, "--force"], capsys)
    assert code == 0
    assert h5py.is_hdf5(out)


@pytest.mark.parametrize("flags, message", [
    (["--cases", "0"], "Invalid --cases 0: expected a positive integer."),
    (["--volume", "2"], "Invalid --volume 2: expected an integer >= 4."),
    (["--classes", "1"], "Invalid --classes 1: expected 2..255 (background + foreground classes)."),
])
def test_synth_flag_errors(tmp_path, capsys, flags, message):
    code, _, err = run_cli(["synth", tmp_path / "x.h5", *flags], capsys)
    assert code == 2
    assert err.strip() == f"bigmem synth: error: {message}"
    assert not (tmp_path / "x.h5").exists()
