"""The bad-input suite: every command refuses bad input by the error contract (README.md, "Exit codes").

Each case is a command line a hostile-but-realistic user types, tagged with the class of defect
it guards against: 2 a good file overwritten, 4 an unhandled exception, 5 a wrong value accepted,
6 a slow or heavy refusal, 8 a misleading message. For each, the test asserts the exit code,
the one line on stderr (pinned text), no traceback, and the files before and after: the case's
folder (its inputs and the current directory) and the shared sources are byte-for-byte the same,
and nothing is left behind.

Cases run in-process (``bigmem.cli.main.main``), except where the cost of importing TensorFlow
before checking the flags is the point: those run in a fresh interpreter that reports whether
TensorFlow was imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import nibabel as nib
import numpy as np
import pytest

from bigmem.nets.tuning import TUNING_DIR_ENV
from bigmem.train.job import NO_TUNE_VARIABLE
from helpers import copy_store, run_cli

GOOD_ROW = {"step": 1, "loss": 0.9, "dice": 0.2, "voxels_per_s": 1.0e5, "step_s": 0.5}
GOOD_PLAN = {"fits": True, "budget_bytes": 2**31, "predicted_peak_bytes": 2**30,
             "chosen": {"volume": 16, "batch_size": 1, "precision": "fp32", "recompute": "none"}, "candidates": []}


# ---- inputs ----------------------------------------------------------------------------------------

def _msd(root: Path, channels: tuple[str, ...] = ("CT",), cases=("a", "b"), shape=(12, 12, 12)) -> Path:
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    rng = np.random.default_rng(0)
    training = []
    for case in cases:
        image_shape = shape + ((len(channels),) if len(channels) > 1 else ())
        nib.save(nib.Nifti1Image(rng.normal(size=image_shape).astype(np.float32), np.eye(4)),
                 str(root / "imagesTr" / f"{case}.nii.gz"))
        nib.save(nib.Nifti1Image(rng.integers(0, 3, shape).astype(np.uint8), np.eye(4)),
                 str(root / "labelsTr" / f"{case}.nii.gz"))
        training.append({"image": f"./imagesTr/{case}.nii.gz", "label": f"./labelsTr/{case}.nii.gz"})
    meta = {"modality": {str(i): c for i, c in enumerate(channels)}, "labels": {"0": "bg", "1": "a", "2": "b"},
            "training": training}
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def _huge_header(root: Path) -> Path:
    """An MSD folder whose one image header claims 30000^3 voxels (the file holds 8)."""
    _msd(root, cases=("h",), shape=(2, 2, 2))
    image = root / "imagesTr" / "h.nii"
    nib.save(nib.Nifti1Image(np.zeros((2, 2, 2), np.float32), np.eye(4)), str(image))
    header = nib.Nifti1Header.from_fileobj(open(image, "rb"))
    header.set_data_shape((30000, 30000, 30000))
    image.write_bytes(header.binaryblock + image.read_bytes()[348:])
    meta = json.loads((root / "dataset.json").read_text())
    meta["training"] = [{"image": "./imagesTr/h.nii", "label": "./labelsTr/h.nii.gz"}]
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_store) -> dict[str, Path]:
    """Read-only inputs shared by the cases: MSD folders and the tiny store (4 x 16^3, 1 channel, 3 classes)."""
    root = tmp_path_factory.mktemp("bad-input-sources")
    return {"msd": _msd(root / "msd"), "msd2": _msd(root / "msd2", channels=("T1", "T2")),
            "huge": _huge_header(root / "huge"), "store": tiny_store, "root": root}


def _unwritable_dir(tmp_path: Path) -> Path | None:
    """A folder this process cannot create files in: a 0555 folder, or /sys for root (chmod does not stop it)."""
    for candidate in (tmp_path.parent / f"{tmp_path.name}-ro", Path("/sys")):
        if candidate != Path("/sys"):
            candidate.mkdir(exist_ok=True)
            candidate.chmod(0o555)
        try:
            fd, probe = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.unlink(probe)
    return None


def _dataset_json(text: str) -> Callable[[Path, dict], None]:
    def setup(tmp: Path, sources: dict) -> None:
        (tmp / "dj").mkdir()
        (tmp / "dj" / "dataset.json").write_text(text)
    return setup


def _store_copy(name: str, mutate: Callable | None = None) -> Callable[[Path, dict], None]:
    def setup(tmp: Path, sources: dict) -> None:
        path = copy_store(sources["store"], tmp / name)
        if mutate is not None:
            with h5py.File(path, "r+") as handle:
                mutate(handle)
    return setup


def _msd_with_a_nan_case(tmp: Path, sources: dict) -> None:
    """A copy of the shared MSD folder whose second case ('b') has a NaN voxel: it fails after 'a' was written."""
    import shutil

    shutil.copytree(sources["msd"], tmp / "nanmsd")
    path = tmp / "nanmsd" / "imagesTr" / "b.nii.gz"
    image = nib.load(str(path))
    data = np.asarray(image.dataobj, np.float32)
    data[1, 2, 3] = np.nan
    nib.save(nib.Nifti1Image(data, image.affine), str(path))


def _a_dir(tmp: Path, sources: dict) -> None:
    (tmp / "adir").mkdir()
    (tmp / "adir" / "keep.txt").write_text("keep me")


def _a_file(tmp: Path, sources: dict) -> None:
    (tmp / "afile").write_text("keep me")


def _good_plan(tmp: Path, sources: dict) -> None:
    (tmp / "plan.json").write_text(json.dumps(GOOD_PLAN))


def _run_dir(metrics: bytes | None = None, monitor: bytes | None = None) -> Callable[[Path, dict], None]:
    def setup(tmp: Path, sources: dict) -> None:
        (tmp / "run").mkdir()
        if metrics is not None:
            (tmp / "run" / "metrics.jsonl").write_bytes(metrics)
        if monitor is not None:
            (tmp / "run" / "monitor.csv").write_bytes(monitor)
    return setup


def _unfinished_run(tmp: Path, sources: dict) -> None:
    """A run directory whose training stopped before model.keras or any checkpoint was written."""
    (tmp / "run").mkdir()
    (tmp / "run" / "config.json").write_text(json.dumps({"preset": "tiny"}))


def _label_folders(tmp: Path, sources: dict) -> None:
    """pred/ and ref/ with one case each, on grids that differ."""
    for name, shape in (("pred", (8, 6, 4)), ("ref", (8, 6, 5))):
        (tmp / name).mkdir()
        nib.save(nib.Nifti1Image(np.zeros(shape, np.uint8), np.eye(4)), str(tmp / name / "case_a.nii.gz"))


def _set_num_classes(value: int):
    def mutate(handle) -> None:
        handle.attrs["num_classes"] = value
    return mutate


def _bad_values_store(name: str, *, label: int = 0, nan: bool = False, records: bool = True):
    """A 3-class store of two 16^3 cases whose 'b' has ``label`` at one voxel (a NaN voxel with ``nan``); without
    ``records`` the per-case label_max/nonfinite_voxels are gone, as in a store written by an older bigmem."""
    def setup(tmp: Path, sources: dict) -> None:
        from bigmem.data.store import StoreWriter

        with StoreWriter(tmp / name, num_classes=3, channel_names=["x"]) as writer:
            for case_id in ("a", "b"):
                image = np.random.default_rng(0).normal(size=(16, 16, 16, 1)).astype(np.float32)
                values = np.zeros((16, 16, 16), np.uint8)
                if case_id == "b":
                    values[2, 3, 4] = label
                    image[5, 6, 7, 0] = np.nan if nan else image[5, 6, 7, 0]
                writer.add_case(case_id, image, values)
            writer.commit()
        if not records:
            with h5py.File(tmp / name, "r+") as handle:
                for case in handle["cases"].values():
                    del case.attrs["label_max"], case.attrs["nonfinite_voxels"]
    return setup


# ---- the cases -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One bad command line and what bigmem must answer.

    ``argv`` and ``message`` name paths as {tmp} (the case's folder, also the current directory),
    {msd}, {msd2}, {huge}, {store} (the shared sources) and {ro} (a folder this process cannot
    write); in ``message``, <*> stands for text that depends on the machine (free memory).
    """

    name: str
    issue_class: int
    argv: tuple[str, ...]
    code: int
    message: str
    setup: Callable[[Path, dict], None] | None = None
    no_tensorflow: bool = False  # run in a fresh interpreter and assert TensorFlow was never imported

    @property
    def command(self) -> str:
        return self.argv[0]


