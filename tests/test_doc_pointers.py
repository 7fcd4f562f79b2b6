"""The documents, docstrings and comments point only at code, files and sections that exist.

Documents: README.md, ARCHITECTURE.md and docs/*.md (docs/cli.md is generated and has its own
test). Code: the docstrings and comments of every module under bigmem/, tests/ and benchmarks/.
A pointer is a repository path (`docs/store.md`, `bigmem/nets/slabs.py`, `README.md`), a path
inside the package (`nets/slabs.py`, `data/preprocess.Preprocessing`), a dotted name of code
(`memory.plans.plan_job`, `bigmem.cpu.isa_class`), a markdown link, or a section
cited beside a markdown file (`docs/guide.md, "Speed"`).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bigmem"
# `unit/module.name` or `unit/module.Class.method` (ARCHITECTURE.md's way of naming code), or a path
REFERENCE = re.compile(r"`([A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)*)`")
DOCUMENTS = ["README.md", "ARCHITECTURE.md",
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.name != "cli.md")]
CODE_FOLDERS = ("bigmem", "tests", "benchmarks")

# A path from the repository root (`docs/guide.md`, `benchmarks/results/`, `tools/numa-vm`), or a markdown
# file at the root (`README.md`, `ARCHITECTURE.md`); not the tail of a longer path (`models/README.md` is one path).
ROOT_PATH = re.compile(r"(?<![\w/.~$<-])((?:bigmem|tests|benchmarks|docs|models|tools)/[\w/.*-]*[\w*/]"
                       r"|[A-Z][A-Z_]*\.md)")
# A path inside the package, as the code names its neighbours (`nets/slabs.py`, `memory/calibration.shipped_x`).
UNITS = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
PACKAGE_PATH = re.compile(rf"(?<![\w/.~$<-])((?:{'|'.join(UNITS)})/[\w/.*-]*[\w*/])")
# Extensions of files a pointer may name; a last component with another dot is `module.name`.
FILE_EXTENSIONS = {"py", "md", "toml", "json", "jsonl", "csv", "txt", "png", "sh", "cfg", "ini", "yaml", "yml",
                   "h5", "gz", "nii", "npz", "keras"}
# A section cited beside a markdown file, `docs/guide.md, "Speed"` (or in parentheses, or after 's): it must
# begin a heading of that file.
SECTION = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md)`?(?:'s)?,?\s*\(?\s*[\"'“]([^\"'”]+)[\"'”]")
# Markdown links to files of the repository: [text](path) or [text](path#anchor).
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _defined(path: Path) -> set[str]:
    """Top-level names of a module, and Class.member for its classes' members."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{item.name}" for item in node.body
                             if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _code_references(text: str) -> list[tuple[str, Path, str | None]]:
    """(reference, module file, name or None) for every backticked `unit/module[.name]` naming bigmem code."""
    found = []
    for reference in REFERENCE.findall(text):
        if "/" not in reference or reference.startswith(("tests/", "benchmarks/", "models/")):
            continue
        if reference.endswith("/"):  # a folder of the package, `infer/` (others: `runs/`, a user's, not ours)
            if (PACKAGE / reference).is_dir() or reference.count("/") > 1:
                found.append((reference, PACKAGE / reference, None))
            continue
        module, _, name = reference.partition(".")
        if name == "py":  # a file: `infer/sliding.py`
            name = ""
        path = PACKAGE / f"{module}.py"
        if (PACKAGE / module.split("/")[0]).is_dir() or path.exists():
            found.append((reference, path, name or None))
    return found


