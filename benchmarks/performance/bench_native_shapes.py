"""Each scan at its own shape against the smallest cube that holds them all: epochs, memory, batch scaling.

    python benchmarks/performance/bench_native_shapes.py epochs [--preset small] [--epochs 3] [--batch-size 1]
        [--sets brats,kits] [--stores DIR]
    python benchmarks/performance/bench_native_shapes.py memory [--presets tiny,small,intelai-brats,kits19] [--steps 2]
    python benchmarks/performance/bench_native_shapes.py batch [--preset intelai-brats] [--shape 64,64,64]
        [--batches 1,2,4,8]
    python benchmarks/performance/bench_native_shapes.py stores --stores DIR     # only write the two stores

``epochs`` trains ``--preset`` on two synthetic stand-ins of real datasets, each at native shapes
(every case whole, padded to a multiple of 2^depth) and as the smallest cube that holds every case
(``--shape N,N,N``, which pads each case to it):

- brats: 4 cases of 240x240x155 x 4 channels (BraTS / MSD Task01); the cube is 240^3;
- kits: 6 cases of 256x256xD, D = 48, 64, 64, 80, 96, 256 (KiTS19's scans are mostly ~100 slices
  at 5 mm, a few long thin-slice ones; in-plane halved to fit a 24 GiB machine); the cube is 256^3.

Each run is ``bigmem train`` in its own process: its summary.json gives the peak (VmHWM), the
traces and compile seconds; metrics.jsonl each step's time, shape and RSS. An epoch's time is the
sum of its steps' (the first epoch includes tracing, one per shape). The expected ratios are the
voxel ratios: brats 0.67 (memory has a fixed part too), kits 0.39.

``memory`` predicts and measures (``bigmem.memory.measure``: a child process, VmHWM) each preset at
three anisotropic shapes and the cube of about the same voxels (rounded to the size contract),
batch 1, fp32. ``batch`` measures one preset and shape at several batch sizes: the slope per sample
that a batch-16 figure rests on.

Run on a quiet machine: the peak reads low when other work competes for the CPUs. Writes
``native_shapes-<machine>-<time>.json`` (never run by pytest).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from harness import bench_parser, command_line, run_command, write_results
from rich.console import Console
from rich.table import Table

from bigmem.config import resolve_config
from bigmem.units import format_bytes

STORE_SETS = {
    "brats": {"shapes": [(240, 240, 155)] * 4, "channels": 4},
    "kits": {"shapes": [(256, 256, d) for d in (48, 64, 64, 80, 96, 256)], "channels": 1},
}
# Per preset: three anisotropic shapes, each a multiple of its 2^depth (kits19: 32).
MEMORY_SHAPES = {
    "tiny": [(48, 256, 256), (256, 64, 64), (160, 192, 128)],
    "small": [(48, 256, 256), (256, 64, 64), (160, 192, 128)],
    "intelai-brats": [(48, 256, 256), (256, 64, 64), (160, 192, 128)],
    "kits19": [(64, 192, 192), (192, 64, 64), (128, 160, 96)],
}


def make_store(name: str, directory: Path, console: Console) -> Path:
    """The stand-in store ``name`` (STORE_SETS) in ``directory``, written once."""
    from bigmem.data.synth import write_synthetic_store

    spec = STORE_SETS[name]
    path = directory / f"{name}-like.h5"
    if not path.exists():
        console.print(f"writing {path} ({len(spec['shapes'])} cases) ...", style="dim")
        write_synthetic_store(path, num_cases=len(spec["shapes"]), volume=0, shapes=spec["shapes"],
                              channels=spec["channels"], seed=1)
    return path


def smallest_cube(shapes, divisor: int) -> int:
    """The edge of the smallest cube, a multiple of ``divisor``, that holds every shape."""
    edge = max(max(s) for s in shapes)
    return -(-edge // divisor) * divisor


def train_run(preset: str, store: Path, out: Path, *, epochs: int, batch_size: int, shape: int | None) -> dict:
    """One ``bigmem train`` in a child process; its summary and per-epoch figures."""
    argv = [sys.executable, "-m", "bigmem", "train", "--model", preset, "--data", str(store), "--epochs", str(epochs),
            "--batch-size", str(batch_size), "--out", str(out), "--checkpoint-every", "100000",
            "--monitor-interval", "0"]
    if shape is not None:
        argv += ["--volume", str(shape)]
    result = run_command(argv, what="bigmem train")
    if not result.ok:
        raise RuntimeError(f"{' '.join(argv[3:])} failed (exit {result.returncode}): "
                           f"{(result.stderr.strip().splitlines() or result.stdout.strip().splitlines() or [''])[-1]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_epoch = len(rows) // epochs
    epochs_out = []
    for e in range(epochs):
        chunk = rows[e * per_epoch:(e + 1) * per_epoch]
        epochs_out.append({"epoch": e + 1, "seconds": round(sum(r["step_s"] for r in chunk), 3),
                           "max_rss_bytes": max(r["rss_bytes"] for r in chunk),
                           "shapes": sorted({"x".join(map(str, r["shape"])) for r in chunk})})
    opening = next((line for line in result.stdout.splitlines() if line.startswith("bigmem train:")), "")
    return {"argv": argv[3:], "wall_s": round(result.wall_s, 1),
            "peak_rss_bytes": summary["peak_rss_bytes"],
            "traces": summary.get("traces"), "compile_s": summary.get("compile_s"),
            "padding_share_per_epoch": summary.get("padding_share_per_epoch"), "epochs": epochs_out,
            "dice": summary["dice"], "opening": opening}


def _ratio(native: dict, cube: dict) -> float:
    return round(native["seconds"] / cube["seconds"], 4)


def run_epochs(args, console: Console) -> dict:
    stores = Path(args.stores) if args.stores else Path(tempfile.mkdtemp(prefix="bigmem-native-"))
    stores.mkdir(parents=True, exist_ok=True)
    divisor = resolve_config(args.preset).model.divisor
    report = {}
    for name in args.sets.split(","):
        store = make_store(name, stores, console)
        shapes = STORE_SETS[name]["shapes"]
        cube = smallest_cube(shapes, divisor)
        runs = {}
        for label, shape in (("native", None), (f"cube {cube}^3", cube)):
            console.print(f"{name}: training {args.preset} {label}, {args.epochs} epochs ...", style="dim")
            with tempfile.TemporaryDirectory(prefix="bigmem-native-run-") as tmp:
                runs[label] = train_run(args.preset, store, Path(tmp) / "run", epochs=args.epochs,
                                        batch_size=args.batch_size, shape=shape)
        native, boxed = runs["native"], runs[f"cube {cube}^3"]
        voxels = sum(math.prod(s) for s in shapes)
        padded = sum(math.prod(-(-v // divisor) * divisor for v in s) for s in shapes)
        report[name] = {"shapes": [list(s) for s in shapes], "channels": STORE_SETS[name]["channels"], "cube": cube,
                        "voxel_ratio": round(voxels / (len(shapes) * cube**3), 4),
                        "padded_voxel_ratio": round(padded / (len(shapes) * cube**3), 4),
                        "time_ratio_last_epoch": _ratio(native["epochs"][-1], boxed["epochs"][-1]),
                        "time_ratio_first_epoch": _ratio(native["epochs"][0], boxed["epochs"][0]),
                        "peak_ratio": round(native["peak_rss_bytes"] / boxed["peak_rss_bytes"], 4), "runs": runs}
    table = Table(title=f"{args.preset}, batch {args.batch_size}: native shapes against the smallest cube")
    for column in ("store", "run", "epoch s (each)", "peak (VmHWM)", "traces", "compile s", "RSS max per epoch"):
        table.add_column(column, justify="right")
    for name, entry in report.items():
        for label, run in entry["runs"].items():
            table.add_row(name, label, ", ".join(f"{e['seconds']:.1f}" for e in run["epochs"]),
                          format_bytes(run["peak_rss_bytes"]), str(run["traces"]), f"{run['compile_s']:.1f}",
                          ", ".join(format_bytes(e["max_rss_bytes"]) for e in run["epochs"]))
        table.add_row(name, "native / cube", f"{entry['time_ratio_last_epoch']:.2f}x (last), "
                      f"{entry['time_ratio_first_epoch']:.2f}x (first)", f"{entry['peak_ratio']:.2f}x",
                      f"voxels {entry['voxel_ratio']:.2f}x", f"padded {entry['padded_voxel_ratio']:.2f}x", "")
    console.print(table)
    return {"preset": args.preset, "batch_size": args.batch_size, "epochs": args.epochs, "sets": report}


def cube_like(shape, divisor: int) -> tuple[int, int, int]:
    """The cube of about ``shape``'s voxels, its edge rounded to a multiple of ``divisor``."""
    edge = max(divisor, int(round(math.prod(shape) ** (1 / 3) / divisor)) * divisor)
    return (edge,) * 3


