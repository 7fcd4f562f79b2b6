"""The one way bigmem writes a file: atomically, with a one-line message when the disk is full.

Every output goes through ``atomic_output``: it is written under a temporary name in its own
folder, flushed to disk and renamed into place, and the temporary (and any folder made for it) is
removed on any failure, so a reader sees the old file or the new one and a failed command leaves
nothing behind. A full disk (ENOSPC), an exhausted quota (EDQUOT) or a failing device (EIO)
becomes ``DiskFullError`` (exit 1), naming the path, the bytes needed and the bytes free. HDF5
files are written through ``atomic_hdf5``, which keeps HDF5 from crashing the process when a
write fails (see there). The run directory (``rundir``), checkpoints (folders, through
``atomic_output(directory=True)``), stores, predictions and reports all write through here, and
``remove_atomically``, ``leftover_temporaries`` and ``remove_leftover_temporaries`` handle what a killed
writer leaves.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from bigmem.errors import DiskFullError
from bigmem.units import format_bytes

if TYPE_CHECKING:
    import h5py

# The write failures that are the disk's, not bigmem's: out of space, out of quota, a failing device.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
# h5py raises some HDF5 write failures (a failed flush or close) as RuntimeError, with the
# system's errno only in HDF5's text: "... errno = 28, error message = 'No space left on device' ...".
_HDF5_ERRNO = re.compile(r"\berrno = (\d+)")
# temporary_name's scheme, read back: .<stem>.tmp-<pid>-<n><suffix> (without -<n>: before the counter existed)
_TEMPORARY = re.compile(r"^\.(?P<stem>.+)\.tmp-(?P<pid>\d+)(?:-\d+)?(?P<suffix>.*)$")
# An older bigmem's temporaries (tempfile.mkstemp beside the output): .<name>.<random>.tmp, naming no process
_OLD_TEMPORARY = re.compile(r"^\..+\.\w+\.tmp$")
_counter = itertools.count()


def disk_errno(exc: BaseException) -> int | None:
    """The errno of ``exc`` if it is ENOSPC, EDQUOT or EIO (also when h5py only says it in its text), else None."""
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return exc.errno
    if isinstance(exc, (OSError, RuntimeError)):
        match = _HDF5_ERRNO.search(str(exc))
        if match and int(match.group(1)) in DISK_ERRNOS:
            return int(match.group(1))
    return None


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` itself (made absolute) if it exists, else its nearest existing parent."""
    where = Path(os.path.abspath(path))
    while not where.exists() and where != where.parent:
        where = where.parent
    return where


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged user may still write on the filesystem of ``path`` (or its nearest existing parent)."""
    return shutil.disk_usage(nearest_existing(path)).free


# Any output a command writes, whatever its own argument is called (run_dir, out, out_dir): ``--out`` on the
# command line.
OUTPUT_FIELD = "{output.path}"


def disk_full_error(path: str | os.PathLike, needed_bytes: int, *, code: int = errno.ENOSPC,
                    at_least: bool = False) -> DiskFullError:
    """The one-line ``DiskFullError`` for a write of about ``needed_bytes`` to ``path`` that failed with ``code``.

    Args:
        path: the output (its final name, not the temporary one).
        needed_bytes: what the whole output needs, as well as the writer knows it.
        code: ENOSPC (default), EDQUOT or EIO.
        at_least: ``needed_bytes`` is only what was written before the failure, a lower bound.
            A disk that filled although ``needed_bytes`` was free had less than it needed: the
            message then says "needed more than <free>".

    Returns:
        ``DiskFullError``: "No space left on device writing 'out.h5' (needed about 40.00 MiB,
        1.50 MiB free). Free space or choose another output.path." (``--out`` on the command line)
    """
    free = free_bytes(Path(path).parent)
    if code != errno.EIO and needed_bytes <= free:  # the estimate was short: all that is known is "more than free"
        needed_bytes, at_least = free, True
    needed = f"{'more than' if at_least else 'about'} {format_bytes(needed_bytes)}"
    advice = (f"Check the device (dmesg) or choose another {OUTPUT_FIELD}." if code == errno.EIO
              else f"Free space or choose another {OUTPUT_FIELD}.")
    message = f"{os.strerror(code)} writing {str(path)!r} (needed {needed}, {format_bytes(free)} free). {advice}"
    return DiskFullError(message, str(path), needed_bytes, free)


def require_free_space(path: str | os.PathLike, needed_bytes: int) -> None:
    """Refuse, before any work, an output of ``needed_bytes`` that cannot fit where ``path`` goes.

    Raises:
        DiskFullError: the filesystem has fewer than ``needed_bytes`` free (the same message a
            failed write gives).
    """
    if needed_bytes > free_bytes(Path(path).parent):
        raise disk_full_error(path, needed_bytes)


def temporary_name(path: str | os.PathLike) -> Path:
    """A hidden name beside ``path`` for its temporary: ``.<stem>.tmp-<pid>-<n><suffix>``.

    The suffix (``.h5``, ``.nii.gz``, ``.png``, ...) is kept, for writers that pick a format by it.
    """
    path = Path(path)
    suffix = ".nii.gz" if path.name.endswith(".nii.gz") else path.suffix
    stem = path.name[:len(path.name) - len(suffix)] if suffix else path.name
    return path.with_name(f".{stem}.tmp-{os.getpid()}-{next(_counter)}{suffix}")


def temporary_of(name: str) -> tuple[str, int] | None:
    """What a ``temporary_name`` stands for: ``(the output's name, the writer's process id)``; None for
    any other name.

    Example:
        >>> temporary_of(".ckpt-00000004.tmp-4242-0")
        ('ckpt-00000004', 4242)
    """
    match = _TEMPORARY.match(name)
    return (match["stem"] + match["suffix"], int(match["pid"])) if match else None


def leftover_temporaries(folder: str | os.PathLike) -> list[Path]:
    """The temporaries in ``folder`` that another process made (one that was killed mid-write), by name.

    This process's own are not listed: they may be in the middle of being written. An older bigmem's
    ``.<name>.<random>.tmp`` (``tempfile.mkstemp``'s, which name no process) are.

    Args:
        folder: the folder to look in (missing: none).

    Returns:
        Their paths, sorted.

    Example:
        >>> leftover_temporaries("runs/small-1")  # after a kill while model.keras was written
        [PosixPath('runs/small-1/.model.tmp-4242-7.keras')]
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _left_over(p.name))


