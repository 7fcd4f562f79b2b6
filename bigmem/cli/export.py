"""``bigmem export``: a trained run as a self-contained model folder, to copy to another machine."""

from __future__ import annotations

import argparse

HELP = "copy what predict needs of a run into a model folder (portable, no training store)"

DESCRIPTION = """\
Write OUT_DIR with what 'bigmem predict' needs of RUN_DIR, and nothing else: config.json (the
network), preprocessing.json (spacing, crop/pad, normalisation with the training dataset's
statistics, channel and class names), plan.json (the sliding window) and the weights: model.keras,
and with --checkpoint the named checkpoint as well (predict it with --checkpoint there too).
The training store is not needed: 'bigmem predict OUT_DIR scans/ -o out' works on any machine
with bigmem. A run trained before runs recorded preprocessing.json gets one here, from its
store. OUT_DIR is written under a temporary name and renamed: never half a model.

examples:
  bigmem export runs/kits19-1 -o models/kits19
  bigmem export runs/brats-2 -o models/brats-best --checkpoint best
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("export", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a bigmem train run directory")
    parser.add_argument("-o", "--out", required=True, metavar="OUT_DIR", help="the model folder to write")
    parser.add_argument("--checkpoint", metavar="WHICH",
                        help="also copy this checkpoint: best, latest or ckpt-N (default: model.keras only)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    parser.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console

    from bigmem import api
    from bigmem.units import format_bytes

    result = api.export(args.run_dir, args.out, checkpoint=args.checkpoint, force=args.force)
    files = ", ".join(result.files)
    Console(soft_wrap=True).print(f"Exported {args.run_dir} to {result.path} ({format_bytes(result.nbytes)}: {files}).",
                                  highlight=False)
    return 0
