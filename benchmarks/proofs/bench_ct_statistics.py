"""CT normalisation figures: bigmem's against nnU-Net's fingerprint and against figures computed by hand.

    python benchmarks/proofs/bench_ct_statistics.py [--nnunet-python PATH] [--out DIR]

Writes a KiTS-like nnU-Net v2 raw dataset (3 CT cases whose foregrounds differ in size and in mean
HU), converts it with ``bigmem convert``, and compares the dataset's CT figures (foreground mean,
std, 0.5 and 99.5 percentiles):

- ``by hand``: every case weighing the same, exactly: the mean of the case means, the std from the
  cases' second moments, the percentiles of the equal-weight mixture of every foreground voxel;
- ``bigmem``: what convert recorded (``preprocess.foreground_sample`` + ``choose_schemes``);
- ``pooled (before)``: the rule bigmem had before, up to 10,000 voxels per case without
  replacement, pooled, under which a small case weighs less;
- ``nnU-Net``: with ``--nnunet-python`` (a Python with nnunetv2 installed, e.g. a benchmark-only
  venv), nnU-Net's own ``DatasetFingerprintExtractor`` on the same folder.

Prints a table and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import numpy as np
from harness import bench_parser, command_line, write_results

# (shape, foreground radius in voxels, mean HU, std HU) per case: a small bright case beside large ones
CASES = [((40, 96, 96), 7, 290.0, 60.0), ((33, 96, 96), 20, 220.0, 80.0), ((57, 96, 96), 16, 235.0, 75.0)]
SPACING = (0.8, 0.8, 3.0)


def write_dataset(root: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    import nibabel as nib

    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    rng = np.random.default_rng(0)
    cases = []
    for index, (shape, radius, mean, std) in enumerate(CASES):
        shape_xyz = (shape[1], shape[2], shape[0])
        grid = np.stack(np.meshgrid(*[np.arange(s) - s / 2 for s in shape_xyz], indexing="ij"), -1)
        distance = np.linalg.norm(grid * np.array(SPACING) / 0.8, axis=-1)
        label = (distance < radius).astype(np.uint8)
        label[distance < radius / 2] = 2
        image = np.where(label > 0, rng.normal(mean, std, shape_xyz), rng.normal(-500, 300, shape_xyz))
        image = np.round(image).astype(np.int16)
        affine = np.diag([*SPACING, 1.0])
        nib.save(nib.Nifti1Image(image, affine), str(root / "imagesTr" / f"case_{index:03d}_0000.nii.gz"))
        nib.save(nib.Nifti1Image(label, affine), str(root / "labelsTr" / f"case_{index:03d}.nii.gz"))
        cases.append((image.astype(np.float64), label))
    (root / "dataset.json").write_text(json.dumps({
        "channel_names": {"0": "CT"}, "labels": {"background": 0, "kidney": 1, "tumor": 2},
        "numTraining": len(CASES), "file_ending": ".nii.gz"}))
    return cases


def by_hand(cases) -> dict:
    """Equal case weights, exactly: each voxel of case c weighs 1 / n_c."""
    values = [image[label > 0] for image, label in cases]
    means = [v.mean() for v in values]
    mean = float(np.mean(means))
    second = float(np.mean([(v ** 2).mean() for v in values]))
    every = np.concatenate(values)
    weights = np.concatenate([np.full(len(v), 1.0 / len(v)) for v in values])
    order = np.argsort(every)
    cumulative = np.cumsum(weights[order]) / weights.sum()
    low, high = (float(every[order][np.searchsorted(cumulative, q / 100)]) for q in (0.5, 99.5))
    return {"mean": mean, "std": (second - mean ** 2) ** 0.5, "low": low, "high": high,
            "foreground_voxels": [int(len(v)) for v in values]}


def pooled_before(cases) -> dict:
    """The former rule: up to 10,000 foreground voxels per case, without replacement, pooled."""
    import zlib

    samples = []
    for index, (image, label) in enumerate(cases):
        where = np.flatnonzero(label.reshape(-1))
        rng = np.random.default_rng(zlib.crc32(f"case_{index:03d}".encode()))
        if where.size > 10_000:
            where = np.sort(rng.choice(where, 10_000, replace=False))
        samples.append(image.reshape(-1)[where])
    pooled = np.concatenate(samples)
    low, high = np.percentile(pooled, (0.5, 99.5))
    return {"mean": float(pooled.mean()), "std": float(pooled.std()), "low": float(low), "high": float(high)}


def bigmem_figures(root: Path, store: Path) -> dict:
    from bigmem.data.convert import convert
    from bigmem.data.layouts import read_dataset
    from bigmem.data.store import HDF5VolumeStore

    convert(read_dataset(root), store)
    with HDF5VolumeStore(store) as opened:
        channel = opened.preprocessing.channels[0]
    return {"mean": channel.mean, "std": channel.std, "low": channel.low, "high": channel.high}


def nnunet_figures(python: str, raw: Path, work: Path) -> dict:
    """nnU-Net v2's own fingerprint of the dataset (Dataset999_KiTSLike under a temporary nnUNet_raw)."""
    dataset = work / "raw" / "Dataset999_KiTSLike"
    dataset.parent.mkdir(parents=True)
    os.symlink(raw, dataset)
    env = dict(os.environ, nnUNet_raw=str(work / "raw"), nnUNet_preprocessed=str(work / "preprocessed"),
               nnUNet_results=str(work / "results"))
    code = ("from nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor import "
            "DatasetFingerprintExtractor as E; E(999, 1, verbose=False).run()")
    subprocess.run([python, "-c", code], env=env, check=True, capture_output=True, text=True)
    fingerprint = json.loads((work / "preprocessed" / "Dataset999_KiTSLike" / "dataset_fingerprint.json").read_text())
    stats = fingerprint["foreground_intensity_properties_per_channel"]["0"]
    return {"mean": stats["mean"], "std": stats["std"], "low": stats["percentile_00_5"],
            "high": stats["percentile_99_5"]}


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--nnunet-python", help="a Python with nnunetv2 installed (a benchmark-only venv)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from bigmem.sysinfo import collect_sysinfo

    console = Console()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "kits_like"
        cases = write_dataset(root)
        rows = {"by hand (equal case weights)": by_hand(cases), "bigmem": bigmem_figures(root, Path(folder) / "s.h5"),
                "pooled (before)": pooled_before(cases)}
        if args.nnunet_python:
            rows["nnU-Net v2 fingerprint"] = nnunet_figures(args.nnunet_python, root, Path(folder) / "nnunet")
    hand = rows["by hand (equal case weights)"]
    table = Table(title="CT foreground figures of a 3-case KiTS-like set (HU)")
    for column in ("", "mean", "std", "0.5 pct", "99.5 pct", "mean vs hand"):
        table.add_column(column, justify="right")
    for name, row in rows.items():
        row["mean_vs_hand_pct"] = 100.0 * (row["mean"] - hand["mean"]) / hand["mean"]
        table.add_row(name, f"{row['mean']:.2f}", f"{row['std']:.2f}", f"{row['low']:.1f}", f"{row['high']:.1f}",
                      f"{row['mean_vs_hand_pct']:+.2f}%")
    console.print(table)
    write_results("ct_statistics", {"machine": collect_sysinfo(include_tensorflow=False),
                                    "command": command_line(__file__), "cases": [list(c[0]) + list(c[1:])
                                                                                 for c in CASES],
                                    "rows": rows}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