DJ = "{tmp}/dj/dataset.json"
CASES = [
    # convert
    Case("dataset-json-is-a-list", 4, ("convert", "{tmp}/dj", "-o", "{tmp}/out.h5"), 1,
         f"{DJ}: expected a JSON object with 'modality' (or 'channel_names'), 'labels' and 'training'; got a list.",
         _dataset_json("[1, 2]")),
    Case("labels-as-a-list", 4, ("convert", "{tmp}/dj", "-o", "{tmp}/out.h5"), 1,
         f"{DJ}: 'labels' must map label values to names, such as {{\"0\": \"background\", \"1\": \"tumour\"}} "
         "(MSD) or {\"background\": 0, \"tumour\": 1} (nnU-Net v2); got a list.",
         _dataset_json('{"modality": {"0": "CT"}, "labels": ["bg", "a"], "training": []}')),
    Case("modality-keyed-by-name", 4, ("convert", "{tmp}/dj", "-o", "{tmp}/out.h5"), 1,
         f"{DJ}: 'modality' must be keyed by channel index (\"0\", \"1\", ...), such as "
         "{\"0\": \"FLAIR\", \"1\": \"T1w\"}; got keys 'FLAIR', 'T1w'.",
         _dataset_json('{"modality": {"FLAIR": 0, "T1w": 1}, "labels": {"0": "bg", "1": "a"}, "training": []}')),
    Case("out-is-a-directory-with-force", 4, ("convert", "{msd}", "-o", "{tmp}/adir", "--force"), 1,
         "Cannot write -o '{tmp}/adir': it is a directory; expected a file name.", _a_dir),
    Case("out-in-unwritable-directory", 4, ("convert", "{msd}", "-o", "{ro}/sub/out.h5"), 1,
         "Cannot write -o '{ro}/sub/out.h5': directory '{ro}' is not writable (<*>)."),
    Case("out-in-missing-nested-folders", 2, ("convert", "{tmp}/nanmsd", "-o", "{tmp}/a/b/c/out.h5"), 1,
         "Case 'b': image has 1 non-finite values (NaN/Inf) ({tmp}/nanmsd/imagesTr/b.nii.gz).",
         _msd_with_a_nan_case),  # 'a' was written first: the folders made for the store go with it
    Case("spacing-nan", 4, ("convert", "{msd}", "-o", "{tmp}/out.h5", "--spacing", "nan,1,1"), 2,
         "Invalid --spacing 'nan,1,1': expected three positive numbers (mm) such as 1,1,1.5."),
    Case("spacing-too-fine-for-memory", 4, ("convert", "{msd}", "-o", "{tmp}/out.h5", "--spacing", "1e-9,1,1"), 3,
         "Converting case 'a' at --spacing 1e-09,1,1 needs about <*> of memory for one case, more than the <*> "
         "available (MemAvailable); choose a coarser --spacing."),
    Case("volume-too-large-for-memory", 4, ("convert", "{msd}", "-o", "{tmp}/out.h5", "--volume", "100000"), 3,
         "Converting a case cropped/padded to 100000x100000x100000 needs about 19.54 PiB of memory for one case, "
         "more than the <*> available (MemAvailable); choose a smaller --volume or --shape."),
    Case("failing-force-keeps-the-store", 2, ("convert", "{tmp}/dj", "-o", "{tmp}/one.h5", "--force"), 1,
         f"{DJ}: expected a JSON object with 'modality' (or 'channel_names'), 'labels' and 'training'; got a list.",
         lambda tmp, s: (_dataset_json("[1, 2]")(tmp, s), _store_copy("one.h5")(tmp, s))),
    Case("volume-zero", 5, ("convert", "{msd}", "-o", "{tmp}/out.h5", "--volume", "0"), 2,
         "Invalid --volume 0: expected a positive integer."),
    Case("append-two-channels-to-one", 8, ("convert", "{msd2}", "-o", "{tmp}/one.h5", "--append"), 1,
         "Cannot --append {msd2}/dataset.json's 2 channels (T1, T2) to '{tmp}/one.h5', whose cases have 1: case "
         "'a' ({msd2}/imagesTr/a.nii.gz) is the first that does not fit.",
         _store_copy("one.h5")),
    Case("header-claims-30000-cubed", 8, ("convert", "{huge}", "-o", "{tmp}/out.h5"), 1,
         "Case 'h': image header claims shape (30000, 30000, 30000) (2.7e+13 voxels, 98.23 TiB in memory), more "
         "than this machine's available memory (<*>) ({huge}/imagesTr/h.nii); the header may be corrupt, or the case "
         "is too large to load here."),
    Case("nifti-file-as-src", 8, ("convert", "{msd}/imagesTr/a.nii.gz", "-o", "{tmp}/out.h5"), 1,
         "{msd}/imagesTr/a.nii.gz is a NIfTI (or gzip) file, not a dataset.json: give the MSD folder (dataset.json, "
         "imagesTr/, labelsTr/) or its dataset.json, or --images/--labels globs for loose files."),
    # train: refused before TensorFlow starts
    Case("memory-budget-1e999", 4, ("train", "--data", "{store}", "--model", "tiny", "--memory-budget", "1e999"), 2,
         "Invalid --memory-budget '1e999': expected a size below 8 EiB (2^63 bytes)."),
    Case("time-budget-negative", 5, ("train", "--data", "{store}", "--model", "tiny", "--time-budget", "-5"), 2,
         "Invalid --time-budget -5: expected a positive, finite number of seconds."),
    Case("holdout-negative", 5, ("train", "--data", "{store}", "--model", "tiny", "--holdout", "-1"), 2,
         "Invalid --holdout -1: expected an integer >= 0."),
    Case("cpus-far-past-the-machine", 6, ("train", "--data", "{store}", "--model", "tiny", "--cpus", "0-99999999"),
         2, "Invalid --cpus '0-99999999': CPU <*> is outside the CPUs this process may use (<*>)."),
    Case("patch-not-a-multiple", 8, ("train", "--data", "{store}", "--model", "tiny", "--strategy", "mirrored",
                                     "--simulate-replicas", "2", "--patch", "7"), 2,
         "Invalid --patch 7: expected a multiple of 4 (the network downsamples 2 times). Try --patch 4 or 8."),
    Case("store-is-a-directory", 8, ("train", "--data", "{tmp}/adir", "--model", "tiny"), 1,
         "Cannot open store '{tmp}/adir': it is a directory; expected a store file (.h5) written by 'bigmem synth' "
         "or 'bigmem convert'.", _a_dir),
    Case("store-num-classes-0", 8, ("train", "--data", "{tmp}/nc0.h5", "--model", "tiny"), 1,
         "Cannot open store '{tmp}/nc0.h5': its num_classes (root attribute) is 0; expected 2..256 (background + at "
         "least one class). The store is damaged or was not written by bigmem: write it again with 'bigmem "
         "convert' or 'bigmem synth'.", _store_copy("nc0.h5", _set_num_classes(0))),
    # refused where the job opens the store, before the first step: no run directory, no checkpoint
    Case("store-label-past-its-classes", 6, ("train", "--data", "{tmp}/l5.h5", "--model", "tiny", "--steps", "2",
                                             "--out", "{tmp}/run"), 1,
         "Case 'b': label value 5 >= number of classes 3 ({tmp}/l5.h5); expected values 0..2: fix the label and "
         "convert again.", _bad_values_store("l5.h5", label=5)),
    Case("store-nan-voxel", 6, ("train", "--data", "{tmp}/nan.h5", "--model", "tiny", "--steps", "2",
                                "--out", "{tmp}/run"), 1,
         "Case 'b': image has 1 non-finite values (NaN/Inf) ({tmp}/nan.h5); fix the source and convert again.",
         _bad_values_store("nan.h5", nan=True)),
    Case("older-store-label-past-its-classes", 6, ("train", "--data", "{tmp}/old.h5", "--model", "tiny", "--steps",
                                                   "2", "--out", "{tmp}/run"), 1,
         "Case 'b': label value 7 >= number of classes 3 ({tmp}/old.h5); expected values 0..2: fix the label and "
         "convert again.", _bad_values_store("old.h5", label=7, records=False)),
    # Refused by the plan, before the tuning pass a new machine runs on its first job (test_bad_input runs
    # every case untuned, with the pass on): in seconds, and with nothing tuned, measured or made.
    Case("volume-1280-on-a-new-machine", 6, ("train", "--volume", "1280", "--out", "{tmp}/run"), 3,
         "Predicted peak <*> for small at 1280^3 x batch 2 (fp32) exceeds the memory budget <*> (MemAvailable): <*>; "
         "or pass --force to try anyway."),
    Case("memory-budget-1KiB-on-a-new-machine", 6, ("train", "--data", "{store}", "--model", "tiny", "--memory-budget",
                                                    "1KiB", "--out", "{tmp}/run"), 3,
         "Predicted peak <*> for tiny at 16^3 (case '<*>', 16x16x16) x batch 1 (fp32) exceeds the memory budget "
         "1.00 KiB (--memory-budget): nothing fits, not even the smallest volume; raise --memory-budget or free "
         "memory; or pass --force to try anyway."),
    Case("batch-size-100000-on-a-new-machine", 6, ("train", "--data", "{store}", "--model", "tiny", "--batch-size",
                                                   "100000", "--out", "{tmp}/run"), 3,
         "Predicted peak <*> for tiny at 16^3 (case '<*>', 16x16x16) x batch 100000 (fp32) exceeds the memory budget "
         "<*> (MemAvailable): use --batch-size <*>; or pass --force to try anyway."),
    Case("holdout-of-every-case", 6, ("train", "--data", "{store}", "--model", "tiny", "--holdout", "4", "--out",
                                      "{tmp}/run"), 1,
         "Cannot hold out 4 of the 4 cases in '{store}': training needs at least one."),
    Case("gpu-memory-1KiB-without-a-gpu", 6, ("train", "--data", "{store}", "--model", "tiny", "--strategy",
                                              "mirrored", "--gpu-memory", "1KiB", "--out", "{tmp}/run"), 1,
         "No GPU found for --strategy mirrored; use --simulate-replicas N to run the same path on N logical CPU "
         "devices."),
    # train/trainer.py's check_run_dir_path refuses these before TensorFlow starts (the resume and chaos work)
    Case("out-is-a-file", 4, ("train", "--data", "{store}", "--model", "tiny", "--steps", "1", "--out",
                              "{tmp}/afile"), 1,
         "Run directory '{tmp}/afile' is a file, not a folder: choose another --out.", _a_file),
    Case("out-in-unwritable-directory", 4, ("train", "--data", "{store}", "--model", "tiny", "--steps", "1", "--out",
                                            "{ro}/run"), 1,
         "Run directory '{ro}/run' cannot be created or opened (<*>): choose another --out."),
    # profile
    Case("usage-error-before-tensorflow", 6, ("profile", "--volume", "50"), 2,
         "Invalid --volume 50: expected a multiple of 8 (the network downsamples 3 times). Try --volume 48 or 56.",
         no_tensorflow=True),
    Case("memory-budget-1e999", 4, ("profile", "--memory-budget", "1e999"), 2,
         "Invalid --memory-budget '1e999': expected a size below 8 EiB (2^63 bytes).", no_tensorflow=True),
    Case("cpus-far-past-the-machine", 6, ("profile", "--cpus", "0-99999999"), 2,
         "Invalid --cpus '0-99999999': CPU <*> is outside the CPUs this process may use (<*>)."),
    Case("measure-beyond-memory", 6, ("profile", "--model", "tiny", "--volume", "4096", "--measure"), 3,
         "--measure would train tiny at 4096^3 x batch 1 (fp32): predicted peak <*> exceeds the memory budget <*> "
         "(MemAvailable). Drop --measure for the estimate alone, or measure a smaller --shape."),
    # plan
    Case("failing-plan-keeps-plan-json", 2, ("plan", "--budget", "1KiB", "--model", "tiny"), 3,
         "Nothing fits 1.00 KiB (--budget): the closest candidate, 4^3 x batch 1 fp32 recompute <*>, needs <*>. "
         "The plan already in plan.json was kept (a failed plan replaces no file).", _good_plan),
    Case("budget-1e999", 4, ("plan", "--budget", "1e999"), 2,
         "Invalid --budget '1e999': expected a size below 8 EiB (2^63 bytes).", no_tensorflow=True),
    Case("out-is-a-directory", 4, ("plan", "--out", "{tmp}/adir"), 1,
         "Cannot write --out '{tmp}/adir': it is a directory; expected a file name.", _a_dir),
    Case("out-in-unwritable-directory", 4, ("plan", "--out", "{ro}/plan.json"), 1,
         "Cannot write --out '{ro}/plan.json': directory '{ro}' is not writable (<*>)."),
    Case("usage-error-before-tensorflow", 6, ("plan", "--volume", "50"), 2,
         "Invalid --volume 50: expected a multiple of 8 (the network downsamples 3 times). Try --volume 48 or 56.",
         no_tensorflow=True),
    # report
    Case("metrics-with-binary-bytes", 4, ("report", "{tmp}/run"), 1,
         "Cannot report on '{tmp}/run': metrics.jsonl has no step rows (2 other lines; a step row is a JSON object "
         "with step, loss, dice, voxels_per_s and step_s).", _run_dir(metrics=b"\x00\xff\xfe\n\x89PNG\r\n")),
    Case("metrics-non-object-lines", 4, ("report", "{tmp}/run"), 1,
         "Cannot report on '{tmp}/run': metrics.jsonl has no step rows (3 other lines; a step row is a JSON object "
         "with step, loss, dice, voxels_per_s and step_s).", _run_dir(metrics=b'[1, 2]\n"step"\n3\n')),
    Case("metrics-rows-without-step", 4, ("report", "{tmp}/run"), 1,
         "Cannot report on '{tmp}/run': metrics.jsonl has no step rows (1 other line; a step row is a JSON object "
         "with step, loss, dice, voxels_per_s and step_s).", _run_dir(metrics=b'{"loss": 1.0, "dice": 0.5}\n')),
    Case("out-in-unwritable-directory", 4, ("report", "{tmp}/run", "--out", "{ro}/report"), 1,
         "Cannot write --out '{ro}/report': directory '{ro}' is not writable (<*>).",
         _run_dir(metrics=(json.dumps(GOOD_ROW) + "\n").encode())),
    Case("only-a-garbage-monitor-csv", 5, ("report", "{tmp}/run"), 1,
         "Cannot report on '{tmp}/run': monitor.csv has no readable rows (expected a time_s column and numeric "
         "rows).", _run_dir(monitor=b"a,b,c\n1,2,3\nnot,a,row\n")),
    # compare
    Case("simulate-replicas-zero", 5, ("compare", "--simulate-replicas", "0"), 2,
         "Invalid --simulate-replicas 0: expected a positive integer."),
    Case("holdout-negative", 5, ("compare", "--holdout", "-1"), 2, "Invalid --holdout -1: expected an integer >= 0."),
    Case("time-budget-negative", 5, ("compare", "--time-budget", "-5"), 2,
         "Invalid --time-budget -5: expected a positive, finite number."),
    Case("out-is-a-file", 4, ("compare", "--out", "{tmp}/afile"), 1,
         "Cannot write --out '{tmp}/afile': it is a file; expected a directory.", _a_file),
    Case("out-in-unwritable-directory", 4, ("compare", "--out", "{ro}/cmp"), 1,
         "Cannot write --out '{ro}/cmp': directory '{ro}' is not writable (<*>)."),
    Case("budget-is-now-equal", 8, ("compare", "--budget", "flops"), 2,
         "compare's --budget is now --equal time|flops (equal training time or equal training FLOPs); "
         "--memory-budget SIZE sets the host memory budget.", no_tensorflow=True),
    Case("budget-without-a-value", 8, ("compare", "--budget"), 2,
         "compare's --budget is now --equal time|flops (equal training time or equal training FLOPs); "
         "--memory-budget SIZE sets the host memory budget."),
    # predict: refused before TensorFlow starts
    Case("not-a-run-directory", 8, ("predict", "{tmp}", "{store}", "-o", "{tmp}/o"), 1,
         "'{tmp}' is not a bigmem run directory: no config.json there.", no_tensorflow=True),
    Case("unfinished-run", 6, ("predict", "{tmp}/run", "{store}", "-o", "{tmp}/o"), 1,
         "No model.keras in '{tmp}/run': the run has not finished. Use --checkpoint latest (or best) to predict with "
         "a checkpoint.", _unfinished_run, no_tensorflow=True),
    Case("no-checkpoint-written", 8, ("predict", "{tmp}/run", "{store}", "-o", "{tmp}/o", "--checkpoint", "best"), 1,
         "No checkpoint 'best' in {tmp}/run/checkpoints: the run has written no complete checkpoint.",
         _unfinished_run, no_tensorflow=True),
    Case("input-missing", 6, ("predict", "{tmp}/run", "{tmp}/scan.nii.gz", "-o", "{tmp}/o"), 1,
         "Cannot read INPUT '{tmp}/scan.nii.gz': no such file or folder.", _unfinished_run, no_tensorflow=True),
    Case("out-is-a-file", 4, ("predict", "{tmp}/run", "{store}", "-o", "{tmp}/afile"), 1,
         "Cannot write -o '{tmp}/afile': it is a file; expected a directory.",
         lambda tmp, sources: (_unfinished_run(tmp, sources), _a_file(tmp, sources)), no_tensorflow=True),
    Case("overlap-one", 5, ("predict", "{tmp}", "{store}", "-o", "{tmp}/o", "--overlap", "1"), 2,
         "Invalid --overlap 1: expected a fraction in [0, 1).", no_tensorflow=True),
    Case("window-zero", 5, ("predict", "{tmp}/run", "{store}", "-o", "{tmp}/o", "--window", "0"), 2,
         "Invalid --window 0: expected a positive integer N or D,H,W.", _unfinished_run, no_tensorflow=True),
    # evaluate
    Case("pred-not-a-folder", 8, ("evaluate", "{tmp}/nothing", "{tmp}"), 1,
         "PRED '{tmp}/nothing' is not a folder: expected a folder of NIfTI label maps (<case>.nii.gz).",
         no_tensorflow=True),
    Case("classes-not-labels", 5, ("evaluate", "{tmp}", "{tmp}", "--classes", "0,x"), 2,
         "Invalid --classes '0,x': expected comma-separated labels such as 1,2,3.", no_tensorflow=True),
    Case("grids-differ", 5, ("evaluate", "{tmp}/pred", "{tmp}/ref"), 1,
         "Case 'case_a': prediction shape (8, 6, 4) != reference shape (8, 6, 5) <*>", _label_folders),
    # synth
    Case("out-is-a-directory", 4, ("synth", "{tmp}/adir", "--force"), 1,
         "Cannot write OUT.h5 '{tmp}/adir': it is a directory; expected a file name.", _a_dir),
    Case("out-in-unwritable-directory", 4, ("synth", "{ro}/s.h5"), 1,
         "Cannot write OUT.h5 '{ro}/s.h5': directory '{ro}' is not writable (<*>)."),
    Case("store-larger-than-the-disk", 4, ("synth", "{tmp}/s.h5", "--cases", "10000000000", "--volume", "64"), 1,
         "Cannot write OUT.h5 '{tmp}/s.h5': it needs about 11.64 PiB, and '{tmp}' has <*> free."),
    Case("phantom-larger-than-memory", 6, ("synth", "{tmp}/s.h5", "--volume", "100000"), 3,
         "One 100000^3 phantom needs about 85.27 PiB of memory, more than the <*> available (MemAvailable); try a "
         "smaller --volume."),
]


