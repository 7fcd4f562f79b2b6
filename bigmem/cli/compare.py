"""``bigmem compare``: the big-memory CPU path against a data-parallel GPU baseline, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from bigmem.cli.common import add_budget_flag, budget_arguments, check_output_dir, check_positive, parse_shape
from bigmem.compare import DEFAULT_PHANTOM_VOLUME, DEFAULT_TIME_BUDGET_S, DEFAULT_VAL_EVERY
from bigmem.errors import UsageError
from bigmem.infer import DEFAULT_OVERLAP
from bigmem.units import parse_bytes

HELP = "compare whole-volume CPU training with a data-parallel GPU baseline"

DESCRIPTION = f"""\
What does training on whole volumes in RAM buy over the usual GPU recipe, and at what cost?
compare trains the same model on the same data (a) bigmem's way, whole volumes in this host's
RAM, evaluated with one whole-volume pass, and (b) data parallel with tf.distribute's
MirroredStrategy on the largest patch that fits one GPU (--gpu-memory), evaluated in Gaussian
sliding windows of that patch (overlap {DEFAULT_OVERLAP:g}, as nnU-Net and MLPerf do). Both are pre-flighted
before either trains, trained for equal time or equal FLOPs (--equal time, the default, or
--equal flops; validation time is not counted), validated every --val-every steps for
the time-to-Dice curves, and scored on the same held-out cases by bigmem predict's and bigmem
evaluate's code (per-class Dice and HD95). With --seeds N each path trains N times and the
conclusion says whether the difference exceeds the seed-to-seed spread.

Defaults keep the proportion of the real case: synthetic phantoms of 64^3 and a GPU memory scaled
so that the planner's patch is the same fraction of their edge as an 80 GiB GPU's patch is of a
512^3 kits19 volume (about half); the output states the stand-in. --data and --gpu-memory override
both. Without GPUs, (b) runs on N logical CPU devices (--simulate-replicas N) and everything it
reports is labelled "simulated on CPU". Writes compare.json, compare.md and compare.png (and every
run directory and its predictions) to --out, and prints the table and the conclusion.
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("compare", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", metavar="STORE.h5",
                        help="HDF5 store (default: synthetic phantoms of --volume, default "
                             f"{DEFAULT_PHANTOM_VOLUME}^3)")
    parser.add_argument("--model", metavar="PRESET", help="preset (default: small)")
    parser.add_argument("--volume", type=int, metavar="N",
                        help="crop/pad every case to N^3 for the whole-volume path (default: each case at its own "
                             "shape; the phantoms' edge without --data)")
    parser.add_argument("--shape", metavar="D,H,W", help="crop/pad every case of --data to D,H,W for the whole-volume "
                                                         "path (default: each case at its own shape)")
    parser.add_argument("--batch-size", type=int, metavar="B", help="per replica, and for the whole-volume path")
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs for the data-parallel path")
    parser.add_argument("--simulate-replicas", type=int, metavar="N",
                        help="run the data-parallel path on N logical CPU devices (default when no GPU: 2)")
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="memory of one GPU, which sizes the patch (default: the scaled stand-in above)")
    parser.add_argument("--gpu-reference", metavar="FILE",
                        help="the JSON benchmarks/performance/gpu_reference.py wrote on a real GPU: the GPU's "
                             "memory and the model's largest patch come from it (with the phantoms, the measured "
                             "kits19 patch sets the stand-in's proportion), and the report adds its measured "
                             "step rate, saying which figures are measured and which simulated")
    parser.add_argument("--equal", choices=("time", "flops"), default="time",
                        help="what the two paths get the same of: training time (default) or training FLOPs")
    # compare's --budget was --equal's old name, and looked like the memory budget: refused with the new names
    parser.add_argument("--budget", nargs="?", const="", default=None, help=argparse.SUPPRESS)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--time-budget", type=float, metavar="S",
                        help=f"seconds of training for the whole-volume path (default {DEFAULT_TIME_BUDGET_S:g}); "
                             "the data-parallel path gets the same seconds, or the same FLOPs")
    length.add_argument("--steps", type=int, metavar="K", help="steps for the whole-volume path instead of seconds")
    parser.add_argument("--seeds", type=int, metavar="N", default=1,
                        help="train each path N times (seeds 0..N-1) and compare the difference with the spread "
                             "(default 1)")
    parser.add_argument("--val-every", type=int, metavar="K", default=DEFAULT_VAL_EVERY,
                        help=f"validate the whole-volume path every K steps, the data-parallel path at the same "
                             f"training FLOPs (default {DEFAULT_VAL_EVERY})")
    add_budget_flag(parser, help_text="host memory budget of both training runs and of the largest-volume figure "
                                      "(default: MemAvailable)")
    parser.add_argument("--holdout", type=int, metavar="N", help="held-out cases for the Dice (default: 1 in 5)")
    parser.add_argument("--monitor-interval", type=float, metavar="S",
                        help="seconds between monitor.csv rows in each run directory (default 1; 0: off)")
    parser.add_argument("--out", metavar="DIR", default="compare", help="output folder (default: ./compare)")
    parser.set_defaults(run=run)


