"""Inference memory: predicted vs measured peak of one whole-volume prediction, and the largest volume that fits.

    python benchmarks/tables/bench_inference_memory.py [--model kits19]
        [--fp32-sizes 32,64,...] [--bf16-sizes 32,64,...] [--knot-sizes N,N,...] [--slab-check SIZE:LIMIT,...]
        [--largest | --no-largest] [--reuse RESULTS.json,...] [--no-measure] [--out DIR] [--write-table]

Every point segments one random volume by ``bigmem predict``'s whole-volume path in a fresh child
process (``bigmem.train.probe``: normalise, pad, forward pass and softmax, the source mapping's
running argmax) and reads its VmHWM (``bigmem.memory.measure.measure`` in its forward pass). Each point is
predicted three ways: with the calibration shipped in ``memory/estimate.py`` (whatever it held
when this ran), with the knots fitted in this run (``defaults_fit``: what ``calibration.SHIPPED`` (mode "inference")
should hold; every measured sweep size, or ``--knot-sizes``), and with those knots but its own
left out (the error a size that was not measured gets; for the last knot, the rule beyond the
knots). ``--slab-check SIZE:LIMIT,...`` measures sizes with the kernel element limit lowered
(``BIGMEM_MAX_KERNEL_ELEMENTS``), so the depth-slab paths run at sizes this machine holds; they
are predicted, never fitted.

``--largest`` (default) then asks the inference plan (``search_inference_plan``, fp32, the
default budget: MemAvailable now) for the largest whole cube the model can segment and measures
that size, predicted with the fitted knots (it is not one of them: beyond the last knot unless
it was in the sweep).

Run it alone on the machine: the peak depends on how the allocator's free buffers line up, and
another process's memory use lowers MemAvailable and so the plan. It holds the heavy-job lock
(``harness.heavy_turn``, /tmp/bigmem-heavy.lock) from its first measurement to its last, so start
it without an outer ``flock`` on that file (it would wait for that one forever).
Prints a table and writes ``inference_memory-<machine>-<time>.json`` (never run by pytest);
``--write-table`` replaces this machine's entry for the model in bigmem/measured/inference_memory.json
with the fitted knots.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from _results import write_table
from harness import bench_parser, command_line, heavy_turn, machine_slug, write_results
from rich.console import Console
from rich.table import Table

from bigmem.config import resolve_config
from bigmem.errors import BigmemError
from bigmem.memory.budget import resolve_budget
from bigmem.memory.calibration import Calibration, machine_cpu_model, knots_from, machine_isa_class, tensorflow_version
from bigmem.memory.estimate import Pass, estimate
from bigmem.memory.measure import measure
from bigmem.memory.search import available_memory_bytes
from bigmem.memory.plans import plan_inference
from bigmem.memory.profile import counts_function
from bigmem.nets.limits import LIMIT_ENVIRONMENT_VARIABLE, kernel_element_limit
from bigmem.units import format_bytes

UNIT = Calibration(1.0, 0, "unit")  # no framework, no slack: the estimate's counted and exact parts alone


def _error_pct(predicted: float, measured: float) -> float:
    return round(100.0 * (predicted - measured) / measured, 2)


def load_reused(paths: str | None) -> dict[tuple, dict]:
    """Measured rows of earlier results files by (model, precision, volume, kernel_limit); a later file wins."""
    found = {}
    for path in (paths.split(",") if paths else []):
        with open(path) as handle:
            report = json.load(handle)
        for row in report.get("points", []) + ([report["largest"]] if report.get("largest") else []):
            if row.get("measured_peak_bytes"):
                origin = row.get("measurement", "")
                row = {**row, "measurement": origin if origin.startswith("reused") else f"reused from {path}"}
                found[(row["model"], row["precision"], row["volume"], row.get("kernel_limit"))] = row
    return found


class Campaign:
    """Measures (or reuses) points and splits each estimate into its counted and exact parts."""

    def __init__(self, args, console):
        self.args, self.console = args, console
        self.reused = load_reused(args.reuse)
        self.counts = {}

    def counts_for(self, model: str):
        if model not in self.counts:
            self.counts[model] = counts_function(resolve_config(model))
        return self.counts[model]

    def point(self, model: str, precision: str, volume: int, role: str, kernel_limit: int | None = None) -> dict:
        """One measured (or reused) size with its estimate's parts; ``measured_peak_bytes`` None if it failed."""
        config = resolve_config(model, {"train": {"precision": precision}})
        shape = (volume,) * 3
        limit = kernel_element_limit(kernel_limit) if kernel_limit else _nothing()
        with limit:  # the blocks' slab accounting follows the limit in force, as the child's ops will
            counts = self.counts_for(model)(shape)
            raw = estimate(config, counts, shape, calibration=UNIT, pass_=Pass.FORWARD)
            shipped = estimate(config, counts, shape, pass_=Pass.FORWARD)
        counted = raw.components["input_tensor"] + raw.components["forward_activations"]
        row = {"model": model, "precision": precision, "volume": volume, "role": role, "kernel_limit": kernel_limit,
               "counted_bytes": counted, "exact_bytes": raw.predicted_peak_bytes - counted,
               "predicted_shipped_bytes": shipped.predicted_peak_bytes,
               "shipped_calibration": shipped.calibration.source, "partitioned_stages": raw.partitioned_stages,
               "components_shipped": shipped.components}
        key = (model, precision, volume, kernel_limit)
        if key in self.reused:
            old = self.reused[key]
            row.update(measured_peak_bytes=old["measured_peak_bytes"], seconds=old.get("seconds"),
                       baseline_bytes=old.get("baseline_bytes"), measurement=old["measurement"])
        elif self.args.no_measure:
            row.update(measured_peak_bytes=None, measurement="not in --reuse (--no-measure)")
        else:
            self.console.print(f"measuring {model} {precision} {volume}^3"
                               + (f" (kernel limit {kernel_limit:,})" if kernel_limit else "") + " ...", style="dim")
            env = {**os.environ, **({LIMIT_ENVIRONMENT_VARIABLE: str(kernel_limit)} if kernel_limit else {})}
            try:
                result = measure(config, shape, env=env, pass_=Pass.FORWARD)
                row.update(measured_peak_bytes=result.peak_bytes, seconds=result.seconds,
                           baseline_bytes=result.baseline_bytes, model_bytes=result.model_bytes,
                           measurement=f"measured {time.strftime('%Y-%m-%d %H:%M')}")
            except BigmemError as error:
                row.update(measured_peak_bytes=None, measurement=str(error))
        if row["measured_peak_bytes"]:
            row["error_shipped_pct"] = _error_pct(row["predicted_shipped_bytes"], row["measured_peak_bytes"])
        return row


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def as_point(row: dict) -> dict:
    """A row as ``calibration.knots_from`` takes it."""
    return {"volume": row["volume"], "counted_activation_bytes": row["counted_bytes"],
            "exact_bytes": row["exact_bytes"], "measured_peak_bytes": row["measured_peak_bytes"]}


