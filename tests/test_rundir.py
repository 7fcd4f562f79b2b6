"""RunDir: the names of a run directory's files, atomic writes (``atomic_output``, ``atomic_hdf5``), and readers."""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest

from bigmem import atomic
from bigmem.atomic import (atomic_hdf5, atomic_output, atomic_write_json, atomic_write_text, close_hdf5, disk_errno,
                           open_hdf5_for_writing, require_free_space)
from bigmem.errors import DiskFullError
from bigmem.rundir import RunDir

SUMMARY = {"steps": 12, "train_s": 3.5, "peak_rss_bytes": 2**30, "loss": 0.25, "dice": 0.75, "input_wait_s": 0.5,
           "step_time_s": 3.0, "input_stall_share": 0.5 / 3.0}


def test_file_names_are_the_run_directory_contract(tmp_path):
    run = RunDir(tmp_path / "run")
    names = {key: getattr(run, key).relative_to(run.path).as_posix() for key in (
        "config", "sysinfo", "plan", "numa", "metrics", "monitor", "monitor_info", "summary", "checkpoints", "model",
        "report")}
    assert names == {"config": "config.json", "sysinfo": "sysinfo.json", "plan": "plan.json", "numa": "numa.json",
                     "metrics": "metrics.jsonl", "monitor": "monitor.csv", "monitor_info": "monitor.json",
                     "summary": "summary.json", "checkpoints": "checkpoints", "model": "model.keras",
                     "report": "report"}


def test_a_new_run_reads_as_empty(tmp_path):
    run = RunDir(tmp_path / "run")
    assert not run.holds_run()
    assert [run.read_config(), run.read_plan(), run.read_numa(), run.read_summary(), run.read_monitor_info()] == [
        None] * 5
    assert run.read_metrics() == []


@pytest.mark.parametrize("name", ["config", "sysinfo", "plan", "numa"])
def test_json_files_round_trip(tmp_path, name):
    run = RunDir(tmp_path / "run")
    data = {"name": name, "nested": {"bytes": 2**40, "list": [1, 2]}}
    written = getattr(run, f"write_{name}")(data)
    assert written == getattr(run, name)
    assert json.loads(written.read_text()) == data
    if name != "sysinfo":
        assert getattr(run, f"read_{name}")() == data
    assert sorted(p.name for p in run.path.iterdir()) == [written.name]  # no temporary file left


def test_summary_schema(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_summary(**SUMMARY)
    assert list(json.loads(run.summary.read_text())) == list(SUMMARY)  # the keys, in their order
    assert run.read_summary() == SUMMARY


def test_a_write_replaces_the_file_whole(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_plan({"fits": True})
    with open(run.plan) as reader:  # a reader that opened the old file keeps reading the old file
        run.write_plan({"fits": False, "budget_bytes": 2**30})
        assert json.loads(reader.read()) == {"fits": True}
    assert run.read_plan() == {"fits": False, "budget_bytes": 2**30}


def test_metrics_of_a_killed_run(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.append_metrics([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}, {"step": 3, "loss": 0.8}])
    with open(run.metrics, "a") as handle:
        handle.write('{"step": 4, "lo')  # torn by a kill
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    run.truncate_metrics(2)  # a resume from the checkpoint at step 2
    assert [r["step"] for r in run.read_metrics()] == [1, 2]


def test_a_torn_json_file_is_an_error_not_an_absence(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.summary.write_text('{"steps": 1')
    with pytest.raises(json.JSONDecodeError):
        run.read_summary()


# ---- atomic_output: the one way a file is written ------------------------------------------------

def _hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture
def one_mib_free(monkeypatch):
    """The filesystem reports 1 MiB free (the errors below are simulated; tests/test_disk_full.py fills real ones)."""
    monkeypatch.setattr(atomic, "free_bytes", lambda path: 2**20)


def test_atomic_output_renames_the_temporary_into_place(tmp_path):
    target = tmp_path / "sub" / "labels.nii.gz"
    with atomic_output(target, needed_bytes=5) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".labels.tmp-") and tmp.name.endswith(".nii.gz")
        assert not tmp.exists() and not target.exists()  # nothing is created for the writer
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
               r"Check the device \(dmesg\) or choose another --out\.$")
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
                          "Free space or choose another --out.")
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
    assert (target / "state.json").read_text() == "old" and _hidden(tmp_path) == []
    with atomic_output(target, directory=True) as tmp:
        assert tmp.is_dir()
        (tmp / "state.json").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000010"]
    assert (target / "state.json").read_text() == "new"


def test_a_failed_metrics_append_leaves_no_torn_line(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.append_metrics([{"step": 1, "loss": 1.0}])
    before = run.metrics.read_bytes()
    real_open = open

    class FullFile:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[:7])  # part of a line reaches the disk, then the disk is full
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "free_bytes", lambda path: 16)
    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: FullFile(real_open(path, mode, *a, **k)))
    message = r"^No space left on device writing '.*metrics\.jsonl' \(needed about 25 B, 16 B free\)\. "
    with pytest.raises(DiskFullError, match=message):
        run.append_metrics([{"step": 2, "loss": 0.5}])
    monkeypatch.undo()
    assert run.metrics.read_bytes() == before


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
    assert not handle.id.valid and not dataset.id.valid
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
                                 "Free space or choose another --out.")
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
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []
    with atomic_output(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole"