RENAMED_BUDGET = ("compare's --budget is now --equal time|flops (equal training time or equal training FLOPs); "
                  "--memory-budget SIZE sets the host memory budget.")


def run(args) -> int:
    if args.budget is not None:
        raise UsageError(RENAMED_BUDGET)
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--volume", args.volume),
                        ("--gpus", args.gpus), ("--simulate-replicas", args.simulate_replicas),
                        ("--time-budget", args.time_budget), ("--seeds", args.seeds), ("--val-every", args.val_every)):
        check_positive(flag, value)
    check_positive("--holdout", args.holdout, zero_ok=True)
    if args.monitor_interval is not None and not 0 <= args.monitor_interval < float("inf"):
        raise UsageError(f"Invalid --monitor-interval {args.monitor_interval:g}: expected seconds >= 0 "
                         "(0 turns the monitor off).")
    gpu_memory = parse_bytes(args.gpu_memory, flag="--gpu-memory") if args.gpu_memory is not None else None
    if gpu_memory == 0:
        raise UsageError(f"Invalid --gpu-memory {args.gpu_memory!r}: expected a positive size such as 80GiB.")
    if gpu_memory is not None and args.gpu_reference is not None:
        raise UsageError("Give either --gpu-memory or --gpu-reference, not both: the reference file measured "
                         "its GPU's memory.")
    from bigmem.compare.gpu_reference import load_gpu_reference

    measured = load_gpu_reference(args.gpu_reference) if args.gpu_reference is not None else None
    memory_budget = budget_arguments(args)[0]
    check_output_dir(args.out, "--out")

    from rich.console import Console

    from bigmem.compare import GpuMemory, Settings, compare, console_table, provenance, scaled_gpu_memory
    from bigmem.config.presets import resolve_config
    from bigmem.data.derived import with_data_fields
    from bigmem.data.store import HDF5VolumeStore
    from bigmem.memory.profile import counts_function

    if args.shape is not None and args.volume is not None:
        raise UsageError("Give either --volume or --shape, not both.")
    if args.shape is not None and args.data is None:
        raise UsageError("--shape needs --data: the synthetic phantoms are cubes (give --volume N for N^3 phantoms).")
    data = {"store": args.data}
    if args.shape is not None:
        data["shape"] = list(parse_shape(args.shape))
    elif args.volume is not None and args.data is not None:
        data["shape"] = [args.volume] * 3
    if args.data is None:  # phantoms of --volume, each trained whole at its own (cube) shape
        data["synth_volume"] = args.volume or DEFAULT_PHANTOM_VOLUME
    overrides = {"data": data, "train": {k: v for k, v in (("batch_size", args.batch_size),) if v is not None}}
    status = Console(soft_wrap=True, stderr=True)
    config = with_data_fields(resolve_config(args.model or "small", overrides),
                              generating=lambda: status.status("generating the synthetic phantoms ..."))
    store = config.data.store
    holdout = args.holdout
    with HDF5VolumeStore(store) as opened:  # a --holdout that leaves no training case is refused here
        num_cases = len(opened)
        if holdout is None:
            holdout = max(1, num_cases // 5)
        if holdout >= num_cases or holdout == 0:
            given = f"--holdout {holdout}" if args.holdout is not None else f"the default --holdout ({holdout})"
            cases = f"{num_cases} case{'s' if num_cases > 1 else ''}"
            need = ("at least one held-out case to score" if holdout == 0
                    else "at least one besides the held-out ones to train on")
            raise UsageError(f"Invalid {given}: the store {store!r} has {cases}; compare needs {need}.")
    reference, patch = None, None
    if measured is not None:
        memory, patch, reference = _measured_gpu(measured, config, args)
    else:
        memory = (GpuMemory(gpu_memory) if gpu_memory is not None
                  else scaled_gpu_memory(config, counts_function(config)))
    from bigmem.tfenv import import_tensorflow

    tf = import_tensorflow(verbose=getattr(args, "verbose", False))
    gpus = len(tf.config.list_physical_devices("GPU"))
    simulate = args.simulate_replicas is not None or gpus == 0
    replicas = args.simulate_replicas or (2 if simulate else (args.gpus or gpus))
    settings = Settings(replicas=replicas, simulate=simulate, gpu_memory=memory, equal=args.equal,
                        time_budget_s=args.time_budget, steps=args.steps, seeds=args.seeds, holdout=holdout,
                        val_every=args.val_every, memory_budget_bytes=memory_budget,
                        monitor_interval_s=args.monitor_interval, patch=patch, gpu_reference=reference)
    console = Console(soft_wrap=True)
    if memory.stand_in:
        status.print(f"GPU memory: {memory.stand_in}.", style="dim", highlight=False)
    if reference is not None:
        status.print(f"{reference.measured_sentence(patch)}.", style="dim", highlight=False)
    report = compare(config, Path(args.out), settings, progress=lambda m: status.print(m, style="dim", highlight=False))
    console.print(console_table(report))
    if provenance(report):
        console.print(provenance(report), highlight=False)
    console.print(report.conclusion.text, highlight=False)
    console.print(f"wrote {args.out}/compare.json, compare.md, compare.png")
    return 0


def _measured_gpu(measured: dict, config, args):
    """(GpuMemory, the fixed patch edge or None, the GpuReference reported) from a --gpu-reference file.

    With --data: the measured GPU's memory, and the compared model's measured largest patch at batch 2
    where the file has it (the planner's patch for that memory otherwise, and where the measured patch
    is not smaller than the volumes). With the phantoms: the scaled stand-in, proportioned by the
    measured kits19 patch of a 512^3 volume, which the file must have.
    """
    from bigmem.compare import GpuMemory, scaled_gpu_memory, whole_shape
    from bigmem.compare.gpu_reference import MEASURED_BATCH, gpu_reference_for
    from bigmem.compare.run import REAL_CASE
    from bigmem.memory.profile import counts_function

    precision = config.train.precision
    own = gpu_reference_for(measured, config.model.name, precision)
    if args.data is None:
        real = gpu_reference_for(measured, REAL_CASE["model"], precision)
        if real is None:
            raise UsageError(f"--gpu-reference {args.gpu_reference}: no {REAL_CASE['model']} measurement at "
                             f"{precision}, which sizes the phantoms' stand-in GPU; give --data STORE.h5 (the "
                             "measured memory then sizes the patch) or a file that measured kits19.")
        return scaled_gpu_memory(config, counts_function(config), real), None, own or real
    patch = None
    if own is not None and own.largest_patch and config.train.batch_size == MEASURED_BATCH \
            and own.largest_patch < max(whole_shape(config)):
        patch = own.largest_patch
    reference = own or gpu_reference_for(measured, config.model.name, precision, memory_only=True)
    return GpuMemory(measured["device"]["memory_bytes"]), patch, reference
