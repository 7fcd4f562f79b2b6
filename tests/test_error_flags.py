"""Library errors name settings, not command-line flags: a notebook caller of ``bigmem.api`` has no ``--batch-size``.

Every message an exception is built from outside bigmem/cli/ (a literal in the constructor call, or one
assigned to a name the call uses) is scanned for ``--flag``: a setting is written ``{section.name}`` and
rendered as its flag by the command line (``bigmem.errors.BigmemError``). The one form left alone is
advice naming a command to run in a shell: ``bigmem plan --data STORE``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from bigmem.cli.common import flag_for
from bigmem.errors import BigmemError, ConfigError, DataError, DiskFullError, InsufficientMemoryError, UsageError

PACKAGE = Path(__file__).resolve().parents[1] / "bigmem"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# A shell command's advice: `bigmem <command>` and its arguments, up to the end of the clause.
COMMAND_ADVICE = re.compile(r"bigmem [a-z]+(?: [^.;:()`]*)?")
EXCEPTIONS = ("BigmemError", "PeerLost", "WorkerFailed", "NothingToDo")


def _text(node: ast.AST) -> str | None:
    """A string literal's text, an f-string's with ``{...}`` for each value, or a ``+`` of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return (_text(node.left) or "{...}") + (_text(node.right) or "{...}")
    return None


def _is_exception(call: ast.Call) -> bool:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name.endswith("Error") or name in EXCEPTIONS


def _assignments(scope: ast.AST) -> dict[str, list[ast.AST]]:
    """The values assigned to each plain name in ``scope``."""
    values: dict[str, list[ast.AST]] = {}
    for node in ast.walk(scope):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
    return values


def _sources(argument: ast.AST, assigned: dict[str, list[ast.AST]]) -> list[ast.AST]:
    """``argument`` and every value assigned to a name it uses, and to the names those use, in turn."""
    sources, todo, seen = [], [argument], set()
    while todo:
        node = todo.pop()
        sources.append(node)
        for name in (n.id for n in ast.walk(node) if isinstance(n, ast.Name)):
            if name not in seen:
                seen.add(name)
                todo += assigned.get(name, [])
    return sources


def _flags_in(call: ast.Call, assigned: dict[str, list[ast.AST]]) -> list[tuple[int, str]]:
    """(line, flag) for each flag outside command advice in the texts ``call`` is built from."""
    found = []
    for argument in [*call.args, *(keyword.value for keyword in call.keywords)]:
        for source in _sources(argument, assigned):
            for node in ast.walk(source):
                text = _text(node)
                if text is not None:
                    found += [(node.lineno, flag) for flag in FLAG.findall(COMMAND_ADVICE.sub("", text))]
    return found


