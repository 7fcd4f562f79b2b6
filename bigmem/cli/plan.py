"""``bigmem plan``: the largest whole volume, then batch, that fits a memory budget."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bigmem.cli.common import add_budget_flag, add_model_flags, budget_arguments, model_overrides

HELP = "find the largest volume and batch that fit a memory budget"

DESCRIPTION = """\
Search the largest whole volume (a multiple of 2^depth), then the largest batch, whose predicted
peak fits the budget, trying fp32 and bf16 (bf16 only where the CPU has it natively, unless
--precision bf16), with and without stage recomputation (preferring, on a tie, full precision
and no recomputation). Each candidate shows its predicted step time: its training FLOPs, plus the
recomputed forward passes, over a rate measured for this CPU's ISA class and precision. Writes
plan.json with every candidate evaluated. Give --volume and/or --batch-size to fix them. Exit
code 3 when nothing fits.

The budget: --memory-budget (or --budget) if given; else what the --numa placement can use;
else MemAvailable. A budget above what a bind or interleave placement can use is capped to it.
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("plan", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_budget_flag(parser, alias=True, help_text="memory budget, e.g. 1.5TiB (default: what the --numa placement "
                                                  "can use, else MemAvailable)")
    add_model_flags(parser, volume_help="fix the volume edge and search the batch size")
    parser.add_argument("--numa", metavar="POLICY", help="budget what this placement can use: bind:NODES -> those "
                                                         "nodes' free memory; interleave[:NODES] -> the smallest "
                                                         "node's free memory x nodes (default: none, MemAvailable)")
    parser.add_argument("--out", metavar="PLAN.json", default="plan.json", help="where to write the plan "
                                                                                  "(default: ./plan.json)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", dest="plan_precision",
                        help="auto: fp32, and bf16 where the CPU has it natively; fp32: fp32 only; bf16: try bf16 "
                             "even where it is emulated (~20x slower) (default: auto)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


def run(args) -> int:
    from bigmem.tfenv import import_tensorflow

    import_tensorflow(verbose=getattr(args, "verbose", False))  # quietly, before anything imports Keras
    from rich.console import Console
    from rich.table import Table

    from bigmem.config.presets import resolve_config
    from bigmem.memory.preflight import require_fit, resolve_budget, search_plan
    from bigmem.memory.profile import counts_function
    from bigmem.nets.limits import max_kernel_elements
    from bigmem.sysinfo import native_bf16
    from bigmem.train.job import EMULATED_BF16_WARNING
    from bigmem.rundir import atomic_write_json
    from bigmem.units import format_bytes

    overrides = model_overrides(args)
    fixed_batch = overrides["train"].get("batch_size")
    config = resolve_config(args.model or "small", overrides)
    explicit, flag = budget_arguments(args)
    placement = topology = None
    if args.numa:
        import os

        from bigmem.numa.policy import resolve_placement
        from bigmem.numa.topology import NUMATopology

        topology = NUMATopology.from_sysfs()
        placement = resolve_placement(args.numa, None, None, topology, set(os.sched_getaffinity(0)))
    budget = resolve_budget(explicit, flag=flag, placement=placement, topology=topology)
    counts_for = counts_function(config)
    allow_bf16 = {"auto": None, "fp32": False, "bf16": True}[args.plan_precision]
    if budget.note:  # on stderr: stdout may be --json
        Console(soft_wrap=True, stderr=True).print(budget.note, style="yellow")
    plan = search_plan(config, counts_for, budget, volume=args.volume, batch_size=fixed_batch, allow_bf16=allow_bf16)
    atomic_write_json(Path(args.out), plan.to_dict())
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        console = Console(soft_wrap=True)
        table = Table(title=f"{config.model.name} within {format_bytes(budget.budget_bytes)} ({budget.source})")
        for column in ("precision", "recompute", "largest volume", "batch", "predicted peak", "voxels vs fp32",
                       "step (pred.)"):
            table.add_column(column, justify="right")
        base = next((c for c in plan.best_per_mode if (c.precision, c.recompute) == ("fp32", "none")), None)
        for c in plan.best_per_mode:
            ratio = f"{(c.volume ** 3 * c.batch_size) / (base.volume ** 3 * base.batch_size):.2f}x" if base else "-"
            mark = " *" if c is plan.chosen else ""
            table.add_row(c.precision, c.recompute, f"{c.volume}^3{mark}", str(c.batch_size),
                          format_bytes(c.predicted_peak_bytes), ratio, f"{c.predicted_step_s:.3g} s")
        console.print(table)
        if args.plan_precision == "bf16" and not native_bf16():
            console.print(EMULATED_BF16_WARNING, style="yellow")
        if plan.chosen:
            chosen = plan.chosen
            flags = f"--volume {chosen.volume} --batch-size {chosen.batch_size} {chosen.flags()}".rstrip()
            console.print(f"chosen: {flags} (est. {format_bytes(chosen.predicted_peak_bytes)}); "
                          f"{len(plan.candidates)} candidates in {args.out}")
            console.print(f"calibration: {plan.calibration['source']}", style="dim")
            console.print(f"step time: {chosen.predicted_step_s:.3g} s predicted ({chosen.step_rate_source})",
                          style="dim")
            breakdown = ", ".join(f"{name} {format_bytes(size)}" for name, size in
                                  sorted(chosen.components.items(), key=lambda item: -item[1]) if size)
            console.print(f"breakdown: {breakdown}")
            if chosen.partitioned_stages:
                console.print(f"depth slabs: {', '.join(chosen.partitioned_stages)} hold tensors past "
                              f"{max_kernel_elements():,} elements (the limit bigmem keeps TF's CPU kernels under) and "
                              "run in depth slabs")
    require_fit(plan)
    return 0
