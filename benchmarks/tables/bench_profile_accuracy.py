"""What ``bigmem profile --measure`` says on this machine: predicted against measured peak, per configuration.

    python benchmarks/tables/bench_profile_accuracy.py [--configs NAME,...] [--steps 3] [--reuse RESULTS.json]
        [--label idle] [--out DIR]

The configurations are the ones a plan must never under-predict on an unseen CPU: small at 48^3,
64^3, 64^3 bf16 and 64^3 with every stage recomputed; kits19 at 64^3, 96^3 recomputed and 160^3;
intelai-brats at 64^3; small at 256^3; and two anisotropic shapes (kits19 64x160x160 and small
32x128x128), all at batch 1. Each is measured as ``bigmem profile --measure`` measures it
(``bigmem.api.profile``: a few steps in a fresh child process, its VmHWM), and the error is
(predicted - measured) / measured. The target: within +-5%, never under by more than 2%.

``--reuse`` takes the measured peaks from an earlier results file and only predicts again: the
estimate can be re-checked after a change to it without measuring. ``--label`` names the run in
the file (e.g. ``idle``, or ``beside-a-job`` when another job was running). bf16 runs only where
the CPU has it natively (elsewhere it is emulated and the plan leaves it out); it is listed as
skipped. Writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from _results import write_results
from harness import bench_parser, command_line
from rich.console import Console
from rich.table import Table

from bigmem import api
from bigmem.errors import BigmemError
from bigmem.memory.calibration import machine_cpu_model, machine_isa_class
from bigmem.units import format_bytes

# name -> (preset, (D, H, W), precision, recompute)
CONFIGS = {
    "small-48": ("small", (48, 48, 48), "fp32", "none"),
    "small-64": ("small", (64, 64, 64), "fp32", "none"),
    "small-64-bf16": ("small", (64, 64, 64), "bf16", "none"),
    "small-64-stages": ("small", (64, 64, 64), "fp32", "stages"),
    "kits19-64": ("kits19", (64, 64, 64), "fp32", "none"),
    "kits19-96-stages": ("kits19", (96, 96, 96), "fp32", "stages"),
    "kits19-160": ("kits19", (160, 160, 160), "fp32", "none"),
    "intelai-brats-64": ("intelai-brats", (64, 64, 64), "fp32", "none"),
    "small-256": ("small", (256, 256, 256), "fp32", "none"),
    "kits19-64x160x160": ("kits19", (64, 160, 160), "fp32", "none"),
    "small-32x128x128": ("small", (32, 128, 128), "fp32", "none"),
}
TOLERANCE_PCT, MOST_UNDER_PCT = 5.0, 2.0


def _config(preset: str, precision: str, recompute: str):
    return api.resolve_config(preset, {"train": {"batch_size": 1, "precision": precision},
                                       "memory": {"recompute": recompute}})


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="names, separated by commas")
    parser.add_argument("--steps", type=int, default=3, help="training steps measured (default 3)")
    parser.add_argument("--reuse", help="an earlier results file whose measured peaks are taken")
    parser.add_argument("--label", default="idle", help="what else ran beside it (recorded in the file)")
    args = parser.parse_args(argv)
    from bigmem.sysinfo import native_bf16

    reused = {}
    if args.reuse:
        reused = {row["name"]: row for row in json.loads(Path(args.reuse).read_text())["rows"]
                  if row.get("measured_peak_bytes")}
    console = Console()
    rows = []
    for name in args.configs.split(","):
        preset, shape, precision, recompute = CONFIGS[name]
        row = {"name": name, "preset": preset, "shape": list(shape), "precision": precision, "recompute": recompute}
        if precision == "bf16" and not native_bf16():
            rows.append({**row, "skipped": "bf16 is emulated on this CPU"})
            continue
        config = _config(preset, precision, recompute)
        measure = name not in reused
        console.print(f"{name}: {'measuring' if measure else 'predicting'} ...")
        try:
            result = api.profile(config, shape, measure=measure, steps=args.steps)
        except BigmemError as exc:  # e.g. killed by the kernel: say so, go on
            rows.append({**row, "skipped": f"failed: {exc}"})
            continue
        predicted = result.estimate.predicted_peak_bytes
        measured = result.measurement.peak_bytes if measure else reused[name]["measured_peak_bytes"]
        rows.append({**row, "predicted_peak_bytes": predicted, "measured_peak_bytes": measured,
                     "error_pct": round(100.0 * (predicted - measured) / measured, 2),
                     "calibration": result.estimate.calibration.source,
                     "measured_here": measure})
    table = Table(title=f"profile --measure on {machine_isa_class()} {machine_cpu_model()} ({args.label})")
    for column in ("config", "shape", "mode", "predicted", "measured", "error"):
        table.add_column(column, justify="right" if column in ("predicted", "measured", "error") else "left")
    for row in rows:
        mode = f"{row['precision']}/{row['recompute']}"
        shape = "x".join(map(str, row["shape"]))
        if "skipped" in row:
            table.add_row(row["name"], shape, mode, "", "", row["skipped"][:60])
            continue
        error = row["error_pct"]
        verdict = "" if -MOST_UNDER_PCT <= error <= TOLERANCE_PCT else " !"
        table.add_row(row["name"], shape, mode, format_bytes(row["predicted_peak_bytes"]),
                      format_bytes(row["measured_peak_bytes"]), f"{error:+.1f}%{verdict}")
    console.print(table)
    write_results("profile_accuracy", {"command": command_line(__file__, argv), "label": args.label,
                                       "rows": rows}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
