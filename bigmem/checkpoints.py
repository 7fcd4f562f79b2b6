"""Atomic checkpoints: the newest complete one is always loadable.

A checkpoint is a directory ``ckpt-<step>`` holding ``variables.h5`` (every model weight and
optimizer variable, in order, with its path and CRC-32) and ``state.json``. It is written through
``bigmem.atomic.atomic_output`` as a folder: under a hidden temporary name, flushed to disk, and
renamed into place; the checkpoint directory, ``checkpoints/`` (and the run directory above it
when the write made ``checkpoints/``) are fsynced, so a checkpoint reported written survives a
power loss, and a full disk is the one-line ``DiskFullError`` every output gives. Readers ignore
hidden names. ``best`` (the model weights at the best validation Dice,
``--val-every``) is written the same way and never pruned. A checkpoint that cannot be read is
kept aside as ``.damaged-<name>`` (``restore_newest``) and ignored from then on. Both training
(resume) and prediction (``--checkpoint``) read them, so this module sits below both.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from bigmem.atomic import (atomic_hdf5, atomic_output, fsync_dir, leftover_temporaries, remove_atomically,
                           require_free_space)
from bigmem.errors import DataError

PREFIX = "ckpt-"
# The temporaries of bigmem versions that named their own (.tmp-<name>-<pid>): a run killed by one of
# those and resumed by this one still has them swept.
LEGACY_TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = ".damaged-"
BEST = "best"
FILES = ("state.json", "variables.h5")


class DamagedCheckpointError(DataError):
    """A checkpoint that cannot be read (torn, truncated, zeroed, a CRC mismatch), as opposed to
    one that reads but belongs to another model.

    Args:
        path: the checkpoint directory.
        reason: what is wrong with it, e.g. "state.json: Expecting value: line 1 column 1 (char 0)".
    """

    def __init__(self, path: Path, reason: str):
        super().__init__(f"Cannot read checkpoint {str(path)!r}: {reason}")
        self.path, self.reason = Path(path), reason


@dataclass(frozen=True)
class Skipped:
    """A checkpoint ``restore_newest`` passed over: its name, why, and where it was kept aside."""

    name: str
    reason: str
    kept_as: Path


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def _step_of(path: Path) -> int | None:
    digits = path.name[len(PREFIX):]
    return int(digits) if path.name.startswith(PREFIX) and digits.isdigit() else None


class CheckpointManager:
    """Saves, finds and restores checkpoints under ``directory``, keeping the newest ``keep``.

    Args:
        directory: the checkpoints folder (``RUN_DIR/checkpoints``), created by the first save.
        keep: periodic checkpoints kept (``best`` is never pruned).

    Example:
        >>> manager = CheckpointManager("runs/tiny/checkpoints")
        >>> path, state, skipped = manager.restore_newest(model, optimizer)
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        self.directory = Path(directory)
        self.keep = int(keep)

    def _named(self) -> list[Path]:
        """Every ``ckpt-<step>`` directory, complete or not, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted((p for p in self.directory.iterdir() if _step_of(p) is not None and p.is_dir()), key=_step_of)

    def all(self) -> list[Path]:
        """Complete checkpoints (both files there), oldest first; temporaries and damaged ones are not."""
        return [p for p in self._named() if all((p / name).is_file() for name in FILES)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        complete = self.all()
        return complete[-1] if complete else None

    def damaged(self) -> list[Path]:
        """The checkpoints kept aside as unreadable (``.damaged-*``), by name."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if p.name.startswith(DAMAGED_PREFIX))

    @property
    def best(self) -> Path | None:
        """The best-validation checkpoint, if one was written."""
        path = self.directory / BEST
        return path if all((path / name).is_file() for name in FILES) else None

    def find(self, name: str) -> Path:
        """A checkpoint by name: 'latest', 'best', 'ckpt-N' or 'N' (a step).

        Raises:
            DataError: no such complete checkpoint (the message lists the ones there are).
        """
        if name == "latest":
            found = self.latest()
        elif name == BEST:
            found = self.best
        else:
            step = name[len(PREFIX):] if name.startswith(PREFIX) else name
            found = next((p for p in self.all() if step.isdigit() and _step_of(p) == int(step)), None)
        if found is None:
            there = [p.name for p in self.all()] + ([BEST] if self.best else [])
            if not there:
                raise DataError(f"No checkpoint {name!r} in {self.directory}: the run has written no complete "
                                "checkpoint.")
            raise DataError(f"No checkpoint {name!r} in {self.directory}: expected "
                            f"{'latest or ' if self.all() else ''}one of {', '.join(there)}.")
        return found

    def save(self, step: int, model, optimizer, state: dict[str, Any]) -> Path:
        """Write ``ckpt-<step>`` (model and optimizer variables, ``state`` plus the step); prune old ones.

        Returns:
            The checkpoint's directory, durable on disk when this returns.
        """
        return self._write(f"{PREFIX}{step:08d}", step, (("model", model.weights), ("optimizer", optimizer.variables)),
                           state, prune=True)

    def save_best(self, step: int, model, state: dict[str, Any]) -> Path:
        """Replace ``best`` with ``model``'s weights at ``step`` (no optimizer: it is for prediction)."""
        return self._write(BEST, step, (("model", model.weights),), state, prune=False)

    def _write(self, name: str, step: int, groups, state: dict[str, Any], *, prune: bool) -> Path:
        """Write checkpoint ``name`` as one atomic folder output (``atomic_output(directory=True)``).

        Raises:
            DiskFullError: the disk has too little space for the variables (checked before
                writing), or filled or failed while writing; nothing is left behind (not even
                ``checkpoints/``, where this write would have made it) and the checkpoints already
                there are untouched.
        """
        final = self.directory / name
        needed = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for _, vs in groups for v in vs)
        require_free_space(final, needed)
        with atomic_output(final, needed_bytes=needed, directory=True) as folder:
            self._write_files(folder, step, groups, state)
        if prune:
            self._prune()
        return final

    @staticmethod
    def _write_files(folder: Path, step: int, groups, state: dict[str, Any]) -> None:
        """variables.h5 and state.json in ``folder`` (``atomic_output`` flushes them, then the folder's names)."""
        with atomic_hdf5(folder / "variables.h5", fsync=False) as handle:
            for group_name, variables in groups:
                group = handle.create_group(group_name)
                for index, variable in enumerate(variables):
                    value = np.asarray(variable.numpy())
                    dataset = group.create_dataset(f"{index:05d}", data=value)
                    dataset.attrs["path"] = variable.path
                    dataset.attrs["crc32"] = _crc32(value)
        with open(folder / "state.json", "w") as handle:
            json.dump({**state, "step": int(step)}, handle, indent=2)

    def _prune(self) -> None:
        for old in self.all()[:-self.keep]:
            remove_atomically(old)  # one rename: a kill never leaves half a checkpoint under its name
        # left by a process that was killed mid-write
        for stale in leftover_temporaries(self.directory) + sorted(self.directory.glob(f"{LEGACY_TMP_PREFIX}*")):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)

    def keep_aside(self, path: Path) -> Path:
        """Rename the unreadable checkpoint ``path`` to ``.damaged-<name>`` (never read or pruned again).

        Returns:
            Its new path (``.damaged-<name>.N`` if that name is taken).
        """
        target = self.directory / f"{DAMAGED_PREFIX}{path.name}"
        number = 1
        while target.exists():
            target = self.directory / f"{DAMAGED_PREFIX}{path.name}.{number}"
            number += 1
        os.replace(path, target)
        fsync_dir(self.directory)
        return target

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        """A checkpoint's state.json (its step, loss, Dice, ...).

        Raises:
            DamagedCheckpointError: it cannot be read, or is not a JSON object with an integer ``step``.
        """
        try:
            state = json.loads((path / "state.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DamagedCheckpointError(path, f"state.json: {exc}") from None
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise DamagedCheckpointError(path, "state.json: expected a JSON object with an integer 'step'")
        return state

    def restore(self, path: Path, model, optimizer=None) -> dict[str, Any]:
        """Load ``path`` into ``model`` and ``optimizer`` (both built; None: the weights only); return its state.

        Every variable is checked against the CRC-32 saved with it (checkpoints written before
        CRCs were saved are read without the check).

        Raises:
            DamagedCheckpointError: the checkpoint cannot be read (a missing, torn or corrupt file).
            DataError: it reads but was written by another model (a variable count or shape differs).
        """
        state = self.read_state(path)
        groups = (("model", model.weights),) + ((("optimizer", optimizer.variables),) if optimizer else ())
        try:
            with h5py.File(path / "variables.h5", "r") as handle:
                for group_name, variables in groups:
                    group = handle[group_name]
                    if len(group) != len(variables):
                        raise DataError(f"Checkpoint {str(path)!r} holds {len(group)} {group_name} variables; "
                                        f"this run has {len(variables)}. Was it written by another model?")
                    for index, variable in enumerate(variables):
                        dataset = group[f"{index:05d}"]
                        value = dataset[...]
                        if tuple(value.shape) != tuple(variable.shape):
                            raise DataError(f"Checkpoint {str(path)!r}: variable {variable.path} has shape "
                                            f"{value.shape}, expected {tuple(variable.shape)}.")
                        if "crc32" in dataset.attrs and int(dataset.attrs["crc32"]) != _crc32(value):
                            raise DamagedCheckpointError(path, f"variables.h5: {group_name} variable "
                                                               f"{variable.path} fails its CRC-32 check")
                        variable.assign(value)
        except (OSError, KeyError, ValueError) as exc:
            raise DamagedCheckpointError(path, f"variables.h5: {exc}") from None
        return state

    def restore_newest(self, model, optimizer=None) -> tuple[Path, dict[str, Any], list[Skipped]]:
        """Restore the newest checkpoint that loads; the newer ones that do not are kept aside.

        Args:
            model, optimizer: built, as for ``restore``.

        Returns:
            ``(path, state, skipped)``: the checkpoint restored, its state, and each newer one
            passed over (``Skipped``: name, reason, where it was kept aside), newest first.

        Raises:
            DataError: no checkpoint loads (each is named with its reason and kept aside), or one
                was written by another model (not damage: nothing is moved).
        """
        skipped: list[Skipped] = []
        for path in reversed(self._named()):
            try:
                missing = [name for name in FILES if not (path / name).is_file()]
                if missing:
                    raise DamagedCheckpointError(path, f"{' and '.join(missing)} missing")
                return path, self.restore(path, model, optimizer), skipped
            except DamagedCheckpointError as exc:
                skipped.append(Skipped(path.name, exc.reason, self.keep_aside(path)))
        found = "; ".join(f"{s.name}: {s.reason} (kept aside as {s.kept_as.name})" for s in skipped)
        raise DataError(f"No checkpoint in {self.directory} loads: {found or 'there is none'}. "
                        "Start a new run with another {train.run_dir}.")
