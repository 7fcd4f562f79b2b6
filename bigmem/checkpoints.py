"""Atomic checkpoints: the newest complete one is always loadable.

A checkpoint is a directory ``ckpt-<step>`` holding ``variables.h5`` (every model weight and
optimizer variable, in order, with its path) and ``state.json``. It is written under a
temporary name, flushed to disk, and renamed into place; readers ignore temporary names.
``best`` (the model weights at the best validation Dice, ``--val-every``) is written the same
way and never pruned. Both training (resume) and prediction (``--checkpoint``) read them, so
this module sits below both.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from bigmem.errors import DataError

PREFIX = "ckpt-"
TMP_PREFIX = ".tmp-"
BEST = "best"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves, finds and restores checkpoints under ``directory``, keeping the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        self.directory = Path(directory)
        self.keep = int(keep)

    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir()
                 if p.name.startswith(PREFIX) and (p / "state.json").is_file() and (p / "variables.h5").is_file()]
        return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))

    def latest(self) -> Path | None:
        complete = self.all()
        return complete[-1] if complete else None

    @property
    def best(self) -> Path | None:
        """The best-validation checkpoint, if one was written."""
        path = self.directory / BEST
        return path if (path / "state.json").is_file() and (path / "variables.h5").is_file() else None

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
            found = next((p for p in self.all() if step.isdigit() and int(p.name[len(PREFIX):]) == int(step)), None)
        if found is None:
            there = [p.name for p in self.all()] + ([BEST] if self.best else [])
            raise DataError(f"No checkpoint {name!r} in {self.directory}: expected latest, best or one of "
                            f"{', '.join(there) or 'none (no complete checkpoint was written)'}.")
        return found

    def save(self, step: int, model, optimizer, state: dict[str, Any]) -> Path:
        return self._write(f"{PREFIX}{step:08d}", step, (("model", model.weights), ("optimizer", optimizer.variables)),
                           state, prune=True)

    def save_best(self, step: int, model, state: dict[str, Any]) -> Path:
        """Replace ``best`` with ``model``'s weights at ``step`` (no optimizer: it is for prediction)."""
        return self._write(BEST, step, (("model", model.weights),), state, prune=False)

    def _write(self, name: str, step: int, groups, state: dict[str, Any], *, prune: bool) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / name
        tmp = self.directory / f"{TMP_PREFIX}{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with h5py.File(tmp / "variables.h5", "w") as handle:
            for group_name, variables in groups:
                group = handle.create_group(group_name)
                for index, variable in enumerate(variables):
                    dataset = group.create_dataset(f"{index:05d}", data=np.asarray(variable.numpy()))
                    dataset.attrs["path"] = variable.path
            handle.flush()
            os.fsync(handle.id.get_vfd_handle())
        with open(tmp / "state.json", "w") as handle:
            json.dump({**state, "step": int(step)}, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():  # a re-save of the same step (e.g. final == periodic), or a new best: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        if prune:
            self._prune()
        return final

    def _prune(self) -> None:
        for old in self.all()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.directory.glob(f"{TMP_PREFIX}*"):
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def read_state(path: Path) -> dict[str, Any]:
        """A checkpoint's state.json (its step, loss, Dice, ...).

        Raises:
            DataError: it cannot be read.
        """
        try:
            return json.loads((path / "state.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"Cannot read checkpoint {str(path)!r}: {exc}") from None

    def restore(self, path: Path, model, optimizer=None) -> dict[str, Any]:
        """Load ``path`` into ``model`` and ``optimizer`` (both built; None: the weights only); return its state.

        Raises:
            DataError: the checkpoint is unreadable or was written by another model.
        """
        groups = (("model", model.weights),) + ((("optimizer", optimizer.variables),) if optimizer else ())
        try:
            with h5py.File(path / "variables.h5", "r") as handle:
                for group_name, variables in groups:
                    group = handle[group_name]
                    if len(group) != len(variables):
                        raise DataError(f"Checkpoint {str(path)!r} holds {len(group)} {group_name} variables; "
                                        f"this run has {len(variables)}. Was it written by another model?")
                    for index, variable in enumerate(variables):
                        value = group[f"{index:05d}"][...]
                        if tuple(value.shape) != tuple(variable.shape):
                            raise DataError(f"Checkpoint {str(path)!r}: variable {variable.path} has shape "
                                            f"{value.shape}, expected {tuple(variable.shape)}.")
                        variable.assign(value)
            with open(path / "state.json") as handle:
                return json.load(handle)
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise DataError(f"Cannot read checkpoint {str(path)!r}: {exc}") from None
