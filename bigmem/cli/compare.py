"""``bigmem compare``: the big-memory CPU path against a data-parallel GPU baseline, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigmem.cli.common import add_budget_flag, budget_arguments
from bigmem.errors import UsageError

HELP = "compare whole-volume CPU training with a data-parallel GPU baseline"

DESCRIPTION = """\
Train the same model on the same data for the same budget (a) bigmem's way, whole volumes in
this host's RAM, and (b) data parallel with tf.distribute.MirroredStrategy on patches that fit
one GPU (--gpu-memory). Without GPUs, (b) runs on N logical CPU devices (--simulate-replicas N)
and everything it reports is labelled "simulated on CPU". Both models are then evaluated on
held-out whole volumes. Writes compare.json, compare.md and compare.png (and both run
directories) to --out, and prints the table.
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("compare", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", metavar="STORE.h5", help="HDF5 store (default: the synthetic phantoms)")
    parser.add_argument("--model", metavar="PRESET", help="preset (default: small)")
    parser.add_argument("--volume", type=int, metavar="N", help="whole-volume edge (default: the preset's)")
    parser.add_argument("--batch-size", type=int, metavar="B", help="per replica, and for the CPU path")
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs for the data-parallel path")
    parser.add_argument("--simulate-replicas", type=int, metavar="N",
                        help="run the data-parallel path on N logical CPU devices (default when no GPU: 2)")
    parser.add_argument("--gpu-memory", metavar="SIZE", default="80GiB",
                        help="memory of one GPU for the patch size and the largest-volume figure (default 80GiB)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, metavar="K", help="training steps for each path (default 5)")
    budget.add_argument("--time-budget", type=float, metavar="S", help="seconds of training for each path")
    add_budget_flag(parser, help_text="host memory budget of both training runs and of the largest-volume figure "
                                      "(default: MemAvailable)")
    parser.add_argument("--holdout", type=int, metavar="N", help="held-out cases for the Dice (default: 1 in 5)")
    parser.add_argument("--monitor-interval", type=float, metavar="S",
                        help="seconds between monitor.csv rows in each path's run directory (default 1; 0: off)")
    parser.add_argument("--out", metavar="DIR", default="compare", help="output folder (default: ./compare)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from bigmem.config.presets import resolve_config
    from bigmem.data.store import HDF5VolumeStore
    from bigmem.data.derived import with_data_fields
    from bigmem.distribute.compare import compare, rows
    from bigmem.tfenv import import_tensorflow
    from bigmem.units import parse_bytes

    if args.steps is not None and args.steps < 1:
        raise UsageError(f"Invalid --steps {args.steps}: expected a positive integer.")
    gpu_memory = parse_bytes(args.gpu_memory, flag="--gpu-memory")
    memory_budget = budget_arguments(args)[0]
    overrides = {"data": {k: v for k, v in (("volume", args.volume),) if v is not None},
                 "train": {k: v for k, v in (("batch_size", args.batch_size),) if v is not None}}
    config = resolve_config(args.model or "small", overrides)
    config = with_data_fields(config.updated({"data": {"store": args.data}}))
    store = config.data.store
    with HDF5VolumeStore(store) as opened:
        num_cases = len(opened)
    holdout = args.holdout if args.holdout is not None else max(1, num_cases // 5)
    tf = import_tensorflow(verbose=getattr(args, "verbose", False))
    gpus = len(tf.config.list_physical_devices("GPU"))
    simulate = args.simulate_replicas is not None or gpus == 0
    replicas = args.simulate_replicas or (2 if simulate else (args.gpus or gpus))
    common = ["--model", args.model or "small", "--data", store, "--holdout", str(holdout)]
    if args.volume:
        common += ["--volume", str(args.volume)]
    if args.batch_size:
        common += ["--batch-size", str(args.batch_size)]
    if memory_budget is not None:
        common += ["--memory-budget", str(memory_budget)]
    if args.monitor_interval is not None:
        if args.monitor_interval < 0:
            raise UsageError(f"Invalid --monitor-interval {args.monitor_interval:g}: expected seconds >= 0 "
                             "(0 turns the monitor off).")
        common += ["--monitor-interval", str(args.monitor_interval)]
    console = Console(soft_wrap=True)
    status = Console(soft_wrap=True, stderr=True)
    report = compare(config, Path(args.out), replicas=replicas, simulate=simulate, gpu_memory_bytes=gpu_memory,
                     steps=args.steps or (None if args.time_budget else 5), time_budget_s=args.time_budget,
                     common=common, progress=lambda m: status.print(m, style="dim"), memory_budget_bytes=memory_budget)
    title = "bigmem compare" + (" — data-parallel path SIMULATED ON CPU" if simulate else "")
    table = Table(title=title)
    table.add_column("")
    table.add_column("big-memory CPU (bigmem)")
    table.add_column(f"data parallel ({replicas} {'simulated replicas' if simulate else 'GPUs'})")
    for row in rows(report):
        table.add_row(*row)
    console.print(table)
    console.print(f"wrote {args.out}/compare.json, compare.md, compare.png")
    return 0
