"""``bigmem synth``: synthetic phantoms in the HDF5 store format (the embedded default dataset)."""

from __future__ import annotations

from bigmem.cli.common import check_allocation, check_output_file

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

    from bigmem import api
    from bigmem.units import format_bytes, format_count

    api.check_synth(args.cases, args.volume, args.classes)  # first, before the memory and output checks
    voxels = args.volume**3
    check_allocation(voxels * PHANTOM_BYTES_PER_VOXEL, f"one {args.volume}^3 phantom", "a smaller --volume")
    check_output_file(args.out, "OUT.h5", needed_bytes=args.cases * voxels * STORE_BYTES_PER_VOXEL)
    console = Console(soft_wrap=True)
    bar = Progress(console=console, transient=True, disable=not console.is_terminal)
    tasks = []

    def advance(done: int, total: int) -> None:  # the bar starts once api.synth's checks pass: (0, total)
        if not tasks:
            bar.start()
            tasks.append(bar.add_task("phantoms", total=total))
        bar.update(tasks[0], completed=done)

    try:
        result = api.synth(args.out, cases=args.cases, volume=args.volume, classes=args.classes, seed=args.seed,
                           force=args.force, progress=advance)
    finally:
        if tasks:
            bar.stop()
    console.print(f"Wrote {format_count(result.cases, 'phantom')} of {result.volume}^3 ({result.classes} classes) to "
                  f"{result.path} ({format_bytes(result.nbytes)}).")
    return 0
