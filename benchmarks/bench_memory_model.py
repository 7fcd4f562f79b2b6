"""Predicted vs measured peak memory, per size and mode; optionally the planner's budget check.

    python benchmarks/bench_memory_model.py [--model small[,kits19]] [--sizes 32,48,64,96,128]
        [--modes fp32/none,bf16/none,fp32/stages,bf16/stages] [--budget 20GiB] [--out DIR]

Each point trains a few steps in a fresh child process and reads its VmHWM (bigmem.memory.measure).
With --budget, it asks the planner for the largest volume per mode within that budget, prints the
voxel ratio of bf16+stages to plain fp32, and measures a run at the bf16+stages size to show it
stays under the budget. Prints a table and writes JSON keyed by machine (never run by pytest).

Run it on a quiet machine: the peak depends on how many ops TensorFlow's executor runs at once,
so it can read low when other work competes for the CPUs (small, 256^3, fp32: 8.9 GiB once with
the test suite running beside it, 10.1 and 10.3 GiB in two quiet runs, 2026-11-30).
"""

from __future__ import annotations

import argparse
import socket
import sys

from _results import write_results
from rich.console import Console
from rich.table import Table

from bigmem.config import resolve_config
from bigmem.errors import BigmemError
from bigmem.memory.calibration import cpu_model, tensorflow_version
from bigmem.memory.measure import measure
from bigmem.memory.planner import available_memory_bytes, make_plan
from bigmem.memory.profile import ProfileResult, counts_function, profile
from bigmem.units import format_bytes, parse_bytes

# A size is measured only if its prediction leaves this share of MemAvailable free, so that the
# kernel does not kill the child halfway through a benchmark for a size that cannot fit anyway.
MEASURABLE_FRACTION = 0.85


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="a preset, or several separated by commas")
    parser.add_argument("--sizes", default="32,48,64,96,128",
                        help="volume edges; a model skips those that are not a multiple of its divisor, "
                             "or whose predicted peak this machine cannot hold")
    parser.add_argument("--modes", default="fp32/none,bf16/none,fp32/stages,bf16/stages")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", help="also check the planner (first --model) at this budget, e.g. 20GiB")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    console = Console(soft_wrap=True)
    models = args.model.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    table = Table(title=f"Predicted vs measured peak (VmHWM), batch {args.batch_size}")
    for column in ("model", "precision", "recompute", "volume", "predicted", "measured", "error", "s/step"):
        table.add_column(column, justify="right")
    for model in models:
        counts_for = None
        divisor = resolve_config(model).model.divisor
        for mode in args.modes.split(","):
            precision, recompute = mode.split("/")
            for size in sizes:
                if size % divisor:
                    continue
                config = resolve_config(model, {"data": {"volume": size}, "train": {
                    "batch_size": args.batch_size, "precision": precision, "recompute": recompute}})
                counts_for = counts_for or counts_function(config)
                predicted = profile(config, (size,) * 3, counts_for).estimate
                if predicted.predicted_peak_bytes > MEASURABLE_FRACTION * available_memory_bytes():
                    console.print(f"{model} {precision}/{recompute} {size}^3: skipped, predicted "
                                  f"{format_bytes(predicted.predicted_peak_bytes)} is more than this machine can hold",
                                  style="dim")
                    continue
                result = ProfileResult(predicted, measure(config, steps=args.steps,
                                                          recompute_stages=predicted.recompute_stages))
                row = {"model": model, "precision": precision, "recompute": recompute, "volume": size,
                       "predicted_peak_bytes": result.estimate.predicted_peak_bytes,
                       "measured_peak_bytes": result.measurement.peak_bytes, "error_pct": round(result.error_pct, 2),
                       "step_s": result.measurement.step_s, "calibration": result.estimate.calibration.source}
                rows.append(row)
                table.add_row(model, precision, recompute, f"{size}^3", format_bytes(row["predicted_peak_bytes"]),
                              format_bytes(row["measured_peak_bytes"]), f"{row['error_pct']:+.1f}%",
                              f"{row['step_s']:.2f}")
                console.print(f"{model} {precision}/{recompute} {size}^3: error {row['error_pct']:+.1f}%", style="dim")
    console.print(table)
    worst = max(rows, key=lambda r: abs(r["error_pct"]))
    console.print(f"worst error: {worst['error_pct']:+.1f}% ({worst['model']} {worst['precision']}/"
                  f"{worst['recompute']} at {worst['volume']}^3); calibration: {rows[0]['calibration']}")
    report = {"machine": {"host": socket.gethostname(), "cpu": cpu_model(), "tensorflow": tensorflow_version()},
              "model": args.model, "batch_size": args.batch_size, "points": rows,
              "worst_error_pct": worst["error_pct"]}
    if args.budget:
        report["budget_check"] = budget_check(args, models[0], console)
    write_results("memory_model", report, args.out, console)
    return 0


def budget_check(args, model: str, console) -> dict:
    budget = parse_bytes(args.budget, flag="--budget")
    config = resolve_config(model, {"train": {"batch_size": args.batch_size}})
    plan = make_plan(config, counts_function(config), budget, budget_source="--budget", batch_size=args.batch_size)
    best = {(c.precision, c.recompute): c for c in plan.best_per_mode}
    fp32, saver = best[("fp32", "none")], best[("bf16", "stages")]
    ratio = saver.volume**3 / fp32.volume**3
    console.print(f"planner at {format_bytes(budget)}: fp32 {fp32.volume}^3, bf16+stages {saver.volume}^3 "
                  f"({ratio:.2f}x the voxels); measuring bf16+stages at {saver.volume}^3 ...")
    run_config = resolve_config(model, {"data": {"volume": saver.volume}, "train": {
        "batch_size": args.batch_size, "precision": "bf16", "recompute": "stages"}})
    try:
        measured = measure(run_config, steps=2)
    except BigmemError as error:  # e.g. killed by the kernel: the plan did not fit after all
        console.print(f"measuring bf16+stages at {saver.volume}^3 FAILED: {error}")
        return {"budget_bytes": budget, "fp32_volume": fp32.volume, "bf16_stages_volume": saver.volume,
                "voxel_ratio": round(ratio, 3), "measured_peak_bytes": None, "error": str(error),
                "predicted_peak_bytes": saver.predicted_peak_bytes, "under_budget": False}
    under = measured.peak_bytes <= budget
    console.print(f"measured peak at {saver.volume}^3 bf16+stages: {format_bytes(measured.peak_bytes)} "
                  f"({'under' if under else 'OVER'} the {format_bytes(budget)} budget; predicted "
                  f"{format_bytes(saver.predicted_peak_bytes)})")
    return {"budget_bytes": budget, "fp32_volume": fp32.volume, "bf16_stages_volume": saver.volume,
            "voxel_ratio": round(ratio, 3), "measured_peak_bytes": measured.peak_bytes,
            "predicted_peak_bytes": saver.predicted_peak_bytes, "under_budget": under}


if __name__ == "__main__":
    sys.exit(main())