def _fill(text: str, paths: dict[str, str]) -> str:
    for key, value in paths.items():
        text = text.replace("{" + key + "}", value)
    return text


def _pattern(message: str, paths: dict[str, str]) -> re.Pattern:
    return re.compile(".+?".join(re.escape(part) for part in _fill(message, paths).split("<*>")))


def _snapshot(*roots: Path) -> dict[str, str]:
    """Every file under ``roots`` (hidden ones included): path -> SHA-256 of its bytes."""
    files = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif path.is_dir() and not any(path.iterdir()):
                files[str(path)] = "empty directory"
    return files


def _run_fresh(argv: list[str], cwd: Path) -> tuple[int, str, str, bool]:
    """bigmem ``argv`` in a fresh interpreter: (exit code, stdout, stderr, whether TensorFlow was imported)."""
    script = ("import sys\nfrom bigmem.cli.main import main\ncode = main(sys.argv[1:])\n"
              "print('tensorflow imported:', 'tensorflow' in sys.modules)\nsys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", script, *argv], cwd=cwd, capture_output=True, text=True)
    imported = "tensorflow imported: True" in result.stdout
    return result.returncode, result.stdout, result.stderr, imported


@pytest.mark.parametrize("case", CASES, ids=[f"{c.command}-class{c.issue_class}-{c.name}" for c in CASES])
def test_bad_input(case: Case, sources, tmp_path, capsys, monkeypatch):
    paths = {"tmp": str(tmp_path), **{k: str(v) for k, v in sources.items() if k != "root"}}
    if "{ro}" in " ".join(case.argv):
        ro = _unwritable_dir(tmp_path)
        if ro is None:
            pytest.skip("no folder this process cannot write to")
        paths["ro"] = str(ro)
    if case.setup is not None:
        case.setup(tmp_path, sources)
    monkeypatch.chdir(tmp_path)  # defaults (./plan.json, ./compare, runs/) land where the snapshot sees them
    # As on a new machine: nothing tuned, and the tuning pass on. A refusal comes before anything is timed
    # or measured, so the pass never writes its file (which the snapshot would see).
    monkeypatch.delenv(NO_TUNE_VARIABLE, raising=False)
    monkeypatch.setenv(TUNING_DIR_ENV, str(tmp_path / "tuning"))
    before = _snapshot(tmp_path, sources["root"])
    argv = [_fill(a, paths) for a in case.argv]
    if case.no_tensorflow:
        code, out, err, imported = _run_fresh(argv, tmp_path)
        assert not imported, "TensorFlow was imported before the flags were checked"
    else:
        code, out, err = run_cli(argv, capsys)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    prefix = f"bigmem {case.command}: error: "
    assert lines[0].startswith(prefix), lines[0]
    assert _pattern(case.message, paths).fullmatch(lines[0][len(prefix):]), lines[0]
    assert code == case.code, err
    assert _snapshot(tmp_path, sources["root"]) == before  # nothing changed, nothing left behind