def _left_over(name: str) -> bool:
    owner = temporary_of(name)
    return owner[1] != os.getpid() if owner else bool(_OLD_TEMPORARY.match(name))


def remove_leftover_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove ``leftover_temporaries(folder)`` (files and folders); a killed writer's debris, never an output.

    Args:
        folder: the folder to clean (missing: nothing to do).

    Returns:
        The paths removed, sorted.

    Example:
        >>> remove_leftover_temporaries("runs/small-1")  # a resumed run starts without the killed one's
        [PosixPath('runs/small-1/.model.tmp-4242-7.keras')]
    """
    stale = leftover_temporaries(folder)
    for path in stale:
        _remove(path)
    return stale


def remove_atomically(path: str | os.PathLike) -> None:
    """Remove the file or folder ``path`` as one rename, then delete it: a reader (or a kill) sees it whole or gone.

    A kill before the delete leaves a hidden temporary (``leftover_temporaries`` finds it).
    """
    path = Path(path)
    doomed = temporary_name(path)
    os.replace(path, doomed)
    _remove(doomed)


@contextmanager
def atomic_output(path: str | os.PathLike, *, needed_bytes: int | Callable[[], int] = 0, directory: bool = False,
                  fsync: bool = True) -> Iterator[Path]:
    """Write ``path`` whole or not at all: yields a temporary path beside it, renamed onto ``path`` on success.

    On leaving the block normally the temporary (a file, or with ``directory`` a folder and the
    files in it) is fsynced, renamed onto ``path`` (an existing folder is moved aside first and
    removed once the rename is durable), and the parent folder fsynced, with the parent of each
    folder made for ``path``. On any exception the temporary, and the folders made for it, are
    removed and an existing ``path`` is left as it was.

    Args:
        path: the output.
        needed_bytes: the bytes the output will take, or a function giving them when asked (at a
            failure); 0 (default): unknown, the message then says what was written before the failure.
        directory: the output is a folder: the temporary is created as an empty folder (default False).
        fsync: flush the data to the device before the rename (default True).

    Yields:
        The temporary path to write (not created, unless ``directory``).

    Raises:
        DiskFullError: a write failed with ENOSPC, EDQUOT or EIO (any exception the block raises is
            translated; other exceptions pass through unchanged). With ``directory``, the
            ``DiskFullError`` of a file written in the folder (``atomic_hdf5``, ``atomic_write_json``)
            is given again naming ``path``.

    Example:
        >>> with atomic_output("out/labels.nii.gz", needed_bytes=array.nbytes) as tmp:
        ...     nib.save(image, tmp)  # out/labels.nii.gz appears only once it is complete
    """
    path = Path(path)
    tmp = temporary_name(path)
    created = _missing_parents(path)  # made here, so removed again if the output fails: nothing is left behind
    replaced = None  # the folder an output folder replaced, moved aside
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp.mkdir()
        yield tmp
        if fsync:
            _fsync_tree(tmp)
        replaced = _replace(tmp, path)
        if fsync:
            for folder in (path, *created):  # the rename, then each new folder's name in its parent
                fsync_dir(folder.parent)
        if replaced is not None:  # deleted only once the new folder's name is durable
            _remove(replaced)
    except BaseException as exc:
        written = _undone(tmp, replaced, created)
        code = disk_errno(exc)
        if isinstance(exc, DiskFullError) and directory and Path(exc.path).is_relative_to(tmp):
            code = disk_errno(exc.__cause__) if exc.__cause__ is not None else None  # a file written in the folder:
            code = errno.ENOSPC if code is None else code  # named as the folder's output, not its temporary
        elif code is None or isinstance(exc, DiskFullError):
            raise
        needed = needed_bytes() if callable(needed_bytes) else int(needed_bytes)
        raise disk_full_error(path, max(needed, written), code=code, at_least=needed <= 0) from exc


def _undone(tmp: Path, replaced: Path | None, created: list[Path]) -> int:
    """A failed output removed: the folder it replaced (moved aside), its temporary and the folders made for it
    (deepest first; one that something else has filled since stays). Returns the bytes it had written."""
    if replaced is not None:
        _remove(replaced)
    written = _size(tmp)
    _remove(tmp)
    for folder in created:
        with suppress(OSError):
            folder.rmdir()
    return written


def _missing_parents(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, deepest first."""
    missing = []
    folder = Path(os.path.abspath(path)).parent
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _replace(tmp: Path, path: Path) -> Path | None:
    """Rename ``tmp`` onto ``path``; an existing folder ``path`` is moved aside first and returned (the caller
    deletes it), as ``os.replace`` cannot replace a non-empty folder."""
    if not (tmp.is_dir() and path.is_dir()):
        os.replace(tmp, path)
        return None
    old = temporary_name(path)
    os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.replace(old, path)
        raise
    return old


