"""``bigmem evaluate`` end to end on KiTS-sized cases, for one or more bigmem checkouts side by side.

    python benchmarks/performance/bench_evaluate.py [--cases 2] [--checkout DIR ...] [--repeats 3] [--warmup 0]
        [--quick] [--out DIR]

Writes ``--cases`` reference/prediction pairs as .nii.gz, 512x512x211 at 0.8x0.8x3.0 mm as KiTS19
ships: kidney (1) and tumour (2) in two kidney-shaped blobs; the prediction shifted and eroded,
with a small false positive near a corner (as a model early in training has), which stretches
the bounding box of class 1 over most of the volume. Then times ``python -m bigmem evaluate PRED
REF`` (reading, Dice, volumes and HD95 per case and class) with each ``--checkout`` first on
PYTHONPATH (default: this one), median and range of ``--repeats`` runs, and again with
``--no-hausdorff``: the difference is HD95's share. The same in this process, without the
command's start and file reads: each checkout's ``case_metrics`` with and without HD95 on the
arrays as nibabel reads them (less noisy). It checks that every
checkout reports the same HD95. Writes ``evaluate-<machine>-<time>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import nibabel as nib
import numpy as np
from proofs.bench_hd95 import SPACING, kidneys
from harness import bench_parser, command_line, run_command, spread, time_calls, write_results
from rich.console import Console
from rich.table import Table

SHAPE = (512, 512, 211)


def write_pairs(root: Path, cases: int) -> tuple[Path, Path]:
    affine = np.diag([*SPACING, 1.0])
    ref_dir, pred_dir = root / "ref", root / "pred"
    ref_dir.mkdir(parents=True)
    pred_dir.mkdir()
    for index in range(cases):
        ref = kidneys(SHAPE, index, 0).astype(np.uint8)
        ref[kidneys(SHAPE, index, 6)] = 2  # the tumour: the kidneys' core
        pred = kidneys(SHAPE, index + 3, 2).astype(np.uint8)
        pred[kidneys(SHAPE, index + 3, 7)] = 2
        pred[10:16, 10:16, 5:8] = 1
        name = f"case_{index:05d}.nii.gz"
        nib.save(nib.Nifti1Image(ref, affine), str(ref_dir / name))
        nib.save(nib.Nifti1Image(pred, affine), str(pred_dir / name))
    return pred_dir, ref_dir


def run(checkout: Path, pred: Path, ref: Path, out: Path, *extra: str) -> float:
    """Seconds of one ``bigmem evaluate`` with ``checkout`` first on PYTHONPATH."""
    result = run_command([sys.executable, "-m", "bigmem", "evaluate", pred, ref, "-o", out, *extra],
                         what="bigmem evaluate", env={**os.environ, "PYTHONPATH": str(checkout)})
    if not result.ok:
        raise SystemExit(f"bigmem evaluate with {checkout} failed:\n{result.stderr}")
    return result.wall_s


def metrics_of(checkout: Path):
    """The checkout's ``bigmem/infer/metrics.py``, imported by path (it imports nothing else of bigmem)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"metrics_{abs(hash(str(checkout)))}",
                                                  checkout / "bigmem" / "infer" / "metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_metrics(checkout: Path, pairs, repeats: int, warmup: int = 0) -> dict:
    """In this process: each case's ``case_metrics`` (classes 1, 2) with HD95 and without, on the arrays as
    nibabel reads them (Fortran-ordered), median over ``repeats``; HD95's share is the difference."""
    metrics = metrics_of(checkout)
    rows = {}
    for hausdorff in (True, False):
        def score(hausdorff=hausdorff):
            for ref, pred in pairs:
                metrics.case_metrics(ref, pred, [1, 2], SPACING, hausdorff=hausdorff)

        timed = time_calls(score, repeats=repeats, warmup=warmup)
        rows["with_hd95_s" if hausdorff else "without_hd95_s"] = timed.spread.median
    rows["hd95_s"] = rows["with_hd95_s"] - rows["without_hd95_s"]
    return rows


def main(argv=None) -> int:
    parser = bench_parser(__doc__, repeats=3, warmup=0, quick={"cases": 1, "repeats": 1})
    parser.add_argument("--cases", type=int, default=2)
    parser.add_argument("--checkout", action="append", help="a bigmem checkout to time (repeatable)")
    args = parser.parse_args(argv)
    checkouts = [Path(c).absolute() for c in (args.checkout or [Path(__file__).resolve().parents[2]])]
    console = Console(soft_wrap=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pred, ref = write_pairs(Path(tmp), args.cases)
        pairs = [(np.asanyarray(nib.load(str(ref / p.name)).dataobj), np.asanyarray(nib.load(str(p)).dataobj))
                 for p in sorted(pred.iterdir())]
        in_process = {str(c): time_metrics(c, pairs, args.repeats, args.warmup) for c in checkouts}
        del pairs
        for index, checkout in enumerate(checkouts):
            summary = Path(tmp) / f"summary-{index}.json"
            for _ in range(args.warmup):
                run(checkout, pred, ref, summary)
            times = spread([run(checkout, pred, ref, summary) for _ in range(args.repeats)])
            rest = spread([run(checkout, pred, ref, Path(tmp) / "rest.json", "--no-hausdorff")
                           for _ in range(args.repeats)])
            scored = json.loads(summary.read_text())
            hd95 = {c: scored["mean"][c]["HD95_mm"] for c in ("1", "2")}
            rows.append({"checkout": str(checkout), **times.as_dict(), "hd95_mm": hd95,
                         "no_hausdorff_median_s": rest.median, "hd95_s": times.median - rest.median})
    table = Table(title=f"bigmem evaluate, {args.cases} KiTS-sized pairs ({'x'.join(map(str, SHAPE))}, 2 classes)")
    for column in ("checkout", "median s", "range s", "--no-hausdorff s", "HD95's share s", "HD95 class 1 / 2 (mm)"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["checkout"], f"{row['median_s']:.2f}", f"{row['min_s']:.2f}-{row['max_s']:.2f}",
                      f"{row['no_hausdorff_median_s']:.2f}", f"{row['hd95_s']:.2f}",
                      f"{row['hd95_mm']['1']:.3f} / {row['hd95_mm']['2']:.3f}")
    console.print(table)
    inner = Table(title="in this process: case_metrics over the cases (arrays as nibabel reads them)")
    for column in ("checkout", "with HD95 s", "without s", "HD95 s"):
        inner.add_column(column)
    for checkout, row in in_process.items():
        inner.add_row(checkout, f"{row['with_hd95_s']:.2f}", f"{row['without_hd95_s']:.2f}", f"{row['hd95_s']:.2f}")
    console.print(inner)
    same = all(np.allclose(list(r["hd95_mm"].values()), list(rows[0]["hd95_mm"].values())) for r in rows)
    console.print(f"equal HD95 across checkouts: {same}")
    write_results("evaluate", {"command": command_line(__file__, argv),
                               "cases": args.cases, "shape": list(SHAPE), "spacing_mm": list(SPACING), "rows": rows,
                               "in_process": in_process,
                               "equal_hd95": same}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