@pytest.mark.parametrize("document", DOCUMENTS)
def test_code_the_documents_name_exists(document):
    text = (ROOT / document).read_text()
    missing = []
    for reference, path, name in _code_references(text):
        if not path.exists():  # a module file, or a folder
            missing.append(f"{reference}: no {path.relative_to(ROOT)}")
        elif name is not None and name.split(".")[0] not in {n.split(".")[0] for n in _defined(path)}:
            missing.append(f"{reference}: {path.relative_to(ROOT)} defines no {name.split('.')[0]}")
        elif name is not None and "." in name and name not in _defined(path):
            missing.append(f"{reference}: {path.relative_to(ROOT)} has no {name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_files_the_documents_name_exist(document):
    text = (ROOT / document).read_text()
    paths = re.findall(r"`((?:bigmem|tests|benchmarks|models)/[\w/.-]*\.(?:py|md|toml))`", text)
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert paths, missing
    assert not missing, missing


def test_the_reference_parser_sees_a_dead_pointer():
    assert _code_references("see `infer/predict.no_such_function`, `data/nowhere.thing` and `nets/slabs.py`") == [
        ("infer/predict.no_such_function", PACKAGE / "infer" / "predict.py", "no_such_function"),
        ("data/nowhere.thing", PACKAGE / "data" / "nowhere.py", "thing"),
        ("nets/slabs.py", PACKAGE / "nets" / "slabs.py", None)]


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and every block of consecutive comment lines in a module."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                found.append((node.body[0].lineno, " ".join(docstring.split())))
    block: list[str] = []
    first = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        if block and token.start[0] != last + 1:
            found.append((first, " ".join(block)))
            block = []
        if not block:
            first = token.start[0]
        block.append(token.string.lstrip("#").strip())
        last = token.start[0]
    if block:
        found.append((first, " ".join(block)))
    return found


def _is_placeholder(path: str) -> bool:
    """`bigmem/measured/NAME.json`, `benchmarks/KIND/SCRIPT`: a name in capitals that stands for any."""
    return any(re.fullmatch(r"[A-Z][A-Z_]*", part.split(".")[0]) and not part.endswith(".md")
               for part in path.split("/"))


def _dead_path(path: str, base: Path) -> str | None:
    """Why ``path`` (relative to ``base``) names nothing there, or None when it does (or is a placeholder)."""
    last = path.rstrip("/").rsplit("/", 1)[-1]
    if _is_placeholder(path):
        return None
    if "*" in path:
        return None if any(base.glob(path)) else "matches no file"
    if "." in last and last.rsplit(".", 1)[1] in FILE_EXTENSIONS:
        return None if (base / path).exists() else "no such file"
    if "." in last:  # `unit/module.name`: the module must exist (what it defines, the documents' test checks)
        module = path.split(".")[0]
        return None if (base / f"{module}.py").exists() or (base / module).is_dir() else "no such module"
    return None if (base / path).exists() or (base / f"{path}.py").exists() else "no such file or folder"


def _headings(document: Path) -> list[str]:
    return [line.lstrip("#").strip().replace("`", "").lower()
            for line in document.read_text().splitlines() if line.startswith("#")]


def _dead_pointers(text: str, *, package_paths: bool) -> list[str]:
    """What ``text`` points at that does not exist: paths, and sections of markdown files."""
    dead = []
    for path in ROOT_PATH.findall(text):
        why = _dead_path(path, ROOT)
        if why:
            dead.append(f"{path}: {why}")
    if package_paths:
        for path in PACKAGE_PATH.findall(text):
            last = path.rstrip("/").rsplit("/", 1)[-1]
            extension = last.rsplit(".", 1)[1] if "." in last else ""
            if extension in FILE_EXTENSIONS and extension not in ("py", "json"):
                continue  # a user's file in an example (a store under data/), not one of the package's
            why = _dead_path(path, PACKAGE)
            if why:
                dead.append(f"{path} (in bigmem/): {why}")
    for document, section in SECTION.findall(text):
        target = ROOT / document if "/" in document or (ROOT / document).exists() else None
        if target is None or not target.exists():
            continue  # not a repository document (`report.md`); a dead path is reported above
        if not any(heading.startswith(section.strip().lower()) for heading in _headings(target)):
            dead.append(f'{document}, "{section}": no such section')
    return dead


def _code_files() -> list[Path]:
    return sorted(p for folder in CODE_FOLDERS for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", CODE_FOLDERS)
def test_docstrings_and_comments_point_at_what_exists(folder):
    dead = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, text in _prose(path):
            dead += [f"{path.relative_to(ROOT)}:{line}: {problem}"
                     for problem in _dead_pointers(text, package_paths=True)]
    assert not dead, "Pointers to files or sections that do not exist:\n" + "\n".join(dead)


# A dotted name of the package's code, `memory.plans.plan_job` or `bigmem.cpu.isa_class` (a top-level module or a unit,
# then modules, then a name the module defines).
TOP_LEVEL = sorted({p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")} | set(UNITS))
DOTTED = re.compile(rf"`(?:bigmem\.)?((?:{'|'.join(TOP_LEVEL)})(?:\.[A-Za-z_]\w*)+)`")


def _dead_dotted_name(reference: str) -> str | None:
    """Why a dotted ``reference`` names no code, or None when it does or is not a name of code.

    Not code: a file (`config.json`, `compare.md`); a name a package's ``__init__`` does not define in lower case,
    which reads as a config value (`config.train.precision`, `compare.holdout`): the package's own names are
    modules and classes.
    """
    parts = reference.split(".")
    if parts[-1] in FILE_EXTENSIONS:
        return None
    path, i = PACKAGE, 0
    while i < len(parts) and (path / parts[i]).is_dir():
        path, i = path / parts[i], i + 1
    if i < len(parts) and (path / f"{parts[i]}.py").exists():
        module, i = path / f"{parts[i]}.py", i + 1
    elif path != PACKAGE:
        module = path / "__init__.py"
        if i < len(parts) and parts[i][0].islower():
            return None
    else:
        return None
    if i == len(parts):
        return None
    defined = _defined(module)
    if parts[i] not in {name.split(".")[0] for name in defined}:
        return f"{module.relative_to(ROOT)} defines no {parts[i]}"
    if i + 1 < len(parts) and parts[i][0].isupper() and f"{parts[i]}.{parts[i + 1]}" not in defined:
        return f"{module.relative_to(ROOT)} has no {parts[i]}.{parts[i + 1]}"
    return None


def test_dotted_names_of_code_exist():
    dead = []
    for path in [*_code_files(), *(ROOT / d for d in DOCUMENTS)]:
        texts = _prose(path) if path.suffix == ".py" else [(0, path.read_text())]
        for line, text in texts:
            dead += [f"{path.relative_to(ROOT)}:{line}: `{ref}`: {why}" for ref in DOTTED.findall(text)
                     if (why := _dead_dotted_name(ref))]
    assert not dead, "Dotted names of code that does not exist:\n" + "\n".join(dead)


@pytest.mark.parametrize("reference,why", [
    ("memory.budget.job_plan", "bigmem/memory/budget.py defines no job_plan"),
    ("sysinfo.isa_class", "bigmem/sysinfo.py defines no isa_class"),
    ("nets.UNet3D", "bigmem/nets/__init__.py defines no UNet3D"),
    ("memory.search.Plan.no_method", "bigmem/memory/search.py has no Plan.no_method"),
    ("memory.plans.plan_job", None),
    ("cpu.isa_class", None),
    ("config.train.precision", None),
    ("config.json", None),
])
def test_the_dotted_name_parser_sees_a_dead_pointer(reference, why):
    assert _dead_dotted_name(reference) == why


@pytest.mark.parametrize("document", DOCUMENTS + ["benchmarks/README.md", "models/README.md"])
def test_sections_the_documents_cite_exist(document):
    dead = [problem for problem in _dead_pointers((ROOT / document).read_text(), package_paths=False)
            if problem.endswith("no such section")]
    assert not dead, dead


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("document", DOCUMENTS + ["docs/cli.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "results").glob("*.md")))
def test_markdown_links_resolve(document):
    path = ROOT / document
    dead = []
    for link in LINK.findall(path.read_text()):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        target, _, anchor = link.partition("#")
        target_path = (path.parent / target).resolve() if target else path
        if not target_path.exists():
            dead.append(f"{link}: no {target}")
        elif anchor and target_path.suffix == ".md" and anchor not in {
                _anchor(line.lstrip("#")) for line in target_path.read_text().splitlines() if line.startswith("#")}:
            dead.append(f"{link}: {target or document} has no heading for #{anchor}")
    assert not dead, dead


def test_the_pointer_parser_sees_dead_paths_and_sections():
    text = ('see docs/nowhere.md, STYLE.md and nets/nowhere.py (README.md, "No such section"); '
            'bigmem/measured/NAME.json and benchmarks/results/train-*.json stand for files; '
            'docs/store.md and nets/slabs.py exist (ARCHITECTURE.md, "Layers").')
    assert _dead_pointers(text, package_paths=True) == [
        "docs/nowhere.md: no such file", "STYLE.md: no such file", "nets/nowhere.py (in bigmem/): no such file",
        'README.md, "No such section": no such section']


def test_the_prose_of_a_module_is_its_docstrings_and_comment_blocks(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Module: see docs/a.md."""\n\n# one\n# block\nx = "docs/b.md"  # c\n\n# d\n'
                      'def f():\n    """F."""\n')  # a string is not prose; a blank line ends a comment block
    assert sorted(_prose(module)) == [(1, "Module: see docs/a.md."), (3, "one block c"), (7, "d"), (9, "F.")]