def measure_points(preset: str, shapes, steps: int, batch_size: int = 1) -> list[dict]:
    from bigmem.memory import profile as api

    config = resolve_config(preset, {"train": {"batch_size": batch_size}})
    counts_for = api.counts_function(config)
    points = []
    for shape in shapes:
        sized = config.updated({"data": {"shape": list(shape)}})
        result = api.profile(sized, shape, counts_for, do_measure=True, steps=steps)
        points.append({"preset": preset, "shape": list(shape), "batch_size": batch_size,
                       "voxels": math.prod(shape), "predicted_peak_bytes": result.estimate.predicted_peak_bytes,
                       "measured_peak_bytes": result.measurement.peak_bytes, "error_pct": round(result.error_pct, 2),
                       "step_s": round(result.measurement.seconds, 3), "components": result.estimate.components})
    return points


def run_memory(args, console: Console) -> dict:
    points = []
    for preset in args.presets.split(","):
        divisor = resolve_config(preset).model.divisor
        shapes = []
        for shape in MEMORY_SHAPES[preset]:
            shapes += [shape, cube_like(shape, divisor)]
        for shape in dict.fromkeys(shapes):
            console.print(f"measuring {preset} at {'x'.join(map(str, shape))} ...", style="dim")
            points += measure_points(preset, [shape], args.steps)
    table = Table(title="predicted vs measured peak, batch 1, fp32 (anisotropic shapes and their cubes)")
    for column in ("preset", "shape", "voxels", "predicted", "measured", "error"):
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(p["preset"], "x".join(map(str, p["shape"])), f"{p['voxels']:,}",
                      format_bytes(p["predicted_peak_bytes"]), format_bytes(p["measured_peak_bytes"]),
                      f"{p['error_pct']:+.1f}%")
    console.print(table)
    return {"points": points}