def predicted_with(knots: list, row: dict) -> int:
    scale, intercept = Calibration(0.0, 0, "knots", knots=knots).line_for(row["counted_bytes"])
    return int(round(row["exact_bytes"] + intercept + scale * row["counted_bytes"]))


def fit(rows: list[dict], knot_sizes: list[int] | None, isa: str, console) -> list[dict]:
    """calibration.SHIPPED entries (mode "inference": knots) per (model, precision), each knot also predicted
    with itself left out."""
    fitted = []
    for model, precision in dict.fromkeys((r["model"], r["precision"]) for r in rows):
        sweep = sorted((r for r in rows if (r["model"], r["precision"]) == (model, precision) and r["role"] == "sweep"
                        and r["measured_peak_bytes"]), key=lambda r: r["volume"])
        knot_rows = [r for r in sweep if knot_sizes is None or r["volume"] in knot_sizes]
        if len(knot_rows) < 2:
            continue
        knots = knots_from([as_point(r) for r in knot_rows])
        for r in rows:
            if (r["model"], r["precision"]) == (model, precision) and r["measured_peak_bytes"]:
                r["predicted_fitted_bytes"] = predicted_with(knots, r)
                r["error_fitted_pct"] = _error_pct(r["predicted_fitted_bytes"], r["measured_peak_bytes"])
                r["knot"] = r in knot_rows
        for index, r in enumerate(knot_rows):
            if index == 0 or len(knot_rows) < 3:
                continue  # the first knot is the framework's intercept; a line needs two other knots
            others = knots_from([as_point(o) for o in knot_rows if o is not r])
            r["error_left_out_pct"] = _error_pct(predicted_with(others, r), r["measured_peak_bytes"])
        entry = {"isa": isa, "model": model, "precision": precision,
                 "knots": [[r["volume"], x, y] for r, (x, y) in zip(knot_rows, knots)]}
        fitted.append(entry)
        console.print(f'    ("{isa}", "{model}", "{precision}"): (')
        for volume, x, y in entry["knots"]:
            console.print(f"        ({volume}, {x:_}, {y:_}),")
        console.print("    ),")
    return fitted


