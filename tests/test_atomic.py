"""bigmem.atomic, the one writer of files: whole or not at all, one line when the disk is full, nothing left behind.

The failures here are simulated; tests/test_disk_full.py fills real (tmpfs) filesystems.
"""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest

from bigmem import atomic
from bigmem.atomic import (atomic_hdf5, atomic_output, atomic_write_json, atomic_write_text, close_hdf5, disk_errno,
                           leftover_temporaries, open_hdf5_for_writing, remove_atomically, remove_leftover_temporaries,
                           require_free_space, temporary_name, temporary_of)
from bigmem.errors import DiskFullError


def _hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def one_mib_free(monkeypatch):
    """The filesystem reports 1 MiB free (the errors below are simulated; tests/test_disk_full.py fills real ones)."""
    monkeypatch.setattr(atomic, "free_bytes", lambda path: 2**20)


def test_atomic_output_renames_the_temporary_into_place(tmp_path):
    target = tmp_path / "sub" / "labels.nii.gz"
    with atomic_output(target, needed_bytes=5) as tmp:
        assert tmp.parent == target.parent
        assert tmp.name.startswith(".labels.tmp-")
        assert tmp.name.endswith(".nii.gz")
        assert not tmp.exists()
        assert not target.exists()  # nothing is created for the writer
        tmp.write_bytes(b"hello")
    assert target.read_bytes() == b"hello"
    assert _hidden(target.parent) == []


def test_atomic_output_removes_its_temporary_on_an_exception(tmp_path):
    target = tmp_path / "out.json"
    with pytest.raises(ValueError, match="boom"):
        with atomic_output(target) as tmp:
            tmp.write_text("half")
            raise ValueError("boom")  # not a disk error: passes through unchanged
    assert list(tmp_path.iterdir()) == []


def test_temporary_names_read_back_to_their_output_and_writer():
    for name in ("labels.nii.gz", "ckpt-00000004", "config.json", ".hidden"):
        assert temporary_of(temporary_name(f"out/{name}").name) == (name, os.getpid())
    assert temporary_of(".model.tmp-99999.keras") == ("model.keras", 99999)  # before the counter was added
    for other in ("ckpt-00000004", ".damaged-ckpt-00000003.1", ".tmp-ckpt-00000010-99999", "x.tmp-1-2"):
        assert temporary_of(other) is None


def test_leftover_temporaries_are_another_process_s(tmp_path):
    mine = temporary_name(tmp_path / "ckpt-00000002")
    mine.mkdir()
    for name in (".ckpt-00000001.tmp-99999-0", ".plan.tmp-99999-3.json", "ckpt-00000001", ".damaged-ckpt-00000001"):
        (tmp_path / name).mkdir()
    assert [p.name for p in leftover_temporaries(tmp_path)] == [".ckpt-00000001.tmp-99999-0",
                                                               ".plan.tmp-99999-3.json"]
    assert leftover_temporaries(tmp_path / "missing") == []


def test_remove_leftover_temporaries_removes_a_killed_writer_s_and_nothing_else(tmp_path):
    """Both schemes: atomic's .<stem>.tmp-<pid>-<n><suffix>, and an older bigmem's mkstemp .<name>.<random>.tmp."""
    mine = temporary_name(tmp_path / "summary.json")
    mine.write_text("{")
    (tmp_path / ".ckpt-00000003.tmp-99999-0").mkdir()
    (tmp_path / ".ckpt-00000003.tmp-99999-0" / "state.json").write_text("{}")
    for name in (".model.tmp-99999.keras", ".config.json.x1y2z3.tmp", "config.json", ".damaged-ckpt-00000001",
                 "notes.tmp"):
        (tmp_path / name).write_text("{")
    removed = remove_leftover_temporaries(tmp_path)
    assert [p.name for p in removed] == [".ckpt-00000003.tmp-99999-0", ".config.json.x1y2z3.tmp",
                                         ".model.tmp-99999.keras"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, "config.json", ".damaged-ckpt-00000001",
                                                                "notes.tmp"])
    assert remove_leftover_temporaries(tmp_path / "missing") == []


def test_remove_atomically_renames_then_deletes(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt-00000001"
    folder.mkdir()
    (folder / "state.json").write_text("{}")
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: renames.append((src, dst)) or real_replace(src, dst))
    remove_atomically(folder)
    assert len(renames) == 1
    assert renames[0][0] == folder
    assert temporary_of(renames[0][1].name) == (folder.name,
                                                                                                   os.getpid())
    assert list(tmp_path.iterdir()) == []


