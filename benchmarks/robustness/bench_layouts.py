"""Each dataset layout end to end: convert, train 3 steps, predict, evaluate, through the CLI.

    python benchmarks/robustness/bench_layouts.py [--out DIR] [--work DIR]

Writes synthetic stand-ins of the three layouts users bring, with real scans' geometry in
miniature (anisotropic spacing, an LPS or permuted affine, cases of different shapes):

- ``msd``: Medical Segmentation Decathlon Task01-like: dataset.json with a training list, 4-D
  images (FLAIR, T1w, t1gd, T2w) as int16 MRI with a zero background, labels 0..3;
- ``nnunet``: nnU-Net v2 raw ``Dataset001_BraTSlike``: one file per channel (CASE_0000 ..
  CASE_0003), ``file_ending``, region labels (whole tumour, tumour core, enhancing tumour with
  ``regions_class_order``) and an imagesTs/ folder;
- ``kits``: KiTS19 case folders (case_00000/imaging.nii.gz + segmentation.nii.gz, int16 CT in HU),
  one test case without a segmentation.

For each it runs ``bigmem convert``, ``bigmem train --model tiny --steps 3 --holdout 1 --val-every 3``,
``bigmem predict`` on the layout's own folder (what predict finds there: imagesTr/ of the MSD set,
whose test list is empty, imagesTs/ of the nnU-Net set and then its held-out case, every KiTS case
folder), and
``bigmem evaluate`` of the held-out case against its original label file with ``--run``, and records
each command, its first lines, the store's normalisation and dtype, val_dice and evaluate's Dice
(they must be equal). Writes ``layouts-<machine>-<time>.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import nibabel as nib
import numpy as np
from harness import bench_parser, run_command, write_results
from rich.console import Console
from rich.table import Table

LPS = np.diag([-1.0, -1.0, 1.0, 1.0])
KITS_AFFINE = np.array([[0.0, 0.0, -0.8, 0.0], [0.0, -0.8, 0.0, 0.0], [-3.0, 0.0, 0.0, 0.0], [0, 0, 0, 1]])


def _save(path: Path, data, affine) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, affine), str(path))


def _brain(rng, shape, channels=4):
    """A head of MRI-like int16 channels (zero outside) with a three-part tumour; labels 0..3."""
    grid = np.ogrid[tuple(slice(0, s) for s in shape)]
    head = sum(((g - s / 2) / (s * 0.42)) ** 2 for g, s in zip(grid, shape)) < 1
    centre = [s * rng.uniform(0.4, 0.6) for s in shape]
    r = np.sqrt(sum(((g - c) / (0.18 * s)) ** 2 for g, c, s in zip(grid, centre, shape)))
    label = np.select([r < 0.35, r < 0.65, r < 1.0], [3, 2, 1], 0).astype(np.uint8) * head
    image = np.stack([np.where(head, rng.normal(300 + 60 * c, 40, shape) + 120 * label, 0) for c in range(channels)],
                     axis=-1)
    return np.round(image).astype(np.int16), label


def _abdomen(rng, shape):
    """CT in HU: air -1000 around a body near 40 HU, two kidneys near 150 HU with a tumour near 60."""
    grid = np.ogrid[tuple(slice(0, s) for s in shape)]
    body = sum(((g - s / 2) / (s * 0.45)) ** 2 for g, s in zip(grid[:2], shape[:2])) < 1
    image = np.where(body, rng.normal(40, 25, shape), -1000.0)
    label = np.zeros(shape, np.uint8)
    for side in (0.32, 0.68):
        kidney = (((grid[0] - shape[0] * 0.5) / (shape[0] * 0.12)) ** 2 + ((grid[1] - shape[1] * side)
                  / (shape[1] * 0.09)) ** 2 + ((grid[2] - shape[2] * 0.5) / (shape[2] * 0.3)) ** 2) < 1
        label[kidney] = 1
    tumour = (((grid[0] - shape[0] * 0.5) / 3.0) ** 2 + ((grid[1] - shape[1] * 0.32) / 3.0) ** 2
              + ((grid[2] - shape[2] * 0.5) / 2.0) ** 2) < 1
    label[tumour] = 2
    image[label == 1] = rng.normal(150, 20, int((label == 1).sum()))
    image[label == 2] = rng.normal(60, 20, int((label == 2).sum()))
    return np.round(image).astype(np.int16), label


def write_msd(root: Path, rng) -> Path:
    training = []
    for index, shape in enumerate([(40, 44, 30), (44, 40, 28), (38, 42, 32)]):
        image, label = _brain(rng, shape)
        name = f"BRATS_{index + 1:03d}.nii.gz"
        _save(root / "imagesTr" / name, image, LPS)
        _save(root / "labelsTr" / name, label, LPS)
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    (root / "dataset.json").write_text(json.dumps({
        "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
        "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
        "training": training, "test": []}))
    return root


def write_nnunet(root: Path, rng) -> Path:
    def case(folder, case_id, shape, with_label):
        image, label = _brain(rng, shape)
        for c in range(4):
            _save(root / folder / f"{case_id}_{c:04d}.nii.gz", image[..., c], LPS)
        if with_label:
            _save(root / "labelsTr" / f"{case_id}.nii.gz", label, LPS)
    for index, shape in enumerate([(40, 44, 30), (44, 40, 28), (38, 42, 32)]):
        case("imagesTr", f"BraTS_{index + 1:03d}", shape, True)
    case("imagesTs", "BraTS_101", (42, 42, 30), False)
    (root / "dataset.json").write_text(json.dumps({
        "channel_names": {"0": "FLAIR", "1": "T1w", "2": "T1gd", "3": "T2w"},
        "labels": {"background": 0, "whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]},
        "regions_class_order": [1, 2, 3], "numTraining": 3, "file_ending": ".nii.gz"}))
    return root


def write_kits(root: Path, rng) -> Path:
    for index, shape in enumerate([(24, 48, 48), (30, 48, 48), (20, 48, 48)]):  # (slices, rows, columns) as KiTS19
        image, label = _abdomen(rng, shape)
        _save(root / f"case_{index:05d}" / "imaging.nii.gz", image, KITS_AFFINE)
        _save(root / f"case_{index:05d}" / "segmentation.nii.gz", label, KITS_AFFINE)
    image, _ = _abdomen(rng, (22, 48, 48))
    _save(root / "case_00210" / "imaging.nii.gz", image, KITS_AFFINE)  # a test case: no segmentation
    return root


def bigmem(argv, env) -> tuple[str, list[str]]:
    """``bigmem ARGV`` in a child process: the command as a user types it, and its non-blank lines of output."""
    command = ["bigmem", *map(str, argv)]
    result = run_command([sys.executable, "-m", "bigmem", *argv], what=" ".join(command), env=env)
    if not result.ok:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return " ".join(command), [line for line in result.stdout.splitlines() if line.strip()]


LAYOUTS = {"msd": (write_msd, "Task01_BrainTumour_like", "BRATS_003"),
           "nnunet": (write_nnunet, "Dataset001_BraTSlike", "BraTS_003"),
           "kits": (write_kits, "kits19", "case_00002")}


def reference_of(layout: str, source: Path, case_id: str) -> Path:
    if layout == "kits":
        return source / case_id / "segmentation.nii.gz"
    return source / "labelsTr" / f"{case_id}.nii.gz"


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--work", help="keep the datasets, stores and runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    console = Console()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bigmem-layouts-"))
    report = {}
    try:
        for name, (write, folder, held_out) in LAYOUTS.items():
            rng = np.random.default_rng(0)
            source = write(work / folder, rng)
            store, run, pred = work / f"{name}.h5", work / f"run-{name}", work / f"pred-{name}"
            steps = []
            steps.append(bigmem(["convert", source, "-o", store], env))
            steps.append(bigmem(["train", "--model", "tiny", "--data", store, "--steps", 3, "--holdout", 1,
                                 "--val-every", 3, "--out", run], env))
            os.remove(store)  # the run directory alone predicts (preprocessing.json)
            steps.append(bigmem(["predict", run, source, "-o", pred, "--mode", "whole"], env))
            if name == "nnunet":  # the folder's test images were predicted; the held-out case is in imagesTr
                steps.append(bigmem(["predict", run, source / "imagesTr", "--cases", held_out, "-o", pred,
                                     "--mode", "whole"], env))
            reference = work / f"ref-{name}"
            reference.mkdir()
            shutil.copy(reference_of(name, source, held_out), reference / f"{held_out}.nii.gz")
            steps.append(bigmem(["evaluate", pred, reference, "--run", run, "--allow-missing",
                                 "-o", work / f"eval-{name}.json"], env))
            evaluate_lines = steps[-1][1]
            summary = json.loads((run / "summary.json").read_text())
            scored = json.loads((work / f"eval-{name}.json").read_text())
            card = json.loads((run / "preprocessing.json").read_text())
            outputs = sorted(p.name for p in pred.iterdir())
            report[name] = {"commands": [c for c, _ in steps], "convert_lines": steps[0][1][:6],
                            "predict_lines": steps[2][1], "outputs": outputs, "evaluate_lines": evaluate_lines,
                            "normalisation": [c["scheme"] for c in card["preprocessing"]["channels"]],
                            "label_names": card["label_names"], "regions": card["regions"],
                            "val_dice": summary["validation"]["val_dice"] if "validation" in summary
                            else summary.get("val_dice"),
                            "evaluate_dice": scored["foreground_mean"]["Dice"],
                            "evaluate_region_mean": scored.get("region_foreground_mean")}
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    table = Table(title="layouts: convert, train 3 steps, predict (store deleted), evaluate")
    for column in ("layout", "normalisation", "outputs", "val_dice", "evaluate Dice", "regions (Dice)"):
        table.add_column(column)
    for name, r in report.items():
        regions = r["evaluate_region_mean"]
        table.add_row(name, ", ".join(sorted(set(r["normalisation"]))), ", ".join(r["outputs"]),
                      f"{r['val_dice']:.4f}", f"{r['evaluate_dice']:.4f}",
                      f"{regions['Dice']:.4f}" if isinstance(regions, dict) and "Dice" in regions else "-")
    console.print(table)
    for name, r in report.items():
        console.print(f"[bold]{name}[/bold]: " + " && ".join(r["commands"]), highlight=False, soft_wrap=True)
        for line in r["convert_lines"][:3] + r["predict_lines"][:1]:
            console.print(f"    {line}", highlight=False, soft_wrap=True)
    write_results("layouts", report, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
