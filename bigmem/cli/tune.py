"""``bigmem tune``: time this machine's kernel choices at a network's shapes, and measure its fixed memory."""

from __future__ import annotations

import argparse

from bigmem.cli.common import (
    add_model_flags, check_positive, check_shape_argument, model_overrides, resolve_with_shape,
)
from bigmem.config.presets import DEFAULT_PRESET

HELP = "time this machine's kernel choices at a network's shapes (cached; train does it on first use)"
DESCRIPTION = """\
Times, on this machine, the alternatives bigmem chooses between for every convolution of one
training step at the given shape and precision: the forward pass and input gradient (the
whole-network ceiling), and for each 3x3x3 convolution oneDNN's 3-D weight gradient against the
planewise one. The winners per precision, stride and input-channel range, the convolutions'
rate and the framework's fixed memory (a training step at the network's smallest shape, against
the shipped memory table) are cached in ~/.cache/bigmem/tuning/ (or $BIGMEM_CACHE_DIR/tuning),
keyed by CPU model, ISA class, TensorFlow version (which fixes oneDNN's), oneDNN on or off and
the thread count. The layers, the planner's step time and its memory estimate read that file
before the shipped tables. `bigmem train` runs this once per precision unless --no-tune.

examples:
  bigmem tune --model kits19 --volume 96
  bigmem tune --model small --shape 64,128,128 --precision bf16 --seconds 120
  bigmem tune --show
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("tune", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser, volume_help="one training volume's edge (default: the preset's reference volume)")
    parser.add_argument("--precision", choices=["fp32", "bf16"],
                        help="the precision to time (default: fp32, and bf16 too where the CPU has it natively)")
    parser.add_argument("--recompute", choices=["none", "stages"],
                        help="the recompute mode whose fixed memory is measured (the kernels are the same; default: "
                             "the preset's, none)")
    parser.add_argument("--seconds", type=float, metavar="S",
                        help="the most seconds each precision's pass may take, memory step included (default 60); "
                             "convolutions left untimed keep the shipped choice")
    parser.add_argument("--no-memory", action="store_true",
                        help="time the kernels only; do not measure the framework's fixed memory")
    parser.add_argument("--show", action="store_true", help="print this machine's tuning and time nothing")
    parser.set_defaults(run=run)


def run(args) -> int:
    from rich.console import Console

    from bigmem.nets.tuning import key_here, load_tuning, tuning_path
    from bigmem.tune import DEFAULT_BUDGET_S

    console = Console(soft_wrap=True)
    if args.show:
        tuning = load_tuning()
        console.print(f"machine key: {key_here().describe()}")
        if tuning is None:
            console.print(f"not tuned: the shipped tables are in force (no {tuning_path()})")
        else:
            console.print(f"{tuning.describe()}\n{tuning.summary()}\nfile: {tuning_path()}")
        return 0
    check_positive("--seconds", args.seconds)
    overrides = model_overrides(args)
    base = resolve_with_shape(args, args.model or DEFAULT_PRESET, overrides)
    shape = tuple(base.data.shape or (base.data.reference_volume,) * 3)
    check_shape_argument(args, shape, base.model)
    from bigmem.sysinfo import native_bf16

    precisions = [args.precision] if args.precision else ["fp32"] + (["bf16"] if native_bf16() else [])
    from bigmem.tune import run_with_progress

    tuning = None
    for precision in precisions:
        config = base.updated({"train": {"precision": precision}})
        console.print(f"tuning {config.model.name} at {'x'.join(map(str, shape))}, batch {config.train.batch_size}, "
                      f"{precision} on {key_here().describe()} ...")
        tuning = run_with_progress(config, shape, console, budget_s=args.seconds or DEFAULT_BUDGET_S,
                                   measure_memory=not args.no_memory)
        last = tuning.tuned[-1]
        console.print(f"  {last['timed']} of {last['convolutions']} convolutions timed in {last['seconds']:.0f} s"
                      + (" (out of time: the rest keep the shipped choice)" if last["partial"] else ""))
    console.print(f"{tuning.summary()}\nwrote {tuning_path()}")
    return 0
