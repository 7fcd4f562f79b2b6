"""What ``bigmem profile --measure`` says on this machine: predicted against measured peak, per configuration.

    python benchmarks/tables/bench_profile_accuracy.py [--configs NAME,...] [--steps 20] [--reuse RESULTS.json,...]
        [--label idle] [--draws 1] [--out DIR]

The configurations are the ones a plan must never under-predict on an unseen CPU: small at 48^3,
64^3, 64^3 bf16 and 64^3 with every stage recomputed; kits19 at 64^3, 96^3 recomputed and 160^3;
intelai-brats at 64^3; small at 256^3; and two anisotropic shapes (kits19 64x160x160 and small
32x128x128), all at batch 1. Then batches of several (small 64^3 x 2 and x 4, 96^3 x 2; kits19 64^3
and 64x96x96 x 2), and networks configured per axis as ``bigmem plan --data`` configures them
(``config/topology.py``'s rules and ``data/experiment.py``'s blocks, named "experiment" as plan
writes them): a KiTS-like one (3 x 0.8 x 0.8 mm) at 64x96x96 x 2, a prostate-like one (0.6 x 0.6 x
3.6 mm) at 160x160x24 x 2, and the KiTS-like one at 64x128x128 with the kernel limit lowered to 2^23
elements so that its full-resolution stages run in depth slabs; and resenc-m at 64^3 x 1 and x 2.
``--configs grid`` instead measures every preset with a shipped table (small, kits19, intelai-brats,
resenc-m) with nothing and with every stage recomputed, at three cube edges each, fp32, batch 1.
Each is measured as ``bigmem profile --measure`` measures it (``bigmem.api.profile``: training steps in
a fresh child process, its VmHWM), and the error is (predicted - measured) / measured. The target:
within +-5%, never under by more than 2%. A run's peak grows past its first steps (TensorFlow's
oneDNN allocator keeps every page it has touched; the estimate's ``allocator_growth``), so the
default is 20 steps, not the 3 that ``bigmem profile --measure`` and the memory tables take; each
row also keeps ``first_steps_bytes``, the prediction less that growth.

``--reuse`` takes the measured peaks from earlier results files and only predicts again: the
estimate can be re-checked after a change to it without measuring. ``--label`` names the run in
the file (e.g. ``idle``, or ``beside-a-job`` when another job was running). bf16 runs only where
the CPU has it natively (elsewhere it is emulated and the plan leaves it out); it is listed as
skipped. ``--draws N`` measures each configuration N times: a configuration's peak moves between
identical runs, and the target holds only if the prediction is within it against every draw (the
error against the highest draw and against the lowest, both in the table). Writes JSON keyed by
machine (never run by pytest).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
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

def planned(spacing, median_shape) -> dict:
    """A preset's tables for the network ``bigmem plan --data`` configures for this spacing and median case."""
    from bigmem.config.topology import pool_and_kernels
    from bigmem.data.experiment import NNUNET_NETWORK, NNUNET_RECIPE

    model = {**pool_and_kernels(spacing, median_shape).to_model_table(), **NNUNET_NETWORK, "name": "experiment"}
    return {"model": model, "train": dict(NNUNET_RECIPE)}


KITS_LIKE = ((3.0, 0.8, 0.8), (40, 96, 96))
PROSTATE_LIKE = ((0.6, 0.6, 3.6), (160, 160, 24))
SLAB_LIMIT = 2**23

