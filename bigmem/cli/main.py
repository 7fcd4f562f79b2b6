"""The ``bigmem`` command: one entry point, one module per subcommand.

``main(argv=None) -> int`` so tests call it directly. Errors map to the exit codes README.md lists:
0 ok · 1 a bigmem error · 2 usage error · 3 does not fit in memory. No traceback unless ``-v``.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import bigmem
from bigmem.cli import compare, convert, evaluate, export, info, plan, predict, profile, report, synth, train, tune
from bigmem.cli.common import flag_for
from bigmem.errors import EXIT_ERROR, EXIT_USAGE, BigmemError

COMMANDS = (info, synth, convert, train, tune, profile, plan, compare, predict, evaluate, export, report)

DESCRIPTION = """\
bigmem trains 3D U-Nets on whole volumetric scans (CT, MRI) in the RAM of one large CPU server.

examples:
  bigmem info                                   the machine as bigmem sees it
  bigmem synth phantoms.h5 --cases 8 --volume 64  synthetic phantoms in the HDF5 store format
  bigmem convert Task01_BrainTumour -o brats.h5  an MSD dataset (NIfTI) -> an HDF5 store
  bigmem train                                  train the 'small' preset on the embedded phantoms
  bigmem train --data store.h5 --model kits19 --volume 128 --precision bf16
  bigmem profile --model kits19 --volume 512    predicted memory footprint, per component
  bigmem plan --memory-budget 1.5TiB --model kits19  the largest volume and batch that fit
  bigmem compare --simulate-replicas 2 --steps 5  big-memory CPU vs data-parallel baseline
  bigmem report runs/small-20261130-101500      plots and a summary of a run (finished or running)
  bigmem predict runs/small-20261130-101500 scans/ -o predictions/  segment new scans, whole volumes
  bigmem evaluate predictions/ Task05/labelsTr  Dice, IoU, volumes and HD95 per case and class
  bigmem export runs/small-20261130-101500 -o models/small  a portable model folder (predict needs only it)

exit codes: 0 ok, 1 error (bad input, corrupt file, ...), 2 usage error, 3 does not fit in memory.
"""


def verbose_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show TensorFlow's logs and full tracebacks")
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigmem", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[verbose_parent()])
    parser.add_argument("--version", action="version", version=f"bigmem {bigmem.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers, [verbose_parent()])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help/--version, 2 for a usage error
        return int(exc.code or 0)
    verbose = getattr(args, "verbose", False)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.run(args))
    except BigmemError as exc:
        if verbose:
            traceback.print_exc()
        message = exc.render(flag_for)  # its fields ({train.batch_size}) as the flags that set them
        print(f"bigmem {args.command}: error: {message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"bigmem {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, not the user's fault: still one line unless -v
        if verbose:
            traceback.print_exc()
        print(f"bigmem {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(run again with -v for the traceback)", file=sys.stderr)
        return EXIT_ERROR


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