def largest(campaign: Campaign, model: str, rows: list[dict], console) -> dict:
    """The inference plan's largest whole cube at the default budget (fp32), measured."""
    config = resolve_config(model, {"train": {"precision": "fp32"}})
    budget = resolve_budget(None)
    plan = plan_inference(config, campaign.counts_for(model), budget)
    chosen = plan.chosen
    above = min((c for c in plan.candidates if not c.fits and chosen and c.volume > chosen.volume),
                key=lambda c: c.volume, default=None)
    result = {"budget_bytes": budget.budget_bytes, "budget_source": budget.source,
              "volume": chosen.volume if chosen else None,
              "plan_predicted_peak_bytes": chosen.predicted_peak_bytes if chosen else None,
              "next_volume": above.volume if above else None,
              "next_predicted_peak_bytes": above.predicted_peak_bytes if above else None,
              "plan_calibration": plan.calibration.get("source") if plan.calibration else None}
    if chosen is None:
        console.print(f"the inference plan fits nothing in {format_bytes(budget.budget_bytes)}")
        return result
    console.print(f"inference plan: {model} fp32 segments at most {chosen.volume}^3 within "
                  f"{format_bytes(budget.budget_bytes)} ({budget.source}): est. "
                  f"{format_bytes(chosen.predicted_peak_bytes)}; {above.volume if above else '-'}^3 needs "
                  f"{format_bytes(above.predicted_peak_bytes) if above else '-'}")
    same = next((r for r in rows if (r["model"], r["precision"], r["volume"], r["kernel_limit"], r["role"])
                 == (model, "fp32", chosen.volume, None, "sweep") and r["measured_peak_bytes"]), None)
    row = dict(same, role="largest") if same else campaign.point(model, "fp32", chosen.volume, "largest")
    result.update(row)
    result["under_budget"] = bool(row["measured_peak_bytes"]) and row["measured_peak_bytes"] <= budget.budget_bytes
    return result


