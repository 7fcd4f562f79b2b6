"""Flags shared by train, profile and plan (the same names map to the same config fields), and
the checks every command makes on its arguments before anything heavy is imported or allocated:
output paths (``check_output_file``, ``check_output_dir``) and sizes that cannot fit in memory
(``check_allocation``)."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from bigmem.atomic import nearest_existing
from bigmem.config.presets import DEFAULT_PRESET, preset_names
from bigmem.errors import DataError, DiskFullError, InsufficientMemoryError, UsageError
from bigmem.units import format_bytes, parse_bytes

# Flags whose name is not the kebab-case of their field's (every other flag is: train.batch_size <-> --batch-size).
# A field is a config field or, for a flag that sets none, ``bigmem.api`` function.argument (predict.overlap).
FLAG_NAMES = {"data.store": "--data", "model.name": "--model", "numa.policy": "--numa",
              "memory.budget_bytes": "--memory-budget", "numa.threads": "--threads",
              "train.run_dir": "--out", "export.out": "-o", "predict.validation": "--val",
              "calibrate.shapes": "--calibrate", "sweep.shapes": "--sweep", "output.path": "--out"}
UNIT_SUFFIXES = ("_bytes", "_s")


def flag_for(field: str) -> str:
    """The flag that sets config field ``field`` (or the library argument ``function.argument``):
    'train.batch_size' -> '--batch-size', 'predict.overlap' -> '--overlap'.

    Example:
        >>> flag_for("distribute.gpu_memory_bytes"), flag_for("memory.budget_bytes")
        ('--gpu-memory', '--memory-budget')
    """
    if field in FLAG_NAMES:
        return FLAG_NAMES[field]
    if field.count(".") != 1 or " " in field or field.startswith("-"):
        return field  # not a config field: a flag already ('--shape') or a plain name ('spatial shape')
    name = field.split(".")[-1]
    for suffix in UNIT_SUFFIXES:
        name = name.removesuffix(suffix)
    return "--" + name.replace("_", "-")


PRESET_HELP = f"preset name ({', '.join(preset_names())}) or a .toml file (default: {DEFAULT_PRESET})"


def add_model_flags(parser, *, volume_help: str, shape_help: str | None = None, model_help: str = PRESET_HELP):
    group = parser.add_argument_group("model and shape")
    group.add_argument("--model", metavar="PRESET", default=None, help=model_help)
    group.add_argument("--shape", metavar="D,H,W", help=shape_help or volume_help)
    group.add_argument("--volume", type=int, metavar="N", help=f"shorthand for --shape N,N,N: {volume_help}")
    group.add_argument("--batch-size", type=int, metavar="B", help="volumes per step (default: the preset's)")
    group.add_argument("--optimizer", choices=["sgd", "adam"],
                       help="SGD with Nesterov momentum (1 slot per weight), or Adam (2 slots)")
    group.add_argument("--recipe", choices=["auto", "augmented", "nnunet", "preset"],
                       help="the training recipe as one name: nnunet (nnU-Net v2's: its augmentation, deep "
                            "supervision, SGD with Nesterov momentum 0.99 at lr 1e-2, weight decay 3e-5, gradients "
                            "clipped to norm 12, poly decay with exponent 0.9, no warm-up), augmented (the preset's "
                            "optimiser and schedule with nnU-Net's augmentation and deep supervision) or preset (the "
                            "preset's own settings); a flag given beside it changes that one part (default auto: "
                            "augmented with --data, where it trained better on unseen subjects than nnunet, "
                            "benchmarks/results/recipe_budget.md; preset on the synthetic set)")
    group.add_argument("--deep-supervision", action=argparse.BooleanOptionalAction, default=None,
                       help="also train each lower decoder resolution through a 1x1x1 head of its own, with "
                            "nnU-Net's weights (1/2^level, the lowest 0, normalised) and labels downsampled as "
                            "nnU-Net does; prediction uses the full resolution only (default: the recipe's: on under "
                            "nnunet, the preset's under preset)")


def add_memory_flags(parser, *, auto: bool = True) -> None:
    group = parser.add_argument_group("memory")
    group.add_argument("--precision", choices=["fp32", "bf16"],
                       help="fp32, or bf16 mixed precision (Keras mixed_bfloat16; weights stay fp32)")
    choices = ["none", "stages", "auto"] if auto else ["none", "stages"]
    group.add_argument("--recompute", choices=choices,
                       help="none: keep every activation for backward; stages: keep only each encoder/decoder "
                            "stage's output and recompute the rest in backward (less memory; one more forward "
                            "pass, about a third more compute)"
                       + ("; auto: the fewest recomputed stages that fit the memory budget" if auto else ""))


class _BudgetFlag(argparse.Action):
    """Stores the size text and how it was spelled, so messages name the flag the user typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.memory_budget_flag = option_string