def test_the_suite_covers_every_class_and_command():
    """The defect classes 2, 4, 5, 6 and 8 each have cases; every command with a bad input in them is here."""
    assert {c.issue_class for c in CASES} == {2, 4, 5, 6, 8}
    assert {c.command for c in CASES} == {"convert", "train", "profile", "plan", "report", "compare", "synth",
                                              "predict", "evaluate"}
    names = [(c.command, c.name) for c in CASES]
    assert len(names) == len(set(names))


def test_skip_bad_skips_a_corrupt_header_instead_of_calling_the_disk_full(sources, tmp_path, capsys):
    """--skip-bad with a 30000^3 header among good cases: the case is skipped, not counted as a 123 TiB store."""
    import shutil

    src = tmp_path / "mixed"
    shutil.copytree(sources["msd"], src)
    shutil.copy(sources["huge"] / "imagesTr" / "h.nii", src / "imagesTr")
    shutil.copy(sources["huge"] / "labelsTr" / "h.nii.gz", src / "labelsTr")
    meta = json.loads((src / "dataset.json").read_text())
    meta["training"].append({"image": "./imagesTr/h.nii", "label": "./labelsTr/h.nii.gz"})
    (src / "dataset.json").write_text(json.dumps(meta))
    code, out, err = run_cli(["convert", src, "-o", tmp_path / "s.h5", "--skip-bad"], capsys)
    assert code == 0, err
    assert "skipped: Case 'h': image header claims shape (30000, 30000, 30000)" in out
    assert f"Wrote 2 cases to {tmp_path / 's.h5'}; 1 skipped" in out


