"""Store size of a BraTS-like dataset: what ``bigmem convert`` writes for MSD Task01-shaped cases.

    python benchmarks/performance/bench_store_size.py [--cases 4] [--source-dtype int16|float32] [--chunks 64|none]
        [--quick] [--out DIR]

Writes ``--cases`` MSD Task01-like cases as NIfTI (.nii.gz): 240x240x155, four MRI channels
(FLAIR, T1w, t1gd, T2w), zero outside a head-shaped ellipsoid, tissue intensities of a few hundred
with noise, labels 0..3 in a tumour-shaped blob, in the source dtype BraTS ships (int16; or
float32). Converts them (uncompressed; 64^3 chunks, the default, or --chunks), and prints per case and in
total: the .nii.gz bytes, the store bytes and the image dtype the store chose. Run it once with
the bigmem to measure (``PYTHONPATH=<old checkout> python benchmarks/performance/bench_store_size.py`` for an
older one: it uses only ``read_msd``, in ``data.layouts`` or, before it, ``data.nifti``, and
``convert.convert``). Writes ``store-size-<machine>-<time>.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import h5py
import nibabel as nib
import numpy as np
from harness import bench_parser, write_results
from rich.console import Console
from rich.table import Table

SHAPE = (240, 240, 155)
CHANNELS = ("FLAIR", "T1w", "t1gd", "T2w")
LABELS = ("background", "edema", "non-enhancing tumor", "enhancing tumour")


def brats_like_case(rng: np.random.Generator, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    grid = np.ogrid[tuple(slice(0, s) for s in SHAPE)]
    head = sum(((g - s / 2) / (s * 0.4)) ** 2 for g, s in zip(grid, SHAPE)) < 1.0
    centre = [s * rng.uniform(0.35, 0.65) for s in SHAPE]
    distance = np.sqrt(sum(((g - c) / 20.0) ** 2 for g, c in zip(grid, centre)))
    label = np.select([distance < 0.4, distance < 0.7, distance < 1.0], [3, 2, 1], 0).astype(np.uint8)
    label[~head] = 0
    image = np.zeros(SHAPE + (len(CHANNELS),), np.float32)
    for c in range(len(CHANNELS)):
        tissue = rng.normal(400 + 80 * c, 60, SHAPE).astype(np.float32) + 150 * label
        image[..., c] = np.where(head, tissue, 0.0)
    if dtype == "int16":
        image = np.clip(np.round(image), 0, 32767).astype(np.int16)
    return image, label


def write_dataset(root: Path, cases: int, dtype: str) -> Path:
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    affine = np.diag([-1.0, -1.0, 1.0, 1.0])  # BraTS's LPS-like 1 mm grid
    training = []
    for index in range(cases):
        image, label = brats_like_case(np.random.default_rng(index), dtype)
        name = f"BRATS_{index + 1:03d}.nii.gz"
        nib.save(nib.Nifti1Image(image, affine), str(root / "imagesTr" / name))
        nib.save(nib.Nifti1Image(label, affine), str(root / "labelsTr" / name))
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    (root / "dataset.json").write_text(json.dumps({
        "modality": {str(i): n for i, n in enumerate(CHANNELS)}, "labels": {str(i): n for i, n in enumerate(LABELS)},
        "training": training}))
    return root


def main(argv=None) -> int:
    parser = bench_parser(__doc__, quick={"cases": 1})
    parser.add_argument("--cases", type=int, default=4)
    parser.add_argument("--source-dtype", choices=["int16", "float32"], default="int16")
    parser.add_argument("--chunks", default="64", help="convert's chunk edge, or none (contiguous)")
    args = parser.parse_args(argv)
    import bigmem
    from bigmem.data.convert import convert
    try:
        from bigmem.data.layouts import read_msd
    except ImportError:  # an older checkout: read_msd was in data.nifti
        from bigmem.data.nifti import read_msd

    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        source = write_dataset(Path(tmp) / "Task01_like", args.cases, args.source_dtype)
        store = Path(tmp) / "brats.h5"
        started = time.perf_counter()
        convert(read_msd(source), store, chunk_edge=None if args.chunks == "none" else int(args.chunks))
        seconds = time.perf_counter() - started
        rows = []
        with h5py.File(store) as handle:
            for case_id in sorted(handle["cases"]):
                name = f"{case_id}.nii.gz"
                nifti = sum((source / sub / name).stat().st_size for sub in ("imagesTr", "labelsTr"))
                group = handle[f"cases/{case_id}"]
                stored = int(group["image"].id.get_storage_size() + group["label"].id.get_storage_size())
                rows.append({"case": case_id, "nifti_bytes": nifti, "store_bytes": stored,
                             "image_dtype": str(group["image"].dtype)})
        total_store = store.stat().st_size
    total_nifti = sum(r["nifti_bytes"] for r in rows)
    table = Table(title=f"store size, {args.cases} BraTS-like cases ({args.source_dtype} source, chunks "
                        f"{args.chunks})")
    for column in ("case", ".nii.gz", "store datasets", "image dtype"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["case"], f"{r['nifti_bytes'] / 1e6:.1f} MB", f"{r['store_bytes'] / 1e6:.1f} MB",
                      r["image_dtype"])
    table.add_row("total", f"{total_nifti / 1e6:.1f} MB", f"{total_store / 1e6:.1f} MB (file)", "")
    console.print(table)
    per_case = total_store / args.cases
    console.print(f"{per_case / 1e6:.1f} MB per case; 484 cases (Task01): {484 * per_case / 1e9:.1f} GB; "
                  f"convert took {seconds:.1f} s")
    write_results("store-size", {"cases": args.cases, "source_dtype": args.source_dtype, "shape": SHAPE,
                                 "chunks": args.chunks,
                                 "channels": list(CHANNELS), "rows": rows, "nifti_bytes": total_nifti,
                                 "store_file_bytes": total_store, "convert_s": seconds,
                                 "bigmem_module": str(Path(bigmem.__file__).parent)}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
