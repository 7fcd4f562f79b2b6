"""What nnU-Net's augmentation costs on whole volumes: per transform, per chain, in memory and in throughput.

    python benchmarks/performance/bench_augment.py [--shapes 240x240x155x4 512x512x256x1] [--repeats 3]
        [--samples 8] [--train] [--train-steps 6] [--quick] [--out DIR]

1. Each transform of the ``nnunet`` chain forced on (probability 1), then the chain as configured
   (its probabilities: the mean over ``--samples`` samples, since most draws skip most transforms),
   in seconds per case on one core, at each shape (a phantom of that shape, C channels).
2. The readers' working memory: the peak resident set a fresh process adds while it runs the
   spatial transform (the chain's largest) on one case, against what the memory plan predicts for
   it (``Compose.working_bytes``).
3. With ``--train``: ``bigmem train --model small`` on phantoms at 240x240x160 (1 channel) with
   ``--augment none`` and ``--augment nnunet`` (and with 2 reader processes), same seed and steps;
   the throughput ratio, each run's input stall share, and augmentation core-seconds per case over
   training core-seconds per case.

Prints tables and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import numpy as np
from harness import bench_parser, command_line, run_function, spread, time_calls, write_results

from bigmem.data.transforms import Sample, SpatialTransform, chain


def phantom_sample(shape, channels: int, seed: int = 0) -> Sample:
    """A normalised-looking sample: phantoms per channel, 3 label values."""
    from bigmem.data.synth import make_phantom

    rng = np.random.default_rng(seed)
    image, label = make_phantom(rng, tuple(shape), 4)
    image = (image - image.mean()) / (image.std() + 1e-6)
    stacked = np.repeat(image, channels, axis=-1) + rng.normal(0, 0.1, (*shape, channels)).astype(np.float32)
    return Sample(np.ascontiguousarray(stacked, np.float32), label, np.full(channels, float(image.min()), np.float32))


def _fresh(sample: Sample) -> Sample:
    return Sample(sample.image.copy(), sample.label.copy(), sample.background.copy())


def per_transform(shape, channels: int, repeats: int, samples: int) -> list[dict]:
    """Seconds per case of each transform forced on, and of the chain as configured."""
    base = phantom_sample(shape, channels)
    rows = []
    nnunet = chain("nnunet")
    for transform in nnunet.transforms:
        forced = type(transform)(**{k: v for k, v in vars(transform).items()})
        if isinstance(forced, SpatialTransform):
            forced.p_rotation = forced.p_scaling = 1.0
        else:
            forced.probability = 1.0
        rng = np.random.default_rng(0)
        passes = time_calls(lambda: forced(_fresh(base), rng), repeats=repeats, warmup=1)
        copy_s = spread(time_calls(lambda: _fresh(base), repeats=repeats).times_s).median
        times = spread(max(t - copy_s, 0.0) for t in passes.times_s)
        rows.append({"transform": transform.name, "forced": True, "s_per_case": times.median, "min_s": times.min,
                     "max_s": times.max})
    timings = []
    for index in range(samples):
        sample = _fresh(base)
        started = time.process_time()
        nnunet(sample, seed=0, sample_index=index)
        timings.append(time.process_time() - started)
    chain_times = spread(timings)
    rows.append({"transform": "nnunet chain (as configured)", "forced": False, "s_per_case": float(np.mean(timings)),
                 "min_s": chain_times.min, "max_s": chain_times.max, "samples": samples})
    return rows


def _spatial_peak(request: dict) -> dict:
    """Run in a fresh process: the resident set the spatial transform adds over its input sample."""
    from bigmem.memory.procfs import peak_rss_bytes, reset_peak_rss

    sample = phantom_sample(request["shape"], request["channels"])
    transform = SpatialTransform(p_rotation=1.0, p_scaling=1.0)
    transform(phantom_sample((8, 8, 8), request["channels"]), np.random.default_rng(1))  # scipy loaded, not counted
    reset_peak_rss()
    before = peak_rss_bytes()
    out = transform(sample, np.random.default_rng(1))
    after = peak_rss_bytes()
    del out
    return {"input_bytes": sample.image.nbytes + sample.label.nbytes, "added_peak_bytes": after - before}


def reader_memory(shape, channels: int) -> dict:
    """Predicted (``Compose.working_bytes``) against the measured peak the spatial transform adds."""
    run = run_function(_spatial_peak, {"shape": list(shape), "channels": channels}, what="The spatial transform")
    measured = run.check("The spatial transform").result
    predicted = chain("nnunet").working_bytes(shape, channels)
    error = 100.0 * (predicted - measured["added_peak_bytes"]) / measured["added_peak_bytes"]
    return {"shape": list(shape), "channels": channels, "predicted_bytes": predicted, **measured,
            "error_pct": error}


def train_run(store: Path, out: Path, augment: str, steps: int, workers: int) -> dict:
    """``bigmem train --model small`` on ``store``; its summary and seconds per step past the first."""
    command = [sys.executable, "-m", "bigmem", "train", "--model", "small", "--data", str(store), "--steps",
               str(steps), "--batch-size", "1", "--augment", augment, "--num-workers", str(workers), "--seed", "0",
               "--monitor-interval", "0", "--checkpoint-every", str(steps), "--out", str(out)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    voxel_rates = [r["voxels_per_s"] for r in rows[1:]]  # the first step compiles
    return {"augment": augment, "num_workers": workers, "steps": steps, "wall_s": wall,
            "median_voxels_per_s": float(np.median(voxel_rates)),
            "input_stall_share": summary.get("input_stall_share"), "final_loss": rows[-1]["loss"]}


def training(args, console) -> dict:
    from bigmem.data.synth import write_synthetic_store

    with tempfile.TemporaryDirectory(dir=args.tmp) as folder:
        store = write_synthetic_store(Path(folder) / "brats_like.h5", num_cases=4, volume=0, num_classes=4,
                                      shapes=[tuple(args.train_shape)] * 4)
        runs = []
        for augment, workers in (("none", 0), ("nnunet", 0), ("nnunet", 2)):
            console.print(f"training small at {args.train_shape} with --augment {augment}, {workers} readers ...")
            runs.append(train_run(store, Path(folder) / f"{augment}-{workers}", augment, args.train_steps, workers))
    none = runs[0]["median_voxels_per_s"]
    for run in runs:
        run["throughput_vs_none"] = run["median_voxels_per_s"] / none
    return {"shape": list(args.train_shape), "runs": runs}


def main(argv=None) -> int:
    parser = bench_parser(__doc__, repeats=3, quick={"shapes": ["48x48x32x2"], "repeats": 1, "samples": 4,
                                                     "train_shape": [64, 64, 48], "train_steps": 3})
    parser.add_argument("--shapes", nargs="+", default=["240x240x155x4", "512x512x256x1"],
                        help="DxHxWxC shapes to time the transforms at")
    parser.add_argument("--samples", type=int, default=16, help="samples the configured chain is averaged over")
    parser.add_argument("--train", action="store_true", help="also time training with and without augmentation")
    parser.add_argument("--train-shape", type=int, nargs=3, default=[240, 240, 160])
    parser.add_argument("--train-steps", type=int, default=6)
    parser.add_argument("--tmp", default=None, help="folder for the training store (default: a temporary one)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from bigmem.sysinfo import collect_sysinfo

    console = Console()
    report: dict = {"machine": collect_sysinfo(include_tensorflow=False), "command": command_line(__file__),
                    "transforms": [], "reader_memory": []}
    for text in args.shapes:
        *shape, channels = (int(v) for v in text.lower().split("x"))
        console.print(f"timing the transforms at {text} ...")
        rows = per_transform(shape, channels, args.repeats, args.samples)
        report["transforms"].append({"shape": shape, "channels": channels, "rows": rows})
        table = Table(title=f"augmentation at {text}: seconds per case, one core (median, range)")
        for column in ("transform", "s/case", "range"):
            table.add_column(column, justify="left" if column == "transform" else "right")
        for row in rows:
            table.add_row(row["transform"], f"{row['s_per_case']:.3f}", f"{row['min_s']:.3f}-{row['max_s']:.3f}")
        console.print(table)
        memory = reader_memory(shape, channels)
        report["reader_memory"].append(memory)
        console.print(f"reader working memory at {text}: predicted {memory['predicted_bytes'] / 2**20:.1f} MiB, "
                      f"measured {memory['added_peak_bytes'] / 2**20:.1f} MiB ({memory['error_pct']:+.1f}%)")
    if args.train:
        report["training"] = training(args, console)
        table = Table(title=f"bigmem train --model small at {args.train_shape}, {args.train_steps} steps")
        for column in ("augment", "readers", "vox/s", "vs none", "input stall"):
            table.add_column(column, justify="right")
        for run in report["training"]["runs"]:
            stall = run["input_stall_share"]
            table.add_row(run["augment"], str(run["num_workers"]), f"{run['median_voxels_per_s']:,.0f}",
                          f"{run['throughput_vs_none']:.2f}x", "-" if stall is None else f"{100 * stall:.1f}%")
        console.print(table)
        voxels = math.prod(args.train_shape)
        train_s = voxels / report["training"]["runs"][0]["median_voxels_per_s"]
        first = report["transforms"][0]
        chain_s = next(r["s_per_case"] for r in first["rows"] if not r["forced"])
        scale = voxels / math.prod(first["shape"]) / first["channels"]  # the training shape has 1 channel
        report["augment_over_train"] = {
            "train_core_s_per_case": train_s * (os.cpu_count() or 1),
            "augment_core_s_per_case": chain_s * scale,
            "ratio": chain_s * scale / (train_s * (os.cpu_count() or 1)),
            "note": "augmentation scaled from the first --shapes row to the training shape by voxels x channels"}
        console.print(f"augmentation / training core-seconds per case: {report['augment_over_train']['ratio']:.3f}")
    write_results("augment", report, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
