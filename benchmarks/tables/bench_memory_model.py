"""Predicted vs measured peak memory per preset and mode, and how far a small-size calibration extrapolates.

    python benchmarks/tables/bench_memory_model.py [--model small,intelai-brats,kits19] [--calibrate-sizes 32,64,96]
        [--check-sizes auto | N,N,...] [--checks-per-mode 2] [--max-peak 20GiB]
        [--modes fp32/none,bf16/none,fp32/stages,bf16/stages] [--reuse RESULTS.json,...] [--no-measure]
        [--fresh-checks] [--fresh-calibration]
        [--lock PATH] [--budget 20GiB] [--out DIR] [--write-table]

For each preset and mode it measures the calibration sizes (all <= 96^3 by default), fits a
calibration from them in the run (as ``bigmem profile --calibrate`` does: past its sizes it
follows the shipped curve, calibration.follow_shape; at each check size only the shipped knots
below that size are followed, so a check never predicts a size the defaults measured), then
predicts and measures the check sizes: by default (``auto``) the largest ones whose in-run prediction stays
under --max-peak (a size whose run fails, e.g. killed by the kernel, is reported and the next
smaller one tried). Every point is reported with three predictions: the shipped defaults'; the
in-run calibration's, which at the check sizes is the extrapolation error from small volumes
alone; and, at the check sizes, the in-run calibration following every shipped knot, which is
what ``bigmem profile --calibrate`` gives a user on this machine (on the machine the defaults
were measured on it only repeats them; on another CPU it is the error a user there gets). Each
point trains a few steps in a fresh child process and reads its VmHWM (bigmem.memory.measure).

--reuse takes the measured peaks of matching points (model, precision, recompute, volume, batch)
from earlier results files instead of measuring again, and says so per point: the estimate can
be re-analysed against measurements without repeating them (--no-measure: nothing else is run).
--lock holds an flock on PATH around each measurement (for a machine shared with other
memory-heavy jobs). With --budget, it asks the planner for the largest volume per mode within
that budget (first --model) and measures a --steps run at the bf16+stages size. The printed
"defaults_fit" is what calibration.SHIPPED holds; --write-table replaces this machine's entry of
bigmem/measured/training_memory.json with it (only what this run measured: run every preset and
mode). Writes JSON keyed by machine (never run by pytest).

Run it on a quiet machine: the peak depends on how many ops TensorFlow's executor runs at once,
so it can read low when other work competes for the CPUs (small, 256^3, fp32: 8.9 GiB once with
the test suite running beside it, 10.1 and 10.3 GiB in two quiet runs, 2026-11-30).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from _results import write_table
from harness import bench_parser, heavy_turn, machine_slug, write_results
from rich.console import Console
from rich.table import Table

from bigmem.atomic import atomic_write_json
from bigmem.config import resolve_config
from bigmem.errors import BigmemError
from bigmem.memory.calibration import (
    DEFAULTS_BATCH_SIZE,
    Calibration,
    machine_cpu_model,
    fit_calibration,
    knots_from,
    machine_isa_class,
    shipped_calibration,
    shipped_shape,
    tensorflow_version,
)
from bigmem.memory.estimate import estimate
from bigmem.memory.measure import measure
from bigmem.memory.search import available_memory_bytes, make_plan
from bigmem.memory.profile import calibration_point, counts_function, stages_for
from bigmem.memory.records import Budget
from bigmem.units import format_bytes, parse_bytes

# The largest edge `--check-sizes auto` considers (kits19 at 512^3 needs ~0.5 TiB even in bf16).
MAX_CHECK_VOLUME = 512


def _point_key(model: str, precision: str, recompute: str, volume: int, batch: int) -> tuple:
    return (model, precision, recompute, int(volume), int(batch))


def load_reused(paths: str | None) -> dict[tuple, dict]:
    """Measured points of earlier results files (comma-separated; a later file wins), by
    (model, precision, recompute, volume, batch)."""
    found = {}
    for path in (paths.split(",") if paths else []):
        with open(path) as handle:
            report = json.load(handle)
        batch = report.get("batch_size", 1)
        for row in report.get("points", []):
            if row.get("measured_peak_bytes"):
                origin = row.get("measurement", "")
                row = {**row, "measurement": origin if origin.startswith("reused") else f"reused from {path}"}
                row.setdefault("model", report.get("model"))  # early files name the model once, at the top
                found[_point_key(row["model"], row["precision"], row["recompute"], row["volume"], batch)] = row
    return found


class Campaign:
    """Measures (or reuses) points and predicts them with the shipped default and an in-run fit."""

    def __init__(self, args, console):
        self.args, self.console = args, console
        self.reused = load_reused(args.reuse)
        self.isa = machine_isa_class()
        self.rows: list[dict] = []
        self.failures: list[dict] = []

    def config(self, model: str, precision: str, recompute: str, volume: int):
        return resolve_config(model, {"data": {"volume": volume}, "train": {
            "batch_size": self.args.batch_size, "precision": precision}, "memory": {"recompute": recompute}})

    def measured(self, config, counts_for, *, reuse: bool = True) -> tuple[int | None, float | None, str]:
        """(peak bytes, s/step, where it came from); (None, None, error) if the run failed."""
        train = config.train
        key = _point_key(config.model.name, train.precision.value, config.memory.recompute.value, config.data.shape[0],
                         train.batch_size)
        if reuse and key in self.reused:
            row = self.reused[key]
            return row["measured_peak_bytes"], row.get("step_s"), row["measurement"]
        if self.args.no_measure:
            return None, None, "not in --reuse (--no-measure)"
        stages = stages_for(config, counts_for((config.data.shape[0],) * 3))
        try:
            with heavy_turn(bool(self.args.lock), self.console.print, lock_path=self.args.lock):
                # forced: the shipped estimate must not veto a size that --max-peak admits
                result = measure(config, steps=self.args.steps, recompute_stages=stages, force=True)
        except BigmemError as error:
            return None, None, str(error)
        return result.peak_bytes, result.seconds, f"measured {time.strftime('%Y-%m-%d %H:%M')}"

    def predict(self, config, counts_for, calibration) -> int:
        volume = config.data.shape[0]
        counts = counts_for((volume,) * 3)
        return estimate(config, counts, (volume,) * 3, recompute_stages=stages_for(config, counts),
                        calibration=calibration).predicted_peak_bytes

    def run_mode(self, model: str, precision: str, recompute: str, counts_for, divisor: int) -> None:
        args = self.args
        shipped = shipped_calibration(model, precision, recompute, isa=self.isa)
        calibration_sizes = [s for s in args.calibrate_sizes if s % divisor == 0]
        points, measured = [], {}
        for size in calibration_sizes:
            config = self.config(model, precision, recompute, size)
            peak, step_s, origin = self.measured(config, counts_for, reuse=not args.fresh_calibration)
            if peak is None:
                self.fail(model, precision, recompute, size, origin)
                continue
            measured[size] = (peak, step_s, origin)
            points.append(calibration_point(config, counts_for, peak))
        if len(points) < 2:
            self.console.print(f"{model} {precision}/{recompute}: fewer than two calibration sizes, skipped")
            return
        shape = shipped_shape(model, precision, recompute, self.isa, args.batch_size)
        as_a_user = fit_calibration(model, precision, recompute, points, shape)  # profile --calibrate's fit
        for size, (peak, step_s, origin) in measured.items():
            self.add(model, precision, recompute, size, "calibration", peak, step_s, origin, counts_for,
                     shipped, as_a_user)
        done, candidates = 0, self.check_candidates(model, precision, recompute, counts_for, divisor,
                                                                 as_a_user)
        fitted = as_a_user  # with no check size measured (--checks-per-mode 0)
        for size in candidates:
            if done >= args.checks_per_mode:
                break
            config = self.config(model, precision, recompute, size)
            # As `profile --calibrate` fits it, but following only the shipped knots below this size:
            # the check extrapolates past every measurement it is judged against.
            below = calibration_point(config, counts_for, 0)["counted_activation_bytes"]
            fitted = fit_calibration(model, precision, recompute, points, [k for k in shape if k[0] < below])
            self.console.print(f"{model} {precision}/{recompute} {size}^3: predicted "
                               f"{format_bytes(self.predict(config, counts_for, fitted))} (in-run fit) ...",
                               style="dim")
            peak, step_s, origin = self.measured(config, counts_for, reuse=not args.fresh_checks)
            if peak is None:
                self.fail(model, precision, recompute, size, origin)
                continue
            self.add(model, precision, recompute, size, "check", peak, step_s, origin, counts_for, shipped, fitted,
                     as_a_user)
            done += 1
        self.rows[-1]["fitted_calibration"] = fitted.to_dict()

    def check_candidates(self, model, precision, recompute, counts_for, divisor, fitted) -> list[int]:
        largest_calibrated = max(self.args.calibrate_sizes)
        if self.args.check_sizes not in ("auto", "reused"):
            sizes = [int(s) for s in self.args.check_sizes.split(",")]
            return sorted((s for s in sizes if s % divisor == 0), reverse=True)
        if self.args.check_sizes == "reused":  # re-analysis: the sizes measured before
            return sorted((k[3] for k in self.reused if k[:3] == (model, precision, recompute)
                           and k[3] > largest_calibrated), reverse=True)
        limit = parse_bytes(self.args.max_peak, flag="--max-peak")
        sizes = range(divisor * (largest_calibrated // divisor + 1), MAX_CHECK_VOLUME + 1, divisor)
        fitting = [s for s in sizes if self.predict(self.config(model, precision, recompute, s), counts_for, fitted)
                   <= limit]
        return sorted(fitting, reverse=True)

    def fail(self, model, precision, recompute, size, error) -> None:
        self.console.print(f"{model} {precision}/{recompute} {size}^3: FAILED: {error}")
        self.failures.append({"model": model, "precision": precision, "recompute": recompute, "volume": size,
                              "error": error})

    def add(self, model, precision, recompute, size, role, peak, step_s, origin, counts_for, shipped, fitted,
            as_a_user=None):
        config = self.config(model, precision, recompute, size)
        by_default = self.predict(config, counts_for, shipped)
        by_fit = self.predict(config, counts_for, fitted)
        row = {"model": model, "precision": precision, "recompute": recompute, "volume": size, "role": role,
               "measured_peak_bytes": int(peak), "step_s": step_s, "measurement": origin,
               "predicted_peak_bytes": by_default, "error_pct": _error_pct(by_default, peak),
               "fitted_predicted_peak_bytes": by_fit, "fitted_error_pct": _error_pct(by_fit, peak),
               "calibration": shipped.source}
        if as_a_user is not None:
            by_user = self.predict(config, counts_for, as_a_user)
            row.update(calibrated_predicted_peak_bytes=by_user, calibrated_error_pct=_error_pct(by_user, peak))
        self.rows.append(row)
        self.console.print(f"{model} {precision}/{recompute} {size}^3 ({role}): measured {format_bytes(peak)}; "
                           f"shipped {row['error_pct']:+.1f}%, in-run fit {row['fitted_error_pct']:+.1f}%"
                           + (f", calibrated as a user {row['calibrated_error_pct']:+.1f}%" if as_a_user else ""),
                           style="dim")


def _error_pct(predicted: int, measured: int) -> float:
    return round(100.0 * (predicted - measured) / measured, 2)


def _worst(rows: list[dict], field: str) -> dict | None:
    return max(rows, key=lambda r: abs(r[field])) if rows else None


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="small,intelai-brats,kits19", help="presets, separated by commas")
    parser.add_argument("--calibrate-sizes", default="32,64,96",
                        help="volume edges the in-run calibration is fitted on (those a preset divides)")
    parser.add_argument("--check-sizes", default="auto",
                        help="volume edges to extrapolate to; 'auto': the largest under --max-peak; "
                             "'reused': those --reuse has above the calibration sizes")
    parser.add_argument("--checks-per-mode", type=int, default=2)
    parser.add_argument("--max-peak", default=None,
                        help="auto check sizes stay under this in-run prediction (default: 85%% of MemAvailable)")
    parser.add_argument("--modes", default="fp32/none,bf16/none,fp32/stages,bf16/stages")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reuse", help="earlier results files (comma-separated) whose measured points are taken, "
                                        "not measured again")
    parser.add_argument("--no-measure", action="store_true",
                        help="only re-analyse: a point that --reuse does not hold is reported missing, not measured")
    parser.add_argument("--fresh-checks", action="store_true",
                        help="measure the check sizes even where --reuse holds them (only the calibration sizes "
                             "are reused)")
    parser.add_argument("--fresh-calibration", action="store_true",
                        help="measure the calibration sizes even where --reuse holds them: a calibration that "
                             "is not the measurement the shipped knots at those sizes came from")
    parser.add_argument("--lock", help="hold an flock on this file around each measurement (e.g. "
                                       "/tmp/bigmem-heavy.lock, the one the other multi-GB benchmarks take turns on)")
    parser.add_argument("--budget", help="also check the planner (first --model) at this budget, e.g. 20GiB")
    parser.add_argument("--write-table", action="store_true",
                        help="replace this machine's entry of bigmem/measured/training_memory.json with this run's "
                             "defaults_fit")
    args = parser.parse_args(argv)
    if args.write_table and args.batch_size != DEFAULTS_BATCH_SIZE:
        parser.error(f"--write-table needs --batch-size {DEFAULTS_BATCH_SIZE}: the shipped knots are at that batch "
                     f"(a calibration at another batch does not follow them); got {args.batch_size}")
    here = machine_isa_class()
    elsewhere = [p for p in (args.reuse.split(",") if args.write_table and args.reuse else [])
                 if json.loads(Path(p).read_text())["machine"].get("isa_class", here) != here]
    if elsewhere:  # the entry would record this machine as the one that measured them
        parser.error(f"--write-table with points another ISA class measured ({', '.join(elsewhere)}): run it there")
    args.calibrate_sizes = [int(s) for s in args.calibrate_sizes.split(",")]
    args.max_peak = args.max_peak or str(int(0.85 * available_memory_bytes()))
    console = Console(soft_wrap=True, width=160)
    campaign = Campaign(args, console)
    report = {"machine": {"host": socket.gethostname(), "cpu": machine_cpu_model(), "isa_class": campaign.isa,
                          "tensorflow": tensorflow_version()},
              "model": args.model, "batch_size": args.batch_size, "calibrate_sizes": args.calibrate_sizes,
              "reused_from": args.reuse, "points": campaign.rows, "failures": campaign.failures}
    partial = Path(args.out) / f"memory_model-partial-{machine_slug()}.json"
    for model in args.model.split(","):
        base = resolve_config(model)
        counts_for = counts_function(base)
        for mode in args.modes.split(","):
            precision, recompute = mode.split("/")
            campaign.run_mode(model, precision, recompute, counts_for, base.model.divisor)
            # what is done so far survives a crash later on
            atomic_write_json(partial, report)
    print_summary(campaign.rows, console, report)
    report["defaults_fit"] = fit_defaults(campaign.rows, campaign.isa, args.batch_size, console)
    if args.budget:
        report["budget_check"] = budget_check(args, args.model.split(",")[0], console)
    path = write_results("memory_model", report, args.out, console)
    partial.unlink(missing_ok=True)  # the whole report is written: the crash copy has served
    if args.write_table:
        write_table("training_memory", {"batch_size": args.batch_size, "tables": [
            {"preset": fit["model"], "precision": fit["precision"], "recompute": fit["recompute"],
             "knots": [{"volume": v, "counted_activation_bytes": x, "overhead_bytes": y} for v, x, y in fit["knots"]],
             "left_out_error_pct": fit["left_out_error_pct"]} for fit in report["defaults_fit"]]},
            results=path, console=console, notes=[
                f"The defaults_fit of this run: every point trained {args.steps} steps in a fresh child process and "
                "read its VmHWM. 'left_out_error_pct' is each knot predicted from the others (the last one by the "
                "rule beyond the knots). A size that failed (e.g. killed by the kernel) has no knot."])
    return 0


def print_summary(rows: list[dict], console, report: dict) -> None:
    table = Table(title=f"Predicted vs measured peak (VmHWM), batch {report['batch_size']}")
    for column in ("model", "precision", "recompute", "volume", "role", "measured", "shipped", "error",
                   "in-run fit", "error", "as a user", "error"):
        table.add_column(column, justify="right")
    for r in rows:
        user = r.get("calibrated_predicted_peak_bytes")
        table.add_row(r["model"], r["precision"], r["recompute"], f"{r['volume']}^3", r["role"],
                      format_bytes(r["measured_peak_bytes"]), format_bytes(r["predicted_peak_bytes"]),
                      f"{r['error_pct']:+.1f}%", format_bytes(r["fitted_predicted_peak_bytes"]),
                      f"{r['fitted_error_pct']:+.1f}%", format_bytes(user) if user else "-",
                      f"{r['calibrated_error_pct']:+.1f}%" if user else "-")
    console.print(table)
    checks = [r for r in rows if r["role"] == "check"]
    for label, field, subset in (("shipped defaults, all points", "error_pct", rows),
                                 ("in-run calibration, all points", "fitted_error_pct", rows),
                                 ("extrapolation (in-run fit, check sizes)", "fitted_error_pct", checks),
                                 ("calibrated on <= the calibration sizes as a user (check sizes)",
                                  "calibrated_error_pct", [r for r in checks if "calibrated_error_pct" in r])):
        worst = _worst(subset, field)
        if worst:
            console.print(f"worst error, {label}: {worst[field]:+.1f}% ({worst['model']} {worst['precision']}/"
                          f"{worst['recompute']} at {worst['volume']}^3)")
            report[f"worst_{field}" + ("_check" if subset is checks else "")] = worst[field]
    report["worst_error_pct"] = report.get("worst_error_pct")


def fit_defaults(rows: list[dict], isa: str, batch_size: int, console) -> list[dict]:
    """calibration.SHIPPED entries from this run (knots at every measured size), left out one at a time.

    Each knot but the first is also predicted from the others (the last one by the rule for sizes
    beyond the knots), so the shipped curve is judged on points it was not fitted to.
    """
    fitted = []
    for key in dict.fromkeys((r["model"], r["precision"], r["recompute"]) for r in rows):
        model, precision, recompute = key
        counts_for = counts_function(resolve_config(model))
        mode_rows = [r for r in rows if (r["model"], r["precision"], r["recompute"]) == key]
        points = [calibration_point(resolve_config(model, {"data": {"volume": r["volume"]}, "train": {
            "batch_size": batch_size, "precision": precision}, "memory": {"recompute": recompute}}), counts_for,
            r["measured_peak_bytes"]) for r in sorted(mode_rows, key=lambda r: r["volume"])]
        knots = knots_from(points)
        left_out = {}
        for index, point in enumerate(points[1:], start=1):
            others = Calibration(0.0, 0, "knots", knots=knots_from(points[:index] + points[index + 1:]))
            scale, framework = others.line_for(point["counted_activation_bytes"])
            predicted = point["exact_bytes"] + framework + scale * point["counted_activation_bytes"]
            left_out[point["volume"]] = _error_pct(int(predicted), point["measured_peak_bytes"])
        volumes = [p["volume"] for p in points]
        fitted.append({"isa": isa, "model": model, "precision": precision, "recompute": recompute,
                       "knots": [[v, x, y] for v, (x, y) in zip(volumes, knots)], "left_out_error_pct": left_out})
        console.print(f'    ("{isa}", "{model}", "{precision}", "{recompute}"): (')
        for volume, (x, y) in zip(volumes, knots):
            console.print(f"        ({volume}, {x:_}, {y:_}),")
        console.print("    ),")
        console.print(f"      left out: {left_out}", style="dim")
    return fitted


def budget_check(args, model: str, console) -> dict:
    budget = parse_bytes(args.budget, flag="--budget")
    config = resolve_config(model, {"train": {"batch_size": args.batch_size}})
    plan = make_plan(config, counts_function(config), Budget(budget, "--budget"), batch_size=args.batch_size)
    best = {(c.precision, c.recompute): c for c in plan.best_per_mode}
    fp32, saver = best[("fp32", "none")], best[("bf16", "stages")]
    ratio = saver.volume**3 / fp32.volume**3
    console.print(f"planner at {format_bytes(budget)}: fp32 {fp32.volume}^3, bf16+stages {saver.volume}^3 "
                  f"({ratio:.2f}x the voxels); measuring bf16+stages at {saver.volume}^3 ...")
    run_config = resolve_config(model, {"data": {"volume": saver.volume}, "train": {
        "batch_size": args.batch_size, "precision": "bf16"}, "memory": {"recompute": "stages"}})
    try:
        with heavy_turn(bool(args.lock), console.print, lock_path=args.lock):
            measured = measure(run_config, steps=args.steps)
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
            "voxel_ratio": round(ratio, 3), "measured_peak_bytes": measured.peak_bytes, "steps": args.steps,
            "step_s": measured.seconds, "predicted_peak_bytes": saver.predicted_peak_bytes, "under_budget": under}


if __name__ == "__main__":
    sys.exit(main())