def add_budget_flag(parser, *, help_text: str, alias: bool = False) -> None:
    """``--memory-budget SIZE`` (and ``--budget``, its older name, where ``alias``), into ``args.memory_budget``.

    The budget's precedence is ``bigmem.memory.budget.resolve_budget``'s.
    """
    names = ("--memory-budget", "--budget") if alias else ("--memory-budget",)
    parser.add_argument(*names, dest="memory_budget", metavar="SIZE", action=_BudgetFlag, help=help_text)


def budget_arguments(args) -> tuple[int | None, str]:
    """(the budget in bytes or None, the flag as typed) from ``add_budget_flag``'s arguments."""
    flag = getattr(args, "memory_budget_flag", None) or "--memory-budget"
    text = getattr(args, "memory_budget", None)
    return (parse_bytes(text, flag=flag) if text else None), flag


NUMA_HELP = ("where memory goes: interleave[:NODES] (round-robin over nodes; for a model bigger than a socket), "
             "local (first touch), bind:NODES (only those nodes, threads on their CPUs), preferred:N, or none "
             "(default). Applied before TensorFlow starts, so every TF thread inherits it.")


def add_numa_flags(parser) -> None:
    group = parser.add_argument_group("NUMA and threads")
    group.add_argument("--numa", metavar="POLICY", help=NUMA_HELP)
    group.add_argument("--cpus", metavar="LIST", help="CPUs to run on, e.g. 0-15,32-47 (default: the policy's "
                                                      "nodes for bind, else all allowed CPUs)")
    group.add_argument("--threads", type=int, metavar="N",
                       help="TensorFlow intra-op threads (default: the number of CPUs used; inter-op threads = "
                            "2 per node they span). Stock TensorFlow ignores OMP_NUM_THREADS and KMP_* variables.")


def numa_overrides(args) -> dict:
    values = {"policy": getattr(args, "numa", None), "cpus": getattr(args, "cpus", None),
              "threads": getattr(args, "threads", None)}
    return {k: v for k, v in values.items() if v is not None}


def model_overrides(args) -> dict:
    """The config sections set by the shared flags (only those the user gave)."""
    sections = {
        "data": {"shape": shape_argument(args)},
        "train": {"batch_size": getattr(args, "batch_size", None), "optimizer": getattr(args, "optimizer", None),
                  "precision": getattr(args, "precision", None), "recipe": getattr(args, "recipe", None)},
        "memory": {"recompute": getattr(args, "recompute", None)},
        "model": {"deep_supervision": getattr(args, "deep_supervision", None)},
    }
    return {name: {k: v for k, v in values.items() if v is not None} for name, values in sections.items()}


def parse_shape(text: str, flag: str = "--shape") -> tuple[int, int, int]:
    """'240,240,144' (or '240x240x144') -> (240, 240, 144).

    Raises:
        UsageError: not three positive integers; the message names ``flag``.
    """
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError(f"Invalid {flag} {text!r}: expected three positive integers D,H,W such as 240,240,144.")
    return shape  # type: ignore[return-value]


