"""``bigmem compare``: the big-memory CPU path against a data-parallel GPU baseline, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigmem.cli.common import add_budget_flag, budget_arguments, check_output_dir, check_positive
from bigmem.errors import UsageError
from bigmem.units import parse_bytes

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
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--volume", args.volume),
                        ("--gpus", args.gpus), ("--simulate-replicas", args.simulate_replicas),
                        ("--time-budget", args.time_budget)):
        check_positive(flag, value)
    check_positive("--holdout", args.holdout, zero_ok=True)
    if args.monitor_interval is not None and not 0 <= args.monitor_interval < float("inf"):
        raise UsageError(f"Invalid --monitor-interval {args.monitor_interval:g}: expected seconds >= 0 "
                         "(0 turns the monitor off).")
    gpu_memory = parse_bytes(args.gpu_memory, flag="--gpu-memory")
    if gpu_memory == 0:
        raise UsageError(f"Invalid --gpu-memory {args.gpu_memory!r}: expected a positive size such as 80GiB.")
    memory_budget = budget_arguments(args)[0]
    check_output_dir(args.out, "--out")

    from rich.console import Console
    from rich.table import Table

    from bigmem.config.presets import resolve_config
    from bigmem.data.derived import with_data_fields
    from bigmem.data.store import HDF5VolumeStore
    from bigmem.distribute.compare import compare, rows
    from bigmem.tfenv import import_tensorflow

    overrides = {"data": {k: v for k, v in (("volume", args.volume),) if v is not None},
                 "train": {k: v for k, v in (("batch_size", args.batch_size),) if v is not None}}
    config = resolve_config(args.model or "small", overrides)
    config = with_data_fields(config.updated({"data": {"store": args.data}}))
    store = config.data.store
    holdout = args.holdout
    with HDF5VolumeStore(store) as opened:  # a --holdout that leaves no training case is refused here
        num_cases = len(opened)
        if holdout is None:
            holdout = max(1, num_cases // 5)
        if holdout >= num_cases:
            given = f"--holdout {holdout}" if args.holdout is not None else f"the default --holdout ({holdout})"
            cases = f"{num_cases} case{'s' if num_cases > 1 else ''}"
            raise UsageError(f"Invalid {given}: the store {store!r} has {cases}, and training needs at least one "
                             "besides the held-out ones.")
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
