"""``bigmem predict``: segment new scans with a trained run, in the source files' geometry."""

from __future__ import annotations

import argparse

from bigmem.cli.common import add_budget_flag, budget_arguments, check_output_dir, parse_shape
from bigmem.errors import UsageError
from bigmem.infer import DEFAULT_OVERLAP

HELP = "segment new scans with a trained run (whole volume in one pass where RAM allows)"

DESCRIPTION = f"""\
Segment every case of INPUT with the network trained in RUN_DIR and write OUT/<case>.nii.gz: a
uint8 label map in the source file's geometry (its shape, affine and orientation), with the
preprocessing of training applied and undone: canonical orientation, --spacing resampling (the
class probabilities are resampled back, then the argmax taken), --shape crop/pad, per-case z-score.

INPUT is a NIfTI file, a folder of them (one case per file, or nnU-Net's <case>_0000.nii.gz per
channel), a Medical Segmentation Decathlon or nnU-Net v2 folder (its imagesTs/, else imagesTr/;
nnU-Net's channel files grouped by case), KiTS case folders (case_00000/imaging.nii.gz, with or
without a segmentation) or one of them, or a bigmem store (all its cases, or --cases); one line
says what was found. NIfTI input is prepared as bigmem convert prepared the run's training store.

Outputs are named after the case id of INPUT's layout (OUT/case_00000.nii.gz for a KiTS case
folder); two inputs that would share an output name are refused before anything is written. A
case whose OUT/<case>.nii.gz exists is kept and counted (a second run resumes an interrupted
one); --force segments it again and overwrites it.

Several RUN_DIRs segment as an ensemble: each network runs on the case in turn (with its own
window and --tta, under --checkpoint), and the mean of their class probabilities is mapped back
and its argmax written. The runs must agree on the classes, the channels and the preparation of
the scan (resampling, crop/pad, normalisation); the first that does not is named. The inference
memory plan counts every member's weights and the probabilities' running sum.

modes: whole (default where the inference memory plan fits the budget) sends the whole volume
through the network in one pass: no tiles, no seams. sliding predicts Gaussian-weighted windows
(sigma 1/8 of the window, --overlap, default {DEFAULT_OVERLAP:g}; the window is what the network trained on —
the training volume, or the patch of a data-parallel run on patches — or --window)
and blends them, as MONAI's sliding_window_inference and nnU-Net do. auto chooses per case and
says which. --tta averages the 8 mirrored passes.

examples:
  bigmem predict runs/kits19 kits19/imagesTs -o predictions/
  bigmem predict runs/kits23 kits23/dataset -o predictions/          # KiTS case folders -> case_XXXXX.nii.gz
  bigmem predict runs/brats Dataset137_BraTS2021 -o predictions/      # nnU-Net v2: imagesTs/, 4 channel files each
  bigmem predict runs/small data/brats.h5 --cases BRATS_480,BRATS_481 -o out --checkpoint best
  bigmem predict runs/small scan.nii.gz -o out --mode sliding --overlap 0.5 --tta --save-probabilities
  bigmem predict runs/fold0 runs/fold1 runs/fold2 runs/fold3 runs/fold4 imagesTs -o ensemble/ --checkpoint best
  for k in 0 1 2 3 4; do bigmem predict runs/fold$k data.h5 --val -o crossval/; done
  bigmem evaluate crossval/ data.h5 -o crossval/summary.json       # the cross-validation summary
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("predict", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                        help="a bigmem train run directory; several: an ensemble, their class probabilities averaged "
                             "(e.g. the five --fold runs of a cross-validation)")
    parser.add_argument("input", metavar="INPUT", help="NIfTI file, folder of NIfTI files, MSD or nnU-Net v2 folder, "
                                                       "KiTS case folders (or one), or store (.h5)")
    parser.add_argument("-o", "--out", metavar="OUT_DIR", required=True, help="where <case>.nii.gz are written")
    parser.add_argument("--checkpoint", default="final", metavar="WHICH",
                        help="final (model.keras, default), best (best validation Dice, --val-every), latest, or "
                             "ckpt-N")
    parser.add_argument("--cases", metavar="IDS", help="comma-separated case ids to segment (default: all)")
    parser.add_argument("--val", action="store_true",
                        help="segment only the run's validation cases: its --fold's val cases (RUN_DIR/"
                             "splits_final.json), or its --holdout cases. Each fold's --val into one OUT, then "
                             "bigmem evaluate OUT, is nnU-Net's cross-validation summary")
    parser.add_argument("--mode", default="auto", choices=["auto", "whole", "sliding"],
                        help="whole volume in one pass, Gaussian-weighted sliding windows, or auto (whole where "
                             "the inference plan fits the memory budget; default)")
    parser.add_argument("--window", metavar="N|D,H,W",
                        help="sliding window: an edge N or a shape D,H,W, each a multiple of 2^depth (default: the "
                             "largest volume the run trained on, or the patch of a run trained on patches)")
    parser.add_argument("--overlap", type=float, default=DEFAULT_OVERLAP, metavar="F",
                        help=f"sliding windows' overlap fraction in [0, 1) (default {DEFAULT_OVERLAP:g})")
    parser.add_argument("--accumulate", default="float32", choices=["float32", "float16"],
                        help="sliding-window accumulators: float32 (default) or float16 (half the memory; an "
                             "overflow stops with an error)")
    parser.add_argument("--tta", action="store_true", help="average the 8 mirrored passes (test-time augmentation)")
    parser.add_argument("--save-probabilities", action="store_true",
                        help="also write <case>_probabilities.npz: the class probabilities (float16, X,Y,Z,K) in the "
                             "same geometry, with its affine (NIfTI-1 has no float16; nnU-Net also uses .npz)")
    parser.add_argument("--ignore-plan", action="store_true",
                        help="--mode whole even where the inference plan says the volume does not fit")
    parser.add_argument("--force", action="store_true",
                        help="overwrite existing outputs (default: a case whose OUT/<case>.nii.gz exists is kept)")
    add_budget_flag(parser, help_text="memory the inference plan may use (default: what the NUMA placement can "
                                      "use, else MemAvailable)")
    parser.set_defaults(run=run)


def _window(text: str | None):
    """--window N or D,H,W as an int or a shape (None when not given)."""
    if text is None:
        return None
    if "," in text:
        return parse_shape(text, "--window")
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"Invalid --window {text!r}: expected a positive integer N or D,H,W such as 128,128,64.") \
            from None


def run(args) -> int:
    from rich.console import Console

    from bigmem import api
    from bigmem.infer.predict import KeptOutput
    from bigmem.units import format_bytes, format_count

    cases = [c.strip() for c in args.cases.split(",") if c.strip()] if args.cases else None
    if args.cases is not None and not cases:
        raise UsageError(f"Invalid --cases {args.cases!r}: expected comma-separated case ids.")
    check_output_dir(args.out, "-o")  # before TensorFlow starts, as predict checks its own arguments
    console = Console(soft_wrap=True)
    budget_bytes, flag = budget_arguments(args)
    done = kept = 0
    for result in api.predict(args.run_dir, args.input, args.out, mode=args.mode, budget_bytes=budget_bytes,
                              budget_flag=flag, ignore_plan=args.ignore_plan, console=console,
                              checkpoint=args.checkpoint, cases=cases, window=_window(args.window),
                              overlap=args.overlap, accumulate=args.accumulate, tta=args.tta,
                              save_probabilities=args.save_probabilities, verbose=getattr(args, "verbose", False),
                              force=args.force, validation=args.val,
                              say=lambda line: console.print(line, highlight=False)):
        if isinstance(result, KeptOutput):
            kept += 1
            console.print(f"{result.case_id}: {result.labels_path} exists, kept (--force overwrites it)",
                          highlight=False)
            continue
        done += 1
        shape = "x".join(map(str, result.shape))
        extra = f" and {result.probabilities_path.name}" if result.probabilities_path else ""
        console.print(f"{result.case_id}: {result.mode}{' +tta' if args.tta else ''}, {shape}, "
                      f"{result.seconds:.1f} s, peak RSS {format_bytes(result.peak_rss_bytes)} -> "
                      f"{result.labels_path}{extra}", highlight=False)
    also = f"; kept {format_count(kept, 'existing output')} (--force overwrites them)" if kept else ""
    console.print(f"Segmented {format_count(done, 'case')} into {args.out}{also}.", highlight=False)
    return 0
