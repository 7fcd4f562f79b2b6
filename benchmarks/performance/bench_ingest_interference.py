"""Training step time alone vs beside a concurrent `bigmem convert`, by write block size and rate limit.

    python benchmarks/performance/bench_ingest_interference.py [--cases 12] [--volume 128] [--train-volume 64]
        [--steps 40] [--warmup 5] [--quick] [--out DIR]

Makes an MSD-layout folder of synthetic NIfTI cases, then runs `bigmem train` (small preset)
alone and while a converter loops `bigmem convert --force` on that folder with: 128 KiB blocks,
1 MiB blocks, and 1 MiB blocks capped at --rate. Step time = median of the steps after the first
``--warmup`` (from metrics.jsonl). Prints the slowdown table and writes JSON (never run by pytest).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import numpy as np
from harness import bench_parser, run_command, spread, write_results


def make_source(root: Path, cases: int, volume: int) -> Path:
    import nibabel as nib

    from bigmem.data.synth import make_phantom

    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for index in range(cases):
        image, label = make_phantom(np.random.default_rng([1, index]), (volume,) * 3, 3)
        nib.save(nib.Nifti1Image(image[..., 0], np.eye(4)), str(root / "imagesTr" / f"c{index:03d}.nii"))
        nib.save(nib.Nifti1Image(label, np.eye(4)), str(root / "labelsTr" / f"c{index:03d}.nii"))
        training.append({"image": f"./imagesTr/c{index:03d}.nii", "label": f"./labelsTr/c{index:03d}.nii"})
    (root / "dataset.json").write_text(json.dumps({"modality": {"0": "synthetic"}, "labels": {
        "0": "background", "1": "class1", "2": "class2"}, "training": training}))
    return root


def train_step_s(tmp: Path, name: str, train_volume: int, steps: int, warmup: int) -> float:
    """The median step of one ``bigmem train`` (small), the first ``warmup`` steps left out."""
    out = tmp / f"run-{name}"
    run_command([sys.executable, "-m", "bigmem", "train", "--model", "small", "--volume", train_volume,
                 "--steps", steps, "--checkpoint-every", steps, "--out", out],
                what="bigmem train").check(f"bigmem train ({name})")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return spread(r["step_s"] for r in rows[warmup:]).median


def main(argv=None) -> int:
    parser = bench_parser(__doc__, warmup=5, warmup_help="first training steps left out of the median",
                          quick={"cases": 2, "volume": 32, "train_volume": 32, "steps": 8, "warmup": 2})
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--volume", type=int, default=128)
    parser.add_argument("--train-volume", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", default="100MB/s")
    parser.add_argument("--tmp", default=None)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    tmp = Path(tempfile.mkdtemp(prefix="bigmem-ingest-", dir=args.tmp))
    source = make_source(tmp / "src", args.cases, args.volume)
    conditions = [("alone", None), ("convert, 128 KiB blocks", ["--block-size", "128KiB"]),
                  ("convert, 1 MiB blocks", ["--block-size", "1MiB"]),
                  (f"convert, 1 MiB blocks, {args.rate}", ["--block-size", "1MiB", "--max-write-rate", args.rate])]
    rows = []
    for name, flags in conditions:
        converter = None
        if flags is not None:
            loop = (f"while true; do {sys.executable} -m bigmem convert {source} -o {tmp}/store.h5 --force "
                    f"{' '.join(flags)} > /dev/null 2>&1; done")
            converter = subprocess.Popen(["bash", "-c", loop], start_new_session=True)
            time.sleep(3)  # let the first conversion get going
        try:
            step_s = train_step_s(tmp, name.split(",")[0].replace(" ", "_") + str(len(rows)), args.train_volume,
                                  args.steps, args.warmup)
        finally:
            if converter is not None:
                os.killpg(converter.pid, signal.SIGTERM)
                converter.wait()
        rows.append({"condition": name, "step_s": step_s})
        console.print(f"{name}: {step_s:.3f} s/step", style="dim")
    base = rows[0]["step_s"]
    table = Table(title=f"train step (small, {args.train_volume}^3) beside bigmem convert "
                        f"({args.cases} x {args.volume}^3 NIfTI)")
    for column in ("condition", "step s (median)", "slowdown"):
        table.add_column(column, justify="right")
    for r in rows:
        r["slowdown_pct"] = 100 * (r["step_s"] / base - 1)
        table.add_row(r["condition"], f"{r['step_s']:.3f}", f"{r['slowdown_pct']:+.0f}%")
    console.print(table)
    report = {"machine": socket.gethostname(), "cpus": os.cpu_count(), "rows": rows}
    write_results("ingest", report, args.out, console)
    subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
