"""The resource monitor's overhead: training steps/s with and without it, from one run.

    python benchmarks/performance/bench_monitor.py [--model small] [--volume 48] [--steps 150] [--repeats 2]
        [--warmup 10] [--interval 1.0] [--quick] [--out DIR]

Runs ``bigmem train`` in fresh processes, alternating --monitor-interval INTERVAL and 0 (off)
``--repeats`` times each, and compares the median steps/s (the first ``--warmup`` steps, tracing
and warm-up, excluded). Also times one ``ResourceMonitor.sample()`` call in this process (the mean
of 200, after one untimed). Prints a table and
writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from harness import bench_parser, run_command, spread, time_calls, write_results
from rich.console import Console
from rich.table import Table

from bigmem.memory.calibration import machine_cpu_model, tensorflow_version
from bigmem.monitor.sampler import ResourceMonitor
from bigmem.rundir import read_jsonl


def train_steps_per_s(args, interval: float, out: Path) -> dict:
    """One ``bigmem train`` with the monitor every ``interval`` s (0: off): its median steps/s after ``--warmup``."""
    command = [sys.executable, "-m", "bigmem", "train", "--model", args.model, "--volume", args.volume,
               "--steps", args.steps, "--checkpoint-every", args.steps, "--monitor-interval", interval, "--out", out]
    result = run_command(command, what="bigmem train")
    if not result.ok:
        raise SystemExit(f"bigmem train failed (exit {result.returncode}): {result.stderr.strip()[-500:]}")
    rows = read_jsonl(out / "metrics.jsonl")[args.warmup:]
    step_s = spread(r["step_s"] for r in rows).median
    samples = 0
    if (out / "monitor.csv").exists():
        samples = len((out / "monitor.csv").read_text().splitlines()) - 1
    return {"interval_s": interval, "steps_per_s": 1.0 / step_s, "median_step_s": step_s, "monitor_rows": samples}


def sample_cost_s(repeats: int = 200) -> float:
    """Mean seconds of one ``ResourceMonitor.sample()`` over ``repeats`` calls, after one untimed."""
    with tempfile.TemporaryDirectory() as folder:
        monitor = ResourceMonitor(Path(folder) / "monitor.csv", interval_s=3600, store_path=folder)
        timed = time_calls(monitor.sample, repeats=repeats, warmup=1)
        return sum(timed.times_s) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=2, repeats_help="runs with the monitor and as many without",
                          warmup=10, warmup_help="first steps of each run left out of its median",
                          quick={"model": "tiny", "volume": 32, "steps": 15, "repeats": 1, "warmup": 5})
    parser.add_argument("--model", default="small")
    parser.add_argument("--volume", type=int, default=48)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    console = Console(soft_wrap=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bigmem-bench-monitor-") as folder:
        for repeat in range(args.repeats):
            for interval in (args.interval, 0.0):
                run = train_steps_per_s(args, interval, Path(folder) / f"r{repeat}-{interval:g}")
                runs.append(run)
                console.print(f"monitor {'on' if interval else 'off'}: {run['steps_per_s']:.2f} steps/s "
                              f"({run['monitor_rows']} monitor rows)", style="dim")
    on = spread(r["steps_per_s"] for r in runs if r["interval_s"] > 0).median
    off = spread(r["steps_per_s"] for r in runs if r["interval_s"] == 0).median
    cost = sample_cost_s()
    table = Table(title=f"monitor overhead: bigmem train {args.model} {args.volume}^3, {args.steps} steps")
    for column in ("monitor", "steps/s (median of runs)", "runs"):
        table.add_column(column, justify="right")
    table.add_row(f"every {args.interval:g} s", f"{on:.3f}", str(args.repeats))
    table.add_row("off", f"{off:.3f}", str(args.repeats))
    console.print(table)
    overhead_pct = 100.0 * (off - on) / off
    console.print(f"overhead: {overhead_pct:+.2f}% steps/s; one sample() costs {cost * 1e3:.2f} ms "
                  f"({100 * cost / args.interval:.3f}% of one core at one sample per {args.interval:g} s)")
    report = {"machine": {"host": socket.gethostname(), "cpu": machine_cpu_model(), "tensorflow": tensorflow_version()},
              "model": args.model, "volume": args.volume, "steps": args.steps, "runs": runs,
              "steps_per_s_on": on, "steps_per_s_off": off, "overhead_pct": overhead_pct,
              "sample_cost_s": cost}
    write_results("monitor", report, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
