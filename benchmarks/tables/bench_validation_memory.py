"""Validation while training: the plan's predicted peak against the measured one, with and without ``--val-every``.

    python benchmarks/tables/bench_validation_memory.py [--configs NAME,...] [--steps 3] [--batch-size 1]
        [--stores DIR] [--keep-runs DIR] [--label idle] [--out DIR]

Each configuration is a small synthetic store (``bigmem.data.synth.write_synthetic_store``): its
training cases, then its held-out cases last, every case trained and validated whole at its own
shape padded to a multiple of 2^depth. It is trained twice, each a ``bigmem train`` in its own
process (``harness.run_command``), ``--steps`` steps at ``--batch-size``:

- with ``--holdout K --val-every STEPS``: validation runs once, after the last step (the
  held-out cases segmented whole beside the trained model and its optimizer); plan.json's
  predicted peak is the larger of training's and validation's (its ``validation`` section);
- without ``--val-every`` (the same training cases): the training step's peak alone.

The measured peak is the training process's own VmHWM (summary.json's ``peak_rss_bytes``);
the supervisor's ``ru_maxrss`` is kept beside it (the two differ only where the run starts a
process of its own, e.g. a first ``bigmem tune``). The resident set after the last step
(metrics.jsonl), where validation starts from, is kept too. The error is
(predicted - measured) / measured; the target is within +-5%.

The configurations: the ``small`` preset on MNI152-like cases at 2 mm (91x109x91 and two
similar shapes, validated at 96x112x96); on MNI-like cases at 4 mm with the held-out case at
2 mm, and at 2 mm with the held-out case at 1 mm (there validation, not training, decides the
peak); and two anisotropic sets (KiTS-like 40x96x96, also with a held-out scan of 160 slices,
and prostate-like 20x160x160). Run it alone: a second job moves a peak by several percent (it
holds the heavy-job lock, ``harness.heavy_turn``, from its first run to its last). Writes
``validation_memory-<machine>-<time>.json`` (never run by pytest).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from harness import bench_parser, command_line, heavy_turn, run_command, write_results
from rich.console import Console
from rich.table import Table

from bigmem.units import format_bytes

TOLERANCE_PCT = 5.0


@dataclass(frozen=True)
class StoreSpec:
    """One configuration: the preset, the training cases' shapes and the held-out cases' (stored last)."""

    preset: str
    train: tuple[tuple[int, int, int], ...]
    held_out: tuple[tuple[int, int, int], ...]
    about: str


CONFIGS = {
    "mni-2mm": StoreSpec("small", ((91, 109, 91), (86, 104, 88)), ((90, 110, 92),),
                         "MNI152 at 2 mm: training and validation both at 96x112x96"),
    "mni-4mm-val-2mm": StoreSpec("small", ((45, 54, 45), (46, 55, 44)), ((91, 109, 91),),
                                 "training at 4 mm (48x56x48), the held-out case at 2 mm: validation decides"),
    "mni-2mm-val-1mm": StoreSpec("small", ((91, 109, 91), (86, 104, 88)), ((182, 218, 182),),
                                 "training at 2 mm, the held-out case at 1 mm (184x224x184): validation decides"),
    "kits-like": StoreSpec("small", ((40, 96, 96), (36, 90, 96)), ((40, 96, 96),),
                           "anisotropic, KiTS-like 5 mm slices"),
    "kits-like-long-held-out": StoreSpec("small", ((40, 96, 96), (36, 90, 96)), ((160, 96, 96),),
                                         "KiTS-like, the held-out scan thin-sliced (160 slices): validation decides"),
    "prostate-like": StoreSpec("small", ((20, 160, 160), (18, 150, 160)), ((20, 160, 160),),
                               "anisotropic, prostate-like thick slices (24x160x160 padded)"),
}


def error_pct(predicted: int, measured: int) -> float:
    """(predicted - measured) / measured, in percent, to 2 decimals."""
    return round(100.0 * (predicted - measured) / measured, 2)


def make_store(name: str, spec: StoreSpec, directory: Path, console: Console) -> Path:
    """The store of ``spec`` in ``directory`` (its training cases, then its held-out ones), written once."""
    from bigmem.data.synth import write_synthetic_store

    path = directory / f"validation-{name}.h5"
    if not path.exists():
        shapes = [*spec.train, *spec.held_out]
        console.print(f"writing {path} ({len(shapes)} cases) ...", style="dim")
        write_synthetic_store(path, num_cases=len(shapes), volume=0, shapes=shapes, seed=1)
    return path


def machine_line(sysinfo: dict) -> str:
    """'avx2 AMD EPYC, 2 CPUs, oneDNN on, TF 2.21.0': the machine a run measured on (its sysinfo.json, no host name)."""
    from bigmem.cpu import isa_class

    tf = sysinfo.get("tensorflow", {})
    onednn = {True: "on", False: "off"}.get(tf.get("onednn_enabled"), "unknown")
    cpu = sysinfo["cpu"]
    return (f"{isa_class(cpu['isa'])} {cpu['model']}, {cpu['logical_cpus']} CPUs, oneDNN {onednn}, "
            f"TF {tf.get('tensorflow', '?')}")


def train_run(spec: StoreSpec, store: Path, out: Path, *, steps: int, batch_size: int, validate: bool) -> dict:
    """One ``bigmem train`` in a fresh process: its plan, its peak (VmHWM and ru_maxrss) and where validation began.

    Raises:
        RuntimeError: the run failed (its last line of output says why).
    """
    argv = [sys.executable, "-m", "bigmem", "train", "--model", spec.preset, "--data", str(store),
            "--holdout", str(len(spec.held_out)), "--steps", str(steps), "--batch-size", str(batch_size),
            "--out", str(out), "--checkpoint-every", "100000"]
    if validate:
        argv += ["--val-every", str(steps)]
    result = run_command(argv, what="bigmem train")
    if not result.ok:
        raise RuntimeError(f"{' '.join(argv[3:])} failed: {result.failure()}")
    plan = json.loads((out / "plan.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    memory_line = next((line for line in result.stdout.splitlines() if line.startswith("Memory:")), "")
    machine = machine_line(json.loads((out / "sysinfo.json").read_text()))
    return {"machine": machine, "argv": argv[3:], "wall_s": round(result.wall_s, 1),
            "peak_rss_bytes": int(summary["peak_rss_bytes"]), "ru_maxrss_bytes": result.peak_rss_bytes,
            "rss_after_last_step_bytes": int(rows[-1]["rss_bytes"]),
            "predicted_peak_bytes": int(plan["predicted_peak_bytes"]), "components": plan["components"],
            "validation": plan.get("validation"), "calibration": plan["calibration"]["source"],
            "val_dice": summary.get("val_dice"), "memory_line": memory_line}


def measure_config(name: str, spec: StoreSpec, stores: Path, args, console: Console) -> dict:
    """Both runs of one configuration, and the figures the table prints."""
    from bigmem.config import resolve_config
    from bigmem.data.pipeline import padded_shape

    divisor = resolve_config(spec.preset).model.divisor
    store = make_store(name, spec, stores, console)
    runs = {}
    for label, validate in (("with_validation", True), ("training_only", False)):
        console.print(f"{name}: training {spec.preset}, {args.steps} steps, "
                      f"{'validating' if validate else 'no validation'} ...", style="dim")
        with tempfile.TemporaryDirectory(prefix="bigmem-valmem-") as tmp:
            out = Path(args.keep_runs) / f"{name}-{label}" if args.keep_runs else Path(tmp) / "run"
            runs[label] = train_run(spec, store, out, steps=args.steps, batch_size=args.batch_size,
                                    validate=validate)
    with_val, alone = runs["with_validation"], runs["training_only"]
    validation = with_val["validation"] or {}
    return {"name": name, "preset": spec.preset, "about": spec.about,
            "train_shapes": [list(s) for s in spec.train], "held_out_shapes": [list(s) for s in spec.held_out],
            "train_padded": sorted({"x".join(map(str, padded_shape(s, divisor))) for s in spec.train}),
            "validation_shape": validation.get("shape"),
            "predicted_training_bytes": alone["predicted_peak_bytes"],
            "measured_training_bytes": alone["peak_rss_bytes"],
            "training_error_pct": error_pct(alone["predicted_peak_bytes"], alone["peak_rss_bytes"]),
            "predicted_validation_pass_bytes": validation.get("predicted_peak_bytes"),
            "predicted_excess_bytes": validation.get("excess_bytes"),
            "predicted_peak_bytes": with_val["predicted_peak_bytes"],
            "measured_peak_bytes": with_val["peak_rss_bytes"],
            "error_pct": error_pct(with_val["predicted_peak_bytes"], with_val["peak_rss_bytes"]),
            "measured_excess_bytes": with_val["peak_rss_bytes"] - alone["peak_rss_bytes"],
            "decided_by": "validation" if validation.get("excess_bytes") else "training",
            "runs": runs}


def print_table(rows: list[dict], title: str, console: Console) -> None:
    """Predicted against measured: the training step alone, and the run that validates."""
    table = Table(title=title)
    for column in ("config", "trained at", "validated at", "train pred", "train meas", "err",
                   "val pass pred", "plan (with val)", "measured", "err", "meas - train", "plan decided by"):
        table.add_column(column, justify="left" if column in ("config", "trained at", "validated at") else "right")
    for row in rows:
        if "skipped" in row:
            table.add_row(row["name"], "", "", "", "", "", "", "", "", row["skipped"][:60], "", "")
            continue
        flag = "" if abs(row["error_pct"]) <= TOLERANCE_PCT else " !"
        train_flag = "" if abs(row["training_error_pct"]) <= TOLERANCE_PCT else " !"
        table.add_row(row["name"], ", ".join(row["train_padded"]), "x".join(map(str, row["validation_shape"] or [])),
                      format_bytes(row["predicted_training_bytes"]), format_bytes(row["measured_training_bytes"]),
                      f"{row['training_error_pct']:+.1f}%{train_flag}",
                      format_bytes(row["predicted_validation_pass_bytes"] or 0),
                      format_bytes(row["predicted_peak_bytes"]), format_bytes(row["measured_peak_bytes"]),
                      f"{row['error_pct']:+.1f}%{flag}", format_bytes(row["measured_excess_bytes"]),
                      row["decided_by"])
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick={"configs": "kits-like", "steps": 2})
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"names, separated by commas ({', '.join(CONFIGS)})")
    parser.add_argument("--steps", type=int, default=3, help="training steps; validation after the last (default 3)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="volumes per step (default 1: each case its own step)")
    parser.add_argument("--stores", help="folder to write the stores in and reuse them from (default: a temporary one)")
    parser.add_argument("--keep-runs", help="folder to keep the run directories in (default: deleted)")
    parser.add_argument("--label", default="idle", help="what else ran beside it (recorded in the file)")
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 180))  # the table's twelve columns, also in a log file
    rows = []
    # the heavy-job lock: no other measurement on this machine's memory while these run
    with tempfile.TemporaryDirectory(prefix="bigmem-valmem-stores-") as tmp, heavy_turn(True, console.print):
        stores = Path(args.stores or tmp)
        stores.mkdir(parents=True, exist_ok=True)
        for name in args.configs.split(","):
            try:
                rows.append(measure_config(name, CONFIGS[name], stores, args, console))
            except RuntimeError as exc:  # e.g. killed by the kernel: say so, go on
                rows.append({"name": name, "skipped": str(exc)})
    machine = next((r["runs"]["with_validation"]["machine"] for r in rows if "runs" in r), "no run finished")
    print_table(rows, f"validation memory on {machine} ({args.label}), {args.steps} steps, batch {args.batch_size}",
                console)
    write_results("validation_memory", {"command": command_line(__file__, argv), "machine": machine,
                                        "label": args.label, "steps": args.steps, "batch_size": args.batch_size,
                                        "voxels": {r["name"]: math.prod(r["validation_shape"]) for r in rows
                                                   if r.get("validation_shape")},
                                        "rows": rows}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
