"""A full disk on a real (tiny tmpfs) filesystem: exit 1, one line with the path, bytes needed and free, nothing left.

Before ``atomic.atomic_hdf5``, ``bigmem convert`` into a nearly full filesystem died with a
segmentation fault in HDF5 (a write HDF5 had deferred to a close failed, and the next close
touched freed memory), leaving ``.out.h5.tmp-PID`` behind. The HDF5 cases run in a child process,
so a crash is seen as a negative return code instead of taking the test run down.

Mounting needs root (CAP_SYS_ADMIN); elsewhere these tests skip, saying so.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from bigmem.data.convert import estimate_store_bytes
from bigmem.data.layouts import read_msd
from bigmem.errors import DiskFullError
from bigmem.rundir import RunDir
from bigmem.units import format_bytes

PAGE = 4096  # tmpfs counts whole pages
MESSAGE = ("bigmem convert: error: No space left on device writing '{path}' (needed {needed}, {free} free). "
           "Free space or choose another --out.")


@pytest.fixture
def small_fs(tmp_path):
    """A function (size_bytes, name) -> an empty folder on a new tmpfs of that size, unmounted after the test."""
    mounts = []

    def make(size_bytes: int, name: str = "fs") -> Path:
        root = tmp_path / name
        root.mkdir()
        if not sys.platform.startswith("linux"):
            pytest.skip("tmpfs is Linux's")
        try:
            result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(root)],
                                    capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            pytest.skip("no mount(8) here to make a small tmpfs")
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounts.append(root)
        return root

    yield make
    for root in mounts:
        subprocess.run(["umount", str(root)], capture_output=True, timeout=30)


def _fill(root: Path, leave_bytes: int) -> None:
    """Fill ``root`` with a ballast file until ``leave_bytes`` (rounded to pages) are free."""
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    (root / "ballast").write_bytes(b"\0" * (free - leave_bytes // PAGE * PAGE))


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != "ballast")


def _msd(root: Path, shapes: dict[str, tuple[int, int, int]]) -> Path:
    """An MSD folder of random float32 cases (incompressible enough that lzf cannot make them fit)."""
    rng = np.random.default_rng(0)
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for case_id, shape in shapes.items():
        affine = np.diag([1.0, 1.0, 1.5, 1.0])
        nib.save(nib.Nifti1Image(rng.normal(100, 20, shape).astype(np.float32), affine),
                 str(root / "imagesTr" / f"{case_id}.nii.gz"))
        nib.save(nib.Nifti1Image(rng.integers(0, 3, shape).astype(np.uint8), affine),
                 str(root / "labelsTr" / f"{case_id}.nii.gz"))
        training.append({"image": f"./imagesTr/{case_id}.nii.gz", "label": f"./labelsTr/{case_id}.nii.gz"})
    (root / "dataset.json").write_text(json.dumps({"modality": {"0": "CT"},
                                                   "labels": {"0": "background", "1": "a", "2": "b"},
                                                   "numTraining": len(training), "training": training}))
    return root


@pytest.fixture
def msd(tmp_path) -> Path:
    return _msd(tmp_path / "Task01", {"c_033": (33, 35, 37), "c_034": (34, 36, 33), "c_035": (35, 33, 34)})


def _bigmem(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bigmem.cli.main", *map(str, argv)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, f"exit {result.returncode} (a negative code is a signal):\n{result.stderr}"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "h5py" not in result.stderr, result.stderr
    return lines[0]


# ---- bigmem convert --------------------------------------------------------------------------------

def test_convert_refuses_a_store_that_cannot_fit_before_reading_a_case(msd, small_fs):
    fs = small_fs(64 * 1024)
    needed = estimate_store_bytes(read_msd(msd).cases)
    line = _one_line(_bigmem("convert", msd, "-o", fs / "out.h5"))
    assert line == MESSAGE.format(path=fs / "out.h5", needed=f"about {format_bytes(needed)}", free="64.00 KiB")
    assert _listing(fs) == []


@pytest.mark.parametrize("out", ["out.h5", "a/b/c/out.h5"], ids=["beside", "in-missing-folders"])
def test_convert_that_fills_the_disk_exits_1_with_one_line_and_leaves_nothing(msd, small_fs, out):
    fs = small_fs(256 * 1024)  # lzf cannot squeeze ~600 KiB of random floats into it; compressed: no pre-check
    line = _one_line(_bigmem("convert", msd, "-o", fs / out, "--compression", "lzf"))
    assert line == MESSAGE.format(path=fs / out, needed="more than 256.00 KiB", free="256.00 KiB")
    assert _listing(fs) == []  # nor the folders a/b/c made for it


@pytest.mark.parametrize("flags", [["--chunks", "none"], ["--chunks", "16"], ["--block-size", "8KiB"]],
                         ids=["contiguous", "chunked", "throttled"])
def test_convert_whose_estimate_fits_but_store_does_not(msd, small_fs, flags):
    """The pre-check passes (a low estimate) and the disk fills mid-write: the uncompressed write paths."""
    fs = small_fs(1024 * 1024)
    needed = estimate_store_bytes(read_msd(msd).cases)
    _fill(fs, needed // 2)  # the real store needs ~2x; the child is told the store needs half of that
    script = textwrap.dedent(f"""
        import sys
        import bigmem.data.convert as convert
        convert.estimate_store_bytes = lambda *a, **k: {needed // 4}
        from bigmem.cli.main import main
        sys.exit(main(sys.argv[1:]))
    """)
    result = subprocess.run([sys.executable, "-c", script, "convert", str(msd), "-o", str(fs / "out.h5"), *flags],
                            capture_output=True, text=True, timeout=300)
    free = format_bytes(needed // 2 // PAGE * PAGE)
    assert _one_line(result) == MESSAGE.format(path=fs / "out.h5", needed=f"more than {free}", free=free)
    assert _listing(fs) == []


def test_a_good_store_survives_a_force_that_fills_the_disk(msd, small_fs, tmp_path):
    fs = small_fs(384 * 1024)
    small = _msd(tmp_path / "Small", {"s_001": (8, 8, 8)})
    assert _bigmem("convert", small, "-o", fs / "out.h5").returncode == 0
    before = {name: (fs / name).read_bytes() for name in _listing(fs)}
    assert sorted(before) == ["out.h5", "out.manifest.json"]
    line = _one_line(_bigmem("convert", msd, "-o", fs / "out.h5", "--force", "--compression", "lzf"))
    assert line.startswith(f"bigmem convert: error: No space left on device writing '{fs / 'out.h5'}' (needed ")
    assert {name: (fs / name).read_bytes() for name in _listing(fs)} == before  # untouched, nothing added


def test_a_good_store_survives_an_append_that_fills_the_disk(msd, small_fs, tmp_path):
    fs = small_fs(512 * 1024)
    small = _msd(tmp_path / "Small", {"s_001": (8, 8, 8)})
    assert _bigmem("convert", small, "-o", fs / "out.h5").returncode == 0
    before = {name: (fs / name).read_bytes() for name in _listing(fs)}
    line = _one_line(_bigmem("convert", msd, "-o", fs / "out.h5", "--append"))
    size = len(before["out.h5"]) + estimate_store_bytes(read_msd(msd).cases)
    free = 512 * 1024 - sum(-(-len(data) // PAGE) * PAGE for data in before.values())
    assert line == MESSAGE.format(path=fs / "out.h5", needed=f"about {format_bytes(size)}", free=format_bytes(free))
    assert {name: (fs / name).read_bytes() for name in _listing(fs)} == before


# ---- the HDF5 writers at every fill level (the segfault's regression test) -------------------------

WRITER = textwrap.dedent("""
    import os, sys
    import numpy as np
    from bigmem.data.store import StoreWriter, WriteThrottle
    from bigmem.errors import DiskFullError
    from bigmem.atomic import atomic_hdf5

    root, kind = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    outcomes = []
    for leave_pages in range(0, 160, 7):  # a full disk at every stage: creating, data, metadata, commit
        for name in os.listdir(root):
            os.unlink(os.path.join(root, name))
        stat = os.statvfs(root)
        with open(os.path.join(root, "ballast"), "wb") as ballast:
            ballast.write(bytes(max(0, stat.f_bavail - leave_pages) * stat.f_frsize))
        try:
            if kind == "checkpoint":  # many small contiguous datasets, as CheckpointManager writes
                with atomic_hdf5(os.path.join(root, "variables.h5")) as handle:
                    for i in range(300):
                        dataset = handle.create_dataset(f"model/{i:05d}", data=rng.random(100 + 37 * i))
                        dataset.attrs["path"] = f"layer_{i}/kernel"
            else:
                options = {"contiguous": dict(chunk_edge=None), "chunked": dict(chunk_edge=16),
                           "throttled": dict(chunk_edge=16, throttle=WriteThrottle(block_bytes=20000))}[kind]
                with StoreWriter(os.path.join(root, "out.h5"), num_classes=2, channel_names=["x"], **options) as w:
                    for i in range(8):
                        w.add_case(f"case_{i}", rng.random((24, 24, 24, 1), dtype=np.float32),
                                   np.zeros((24, 24, 24), np.uint8), attrs={"note": "x" * 500})
                    w.commit()
            outcomes.append("ok")
        except DiskFullError as exc:
            assert "\\n" not in str(exc) and str(exc).startswith("No space left on device writing ")
            outcomes.append("full")
        left = sorted(set(os.listdir(root)) - {"ballast", "out.h5", "variables.h5"})
        assert left == [], left
    print(" ".join(outcomes))
""")


@pytest.mark.parametrize("kind", ["contiguous", "chunked", "throttled", "checkpoint"])
def test_hdf5_writes_never_crash_whatever_the_disk_holds(small_fs, kind):
    fs = small_fs(1024 * 1024)
    result = subprocess.run([sys.executable, "-c", WRITER, str(fs), kind], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert result.returncode == 0, f"exit {result.returncode} (-11: a segmentation fault):\n{result.stderr[-3000:]}"
    assert result.stderr == ""  # not one "Exception ignored in ObjectID.__dealloc__"
    outcomes = result.stdout.split()
    assert "full" in outcomes
    assert outcomes[0] == "full"  # the disk did fill, from the first write on


# ---- a run directory's JSON and predict's outputs ---------------------------------------------------

def test_a_run_directory_json_write_on_a_full_disk(small_fs):
    fs = small_fs(64 * 1024)
    run = RunDir(fs / "run")
    run.write_config({"model": "tiny"})
    _fill(fs, 0)
    summary = {"steps": 1, "train_s": 1.0, "peak_rss_bytes": 1, "loss": 0.5, "dice": 0.5, "input_wait_s": 0.0,
               "step_time_s": 1.0, "input_stall_share": 0.0, "validation": {"notes": "x" * 10000}}
    with pytest.raises(DiskFullError) as caught:
        run.write_summary(**summary)
    needed = len(json.dumps({k: v for k, v in summary.items() if k != "validation"} | summary["validation"],
                            indent=2)) + 1
    assert str(caught.value) == (f"No space left on device writing '{run.summary}' (needed about "
                                 f"{format_bytes(needed)}, 0 B free). Free space or choose another output.path.")
    assert (caught.value.path, caught.value.needed_bytes, caught.value.free_bytes) == (str(run.summary), needed, 0)
    with pytest.raises(DiskFullError):
        run.write_config({"model": "tiny", "more": "y" * 10000})
    assert sorted(p.name for p in run.path.iterdir()) == ["config.json"]  # no summary, no temporary
    assert run.read_config() == {"model": "tiny"}  # the good file untouched


def test_predict_outputs_on_a_full_disk(small_fs):
    from bigmem.infer.predict import write_nifti, write_probabilities

    fs = small_fs(256 * 1024)
    labels = np.random.default_rng(0).integers(0, 3, (40, 40, 40)).astype(np.uint8)
    write_nifti(labels[:8], np.eye(4), fs / "good.nii.gz")
    before = (fs / "good.nii.gz").read_bytes()
    _fill(fs, 8 * 1024)
    with pytest.raises(DiskFullError, match=r"^No space left on device writing '.*/good\.nii\.gz' \(needed about "
                                            r"62\.84 KiB, 8\.00 KiB free\)\. Free space or choose another "
                                            r"output\.path\.$"):
        write_nifti(labels, np.eye(4), fs / "good.nii.gz")
    assert (fs / "good.nii.gz").read_bytes() == before
    probabilities = np.random.default_rng(1).random((40, 40, 40, 3)).astype(np.float16)
    with pytest.raises(DiskFullError, match=r"^No space left on device writing '.*/case\.npz' \(needed about "
                                            r"375\.12 KiB, 8\.00 KiB free\)"):
        write_probabilities(probabilities, np.eye(4), fs / "case.npz")
    assert _listing(fs) == ["good.nii.gz"]


def test_an_io_error_names_the_device_not_the_space(tmp_path, monkeypatch):
    from bigmem.infer.predict import write_nifti

    def failing_save(image, path):
        Path(path).write_bytes(b"half")
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(nib, "save", failing_save)
    with pytest.raises(DiskFullError, match=r"^Input/output error writing '.*/x\.nii\.gz' \(needed about 352 B, "
                                            r".* free\)\. Check the device \(dmesg\) or choose another "
                                            r"output\.path\.$"):
        write_nifti(np.zeros((0, 0, 0), np.uint8), np.eye(4), tmp_path / "x.nii.gz")
    assert list(tmp_path.iterdir()) == []


CHECKPOINTS = textwrap.dedent("""
    import os, shutil, sys
    import numpy as np
    from bigmem.checkpoints import CheckpointManager
    from bigmem.errors import DiskFullError

    class Variable:  # what CheckpointManager reads of a Keras variable
        def __init__(self, i, size):
            self.value = np.random.default_rng(i).random(size).astype(np.float32)
            self.shape, self.dtype, self.path = self.value.shape, self.value.dtype, f"layer_{i}/kernel"

        def numpy(self):
            return self.value

    class Model:
        weights = [Variable(i, 100 + 37 * i) for i in range(60)]  # 280 KiB

    class Optimizer:
        variables = [Variable(1000 + i, 50) for i in range(20)]

    root = sys.argv[1]
    outcomes = []
    for leave_pages in range(0, 120, 5):  # a full disk before the write, during the data, at the end
        shutil.rmtree(os.path.join(root, "checkpoints"), ignore_errors=True)
        for name in os.listdir(root):
            os.unlink(os.path.join(root, name))
        manager = CheckpointManager(os.path.join(root, "checkpoints"))
        manager.save(1, Model, Optimizer, {"loss": 1.0})
        stat = os.statvfs(root)
        with open(os.path.join(root, "ballast"), "wb") as ballast:
            ballast.write(bytes(max(0, stat.f_bavail - leave_pages) * stat.f_frsize))
        try:
            manager.save(2, Model, Optimizer, {"loss": 0.5})
            outcomes.append("ok")
        except DiskFullError as exc:
            final = os.path.join(root, "checkpoints", "ckpt-00000002")
            assert str(exc).startswith(f"No space left on device writing {final!r} (needed ") and "\\n" not in str(exc)
            outcomes.append("full")
        left = sorted(os.listdir(os.path.join(root, "checkpoints")))
        assert left in (["ckpt-00000001"], ["ckpt-00000001", "ckpt-00000002"]), left
        assert manager.read_state(manager.latest())["step"] == (2 if outcomes[-1] == "ok" else 1)
    print(" ".join(outcomes))
""")


def test_a_checkpoint_on_a_full_disk_is_refused_and_the_last_one_kept(small_fs):
    fs = small_fs(1024 * 1024)
    result = subprocess.run([sys.executable, "-c", CHECKPOINTS, str(fs)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert result.returncode == 0, f"exit {result.returncode} (-11: a segmentation fault):\n{result.stderr[-3000:]}"
    assert result.stderr == ""
    outcomes = result.stdout.split()
    assert outcomes[0] == "full", outcomes
    assert outcomes[-1] == "ok", outcomes  # full at first; fits with room enough


def test_the_final_model_on_a_full_disk_is_one_line_and_leaves_nothing(small_fs):
    """model.keras goes through the one atomic writer: DiskFullError naming it, no temporary left."""
    from bigmem.train.trainer import _save_model

    class Weight:
        def numpy(self):
            return np.zeros(2**19, np.float32)  # 2 MiB

    class Model:  # what _save_model uses of a Keras model
        weights = [Weight()]

        def save(self, path):
            with open(path, "wb") as handle:
                handle.write(bytes(2 * 2**20))

    fs = small_fs(1024 * 1024)
    target = fs / "model.keras"
    with pytest.raises(DiskFullError) as info:
        _save_model(Model(), target)
    assert str(info.value).startswith(f"No space left on device writing '{target}' (needed about 2.00 MiB, ")
    assert list(fs.iterdir()) == []


# ---- bigmem train ---------------------------------------------------------------------------------

def test_a_disk_that_cannot_hold_one_checkpoint_is_refused_before_the_run(small_fs, tiny_store, tmp_path, monkeypatch):
    """Refused with the plan, before the tuning pass and before the run directory exists (nothing is written)."""
    monkeypatch.delenv("BIGMEM_NO_TUNE", raising=False)  # a new machine: the pass is due, and must not run
    monkeypatch.setenv("BIGMEM_TUNING_DIR", str(tmp_path / "tuning"))
    fs = small_fs(32 * 1024)
    result = _bigmem("train", "--model", "tiny", "--data", tiny_store, "--out", fs / "run", "--steps", 4,
                     "--recipe", "preset")  # Adam: the checkpoint size the budget below was chosen for
    line = _one_line(result)
    assert line == (f"bigmem train: error: No space left on device writing '{fs / 'run' / 'checkpoints'}' (needed "
                    "about 118.77 KiB, 32.00 KiB free). Free space or choose another --out.")
    assert list(fs.iterdir()) == []
    assert not (tmp_path / "tuning").exists()


def test_a_run_stopped_by_a_full_disk_leaves_no_event_file(small_fs, tiny_store):
    """The first checkpoint cannot fit: one line naming it, and the TensorBoard files the run began are gone."""
    # The pre-flight sees room for the tiny model's ~119 KiB checkpoint; the run directory's JSON and logs then
    # take ~40 KiB of it (tmpfs counts whole pages), so the checkpoint no longer fits when it is written.
    fs = small_fs(136 * 1024)
    result = _bigmem("train", "--model", "tiny", "--data", tiny_store, "--out", fs / "run", "--steps", 4,
                     "--checkpoint-every", 2, "--recipe", "preset")  # Adam: the checkpoint size fs was sized for
    line = _one_line(result)
    assert line.startswith(f"bigmem train: error: No space left on device writing "
                           f"'{fs / 'run' / 'checkpoints' / 'ckpt-00000002'}' (needed about "), line
    left = sorted(p.relative_to(fs).as_posix() for p in fs.rglob("*"))
    assert "run/metrics.jsonl" in left  # steps 1 and 2 were logged (TensorBoard too) before the checkpoint
    assert not [name for name in left if "tensorboard" in name or "/." in name], left


def test_a_full_disk_at_the_final_model_removes_the_runs_event_files(tmp_path, tiny_store, capsys, monkeypatch):
    """After the loop, model.keras cannot be written: the run stops with its one line, its event files go too."""
    from helpers import run_cli

    from bigmem.atomic import disk_full_error

    def full(model, path):
        raise disk_full_error(path, 2**20)

    monkeypatch.setattr("bigmem.train.trainer._save_model", full)
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--out", out, "--steps", 2], capsys)
    assert code == 1, err
    assert f"No space left on device writing '{out / 'model.keras'}'" in err, err
    assert (out / "checkpoints").is_dir()  # the last checkpoint stays: --resume finishes the run
    assert (out / "metrics.jsonl").is_file()  # the run logged its steps (TensorBoard too) ...
    assert not [p for p in out.rglob("events.out.tfevents.*")]  # ... and its event files are gone


def test_event_files_on_a_full_disk_are_one_line_and_removed(small_fs):
    import tensorflow as tf

    from bigmem.monitor.events import EventWriters

    fs = small_fs(256 * 1024)
    events = EventWriters(fs / "tensorboard")
    with pytest.raises(DiskFullError) as caught:
        with events:
            with events.writing("train", 0):
                tf.summary.scalar("loss", 1.0)
            _fill(fs, 0)
            for step in range(1, 1000):  # TensorFlow flushes every 10 events: one of those finds the disk full
                with events.writing("train", step):
                    tf.summary.text("note", "x" * 1000)
    event_file = events.directory / "train"
    assert str(caught.value).startswith(f"No space left on device writing '{event_file}/events.out.tfevents.")
    assert str(caught.value).endswith(" free). Free space or choose another output.path.")
    assert "\n" not in str(caught.value)
    assert _listing(fs) == []  # the event file and the folders made for it
