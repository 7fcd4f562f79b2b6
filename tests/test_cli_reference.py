"""docs/cli.md is the command-line reference ``bigmem.cli.reference`` renders from the parser."""

from __future__ import annotations

from pathlib import Path

from bigmem.cli import reference
from bigmem.cli.main import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCUMENT = ROOT / "docs" / "cli.md"


def test_docs_cli_md_is_the_current_reference():
    assert DOCUMENT.read_text() == reference.markdown(), (
        f"docs/cli.md is stale (a flag changed); regenerate it: {reference.REGENERATE}")


def test_every_subcommand_has_a_section():
    text = reference.markdown()
    names = [module.__name__.rsplit(".", 1)[-1] for module in COMMANDS]
    missing = [name for name in names if f"\n## `bigmem {name}`\n" not in text]
    parser = build_parser()
    registered = next(action for action in parser._actions if action.dest == "command").choices
    assert sorted(names) == sorted(registered)
    assert not missing, missing


def test_a_flag_shows_its_names_value_and_help():
    text = reference.markdown()
    assert "| `-o STORE.h5`" not in text  # names and value are separate columns
    assert ("| `--normalization` | `{auto,ct,zscore,zscore_nonzero,none}` | intensity normalisation, recorded in "
            "the store") in text
    assert "| `-o`, `--out` | `STORE.h5` | the store to write |" in text  # both names, one value


def test_the_reference_does_not_depend_on_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    narrow = reference.markdown()
    monkeypatch.setenv("COLUMNS", "300")
    assert reference.markdown() == narrow


def test_check_exits_1_on_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text("# Command-line reference\n")
    assert reference.main(["--check", str(stale)]) == 1
    assert reference.REGENERATE in capsys.readouterr().err
    assert reference.main(["--check", str(DOCUMENT)]) == 0