def shape_argument(args) -> tuple[int, int, int] | None:
    """The spatial shape ``--shape D,H,W`` or ``--volume N`` (N, N, N) asks for; None when neither was given.

    Raises:
        UsageError: ``--shape`` is not three positive integers, or ``--volume`` not a positive integer.
    """
    text, volume = getattr(args, "shape", None), getattr(args, "volume", None)
    if text is not None and volume is not None:
        raise UsageError("Give either --volume or --shape, not both.")
    if text is not None:
        return parse_shape(text)
    if volume is not None:
        check_positive("--volume", volume)
        return (int(volume),) * 3
    return None


def check_shape_argument(args, shape, model) -> None:
    """``config.schema.check_shape`` for the shape the user gave, its message naming the flag typed.

    ``--volume N`` is judged as the edge it is (``Invalid --volume 18: ... Try --volume 16 or 20.``).
    """
    from bigmem.config.schema import check_multiple, check_shape

    if getattr(args, "volume", None) is not None:
        check_multiple("--volume", int(args.volume), model)
    else:
        check_shape("--shape", shape, model)


def resolve_with_shape(args, preset, overrides: dict):
    """``config.presets.resolve_config(preset, overrides)``, the shape the user typed checked first.

    The config knows a shape, not the flag that set it, and names a cube after its shorthand
    (``data.volume``): a ``--shape 50,50,50`` the network cannot take would be refused as
    ``Invalid --volume 50``. Checked here against the preset's network, the message names the flag
    given and suggests valid values of it (``check_shape_argument``).

    Raises:
        ConfigError: the typed shape, or any other setting, is one the preset cannot use.
    """
    from bigmem.config.presets import resolve_config

    shape = overrides.get("data", {}).get("shape")
    if shape is not None:
        without = {**overrides, "data": {k: v for k, v in overrides["data"].items() if k != "shape"}}
        check_shape_argument(args, shape, resolve_config(preset, without).model)
    return resolve_config(preset, overrides)


def shape_flag(args) -> str:
    """The flag the user set the shape with, for messages: ``--volume`` or ``--shape``."""
    return "--volume" if getattr(args, "volume", None) is not None else "--shape"



def parse_spacing(text: str, flag: str = "--spacing") -> tuple[float, float, float]:
    """'1,1,1.5' -> (1.0, 1.0, 1.5): three positive, finite numbers (mm; NaN and inf are refused)."""
    try:
        spacing = tuple(float(part) for part in text.split(","))
    except ValueError:
        spacing = ()
    if len(spacing) != 3 or not all(0 < value < math.inf for value in spacing):
        raise UsageError(f"Invalid {flag} {text!r}: expected three positive numbers (mm) such as 1,1,1.5.")
    return spacing  # type: ignore[return-value]


def check_positive(flag: str, value: int | float | None, *, zero_ok: bool = False) -> None:
    """Raise ``UsageError`` unless ``value`` (when given) is a finite number > 0 (>= 0 with ``zero_ok``)."""
    if value is None:
        return
    low_ok = value >= 0 if zero_ok else value > 0
    if not (low_ok and value < math.inf):
        integer = isinstance(value, int)
        what = (("an integer >= 0" if integer else "a number >= 0") if zero_ok else
                ("a positive integer" if integer else "a positive, finite number"))
        raise UsageError(f"Invalid {flag} {value:g}: expected {what}.")


