"""``bigmem export``'s API: the files of a run that ``bigmem predict`` reads, copied into a model folder."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from bigmem.checkpoints import CheckpointManager
from bigmem.errors import DataError
from bigmem.infer.modelcard import CARD_NAME, ModelCard
from bigmem.infer.predict import run_config
from bigmem.atomic import atomic_output
from bigmem.rundir import RunDir


@dataclass(frozen=True)
class Exported:
    path: Path
    files: list[str]  # relative to ``path``
    nbytes: int


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, *, checkpoint: str | None = None,
               force: bool = False) -> Exported:
    """Copy what predict needs of ``run_dir`` into the folder ``out`` (atomically).

    Args:
        run_dir: a finished ``bigmem train`` run (``model.keras``), or one with ``checkpoint``.
        out: the model folder to write.
        checkpoint: also copy this checkpoint ('best', 'latest', 'ckpt-N'); None: ``model.keras`` only.
        force: replace an existing ``out``.

    Returns:
        ``Exported``: the folder, the files in it and their bytes.

    Raises:
        DataError: not a run directory, no ``model.keras`` (and no ``checkpoint``), no such
            checkpoint, no preprocessing record and no store to make one from, or ``out`` exists
            without ``force`` (or is inside the run).
    """
    run, out = RunDir(run_dir), Path(out)
    config = run_config(run_dir)  # refuses a folder that is not a run
    card = ModelCard.of_run(run_dir, config.data.store)
    if out.exists() and not force:
        raise DataError(f"{str(out)!r} exists: pass {{export.force}} to replace it, or choose another "
                        "{export.out}.")
    if out.resolve().is_relative_to(run.path.resolve()):
        raise DataError(f"{{export.out}} {str(out)!r} is inside the run directory {str(run.path)!r}; choose a "
                        "folder outside it.")
    chosen = CheckpointManager(run.checkpoints).find(checkpoint) if checkpoint else None
    if chosen is None and not run.model.is_file():
        raise DataError(f"No model.keras in {str(run.path)!r}: the run has not finished. Give "
                        "{export.checkpoint} latest (or best) to export a checkpoint.")
    copies = [(source, source.name) for source in (run.config, run.plan, run.model) if source.is_file()]
    if chosen is not None:
        copies.append((chosen, f"{run.checkpoints.name}/{chosen.name}"))
    nbytes = sum(_size(source) for source, _ in copies)
    with atomic_output(out, directory=True, needed_bytes=nbytes) as tmp:
        for source, name in copies:
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target)
            else:
                shutil.copy2(source, target)
        card.write(tmp)
    files = sorted([name for _, name in copies] + [CARD_NAME])
    return Exported(out, files, nbytes + (out / CARD_NAME).stat().st_size)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