def test_a_replaced_folder_is_deleted_only_after_the_rename_is_synced(tmp_path, monkeypatch):
    target = tmp_path / "best"
    target.mkdir()
    (target / "state.json").write_text("old")
    seen = []
    real_fsync_dir = atomic.fsync_dir
    monkeypatch.setattr(atomic, "fsync_dir", lambda path: seen.append(sorted(p.name for p in tmp_path.iterdir()))
                        or real_fsync_dir(path))
    with atomic_output(target, directory=True) as tmp:
        (tmp / "state.json").write_text("new")
    assert len(seen[-1]) == 2
    assert seen[-1][1] == "best"  # the old one, moved aside, still there at the sync
    assert temporary_of(seen[-1][0]) == ("best", os.getpid())
    assert [p.name for p in tmp_path.iterdir()] == ["best"]
    assert (target / "state.json").read_text() == "new"


def test_a_good_file_is_untouched_when_its_replacement_fails(tmp_path, one_mib_free):
    target = tmp_path / "plan.json"
    target.write_text('{"fits": true}')
    with pytest.raises(DiskFullError):
        with atomic_output(target, needed_bytes=3 * 2**20) as tmp:
            tmp.write_text('{"fits": fal')
            raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_text() == '{"fits": true}'
    assert _hidden(tmp_path) == []


def test_a_good_file_is_untouched_when_the_rename_fails(tmp_path, monkeypatch, one_mib_free):
    target = tmp_path / "plan.json"
    target.write_text("good")

    def failing_replace(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    message = (r"^Input/output error writing '.*plan\.json' \(needed about 3 B, 1\.00 MiB free\)\. "
               r"Check the device \(dmesg\) or choose another output\.path\.$")
    with pytest.raises(DiskFullError, match=message):
        with atomic_output(target, needed_bytes=3) as tmp:
            tmp.write_text("new")
    assert target.read_text() == "good"
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "No space left on device"),
                                         (errno.EDQUOT, "Disk quota exceeded")])
def test_a_full_disk_becomes_one_line_with_path_needed_and_free(tmp_path, code, words, one_mib_free):
    target = tmp_path / "out.h5"
    with pytest.raises(DiskFullError) as caught:
        with atomic_output(target, needed_bytes=40 * 2**20) as tmp:
            tmp.write_bytes(b"x" * 100)
            raise OSError(code, os.strerror(code))
    error = caught.value
    assert str(error) == (f"{words} writing '{target}' (needed about 40.00 MiB, 1.00 MiB free). "
                          "Free space or choose another output.path.")
    assert (error.path, error.needed_bytes, error.free_bytes, error.exit_code) == (str(target), 40 * 2**20, 2**20, 1)
    assert list(tmp_path.iterdir()) == []


