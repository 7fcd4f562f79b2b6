"""TensorBoard event files, written so that a full disk stops a run with one line and leaves none behind.

TensorFlow creates an event file the moment a summary writer is made (before anything is logged
in it), buffers what is logged, and reports a full disk as an ``OpError`` (RESOURCE_EXHAUSTED,
"No space left on device") from whichever call happens to flush. ``EventWriters`` makes each
writer on first use, turns TensorFlow's disk errors into the ``DiskFullError`` every bigmem
output gives, and, when the run is stopped by a full disk, removes the event files (and the
folders) it made: they end in a torn record, and the space they hold is what the disk lacks.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

from bigmem.atomic import DISK_ERRNOS, disk_errno, disk_full_error
from bigmem.errors import DiskFullError
from bigmem.tfenv import import_tensorflow


class EventWriters:
    """One TensorFlow summary writer per subfolder of ``directory`` (``train/``, ``validation/``), made on first use.

    A context manager held for the whole training loop: leaving it closes (flushes) the writers;
    leaving it with a full-disk error (``DiskFullError``, or an ``OSError`` with ENOSPC, EDQUOT or
    EIO), or failing to flush on leaving, also removes every event file the writers made and the
    folders made for them. Event files of earlier runs (a resumed run's) are never touched.

    Args:
        directory: the run's TensorBoard folder (``RunDir.tensorboard``); made on the first write.

    Raises:
        DiskFullError: (``writing``, leaving the block) TensorFlow could not write an event file
            for lack of space or a failing device; it names the event file.

    Example:
        >>> with EventWriters(run.tensorboard) as events:
        ...     with events.writing("train", step=4):
        ...         tf.summary.scalar("loss", 0.5)  # RUN/tensorboard/train/events.out.tfevents.*
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._writers: dict[str, object] = {}
        self._files: dict[str, list[Path]] = {}  # writer name -> the event files it made
        self._made: list[Path] = []  # folders made for the writers, deepest first

    @property
    def files(self) -> list[Path]:
        """The event files this process's writers made, by writer."""
        return [path for paths in self._files.values() for path in paths]

    @contextmanager
    def writing(self, name: str, step: int) -> Iterator[None]:
        """The block's ``tf.summary`` calls go to the writer ``name`` (made now if new) at ``step``.

        Raises:
            DiskFullError: TensorFlow could not write the event file (a full disk, a failing device).
        """
        with self._disk_errors(name):
            writer = self._writers[name] if name in self._writers else self._make(name)
            with writer.as_default(step=step):
                yield

    def _make(self, name: str):
        tf = import_tensorflow()
        folder = self.directory / name
        missing = []
        parent = Path(os.path.abspath(folder))
        while not parent.exists() and parent != parent.parent:
            missing.append(parent)
            parent = parent.parent
        self._made += missing
        before = set(folder.iterdir()) if folder.is_dir() else set()
        try:
            self._writers[name] = tf.summary.create_file_writer(str(folder))
        finally:  # the file is there as soon as TensorFlow opened it, even if writing its header failed
            self._files[name] = sorted(set(folder.iterdir()) - before) if folder.is_dir() else []
        return self._writers[name]

    @contextmanager
    def _disk_errors(self, name: str) -> Iterator[None]:
        """TensorFlow's disk errors for writer ``name`` as ``DiskFullError`` (its message names no errno)."""
        tf = import_tensorflow()
        try:
            yield
        except tf.errors.OpError as exc:
            code = next((c for c in sorted(DISK_ERRNOS) if os.strerror(c) in (exc.message or "")), None)
            if code is None:
                raise
            files = self._files.get(name) or [self.directory / name]
            raise disk_full_error(files[0], 0, code=code) from None

    def close(self) -> None:
        """Close (flush) every writer.

        Raises:
            DiskFullError: a writer's last flush failed for lack of space (every writer is closed even so).
        """
        failure = None
        for name, writer in list(self._writers.items()):
            try:
                with self._disk_errors(name):
                    writer.close()
            except DiskFullError as exc:
                failure = failure or exc
        self._writers.clear()
        if failure is not None:
            raise failure

    def remove(self) -> None:
        """Remove the event files the writers made, then the folders made for them where nothing else is in them."""
        for path in self.files:
            path.unlink(missing_ok=True)
        self._files.clear()
        for folder in self._made:  # deepest first
            with suppress(OSError):
                folder.rmdir()
        self._made.clear()

    def __enter__(self) -> "EventWriters":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self.close()
        except DiskFullError:
            self.remove()
            if exc is None:
                raise
            return False  # the run's own error is the one to report
        if exc is not None and (isinstance(exc, DiskFullError) or disk_errno(exc) is not None):
            self.remove()
        return False