def print_table(rows: list[dict], machine: dict, console) -> None:
    onednn = "on" if machine["onednn_enabled"] else "off"
    table = Table(title=f"Inference peak (VmHWM), predicted vs measured: {machine['cpu']}, ISA {machine['isa_class']}, "
                        f"oneDNN {onednn}, TF {machine['tensorflow']}")
    for column in ("model", "prec.", "volume", "role", "measured", "shipped", "error", "fitted", "error",
                   "left out", "s"):
        table.add_column(column, justify="right")
    for r in rows:
        role = r["role"] + (f" (limit {r['kernel_limit']:,})" if r.get("kernel_limit") else "") + (
            ", knot" if r.get("knot") else "")
        measured = r.get("measured_peak_bytes")
        table.add_row(r["model"], r["precision"], f"{r['volume']}^3", role,
                      format_bytes(measured) if measured else "FAILED",
                      format_bytes(r["predicted_shipped_bytes"]),
                      f"{r['error_shipped_pct']:+.1f}%" if "error_shipped_pct" in r else "-",
                      format_bytes(r["predicted_fitted_bytes"]) if "predicted_fitted_bytes" in r else "-",
                      f"{r['error_fitted_pct']:+.1f}%" if "error_fitted_pct" in r else "-",
                      f"{r['error_left_out_pct']:+.1f}%" if "error_left_out_pct" in r else "-",
                      f"{r['seconds']:.0f}" if r.get("seconds") else "-")
    console.print(table)


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="kits19")
    parser.add_argument("--fp32-sizes", default="32,64,96,128,160,192,224,256")
    parser.add_argument("--bf16-sizes", default="32,64,128,192,256", help="'' to skip bf16")
    parser.add_argument("--knot-sizes", help="fit the knots on these sweep sizes only (default: all)")
    parser.add_argument("--slab-check", default="128:16777216,160:33554432,192:67108864", metavar="SIZE:LIMIT,...",
                        help="measure SIZE^3 fp32 with the kernel element limit lowered to LIMIT ('' to skip); the "
                             "defaults put kits19's full-resolution tensors past the limit and the rest under it, as "
                             "at 352^3 and above with the real limit")
    parser.add_argument("--largest", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--reuse", help="measured points of earlier results files (comma-separated)")
    parser.add_argument("--no-measure", action="store_true", help="measure nothing: --reuse only")
    parser.add_argument("--write-table", action="store_true",
                        help="replace this machine's entry for --model in bigmem/measured/inference_memory.json with "
                             "the fitted knots")
    args = parser.parse_args(argv)
    here = machine_isa_class()
    elsewhere = [p for p in (args.reuse.split(",") if args.write_table and args.reuse else [])
                 if json.loads(Path(p).read_text())["machine"].get("isa_class", here) != here]
    if elsewhere:  # the entry would record this machine as the one that measured them
        parser.error(f"--write-table with points another ISA class measured ({', '.join(elsewhere)}): run it there")
    from bigmem.sysinfo import tensorflow_description
    from bigmem.tfenv import import_tensorflow

    import_tensorflow()
    tf_info = tensorflow_description()
    console = Console(soft_wrap=True, width=170)
    isa = machine_isa_class()
    with heavy_turn(not args.no_measure, console.print):  # MemAvailable (the plan's budget) counts too
        machine = {"host": socket.gethostname(), "cpu": machine_cpu_model(), "isa_class": isa,
                   "tensorflow": tensorflow_version(), "keras": tf_info["keras"],
                   "onednn_enabled": tf_info["onednn_enabled"], "onednn_reason": tf_info["onednn_reason"],
                   "TF_ENABLE_ONEDNN_OPTS": tf_info["TF_ENABLE_ONEDNN_OPTS"],
                   "mem_available_bytes_at_start": available_memory_bytes()}
        campaign = Campaign(args, console)
        rows = []
        for precision, sizes in (("fp32", args.fp32_sizes), ("bf16", args.bf16_sizes)):
            for volume in _sizes(sizes):
                rows.append(campaign.point(args.model, precision, volume, "sweep"))
        for check in filter(None, args.slab_check.split(",")):
            size, limit = (int(v) for v in check.split(":"))
            rows.append(campaign.point(args.model, "fp32", size, "slab check", kernel_limit=limit))
        result = largest(campaign, args.model, rows, console) if args.largest else None
    report = {"machine": machine, "model": args.model, "command": command_line(__file__, argv),
              "reused_from": args.reuse}
    table_rows = rows + ([result] if result and result.get("measured_peak_bytes") else [])
    report["defaults_fit"] = fit(table_rows, _sizes(args.knot_sizes) if args.knot_sizes else None, isa, console)
    print_table(table_rows, machine, console)
    report["points"], report["largest"] = rows, result
    path = write_results("inference_memory", report, args.out, console)
    if args.write_table:
        write_table("inference_memory", {"preset": args.model, "tables": [
            {"preset": fit["model"], "precision": fit["precision"],
             "knots": [{"volume": v, "counted_activation_bytes": x, "overhead_bytes": y} for v, x, y in fit["knots"]]}
            for fit in report["defaults_fit"]]}, key=f"{machine_slug()}/{args.model}", results=path, console=console,
            notes=["The defaults_fit of this run: every point one whole-volume prediction in a fresh child process "
                   "(bigmem/infer/probe.py) reading its VmHWM. Each point's error with its own knot left out is the "
                   "'error_left_out_pct' of the results file's points."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
