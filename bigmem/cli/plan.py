"""``bigmem plan``: the largest whole volume, then batch, that fits a memory budget."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bigmem.cli.common import (
    PRESET_HELP,
    add_budget_flag,
    flag_for,
    add_shape_column,
    add_model_flags,
    budget_arguments,
    check_output_file,
    check_positive,
    model_overrides,
    resolve_with_shape,
)
from bigmem.config.presets import DEFAULT_PRESET
from bigmem.errors import DataError, UsageError

HELP = "find the largest volume and batch that fit a memory budget"

DESCRIPTION = """\
Search the largest whole volume (a multiple of 2^depth), then the largest batch, whose predicted
peak fits the budget, trying fp32 and bf16 (bf16 only where the CPU has it natively, unless
--precision bf16), with and without stage recomputation (preferring, on a tie, full precision
and no recomputation). Each candidate shows its predicted step time: its training FLOPs, plus the
recomputed forward passes, over a rate measured for this CPU's ISA class and precision. Writes
plan.json with every candidate evaluated. Give --shape D,H,W (or --volume N for N^3) and/or
--batch-size to fix them. Exit code 3 when nothing fits.

--data STORE plans the store's own scans, as bigmem train runs them: each case whole at its own
shape, padded to the network's size contract (or cropped/padded to --shape when given). The step
planned is the largest the store can feed (the largest case at batch 1; a batch of several is
padded to its members' bounding shape, so the bounding shape of all of them); plan.json and the
table list every case with its shape, padded shape and predicted peak. The batch is capped by the
dataset as nnU-Net caps it: one step sees at most 5% of the training cases' voxels (at least 2).

--data STORE without --model (or with --model auto) also configures the network from the store,
by nnU-Net v2's experiment-planner rules with the median case whole as the "patch": the target
spacing (the median; the 10th percentile on an axis more than 3x coarser than the others), each
stage's kernel and stride per axis (an axis is halved while it is at least 8 voxels and its
spacing is under twice the finest one's; its kernel is 1 until then), stages until the bottleneck
is about 4 voxels, 32 x 2^stage features capped at 320, nnU-Net's PlainConvUNet blocks and SGD
recipe, deep supervision. The memory planner chooses batch, precision and recompute for it, and
the experiment is written as a preset beside plan.json (experiment.toml): train it with
bigmem train --plan experiment.toml --data STORE. Cases not at the target spacing are named, with
the convert --spacing that resamples them (predict maps segmentations back to each scan's grid).

The budget: --memory-budget (or --budget) if given; else what the --numa placement can use;
else MemAvailable. A budget above what a bind or interleave placement can use is capped to it. A
budget above this machine's memory plans for a bigger machine (and says so); bigmem train and
profile --measure refuse one.

--inference plans segmenting one whole volume instead (bigmem predict: batch 1, no gradients, no
optimizer): the largest cube, a multiple of 2^depth, whose predicted inference peak fits, in the
model's precision (the preset's, or --precision fp32/bf16); with --volume, whether that one fits
(exit code 3 with the largest that does when not).

On a machine of several NUMA nodes, plan also weighs the chosen candidate's two layouts against
each node's free memory: one process interleaved over all nodes (each holds peak / nodes; --numa
interleave), or one worker per node with CPUs (bigmem train --strategy per-node: each holds its
whole peak on its own node, global batch = workers x --batch-size). plan.json then has `layouts`.
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("plan", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_budget_flag(parser, alias=True, help_text="memory budget, e.g. 1.5TiB (default: what the --numa placement "
                                                  "can use, else MemAvailable)")
    add_model_flags(parser, volume_help="fix the volume edge and search the batch size",
                    model_help=PRESET_HELP.replace("(default:", "or auto: the network configured from --data's "
                                                   "cases (the default with --data; without it:"),
                    shape_help="fix the volume's shape D,H,W (e.g. 240,240,144) and search the batch size")
    parser.add_argument("--data", metavar="STORE.h5", help="plan this store's scans at their own shapes (with "
                                                             "--shape: cropped/padded to it)")
    parser.add_argument("--pad-multiple", type=int, metavar="N",
                        help="with --data: pad each case's axes to a multiple of N, as bigmem train --pad-multiple")
    parser.add_argument("--numa", metavar="POLICY", help="budget what this placement can use: bind:NODES -> those "
                                                         "nodes' free memory; interleave[:NODES] -> the smallest "
                                                         "node's free memory x nodes (default: none, MemAvailable)")
    parser.add_argument("--out", metavar="PLAN.json", default="plan.json", help="where to write the plan "
                                                                                  "(default: ./plan.json)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], dest="plan_precision",
                        help="auto: fp32, and bf16 where the CPU has it natively; fp32: fp32 only; bf16: try bf16 "
                             "even where it is emulated (~20x slower) (default: auto)")
    parser.add_argument("--inference", action="store_true",
                        help="the largest whole volume one prediction can segment (bigmem predict), not training")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


def _checked(args):
    """(config, the batch the user fixed or None, the resolved --numa placement or None) from the flags, every
    one checked before TensorFlow starts."""
    check_positive("--batch-size", args.batch_size)
    overrides = model_overrides(args)
    fixed_batch = overrides["train"].get("batch_size")
    if args.data is not None:
        if not Path(args.data).exists():
            raise DataError(f"Cannot open store {args.data!r} (--data): no such file.")
        overrides["data"]["store"] = args.data
    if args.pad_multiple is not None:
        if args.data is None:
            raise UsageError("--pad-multiple pads a store's cases: give --data STORE.h5.")
        overrides["data"]["pad_multiple"] = args.pad_multiple
    inference = getattr(args, "inference", False)
    if inference and args.data is not None:
        raise UsageError("--inference plans one whole volume of --shape; --data does not apply.")
    experiment = None
    if args.model == "auto" and args.data is None:
        from bigmem.api import preset_for

        preset_for("auto")  # refuses: auto needs a store
    if args.data is not None and args.model in (None, "auto"):
        from bigmem.api import auto_preset, configure

        experiment = configure(args.data)  # the store's spacings and shapes: h5py only, before TensorFlow
        config = resolve_with_shape(args, auto_preset(experiment), overrides)
    else:
        config = resolve_with_shape(args, args.model or DEFAULT_PRESET, overrides)
    if inference and fixed_batch is not None:
        raise UsageError("--inference segments one volume at a time: --batch-size does not apply.")
    if inference and args.plan_precision not in (None, "auto"):  # auto: the model's own precision (the preset's)
        config = config.updated({"train": {"precision": args.plan_precision}})
    placement = None
    if args.numa:  # checked before TensorFlow starts
        import os

        from bigmem.numa.policy import resolve_placement
        from bigmem.numa.topology import NUMATopology

        placement = resolve_placement(args.numa, None, None, NUMATopology.from_sysfs(), set(os.sched_getaffinity(0)))
    return config, fixed_batch, placement, experiment


def run(args) -> int:
    # Every flag is checked before TensorFlow is imported (seconds) or anything is computed.
    from bigmem import api

    explicit, flag = budget_arguments(args)
    out = check_output_file(args.out, "--out")
    config, fixed_batch, placement, experiment = _checked(args)
    inference = getattr(args, "inference", False)
    from bigmem.tfenv import import_tensorflow

    import_tensorflow(verbose=getattr(args, "verbose", False))  # quietly, before anything imports Keras
    allow_bf16 = {None: None, "auto": None, "fp32": False, "bf16": True}[args.plan_precision]
    result = api.plan(config, batch_size=fixed_batch, budget_bytes=explicit, budget_flag=flag, numa=placement,
                      inference=inference, allow_bf16=None if inference else allow_bf16, out=out,
                      experiment=experiment)
    from rich.console import Console

    notes = Console(soft_wrap=True, stderr=True)  # on stderr: stdout may be --json
    for note in result.notes:
        notes.print(note, style="yellow")
    if inference:
        return _inference(args, result)
    from bigmem.memory.plans import plan_dict

    plan = result.plan
    if args.json:
        print(json.dumps(plan_dict(plan, result.layouts), indent=2))
    else:
        _print_plan(args, result.config, result.budget, plan)
        if plan.precision_note:
            notes.print(plan.precision_note, style="yellow")
        if result.layouts is not None:
            _print_layouts(Console(soft_wrap=True), result.layouts)
    result.require()
    return 0


# Why one would pick each layout (the published local/remote figures behind it: benchmarks/results/numa.md).
LAYOUTS_WHY = ("why: per-node keeps each worker's memory traffic on its own node; interleave sends (N-1)/N = {remote} "
               "of one process's accesses to other nodes, but it is the only layout for a job whose batch of 1 needs "
               "more than one node's memory. Neither layout's throughput was measured here.")


def _print_layouts(console, layouts) -> None:
    """The two layouts on this machine's nodes: processes, batches, each process's peak, fits, and why."""
    from rich.table import Table

    from bigmem.units import format_bytes

    rows = (layouts.interleave, layouts.per_node)
    table = Table(title=f"layouts on {len(layouts.interleave.nodes)} NUMA nodes (against each node's free memory)")
    for column in ("layout", "processes", "batch", "global batch", "peak per process", "fits"):
        table.add_column(column, justify="right")
    for layout in rows:
        mark = " *" if layout.name == layouts.recommended else ""
        table.add_row(f"{layout.name}{mark}", str(layout.num_processes), str(layout.batch_size),
                      str(layout.global_batch_size), format_bytes(layout.predicted_peak_bytes),
                      "yes" if layout.fits else "no")
    console.print(table)
    for layout in rows:
        console.print(f"{layout.name}: {layout.reason}")
    flags = {"interleave": "bigmem train --numa interleave", "per-node": "bigmem train --strategy per-node"}
    if layouts.recommended is not None:
        console.print(f"layout: {layouts.recommended} ({flags[layouts.recommended]})")
    else:
        console.print("layout: neither fits this machine's nodes")
    n = len(layouts.interleave.nodes)
    console.print(LAYOUTS_WHY.format(remote=f"{n - 1}/{n}"), style="dim")


def _print_plan(args, config, budget, plan) -> None:
    """The best candidate per precision and recompute mode, the cases, and the chosen flags."""
    from rich.console import Console
    from rich.table import Table

    from bigmem.sysinfo import native_bf16
    from bigmem.train.job import EMULATED_BF16_WARNING
    from bigmem.units import format_bytes

    console = Console(soft_wrap=True)
    table = Table(title=f"{config.model.name} within {format_bytes(budget.budget_bytes)} ({budget.source})")
    shapes = [c.shape_text + (" *" if c is plan.chosen else "") for c in plan.best_per_mode]
    for column in ("precision", "recompute"):
        table.add_column(column, justify="right")
    add_shape_column(table, "volume" if plan.searched_shape is not None else "largest volume", shapes,
                     justify="right")
    for column in ("batch", "predicted peak", "voxels vs fp32", "step (pred.)"):
        table.add_column(column, justify="right")
    base = next((c for c in plan.best_per_mode if (c.precision, c.recompute) == ("fp32", "none")), None)
    for c, shape in zip(plan.best_per_mode, shapes):
        ratio = (f"{(math.prod(c.shape) * c.batch_size) / (math.prod(base.shape) * base.batch_size):.2f}x"
                 if base else "-")
        table.add_row(c.precision, c.recompute, shape, str(c.batch_size),
                      format_bytes(c.predicted_peak_bytes), ratio, f"{c.predicted_step_s:.3g} s")
    console.print(table)
    if plan.experiment:
        _print_experiment(console, plan.experiment.to_dict())
    if plan.cases:
        _print_cases(console, plan.cases, config)
    cap = plan.batch_cap
    if cap and cap.uncapped is not None and cap.uncapped > cap.cap:
        console.print(f"batch: {cap.cap}, capped by the dataset (memory alone allows {cap.uncapped}): {cap.rule}")
    if args.plan_precision == "bf16" and not native_bf16():
        console.print(EMULATED_BF16_WARNING, style="yellow")
    if plan.chosen:
        _print_chosen(console, args, config, plan)


def _print_experiment(console, experiment: dict) -> None:
    """The network configured from the store: spacing, stages, kernels, strides, features; the preset written."""
    def triples(values):
        return " ".join("x".join(map(str, v)) for v in values)

    console.print(f"configured from {experiment['cases']} cases: target spacing "
                  f"{'x'.join(f'{s:g}' for s in experiment['target_spacing'])} mm, median case "
                  f"{'x'.join(f'{s:g}' for s in experiment['median_shape'])} (padded "
                  f"{'x'.join(map(str, experiment['padded_median_shape']))}), {experiment['stages']} stages")
    console.print(f"  kernels {triples(experiment['kernel_sizes'])}")
    console.print(f"  strides {triples(experiment['strides'])}")
    console.print(f"  features {' '.join(map(str, experiment['features']))}")
    if experiment["preset"]:
        console.print(f"preset: {experiment['preset']} (bigmem train --plan {experiment['preset']} --data "
                      f"{experiment['store']})")


def _print_chosen(console, args, config, plan) -> None:
    """The flags that run the chosen candidate, where its figures come from, and its breakdown."""
    from bigmem.errors import render_fields
    from bigmem.speed import MachineSpeed
    from bigmem.units import format_bytes

    chosen = plan.chosen
    shape_flag = chosen.shape_flag() if not plan.cases or config.data.shape else "--data " + str(args.data) + (
        f" --pad-multiple {config.data.pad_multiple}" if config.data.pad_multiple else "")
    flags = render_fields(f"{shape_flag} --batch-size {chosen.batch_size} {chosen.flags()}".rstrip(), flag_for)
    console.print(f"chosen: {flags} (est. {format_bytes(chosen.predicted_peak_bytes)}); "
                  f"{len(plan.candidates)} candidates in {args.out}")
    console.print(f"calibration: {plan.calibration.source}", style="dim")
    console.print(f"step time: {chosen.predicted_step_s:.3g} s predicted on this machine's "
                  f"{MachineSpeed.here().cores} cores ({chosen.step_rate_source}); a machine with more cores "
                  "steps faster", style="dim")
    _print_breakdown(console, chosen)


def _print_breakdown(console, chosen) -> None:
    """A candidate's bytes per component, largest first, and the stages that run in depth slabs."""
    from bigmem.nets.limits import max_kernel_elements
    from bigmem.units import format_bytes

    breakdown = ", ".join(f"{name} {format_bytes(size)}" for name, size in
                          sorted(chosen.components.items(), key=lambda item: -item[1]) if size)
    console.print(f"breakdown: {breakdown}")
    if chosen.partitioned_stages:
        console.print(f"depth slabs: {', '.join(chosen.partitioned_stages)} hold tensors past "
                      f"{max_kernel_elements():,} elements (the limit bigmem keeps TF's CPU kernels under) and "
                      "run in depth slabs")


def _print_cases(console, rows, config) -> None:
    """The per-case table, one row per padded shape (largest first; a store of hundreds has far fewer)."""
    from rich.table import Table

    from bigmem.units import format_bytes, format_count

    groups: dict[tuple, list] = {}
    for row in rows:
        groups.setdefault(tuple(row.padded_shape), []).append(row)
    fixed = config.data.shape is not None
    table = Table(title=f"{format_count(len(rows), 'case')} " + ("cropped/padded to one shape" if fixed else
                                                 "whole at their own shapes, padded to the size contract"))
    ordered = sorted(groups.items(), key=lambda kv: -kv[1][0].predicted_peak_bytes)[:20]
    trained = ["x".join(map(str, shape)) for shape, _ in ordered]
    sources = []
    for _, members in ordered:
        found = sorted({"x".join(map(str, m.shape)) for m in members})
        sources.append(", ".join(found[:3]) + (f", ... ({len(found)})" if len(found) > 3 else ""))
    add_shape_column(table, "trained shape", trained, justify="right")
    table.add_column("cases", justify="right")
    add_shape_column(table, "source shapes", sources, justify="right")
    for column in ("predicted peak", "fits"):
        table.add_column(column, justify="right")
    for shape, source, (_, members) in zip(trained, sources, ordered):
        table.add_row(shape, str(len(members)), source, format_bytes(members[0].predicted_peak_bytes),
                      "yes" if members[0].fits else "no")
    console.print(table)
    if len(groups) > 20:
        console.print(f"... and {len(groups) - 20} smaller shapes (every case is in plan.json)", style="dim")


def _inference(args, result) -> int:
    """``--inference``: the largest whole volume a prediction can segment (or whether ``--shape`` fits)."""
    from rich.console import Console
    from rich.table import Table

    from bigmem.units import format_bytes

    config, budget, plan = result.config, result.budget, result.plan
    fixed = config.data.shape
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        console = Console(soft_wrap=True)
        table = Table(title=f"{config.model.name} inference ({config.train.precision.value}, one whole volume) within "
                            f"{format_bytes(budget.budget_bytes)} ({budget.source})")
        candidates = sorted(plan.candidates, key=lambda c: c.volume)
        shapes = [c.shape_text + (" *" if c is plan.chosen else "") for c in candidates]
        add_shape_column(table, "volume", shapes, justify="right")
        for column in ("predicted peak", "fits"):
            table.add_column(column, justify="right")
        for c, shape in zip(candidates, shapes):
            table.add_row(shape, format_bytes(c.predicted_peak_bytes), "yes" if c.fits else "no")
        console.print(table)
        if plan.chosen is not None:
            chosen = plan.chosen
            what = (f"{chosen.shape_text} {'fits' if plan.fits else 'does not fit'}" if fixed is not None
                    else f"largest whole volume: {chosen.volume}^3")
            console.print(f"{what} (est. {format_bytes(chosen.predicted_peak_bytes)}); {len(plan.candidates)} "
                          f"candidates in {args.out}")
            console.print(f"calibration: {plan.calibration.source}", style="dim")
            _print_breakdown(console, chosen)
    result.require()  # exit 3 unless it fits, naming what does
    return 0