# name -> (preset, (D, H, W), precision, recompute[, batch[, kernel element limit]]); a preset is a name, or
# (spacing, median shape) of a configured network
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
    "small-64-b2": ("small", (64, 64, 64), "fp32", "none", 2),
    "small-64-b4": ("small", (64, 64, 64), "fp32", "none", 4),
    "small-96-b2": ("small", (96, 96, 96), "fp32", "none", 2),
    "kits19-64-b2": ("kits19", (64, 64, 64), "fp32", "none", 2),
    "kits19-64x96x96-b2": ("kits19", (64, 96, 96), "fp32", "none", 2),
    "planned-kits-64x96x96-b2": (KITS_LIKE, (64, 96, 96), "fp32", "none", 2),
    "planned-prostate-160x160x24-b2": (PROSTATE_LIKE, (160, 160, 24), "fp32", "none", 2),
    "planned-kits-64x128x128": (KITS_LIKE, (64, 128, 128), "fp32", "none"),
    "planned-kits-64x128x128-slabs": (KITS_LIKE, (64, 128, 128), "fp32", "none", 1, SLAB_LIMIT),
    "planned-kits-64x96x96-b2-slabs": (KITS_LIKE, (64, 96, 96), "fp32", "none", 2, SLAB_LIMIT),
    "small-64-b2-slabs": ("small", (64, 64, 64), "fp32", "none", 2, SLAB_LIMIT // 4),
    "kits19-64x96x96-b2-slabs": ("kits19", (64, 96, 96), "fp32", "none", 2, SLAB_LIMIT),
    "resenc-m-64": ("resenc-m", (64, 64, 64), "fp32", "none"),
    "resenc-m-64-b2": ("resenc-m", (64, 64, 64), "fp32", "none", 2),
    "resenc-m-64x96x96": ("resenc-m", (64, 96, 96), "fp32", "none"),
}
# Every preset with a shipped table, in both recompute modes, at three cube edges of its own size contract
# (``--configs grid``): what a first run of each network plans on a new machine.
GRID_EDGES = {"small": (48, 64, 96), "kits19": (64, 96, 128), "intelai-brats": (48, 64, 96), "resenc-m": (32, 64, 96)}
GRID = {f"grid-{preset}-{edge}-{mode}": (preset, (edge,) * 3, "fp32", mode)
        for preset, edges in GRID_EDGES.items() for mode in ("none", "stages") for edge in edges}
CONFIGS.update(GRID)
TOLERANCE_PCT, MOST_UNDER_PCT = 5.0, 2.0


def _config(preset, precision: str, recompute: str, batch: int = 1):
    tables = preset if isinstance(preset, str) else planned(*preset)
    return api.resolve_config(tables, {"train": {"batch_size": batch, "precision": precision},
                                       "memory": {"recompute": recompute}})