def test_free_space_is_measured_after_the_temporary_is_removed(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(atomic, "free_bytes", lambda path: seen.append(sorted(tmp_path.iterdir())) or 2**20)
    with pytest.raises(DiskFullError):
        with atomic_output(tmp_path / "out.h5", needed_bytes=40 * 2**20) as tmp:
            tmp.write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert seen == [[]]


def test_an_estimate_short_of_the_free_space_says_more_than_free(tmp_path, one_mib_free):
    with pytest.raises(DiskFullError, match=r"\(needed more than 1\.00 MiB, 1\.00 MiB free\)") as caught:
        with atomic_output(tmp_path / "out.h5", needed_bytes=1000):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.needed_bytes == 2**20


def test_unknown_needed_bytes_report_what_was_written(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "free_bytes", lambda path: 1024)
    with pytest.raises(DiskFullError, match=r"\(needed more than 2\.00 KiB, 1\.00 KiB free\)"):
        with atomic_output(tmp_path / "x.bin") as tmp:
            tmp.write_bytes(b"x" * 2048)
            raise OSError(errno.ENOSPC, "No space left on device")


def test_a_function_gives_needed_bytes_when_the_write_fails(tmp_path, one_mib_free):
    sizes = [1]
    with pytest.raises(DiskFullError, match=r"needed about 5\.00 MiB, ") as caught:
        with atomic_output(tmp_path / "x.bin", needed_bytes=lambda: sizes[-1]) as tmp:
            tmp.write_bytes(b"x")
            sizes.append(5 * 2**20)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.needed_bytes == 5 * 2**20


def test_h5py_errors_carry_their_errno_in_their_text():
    flush = RuntimeError("Unable to flush file (file write failed: time = Mon Nov 30 23:22:16 2026\n, filename = "
                         "'/x/.t.h5', file descriptor = 3, errno = 28, error message = 'No space left on device')")
    assert disk_errno(flush) == errno.ENOSPC
    assert disk_errno(OSError(errno.EIO, "x")) == errno.EIO
    assert disk_errno(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_errno(RuntimeError("errno = 2")) is None  # ENOENT is not a disk failure
    assert disk_errno(ValueError("errno = 28")) is None


def test_require_free_space_refuses_before_any_work(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    require_free_space(tmp_path / "small.h5", 1)
    with pytest.raises(DiskFullError, match=r"^No space left on device writing '.*huge\.h5' \(needed about "):
        require_free_space(tmp_path / "new" / "huge.h5", free + 2**40)
    assert list(tmp_path.iterdir()) == []


def test_atomic_output_of_a_directory_replaces_the_old_one_whole(tmp_path, one_mib_free):
    target = tmp_path / "ckpt-00000010"
    target.mkdir()
    (target / "state.json").write_text("old")
    with pytest.raises(DiskFullError):
        with atomic_output(target, directory=True) as tmp:
            (tmp / "state.json").write_text("ne")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert (target / "state.json").read_text() == "old"
    assert _hidden(tmp_path) == []
    with atomic_output(target, directory=True) as tmp:
        assert tmp.is_dir()
        (tmp / "state.json").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000010"]
    assert (target / "state.json").read_text() == "new"


def test_atomic_write_json_keeps_the_usual_file_mode(tmp_path):
    path = atomic_write_json(tmp_path / "config.json", {"a": 1})
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- HDF5 ----------------------------------------------------------------------------------------

def test_atomic_hdf5_writes_a_readable_file(tmp_path):
    import h5py

    with atomic_hdf5(tmp_path / "weights.h5", needed_bytes=800) as handle:
        handle.create_dataset("model/00000", data=np.arange(100.0)).attrs["path"] = "dense/kernel"
    with h5py.File(tmp_path / "weights.h5", "r") as handle:
        assert handle["model/00000"].attrs["path"] == "dense/kernel"
        np.testing.assert_array_equal(handle["model/00000"][...], np.arange(100.0))
    assert _hidden(tmp_path) == []


def test_atomic_hdf5_adds_to_a_copy(tmp_path):
    import h5py

    with atomic_hdf5(tmp_path / "s.h5") as handle:
        handle["a"] = [1, 2]
    with pytest.raises(KeyError):
        with atomic_hdf5(tmp_path / "s.h5", copy_of=tmp_path / "s.h5") as handle:
            handle["b"] = [3]
            raise KeyError("stop")
    with h5py.File(tmp_path / "s.h5", "r") as handle:
        assert list(handle) == ["a"]  # the failed addition never reached the original
    with atomic_hdf5(tmp_path / "s.h5", copy_of=tmp_path / "s.h5") as handle:
        handle["b"] = [3]
    with h5py.File(tmp_path / "s.h5", "r") as handle:
        assert list(handle) == ["a", "b"]
    assert _hidden(tmp_path) == []


def test_close_hdf5_discard_closes_every_object(tmp_path):
    handle = open_hdf5_for_writing(tmp_path / "x.h5")
    dataset = handle.create_dataset("d", data=np.zeros(10))
    close_hdf5(handle, discard=True)
    assert not handle.id.valid
    assert not dataset.id.valid
    close_hdf5(handle, discard=True)  # closing twice is a no-op, never a second HDF5 close


def test_a_full_disk_inside_a_folder_output_names_the_folder(tmp_path, one_mib_free):
    target = tmp_path / "checkpoints" / "ckpt-00000010"
    with pytest.raises(DiskFullError) as caught:
        with atomic_output(target, directory=True, needed_bytes=3 * 2**20) as tmp:
            with atomic_hdf5(tmp / "variables.h5", fsync=False) as handle:
                handle["a"] = np.zeros(10)
            atomic_write_text(tmp / "state.json", "{}")
            with atomic_output(tmp / "more.bin"):
                raise OSError(errno.EDQUOT, "Disk quota exceeded")
    assert str(caught.value) == (f"Disk quota exceeded writing '{target}' (needed about 3.00 MiB, 1.00 MiB free). "
                                 "Free space or choose another output.path.")
    assert not (tmp_path / "checkpoints").exists()  # made for the output, removed with it


def test_a_failed_output_removes_the_folders_it_made(tmp_path):
    """-o into folders that do not exist yet: they appear with the output, and go again if it fails."""
    target = tmp_path / "new" / "deeper" / "out.json"
    with pytest.raises(RuntimeError):
        with atomic_output(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("the writer failed")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):  # a folder that was there before stays
        with atomic_output(tmp_path / "kept" / "sub" / "x.txt"):
            raise RuntimeError("again")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert list((tmp_path / "kept").iterdir()) == []
    with atomic_output(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole"
