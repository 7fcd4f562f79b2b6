"""``bigmem evaluate``: Dice, IoU, volumes and HD95 of predicted label maps against references."""

from __future__ import annotations

import argparse

from bigmem.errors import UsageError

HELP = "score predicted label maps against references: Dice, IoU, TP/FP/FN, volumes, HD95, per class and region"

# The empty rule is bigmem.infer.metrics.EMPTY_RULE; it is restated here so that --help does not
# import numpy (tests/cli/test_evaluate_command.py checks the two say the same).
DESCRIPTION = """\
Compare each predicted label map in PRED (a folder of <case>.nii.gz or .nii) with its reference
in REF, voxel for voxel, with the reference's voxel spacing. REF is the dataset the cases came
from, read as convert and predict read it, its cases under the ids predict names its outputs with:
  - a Medical Segmentation Decathlon or nnU-Net v2 folder: its labelsTr/ and, where present,
    labelsTs/ label maps;
  - KiTS case folders (case_00000/segmentation.nii.gz): the case id is the folder's name; folders
    without a segmentation (test cases) have no reference;
  - a folder of NIfTI label maps (<case>.nii.gz), such as labelsTr/;
  - a bigmem store, whose cases are scored on their source grid: against the source label file
    where convert resampled or cropped them.
Per case and per class: Dice, IoU, TP/FP/FN voxel counts, reference and predicted volumes in mL,
and the 95th percentile Hausdorff distance (HD95) in mm between the two surfaces (MONAI's
definition). Writes summary.json (nnU-Net v2's layout: metric_per_case, mean per class,
foreground_mean) and prints the means.

names and regions: Classes are named, and regions (label values scored together, such as BraTS's
whole_tumor [1, 2, 3], tumor_core [2, 3] and enhancing_tumor [3]) are scored beside them, from the
REF store, else the --run (its preprocessing.json or training store), else the REF dataset's
dataset.json, or the one beside a REF folder of label maps (MSD's {"0": "background"} or nnU-Net
v2's {"background": 0, "whole_tumor": [1, 2, 3]}), or KiTS's classes. A class nothing names is
class1, class2, ...

empty classes: A class absent from both reference and prediction has Dice, IoU and HD95 undefined
(NaN in the API, null in summary.json) and is left out of the means, as nnU-Net v2 does; absent from
one side only, Dice and IoU are 0 and HD95 is undefined (no surface to measure from). Means count the
cases left out (num_undefined). MONAI's ignore_empty=True also leaves out a class whose reference
is empty even when the prediction is not; bigmem scores that false positive 0, as nnU-Net does.

A case on one side only (a reference without prediction, or a prediction without reference) is an
error unless --allow-missing; so are shapes that differ, non-integer labels and labels >= the
number of classes. Affines that differ by more than 1e-3 are a warning.

examples:
  bigmem evaluate runs/kits19/predictions kits19/data --allow-missing
  bigmem evaluate predictions/ Dataset137_BraTS2021 --run runs/brats
  bigmem evaluate predictions/ brats.h5 --allow-missing --classes 1,2,3 -o eval/summary.json
  bigmem evaluate predictions/ Task01_BrainTumour/labelsTr
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("evaluate", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pred", metavar="PRED", help="folder of predicted label maps (<case>.nii.gz or .nii)")
    parser.add_argument("ref", metavar="REF", help="the references: an MSD or nnU-Net v2 dataset folder "
                                                   "(labelsTr/, labelsTs/), KiTS case folders, a folder of label maps, "
                                                   "or a bigmem store (.h5)")
    parser.add_argument("-o", "--out", metavar="SUMMARY.json", help="where to write the summary "
                                                                    "(default: PRED/summary.json)")
    parser.add_argument("--classes", metavar="C[,C...]",
                        help="foreground labels to score, e.g. 1,2 (default: 1..num_classes-1 for a store or "
                             "--num-classes, else 1..the largest label seen)")
    parser.add_argument("--num-classes", type=int, metavar="K",
                        help="labels are 0..K-1; a larger one is an error (default: the store's; unchecked "
                             "for a folder)")
    parser.add_argument("--allow-missing", action="store_true",
                        help="score the cases found in both PRED and REF instead of failing on the others")
    parser.add_argument("--no-hausdorff", action="store_true", help="skip HD95 (the slow part on large volumes)")
    parser.add_argument("--run", dest="run_dir", metavar="RUN_DIR",
                        help="the run that made the predictions: its model's number of classes, and the class names "
                             "and regions it was trained with (its preprocessing.json, or its training store)")
    parser.set_defaults(run=run)


def parse_classes(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; a UsageError naming the flag otherwise.

    Example:
        >>> parse_classes("3, 1")
        [3, 1]
    """
    try:
        classes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        classes = []
    if not classes:
        raise UsageError(f"Invalid --classes {text!r}: expected comma-separated labels such as 1,2,3.")
    return classes


def run(args) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from bigmem import api
    from bigmem.units import format_count

    classes = parse_classes(args.classes) if args.classes else None
    if args.num_classes is not None and args.num_classes < 2:
        raise UsageError(f"Invalid --num-classes {args.num_classes}: expected at least 2 (background and one class).")
    out = Path(args.out) if args.out else Path(args.pred) / "summary.json"
    console = Console(soft_wrap=True)
    with console.status("evaluating", spinner="dots") as status:
        summary = api.evaluate(args.pred, args.ref, classes=classes, num_classes=args.num_classes,
                           allow_missing=args.allow_missing, out=out, hausdorff=not args.no_hausdorff,
                           run=args.run_dir, warn=lambda m: console.print(f"warning: {m}", style="yellow"),
                           progress=lambda case_id: status.update(f"evaluating: {case_id} done"))
    table = Table(title=f"{format_count(summary['num_cases'], 'case')}; means over the cases where defined")
    table.add_column("class / region" if summary["regions"] else "class")
    for column in ("Dice", "IoU", "HD95 mm", "undefined Dice/HD95"):
        table.add_column(column, justify="right")
    for c in summary["classes"]:
        key = str(c)
        name = summary["label_names"][key]
        _add_row(table, key if name == f"class{c}" else f"{c} {name}", summary["mean"][key],
                 summary["num_undefined"][key])
    _add_row(table, "foreground mean", summary["foreground_mean"], None)
    if summary["foreground_mean"] != summary["foreground_mean_defined"]:  # a class undefined in every case: NaN
        _add_row(table, "foreground mean (defined)", summary["foreground_mean_defined"], None)
    for region, values in summary["regions"].items():
        _add_row(table, f"{region} ({','.join(map(str, values))})", summary["region_mean"][region],
                 summary["region_num_undefined"][region])
    if summary["regions"]:
        _add_row(table, "region mean", summary["region_foreground_mean"], None)
    console.print(table)
    console.print(f"wrote {out}")
    return 0


def _add_row(table, label: str, mean: dict, undefined: dict | None) -> None:
    """One row of the means table: a class or region (with its undefined counts), or a mean of them (bold)."""
    table.add_row(label, _number(mean["Dice"]), _number(mean["IoU"]), _number(mean["HD95_mm"], 2),
                  f"{undefined['Dice']}/{undefined['HD95_mm']}" if undefined is not None else "",
                  style=None if undefined is not None else "bold")


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
