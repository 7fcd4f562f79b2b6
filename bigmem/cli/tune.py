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

    from bigmem import api

    console = Console(soft_wrap=True)
    if args.show:
        shown = api.machine_tuning()
        console.print(f"machine key: {shown.key}")
        if shown.tuning is None:
            console.print(f"not tuned: the shipped tables are in force (no {shown.path})")
        else:
            console.print(f"{shown.tuning.describe()}\n{shown.tuning.summary()}\nfile: {shown.path}")
        return 0
    check_positive("--seconds", args.seconds)
    base = resolve_with_shape(args, args.model or DEFAULT_PRESET, model_overrides(args))
    check_shape_argument(args, tuple(base.data.shape or (base.data.reference_volume,) * 3), base.model)
    bars = _PassBars(console)
    try:
        result = api.tune(base, precisions=[args.precision] if args.precision else None, seconds=args.seconds,
                          measure_memory=not args.no_memory, say=bars.say, progress=bars.progress)
    finally:
        bars.close()
    console.print(f"{result.tuning.summary()}\nwrote {result.path}")
    return 0


class _PassBars:
    """A transient progress bar on ``console`` for each precision's pass of ``api.tune``: opened by the pass's first
    progress, closed before the next line is said (or at the end)."""

    def __init__(self, console) -> None:
        self.console, self.bar, self.task = console, None, None

    def say(self, line: str) -> None:
        """Close the pass's bar, then print ``line``."""
        self.close()
        self.console.print(line)

    def progress(self, what: str, done: float) -> None:
        """Show (what, fraction done) on the pass's bar, opened first if needed."""
        from bigmem.tune import tuning_bar

        if self.bar is None:
            self.bar = tuning_bar(self.console)
            self.bar.start()
            self.task = self.bar.add_task("", total=1.0)
        self.bar.update(self.task, completed=done, description=what)

    def close(self) -> None:
        """Take the bar down (transient; where the output is not a terminal, rich ends it with a newline)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