def test_read_jsonl_checked_names_the_lines_it_leaves_out(tmp_path):
    """The one JSON-lines reader: binary bytes, non-objects and refused rows are numbered; a torn last line is not."""
    from bigmem.rundir import read_jsonl, read_jsonl_checked

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\x00\xff\xfe\n[1, 2]\n\n{"loss": 2}\n"text"\n{"step": 2}\n{"step": 3, "lo')
    assert read_jsonl_checked(path) == ([{"step": 1}, {"loss": 2}, {"step": 2}], [2, 3, 6])
    assert read_jsonl_checked(path, keep=lambda row: "step" in row) == ([{"step": 1}, {"step": 2}], [2, 3, 5, 6])
    assert read_jsonl(path) == [{"step": 1}, {"loss": 2}, {"step": 2}]
    assert read_jsonl_checked(tmp_path / "missing.jsonl") == ([], [])


def test_report_leaves_out_bad_lines_and_says_so(tmp_path, capsys):
    """A run with good rows and a few bad lines is reported (exit 0), the bad lines named once each."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{**GOOD_ROW, "step": step} for step in (1, 2, 3)]
    text = "\n".join(json.dumps(r) for r in rows[:2]) + '\n[1]\n{"loss": 1}\n' + json.dumps(rows[2]) + "\n"
    (run / "metrics.jsonl").write_text(text)
    (run / "monitor.csv").write_bytes(b"\x00garbage")
    code, out, err = run_cli(["report", run], capsys)
    assert code == 0, err
    assert err.splitlines() == [f"note: {run}/metrics.jsonl: left out 2 lines that are not step rows (lines 3, 4)",
                                f"note: {run}/monitor.csv: no readable rows (not a bigmem monitor.csv, or no sample "
                                "yet); left out"]
    report = json.loads((run / "report" / "report.json").read_text())
    assert report["runs"][0]["steps"] == 3
    assert len(report["runs"][0]["notes"]) == 2
    assert "| left out while reading |" in (run / "report" / "report.md").read_text()


@pytest.mark.parametrize("bad, message", [
    ({"label": 5}, "Case 'b': label value 5 >= number of classes 3 ({store}); expected values 0..2: fix the label and "
                   "convert again."),
    ({"nan": True}, "Case 'b': image has 1 non-finite values (NaN/Inf) ({store}); fix the source and convert again."),
], ids=["label-5-of-3-classes", "nan-voxel"])
def test_bad_store_values_are_refused_before_the_first_step(tmp_path, capsys, monkeypatch, bad, message):
    """Refused where the job opens the store: the loop never starts, no run directory or checkpoint is written."""
    import bigmem.train.trainer as trainer
    from bigmem.errors import DataError

    started = []
    monkeypatch.setattr(trainer, "run_loop", lambda *args, **kwargs: started.append(True) or pytest.fail("stepped"))
    _bad_values_store("s.h5", **bad)(tmp_path, {})
    code, _, err = run_cli(["train", "--model", "tiny", "--data", tmp_path / "s.h5", "--steps", 2, "--out",
                            tmp_path / "run"], capsys)
    assert err.strip() == "bigmem train: error: " + message.format(store=tmp_path / "s.h5")
    assert (code, started) == (DataError.exit_code, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.h5"]  # no run directory, so no checkpoint or step