def flags_in_library_errors(package: Path = PACKAGE) -> list[str]:
    """'path:line: --flag' for every flag in an exception's message outside bigmem/cli/."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "cli":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        module_names = _assignments(tree)
        for scope in ast.walk(tree):
            if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                continue
            assigned = {**module_names, **_assignments(scope)}
            calls = (n for n in ast.walk(scope) if isinstance(n, ast.Call) and _is_exception(n))
            for call in calls:
                found.update(f"{path.relative_to(package.parent)}:{line}: {flag}"
                             for line, flag in _flags_in(call, assigned))
    return sorted(found)


def test_no_library_error_names_a_flag():
    assert flags_in_library_errors() == []


def test_the_scan_finds_a_flag_in_a_message(tmp_path):
    (tmp_path / "module.py").write_text('def f(n):\n    raise UsageError(f"Invalid --overlap {n}.")\n')
    assert flags_in_library_errors(tmp_path) == [f"{tmp_path.name}/module.py:2: --overlap"]


def test_the_scan_follows_a_message_built_in_a_variable(tmp_path):
    (tmp_path / "module.py").write_text('def f(n):\n    advice = "or pass --force"\n    message = f"No. {advice}"\n'
                                        "    raise InsufficientMemoryError(message, n, n)\n")
    assert flags_in_library_errors(tmp_path) == [f"{tmp_path.name}/module.py:2: --force"]


def test_the_scan_allows_advice_naming_a_bigmem_command(tmp_path):
    (tmp_path / "module.py").write_text('raise DataError("No plan: run `bigmem plan --data STORE` first.")\n')
    assert flags_in_library_errors(tmp_path) == []


def test_the_scan_skips_the_command_line(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "module.py").write_text('raise UsageError("Give either --volume or --shape.")\n')
    assert flags_in_library_errors(tmp_path) == []


def test_a_library_error_names_the_field():
    assert str(UsageError("Invalid {predict.overlap} 1: expected a fraction.")) == ("Invalid predict.overlap 1: "
                                                                                      "expected a fraction.")


def test_the_command_line_renders_the_flag():
    exc = UsageError("Invalid {predict.overlap} 1: expected a fraction.")
    assert exc.render(flag_for) == "Invalid --overlap 1: expected a fraction."


def test_fields_render_as_their_flags():
    exc = DataError("Choose another {train.run_dir}, or lower {memory.budget_bytes}.")
    assert exc.render(flag_for) == "Choose another --out, or lower --memory-budget."


def test_the_template_is_kept():
    assert DataError("Pass {convert.force}.").template == "Pass {convert.force}."


def test_a_message_without_placeholders_is_unchanged():
    message = "Cannot read 'a b.h5': {not a field} {A.B} {x} {'a.b': 1} 50% done\\n."
    assert str(BigmemError(message)) == message


def test_a_dict_like_brace_is_left_alone():
    exc = DataError("Unexpected {'train.steps': 1} in 'runs/{Run-1}/{2024.1}/x.h5'.")
    assert exc.render(flag_for) == "Unexpected {'train.steps': 1} in 'runs/{Run-1}/{2024.1}/x.h5'."


def test_a_lowercase_dotted_name_in_braces_is_a_placeholder():
    assert DataError("See {numa.policy}.").render(lambda name: f"<{name}>") == "See <numa.policy>."


def test_config_error_keeps_its_field():
    assert ConfigError("train.batch_size", "Invalid {field} 0.").field == "train.batch_size"


def test_config_error_renders_its_field_as_the_flag():
    assert ConfigError("train.batch_size", "Invalid {field} 0 ({numa.policy}).").render(flag_for) == (
        "Invalid --batch-size 0 (--numa).")


def test_config_error_names_its_field_as_a_dotted_name():
    assert str(ConfigError("train.batch_size", "Invalid {field} 0.")) == "Invalid train.batch_size 0."


def test_insufficient_memory_keeps_required_bytes():
    assert InsufficientMemoryError("Does not fit; pass {train.force}.", 300, 200).required_bytes == 300


def test_insufficient_memory_keeps_available_bytes():
    assert InsufficientMemoryError("Does not fit; pass {train.force}.", 300, 200).available_bytes == 200


def test_insufficient_memory_renders_its_flag():
    exc = InsufficientMemoryError("Does not fit; pass {train.force}.", 300, 200)
    assert exc.render(flag_for) == "Does not fit; pass --force."


def test_disk_full_keeps_its_path():
    assert DiskFullError("Full; choose another {output.path}.", "/x/out.h5", 10, 1).path == "/x/out.h5"


def test_disk_full_renders_its_flag():
    exc = DiskFullError("Full; choose another {output.path}.", "/x/out.h5", 10, 1)
    assert exc.render(flag_for) == "Full; choose another --out."


@pytest.mark.parametrize("field, flag", [("train.run_dir", "--out"), ("export.out", "-o"),
                                         ("predict.validation", "--val"), ("calibrate.shapes", "--calibrate"),
                                         ("train.resume", "--resume"), ("numa.policy", "--numa"),
                                         ("train_per_node.workers_per_node", "--workers-per-node"),
                                         ("distribute.gpu_memory_bytes", "--gpu-memory"),
                                         ("evaluate.allow_missing", "--allow-missing")])
def test_a_library_argument_renders_as_the_flag_the_command_has(field, flag):
    assert flag_for(field) == flag