@contextlib.contextmanager
def _kernel_limit(limit: int | None):
    """``BIGMEM_MAX_KERNEL_ELEMENTS`` set to ``limit`` (none: as it is) inside the block."""
    from bigmem.nets.limits import LIMIT_ENVIRONMENT_VARIABLE

    before = os.environ.get(LIMIT_ENVIRONMENT_VARIABLE)
    if limit is not None:
        os.environ[LIMIT_ENVIRONMENT_VARIABLE] = str(limit)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LIMIT_ENVIRONMENT_VARIABLE, None)
        else:
            os.environ[LIMIT_ENVIRONMENT_VARIABLE] = before


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--configs", default=",".join(name for name in CONFIGS if name not in GRID),
                        help="names, separated by commas; 'grid': every preset and recompute mode at three edges")
    parser.add_argument("--steps", type=int, default=20,
                        help="training steps measured (default 20: a run's peak grows past its first steps)")
    parser.add_argument("--reuse", help="earlier results files (comma-separated; a later one wins) whose measured "
                                        "peaks are taken")
    parser.add_argument("--label", default="idle", help="what else ran beside it (recorded in the file)")
    parser.add_argument("--draws", type=int, default=1,
                        help="measure each configuration this many times, in a fresh child each (default 1): the "
                             "row keeps every draw, its median as the measured peak and the error at each end")
    args = parser.parse_args(argv)
    from bigmem.sysinfo import native_bf16

    reused = {}
    for path in args.reuse.split(",") if args.reuse else []:  # a later file wins
        earlier = json.loads(Path(path).read_text())
        steps = re.search(r"--steps[ =](\d+)", earlier.get("command", ""))  # files before "steps" was kept: 3
        steps = int(steps.group(1)) if steps else 3
        reused.update({row["name"]: {"steps": steps, **row, "measured_in": Path(path).name}
                       for row in earlier["rows"] if row.get("measured_peak_bytes")})
    console = Console()
    rows = []
    names = list(GRID) if args.configs == "grid" else args.configs.split(",")
    for name in names:
        preset, shape, precision, recompute, *rest = CONFIGS[name]
        batch, limit = (list(rest) + [1, None][len(rest):])[:2]
        row = {"name": name, "preset": preset if isinstance(preset, str) else "experiment", "shape": list(shape),
               "precision": precision, "recompute": recompute, "batch_size": batch, "kernel_limit": limit}
        if precision == "bf16" and not native_bf16():
            rows.append({**row, "skipped": "bf16 is emulated on this CPU"})
            continue
        config = _config(preset, precision, recompute, batch)
        measure = name not in reused
        console.print(f"{name}: {'measuring' if measure else 'predicting'} ...")
        try:
            with _kernel_limit(limit):  # the estimate and the measuring child both read it
                results = [api.profile(config, shape, measure=measure, steps=args.steps)
                           for _ in range(args.draws if measure else 1)]
        except BigmemError as exc:  # e.g. killed by the kernel: say so, go on
            rows.append({**row, "skipped": f"failed: {exc}"})
            continue
        result = results[0]
        predicted = result.estimate.predicted_peak_bytes
        draws = ([r.measurement.peak_bytes for r in results] if measure
                 else reused[name].get("measured_draws_bytes", [reused[name]["measured_peak_bytes"]]))
        measured = int(statistics.median(draws))
        rows.append({**row, "steps": args.steps if measure else reused[name]["steps"],
                     "predicted_peak_bytes": predicted, "first_steps_bytes": result.estimate.first_steps_bytes,
                     "measured_peak_bytes": measured,
                     "error_pct": round(100.0 * (predicted - measured) / measured, 2),
                     "measured_draws_bytes": draws,
                     "error_pct_range": [round(100.0 * (predicted - d) / d, 2) for d in (max(draws), min(draws))],
                     "calibration": result.estimate.calibration.source,
                     "partitioned_stages": list(result.estimate.partitioned_stages),
                     "measured_here": measure, **({} if measure else {"measured_in": reused[name]["measured_in"]})})
    table = Table(title=f"profile --measure on {machine_isa_class()} {machine_cpu_model()} ({args.label})")
    for column in ("config", "shape", "mode", "predicted", "measured", "error"):
        table.add_column(column, justify="right" if column in ("predicted", "measured", "error") else "left")
    for row in rows:
        mode = f"{row['precision']}/{row['recompute']} x{row.get('batch_size', 1)}"
        shape = "x".join(map(str, row["shape"]))
        if "skipped" in row:
            table.add_row(row["name"], shape, mode, "", "", row["skipped"][:60])
            continue
        low, high = row["error_pct_range"]  # against the highest draw, and the lowest
        verdict = "" if -MOST_UNDER_PCT <= low and high <= TOLERANCE_PCT else " !"
        draws = row["measured_draws_bytes"]
        measured = format_bytes(row["measured_peak_bytes"]) + (
            f" ({format_bytes(min(draws))}-{format_bytes(max(draws))}, {len(draws)} draws)" if len(draws) > 1 else "")
        error = f"{low:+.1f}%" + (f"..{high:+.1f}%" if len(draws) > 1 else "")
        table.add_row(row["name"], shape, mode, format_bytes(row["predicted_peak_bytes"]), measured,
                      f"{error}{verdict}")
    console.print(table)
    write_results("profile_accuracy", {"command": command_line(__file__, argv), "label": args.label,
                                       "rows": rows}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
