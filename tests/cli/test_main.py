"""The entry point: no TensorFlow at import, exit codes, one-line errors, -v tracebacks."""

from __future__ import annotations

import subprocess
import sys

import bigmem
from bigmem.cli import main as cli_main
from helpers import run_cli

NO_TF_SNIPPET = """
import sys
import bigmem
from bigmem.cli.main import main
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    codes = [main(["--help"]), main(["train", "--help"]), main(["synth", "--help"]), main(["info", "--help"])]
print(codes, "tensorflow" in sys.modules, "keras" in sys.modules, "h5py" in sys.modules)
"""


def test_import_and_help_leave_tensorflow_unimported():
    result = subprocess.run([sys.executable, "-c", NO_TF_SNIPPET], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[0, 0, 0, 0] False False False"


def test_version(capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0
    assert out.strip() == f"bigmem {bigmem.__version__}"


def test_console_script_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "bigmem", "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.strip() == f"bigmem {bigmem.__version__}"


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run_cli([], capsys)
    assert code == 2
    assert "usage: bigmem" in err


def test_unknown_command_is_a_usage_error(capsys):
    code, _, err = run_cli(["trian"], capsys)
    assert code == 2
    assert "invalid choice: 'trian'" in err


def test_help_lists_commands_and_exit_codes(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    for word in ("info", "synth", "train", "exit codes"):
        assert word in out


def test_internal_error_is_one_line_without_v(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(cli_main.info, "run", boom)
    code, _, err = run_cli(["info"], capsys)
    assert code == 1
    assert err.strip() == "bigmem info: internal error: RuntimeError: kaboom (run again with -v for the traceback)"


def test_internal_error_shows_traceback_with_v(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(cli_main.info, "run", boom)
    code, _, err = run_cli(["info", "-v"], capsys)
    assert code == 1
    assert "Traceback (most recent call last)" in err