def _probe_writable(directory: Path, flag: str, target: Path) -> None:
    """Create and remove a file in ``directory``: the one test that also holds for root and read-only mounts."""
    if not directory.is_dir():
        raise DataError(f"Cannot write {flag} {str(target)!r}: {str(directory)!r} is a file, not a directory.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".bigmem-probe-", dir=directory)
    except OSError as exc:
        raise DataError(f"Cannot write {flag} {str(target)!r}: directory {str(directory)!r} is not writable "
                        f"({exc.strerror or exc}).") from None
    os.close(fd)
    os.unlink(probe)


def _check_free(directory: Path, flag: str, target: Path, needed_bytes: int | None) -> None:
    if not needed_bytes:
        return
    import shutil

    free = shutil.disk_usage(directory).free
    if needed_bytes > free:
        raise DiskFullError(f"Cannot write {flag} {str(target)!r}: it needs about {format_bytes(needed_bytes)}, and "
                            f"{str(directory)!r} has {format_bytes(free)} free.", str(target), needed_bytes, free)


def check_output_file(path: str | os.PathLike, flag: str, *, needed_bytes: int | None = None) -> Path:
    """Check, before any work, that the file ``path`` (and any missing parent folders) can be written.

    Args:
        path: the output file (it may exist: overwriting is the command's decision).
        flag: the flag that named it, for messages ('-o', '--out').
        needed_bytes: the output's expected size, checked against the free space (default: not checked).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        DataError: ``path`` is a directory, a parent is a file, or the folder it goes in is not
            writable (permissions, a read-only mount).
        DiskFullError: ``needed_bytes`` exceeds the free space there.

    Example:
        >>> check_output_file("runs/plan.json", "--out")
        PosixPath('runs/plan.json')
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"Cannot write {flag} {str(path)!r}: it is a directory; expected a file name.")
    folder = nearest_existing(path.parent)
    _probe_writable(folder, flag, path)
    _check_free(folder, flag, path, needed_bytes)
    return path


def check_output_dir(path: str | os.PathLike, flag: str, *, needed_bytes: int | None = None) -> Path:
    """Check, before any work, that the folder ``path`` exists and is writable or can be created.

    Args:
        path: the output folder (it may exist).
        flag: the flag that named it, for messages ('--out').
        needed_bytes: the outputs' expected size, checked against the free space (default: not checked).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        DataError: ``path`` (or a parent) is a file, or it (or the nearest existing parent) is not
            writable.
        DiskFullError: ``needed_bytes`` exceeds the free space there.

    Example:
        >>> check_output_dir("runs/small-1", "--out")  # bigmem train's run directory, before TensorFlow starts
        PosixPath('runs/small-1')
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DataError(f"Cannot write {flag} {str(path)!r}: it is a file; expected a directory.")
    folder = nearest_existing(path)
    _probe_writable(folder, flag, path)
    _check_free(folder, flag, path, needed_bytes)
    return path


def check_allocation(needed_bytes: int, what: str, hint: str) -> None:
    """Raise ``InsufficientMemoryError`` (exit 3) when ``needed_bytes`` exceed MemAvailable.

    For sizes a command would allocate before any pre-flight of its own (a phantom, a case):
    ``what`` says what needs them ('one 100000^3 phantom'), ``hint`` the way out ('a smaller --volume').
    """
    import psutil

    available = int(psutil.virtual_memory().available)
    if needed_bytes > available:
        raise InsufficientMemoryError(f"{what[:1].upper()}{what[1:]} needs about {format_bytes(needed_bytes)} of "
                                      f"memory, more than the {format_bytes(available)} available (MemAvailable); "
                                      f"try {hint}.", needed_bytes, available)


def add_shape_column(table, header: str, cells, **options) -> None:
    """A ``rich`` table column of shapes ('200x240x192') that is never cut to '200x240x…'.

    The column is at least as wide as its widest shape (a word of ``cells``: '200x240x192 *' is two),
    so a narrow terminal shrinks the other columns first; where even that is not enough, a shape
    folds onto the next line instead of losing digits.

    Args:
        table: a ``rich.table.Table`` whose rows are not added yet.
        header: the column's title.
        cells: the texts the column will hold.
        **options: ``Table.add_column``'s others (``justify``).

    Example:
        >>> add_shape_column(table, "volume", ["200x240x192 *", "96x96x96"], justify="right")
    """
    widest = max((len(word) for cell in cells for word in str(cell).split()), default=0)
    table.add_column(header, min_width=widest, overflow="fold", **options)
