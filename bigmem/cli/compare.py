"""``bigmem compare``: the big-memory CPU path against a data-parallel GPU baseline, side by side."""

from __future__ import annotations

import argparse

from bigmem.cli.common import add_budget_flag, budget_arguments, check_output_dir, parse_shape
from bigmem.compare import DEFAULT_PHANTOM_VOLUME, DEFAULT_TIME_BUDGET_S
from bigmem.compare.setup import DEFAULT_SIMULATED_REPLICAS, EQUAL, HOLDOUT_ONE_IN, CompareRequest
from bigmem.config.schema import TrainConfig
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
    # Every flag defaults to None: a flag not given keeps CompareRequest's default, which its help quotes.
    parser = subparsers.add_parser("compare", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", metavar="STORE.h5",
                        help="HDF5 store (default: synthetic phantoms of --volume, default "
                             f"{DEFAULT_PHANTOM_VOLUME}^3)")
    parser.add_argument("--model", metavar="PRESET", help=f"preset (default: {CompareRequest.model})")
    parser.add_argument("--volume", type=int, metavar="N",
                        help="crop/pad every case to N^3 for the whole-volume path (default: each case at its own "
                             "shape; the phantoms' edge without --data)")
    parser.add_argument("--shape", metavar="D,H,W", help="crop/pad every case of --data to D,H,W for the whole-volume "
                                                         "path (default: each case at its own shape)")
    parser.add_argument("--batch-size", type=int, metavar="B",
                        help="per replica, and for the whole-volume path (default: the preset's)")
    parser.add_argument("--gpus", type=int, metavar="N", help="GPUs for the data-parallel path (default: every GPU "
                                                              "found)")
    parser.add_argument("--simulate-replicas", type=int, metavar="N",
                        help="run the data-parallel path on N logical CPU devices (default when no GPU: "
                             f"{DEFAULT_SIMULATED_REPLICAS})")
    parser.add_argument("--gpu-memory", metavar="SIZE",
                        help="memory of one GPU, which sizes the patch (default: the scaled stand-in above)")
    parser.add_argument("--gpu-reference", metavar="FILE",
                        help="the JSON benchmarks/performance/gpu_reference.py wrote on a real GPU: the GPU's "
                             "memory and the model's largest patch come from it (with the phantoms, the measured "
                             "kits19 patch sets the stand-in's proportion), and the report adds its measured "
                             "step rate, saying which figures are measured and which simulated")
    parser.add_argument("--equal", choices=EQUAL,
                        help="what the two paths get the same of: training time or training FLOPs (default "
                             f"{CompareRequest.equal})")
    # compare's --budget was --equal's old name, and looked like the memory budget: refused with the new names
    parser.add_argument("--budget", nargs="?", const="", default=None, help=argparse.SUPPRESS)
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--time-budget", type=float, metavar="S",
                        help=f"seconds of training for the whole-volume path (default {DEFAULT_TIME_BUDGET_S:g}); "
                             "the data-parallel path gets the same seconds, or the same FLOPs")
    length.add_argument("--steps", type=int, metavar="K", help="steps for the whole-volume path instead of seconds")
    parser.add_argument("--seeds", type=int, metavar="N",
                        help="train each path N times (seeds 0..N-1) and compare the difference with the spread "
                             f"(default {CompareRequest.seeds})")
    parser.add_argument("--val-every", type=int, metavar="K",
                        help=f"validate the whole-volume path every K steps, the data-parallel path at the same "
                             f"training FLOPs (default {CompareRequest.val_every})")
    add_budget_flag(parser, help_text="host memory budget of both training runs and of the largest-volume figure "
                                      "(default: MemAvailable)")
    parser.add_argument("--holdout", type=int, metavar="N",
                        help=f"held-out cases for the Dice (default: 1 in {HOLDOUT_ONE_IN})")
    parser.add_argument("--monitor-interval", type=float, metavar="S",
                        help="seconds between monitor.csv rows in each run directory (default "
                             f"{TrainConfig.monitor_interval_s:g}; 0: off)")
    parser.add_argument("--out", metavar="DIR", help=f"output folder (default: ./{CompareRequest.out})")
    parser.set_defaults(run=run)


RENAMED_BUDGET = ("compare's --budget is now --equal time|flops (equal training time or equal training FLOPs); "
                  "--memory-budget SIZE sets the host memory budget.")


def request_from(args) -> CompareRequest:
    """The ``CompareRequest`` the flags ask for: sizes and shapes parsed, a flag not given left at its default.

    Raises:
        UsageError: compare's old ``--budget``, or a size or shape that does not parse.
    """
    if args.budget is not None:
        raise UsageError(RENAMED_BUDGET)
    given = {
        "data": args.data, "model": args.model, "volume": args.volume,
        "shape": parse_shape(args.shape) if args.shape is not None else None, "batch_size": args.batch_size,
        "gpus": args.gpus, "simulate_replicas": args.simulate_replicas,
        "gpu_memory_bytes": parse_bytes(args.gpu_memory, flag="--gpu-memory") if args.gpu_memory is not None else None,
        "gpu_reference": args.gpu_reference, "equal": args.equal, "time_budget_s": args.time_budget,
        "steps": args.steps, "seeds": args.seeds, "val_every": args.val_every,
        "memory_budget_bytes": budget_arguments(args)[0], "holdout": args.holdout,
        "monitor_interval_s": args.monitor_interval, "out": args.out,
    }
    return CompareRequest(**{name: value for name, value in given.items() if value is not None})


def run(args) -> int:
    request = request_from(args)
    request.check()  # the cheap refusals, before TensorFlow or the phantoms
    check_output_dir(request.out, "--out")

    from rich.console import Console

    from bigmem import api
    from bigmem.compare import console_table, provenance

    status = Console(soft_wrap=True, stderr=True)
    report = api.compare(request, progress=lambda line: status.print(line, style="dim", highlight=False),
                         generating=lambda: status.status("generating the synthetic phantoms ..."),
                         verbose=getattr(args, "verbose", False))
    console = Console(soft_wrap=True)
    console.print(console_table(report))
    if provenance(report):
        console.print(provenance(report), highlight=False)
    console.print(report.conclusion.text, highlight=False)
    console.print(f"wrote {request.out}/compare.json, compare.md, compare.png")
    return 0