def _fsync_tree(path: Path) -> None:
    """A file's data, or a folder's files (by name) and then the folder's entries."""
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            if child.is_file():
                _fsync_file(child)
        fsync_dir(path)
    elif path.exists():
        _fsync_file(path)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of the folder ``path`` (names created, renamed or removed in it) durable.

    Raises:
        OSError: the device failed (ENOSPC, EDQUOT, EIO); a filesystem that cannot fsync a folder is not an error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform without directory handles
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on a directory (EINVAL); that is not a failed write
        if exc.errno in DISK_ERRNOS:
            raise
    finally:
        os.close(fd)


def _size(path: Path) -> int:
    """Bytes written to ``path`` (a file or a folder's files); a sparse file's holes (HDF5 leaves some) not counted."""
    def written(stat: os.stat_result) -> int:
        return min(stat.st_size, stat.st_blocks * 512) if hasattr(stat, "st_blocks") else stat.st_size

    try:
        if path.is_dir():
            return sum(written(p.stat()) for p in path.rglob("*") if p.is_file())
        return written(path.stat())
    except OSError:
        return 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through ``atomic_output`` (mode 0666 less the umask, as ``open`` gives).

    Raises:
        DiskFullError: the filesystem is full or failing.
    """
    data = text.encode()
    with atomic_output(path, needed_bytes=len(data)) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON through ``atomic_write_text``."""
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


