"""Predicted vs measured peak memory, per size and mode; optionally the planner's budget check.

    python benchmarks/bench_memory_model.py [--model small] [--sizes 32,48,64,96,128]
        [--modes fp32/none,bf16/none,fp32/stages,bf16/stages] [--budget 20GiB] [--out DIR]

Each point trains a few steps in a fresh child process and reads its VmHWM (bigmem.memory.measure).
With --budget, it asks the planner for the largest volume per mode within that budget, prints the
voxel ratio of bf16+stages to plain fp32, and measures a run at the bf16+stages size to show it
stays under the budget. Prints a table and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import argparse
import socket
import sys

from _results import write_results
from rich.console import Console
from rich.table import Table

from bigmem.config import resolve_config
from bigmem.memory.calibration import cpu_model, tensorflow_version
from bigmem.memory.measure import measure
from bigmem.memory.planner import make_plan
from bigmem.memory.profile import counts_function, profile
from bigmem.units import format_bytes, parse_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--sizes", default="32,48,64,96,128")
    parser.add_argument("--modes", default="fp32/none,bf16/none,fp32/stages,bf16/stages")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", help="also check the planner at this budget, e.g. 20GiB")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    console = Console(soft_wrap=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    table = Table(title=f"{args.model}: predicted vs measured peak (VmHWM), batch {args.batch_size}")
    for column in ("precision", "recompute", "volume", "predicted", "measured", "error", "s/step"):
        table.add_column(column, justify="right")
    counts_for = None
    for mode in args.modes.split(","):
        precision, recompute = mode.split("/")
        for size in sizes:
            config = resolve_config(args.model, {"data": {"volume": size}, "train": {
                "batch_size": args.batch_size, "precision": precision, "recompute": recompute}})
            counts_for = counts_for or counts_function(config)
            result = profile(config, (size,) * 3, counts_for, do_measure=True, steps=args.steps)
            row = {"precision": precision, "recompute": recompute, "volume": size,
                   "predicted_peak_bytes": result.estimate.predicted_peak_bytes,
                   "measured_peak_bytes": result.measurement.peak_bytes, "error_pct": round(result.error_pct, 2),
                   "step_s": result.measurement.step_s, "calibration": result.estimate.calibration.source}
            rows.append(row)
            table.add_row(precision, recompute, f"{size}^3", format_bytes(row["predicted_peak_bytes"]),
                          format_bytes(row["measured_peak_bytes"]), f"{row['error_pct']:+.1f}%", f"{row['step_s']:.2f}")
            console.print(f"{precision}/{recompute} {size}^3: error {row['error_pct']:+.1f}%", style="dim")
    console.print(table)
    worst = max(rows, key=lambda r: abs(r["error_pct"]))
    console.print(f"worst error: {worst['error_pct']:+.1f}% ({worst['precision']}/{worst['recompute']} at "
                  f"{worst['volume']}^3); calibration: {rows[0]['calibration']}")
    report = {"machine": {"host": socket.gethostname(), "cpu": cpu_model(), "tensorflow": tensorflow_version()},
              "model": args.model, "batch_size": args.batch_size, "points": rows,
              "worst_error_pct": worst["error_pct"]}
    if args.budget:
        report["budget_check"] = budget_check(args, console)
    write_results("memory_model", report, args.out, console)
    return 0


def budget_check(args, console) -> dict:
    budget = parse_bytes(args.budget, flag="--budget")
    config = resolve_config(args.model, {"train": {"batch_size": args.batch_size}})
    plan = make_plan(config, counts_function(config), budget, budget_source="--budget", batch_size=args.batch_size)
    best = {(c.precision, c.recompute): c for c in plan.best_per_mode}
    fp32, saver = best[("fp32", "none")], best[("bf16", "stages")]
    ratio = saver.volume**3 / fp32.volume**3
    console.print(f"planner at {format_bytes(budget)}: fp32 {fp32.volume}^3, bf16+stages {saver.volume}^3 "
                  f"({ratio:.2f}x the voxels); measuring bf16+stages at {saver.volume}^3 ...")
    run_config = resolve_config(args.model, {"data": {"volume": saver.volume}, "train": {
        "batch_size": args.batch_size, "precision": "bf16", "recompute": "stages"}})
    measured = measure(run_config, steps=2)
    under = measured.peak_bytes <= budget
    console.print(f"measured peak at {saver.volume}^3 bf16+stages: {format_bytes(measured.peak_bytes)} "
                  f"({'under' if under else 'OVER'} the {format_bytes(budget)} budget; predicted "
                  f"{format_bytes(saver.predicted_peak_bytes)})")
    return {"budget_bytes": budget, "fp32_volume": fp32.volume, "bf16_stages_volume": saver.volume,
            "voxel_ratio": round(ratio, 3), "measured_peak_bytes": measured.peak_bytes,
            "predicted_peak_bytes": saver.predicted_peak_bytes, "under_budget": under}


if __name__ == "__main__":
    sys.exit(main())
