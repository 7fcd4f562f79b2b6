"""``bigmem synth``: synthetic phantoms in the HDF5 store format (the embedded default dataset)."""

from __future__ import annotations

from bigmem.cli.common import check_allocation, check_output_file
from bigmem.errors import DataError, UsageError

HELP = "write synthetic 3D phantoms to an HDF5 store"
# data/synth.make_phantom's peak RSS growth per voxel (its grids, radii, ripple and float64 noise),
# measured on the dev machine: 95 B/voxel at 64^3, 82 at 128^3; the larger figure, rounded up.
PHANTOM_BYTES_PER_VOXEL = 96
STORE_BYTES_PER_VOXEL = 5  # one float32 image channel and a uint8 label, uncompressed


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser(
        "synth", help=HELP, parents=parents,
        description="Write synthetic 3D phantoms (noisy volumes with a bias field and lumpy ellipsoids of "
                    "CLASSES-1 foreground classes) to an HDF5 store that 'bigmem train --data' reads.")
    parser.add_argument("out", metavar="OUT.h5", help="the store to write")
    parser.add_argument("--cases", type=int, default=8, help="number of cases (default: 8)")
    parser.add_argument("--volume", type=int, default=64, help="edge of each cubic volume in voxels (default: 64)")
    parser.add_argument("--classes", type=int, default=3, help="number of classes, background included (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument("--force", action="store_true", help="overwrite OUT.h5 if it exists")
    parser.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from bigmem.data.synth import write_synthetic_store
    from bigmem.units import format_bytes, format_count

    if args.cases < 1:
        raise UsageError(f"Invalid --cases {args.cases}: expected a positive integer.")
    if args.volume < 4:
        raise UsageError(f"Invalid --volume {args.volume}: expected an integer >= 4.")
    if not 2 <= args.classes <= 255:
        raise UsageError(f"Invalid --classes {args.classes}: expected 2..255 (background + foreground classes).")
    voxels = args.volume**3
    check_allocation(voxels * PHANTOM_BYTES_PER_VOXEL, f"one {args.volume}^3 phantom", "a smaller --volume")
    out = check_output_file(args.out, "OUT.h5", needed_bytes=args.cases * voxels * STORE_BYTES_PER_VOXEL)
    if out.exists() and not args.force:
        raise DataError(f"{str(out)!r} exists: pass --force to overwrite it.")
    console = Console(soft_wrap=True)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("phantoms", total=args.cases)
        write_synthetic_store(out, num_cases=args.cases, volume=args.volume, num_classes=args.classes, seed=args.seed,
                              progress=lambda done, total: progress.update(task, completed=done))
    console.print(f"Wrote {format_count(args.cases, 'phantom')} of {args.volume}^3 ({args.classes} classes) to {out} "
                  f"({format_bytes(out.stat().st_size)}).")
    return 0