# ---- HDF5 --------------------------------------------------------------------------------------
#
# Why HDF5 needs more than a temporary name: HDF5 defers writes (each dataset's chunk cache, the
# contiguous datasets' sieve buffer, the metadata cache) to the moment an object is closed. When
# such a deferred write fails (a full disk), HDF5 1.14 frees the object's memory but keeps its id
# (h5py/h5py#1642, #914); h5py reports "Exception ignored in ObjectID.__dealloc__" for each and the
# next close of the file touches the freed memory: a segmentation fault. So a file bigmem writes
# has no raw-data caches (every data write reaches the disk, and fails, in the call that makes it),
# is flushed before it is closed, and after a failed write its descriptor is pointed at memory so
# that closing it cannot fail again (h5py's own tests "un-break writing so we can close").


def open_hdf5_for_writing(path: str | os.PathLike, mode: str = "w") -> "h5py.File":
    """An ``h5py.File`` whose write failures are raised by the call that writes, never by a close.

    The chunk cache and the sieve buffer are off: a dataset write goes to the disk in the call
    (whole chunks are written whole either way, so large writes lose nothing).

    Args:
        path: the file.
        mode: ``"w"`` (create or truncate, default) or ``"r+"`` (an existing file).

    Returns:
        The open file; close it with ``close_hdf5``.
    """
    import h5py
    from h5py import h5f, h5p

    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_EARLIEST, h5f.LIBVER_LATEST)  # h5py's default: the most readable format
    mdc_nelmts, rdcc_nslots, _, rdcc_w0 = fapl.get_cache()
    fapl.set_cache(mdc_nelmts, rdcc_nslots, 0, rdcc_w0)  # no chunk cache
    fapl.set_sieve_buf_size(0)  # no sieve buffer
    name = os.fsencode(path)
    if mode == "w":
        fid = h5f.create(name, h5f.ACC_TRUNC, fapl=fapl)
    elif mode == "r+":
        fid = h5f.open(name, h5f.ACC_RDWR, fapl=fapl)
    else:
        raise ValueError(f"mode {mode!r}: expected 'w' or 'r+'")
    return h5py.File(fid)


def close_hdf5(handle: "h5py.File", *, discard: bool = False) -> None:
    """Close ``handle`` (every object of it, then the file); with ``discard``, after a failed write.

    With ``discard`` the file is about to be deleted: its descriptor is first pointed at an empty
    in-memory file of the same size, so that the writes HDF5 makes while closing succeed and go
    nowhere, and a close that fails even so is not retried (a second close of a half-closed HDF5
    file is what crashes). Without it a failure to close is raised.
    """
    if not handle.id.valid:
        return
    if not discard:
        handle.close()
        return
    try:
        fd = handle.id.get_vfd_handle()
        scratch = os.memfd_create("bigmem-discard")
        try:
            os.ftruncate(scratch, os.fstat(fd).st_size)
            os.dup2(scratch, fd)
        finally:
            os.close(scratch)
    except (AttributeError, OSError):  # no memfd (not Linux): the close may fail again, and is not retried
        pass
    try:
        handle.close()
    except (OSError, RuntimeError):
        pass  # HDF5 could not close it; the descriptor points at memory and the file is deleted


@contextmanager
def atomic_hdf5(path: str | os.PathLike, *, needed_bytes: int | Callable[[], int] = 0,
                copy_of: str | os.PathLike | None = None, fsync: bool = True) -> Iterator["h5py.File"]:
    """Write the HDF5 file ``path`` whole or not at all (``atomic_output`` with HDF5's safeguards).

    Args:
        path: the file.
        needed_bytes: its expected size (for the message if the disk fills), as ``atomic_output``.
        copy_of: start from a copy of this file (e.g. ``path`` itself, to add to it) instead of
            an empty one (default None).
        fsync: flush the data to the device before the rename (default True).

    Yields:
        The open ``h5py.File`` (``open_hdf5_for_writing``); it is flushed and closed on leaving the
        block, then renamed onto ``path``.

    Raises:
        DiskFullError: a write failed with ENOSPC, EDQUOT or EIO; nothing is left behind.

    Example:
        >>> with atomic_hdf5("weights.h5", needed_bytes=total) as handle:
        ...     handle.create_dataset("kernel", data=kernel)
    """
    with atomic_output(path, needed_bytes=needed_bytes, fsync=fsync) as tmp:
        if copy_of is not None:
            shutil.copyfile(copy_of, tmp)
        handle = open_hdf5_for_writing(tmp, "w" if copy_of is None else "r+")
        try:
            yield handle
            handle.flush()  # the last deferred metadata writes fail here, where they can be undone
        except BaseException:
            close_hdf5(handle, discard=True)
            raise
        close_hdf5(handle)