def run_batch(args, console: Console) -> dict:
    shape = tuple(int(v) for v in args.shape.split(","))
    points = []
    for batch in (int(b) for b in args.batches.split(",")):
        console.print(f"measuring {args.preset} at {args.shape} x batch {batch} ...", style="dim")
        points += measure_points(args.preset, [shape], args.steps, batch)
    slopes = [(b["measured_peak_bytes"] - a["measured_peak_bytes"]) / (b["batch_size"] - a["batch_size"])
              for a, b in zip(points, points[1:])]
    predicted = [(b["predicted_peak_bytes"] - a["predicted_peak_bytes"]) / (b["batch_size"] - a["batch_size"])
                 for a, b in zip(points, points[1:])]
    table = Table(title=f"{args.preset} at {args.shape}: peak against batch size")
    for column in ("batch", "predicted", "measured", "error", "measured per added sample", "predicted per sample"):
        table.add_column(column, justify="right")
    for i, p in enumerate(points):
        table.add_row(str(p["batch_size"]), format_bytes(p["predicted_peak_bytes"]),
                      format_bytes(p["measured_peak_bytes"]), f"{p['error_pct']:+.1f}%",
                      format_bytes(slopes[i - 1]) if i else "", format_bytes(predicted[i - 1]) if i else "")
    console.print(table)
    return {"preset": args.preset, "shape": list(shape), "points": points,
            "measured_bytes_per_sample": [int(s) for s in slopes],
            "predicted_bytes_per_sample": [int(s) for s in predicted]}


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("what", choices=["epochs", "memory", "batch", "stores"])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--presets", default="tiny,small,intelai-brats,kits19")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--sets", default="brats,kits")
    parser.add_argument("--stores", help="folder for the stand-in stores (kept, reused)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--shape", default="64,64,64")
    parser.add_argument("--batches", default="1,2,4,8")
    args = parser.parse_args(argv)
    console = Console(soft_wrap=True)
    from bigmem.sysinfo import collect_sysinfo

    if args.what == "stores":
        for name in args.sets.split(","):
            make_store(name, Path(args.stores or "."), console)
        return 0
    run = {"epochs": run_epochs, "memory": run_memory, "batch": run_batch}[args.what]
    report = {"what": args.what, "command": command_line(__file__, argv),
              "machine": collect_sysinfo(), "cores": len(os.sched_getaffinity(0)), **run(args, console)}
    write_results(f"native_shapes_{args.what}", report, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
