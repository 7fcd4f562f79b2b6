"""The command-line reference (docs/cli.md), rendered from the parser ``bigmem`` itself builds.

``markdown()`` walks ``main.build_parser()``: for every subcommand its usage, its description and
each flag (names, metavar, choices, help). It formats everything itself rather than through
argparse's help formatter, so the text depends neither on the terminal's width (COLUMNS) nor on
the Python version's formatting of usage lines. Regenerate the file after changing a flag:

    python -m bigmem.cli.reference > docs/cli.md

and ``python -m bigmem.cli.reference --check docs/cli.md`` exits 1 when the file is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable

from bigmem.cli.main import build_parser

REGENERATE = "python -m bigmem.cli.reference > docs/cli.md"
USAGE_WIDTH = 100  # usage lines are wrapped at this many characters, between whole items
COMMON_FLAGS = ("-h", "-v")  # every subcommand takes them; listed once, at the top
MARKDOWN_SPECIAL = "\\`*_<|"


def markdown() -> str:
    """The command-line reference of every ``bigmem`` subcommand, as markdown.

    Returns:
        The text of docs/cli.md: the commands, then one section per subcommand (``## bigmem NAME``)
        with its usage, its description and a table of its flags, in the order ``bigmem --help``
        lists them.

    Example:
        >>> text = markdown()
        >>> "## `bigmem train`" in text and "`--batch-size`" in text
        True
    """
    parser = build_parser()
    commands = _subcommands(parser)
    lines = ["# Command-line reference", "",
             f"Generated from bigmem's argument parser by `{REGENERATE}`; do not edit by hand.",
             "`bigmem COMMAND --help` prints the same. Every command also takes `-h`/`--help` and",
             "`-v`/`--verbose` (TensorFlow's logs and full tracebacks); the tables below leave them out.", "",
             "```text", *_usage(parser), "```", "",
             "| command | what it does |", "|---|---|"]
    lines += [f"| [`{name}`](#bigmem-{name}) | {_escape(help_text)} |" for name, help_text, _ in commands]
    lines += ["", "```text", parser.description.strip("\n"), "```"]
    for name, _, subparser in commands:
        lines += ["", f"## `bigmem {name}`", "", "```text", *_usage(subparser), "```"]
        if subparser.description:
            lines += ["", "```text", subparser.description.strip("\n"), "```"]
        for title, actions in _groups(subparser):
            lines += ["", f"### {title}", "", "| flag | value | help |", "|---|---|---|"]
            lines += [_row(action) for action in actions]
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in registration order."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]


def _shown(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS and not set(action.option_strings) & set(COMMON_FLAGS)


def _groups(parser: argparse.ArgumentParser) -> Iterable[tuple[str, list[argparse.Action]]]:
    """(title, actions) of each argument group with something to show: positionals, options, then named groups."""
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _shown(a)]
        if not actions:
            continue
        if group is parser._positionals:
            title = "Arguments"
        elif group is parser._optionals:
            title = "Options"
        else:
            title = group.title[:1].upper() + group.title[1:]
        yield title, actions


def _metavar(action: argparse.Action) -> str:
    """What follows the flag: its metavar, ``{a,b}`` for choices, the dest in capitals, or '' for a switch."""
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        text = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        text = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        text = action.dest.upper() if action.option_strings else action.dest
    if action.nargs == "?" and action.option_strings:
        return f"[{text}]"
    if action.nargs == "*":
        return f"[{text} ...]"
    if action.nargs == "+":
        return f"{text} [{text} ...]"
    return text


def _usage_item(action: argparse.Action) -> str:
    """One action as a usage line shows it, without the brackets of an optional one."""
    value = _metavar(action)
    if not action.option_strings:
        return f"[{value}]" if action.nargs in ("?", "*") else value
    if isinstance(action, argparse.BooleanOptionalAction):
        return " | ".join(action.option_strings)
    return f"{action.option_strings[0]} {value}".rstrip()


def _usage(parser: argparse.ArgumentParser) -> list[str]:
    """``usage: PROG ...`` as lines of at most ``USAGE_WIDTH`` characters (longer only for one long item)."""
    grouped = {id(a): group for group in parser._mutually_exclusive_groups for a in group._group_actions}
    items, done = [], set()
    for action in [a for a in parser._actions if a.option_strings] + [a for a in parser._actions
                                                                       if not a.option_strings]:
        if id(action) in done or action.help is argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            items.append(f"{action.metavar} ...")
            continue
        group = grouped.get(id(action))
        if group is not None:
            members = [a for a in group._group_actions if a.help is not argparse.SUPPRESS]
            done.update(id(a) for a in members)
            inner = " | ".join(_usage_item(a) for a in members)
            items.append(f"({inner})" if group.required else f"[{inner}]")
            continue
        item = _usage_item(action)
        items.append(item if action.required or not action.option_strings else f"[{item}]")
    lines, line = [], f"usage: {parser.prog}"
    indent = " " * (len("usage: ") + len(parser.prog) + 1)
    for item in items:
        if len(line) + 1 + len(item) > USAGE_WIDTH and line.strip() != f"usage: {parser.prog}":
            lines.append(line)
            line = indent + item
        else:
            line = f"{line} {item}"
    return lines + [line]


def _escape(text: str) -> str:
    """``text`` on one line, with markdown's special characters escaped (for a table cell)."""
    text = " ".join(text.split())
    return "".join("\\" + c if c in MARKDOWN_SPECIAL else c for c in text)


def _row(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{_metavar(action)}`"
    value = _metavar(action) if action.option_strings else ""
    if not action.option_strings and action.nargs in ("?", "*"):
        value = "optional"
    return f"| {names} | {f'`{value}`' if value and value != 'optional' else value} | {_escape(action.help or '')} |"


def main(argv: list[str] | None = None) -> int:
    """Print the reference, or with ``--check FILE`` compare FILE with it.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0; 1 when ``--check`` finds FILE different from ``markdown()`` (or missing).
    """
    parser = argparse.ArgumentParser(prog="python -m bigmem.cli.reference",
                                     description="Print bigmem's command-line reference as markdown.")
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the reference")
    args = parser.parse_args(argv)
    text = markdown()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.check)
    if path.exists() and path.read_text() == text:
        return 0
    print(f"{path} is not the current reference; regenerate it: {REGENERATE}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
