"""Memory bandwidth and training step time under each NUMA policy available on this machine.

    python benchmarks/bench_numa.py [--policies none,local,interleave,bind:0,preferred:0]
        [--model small] [--volume 64] [--steps 6] [--copy-gib 1] [--out DIR]

Each policy runs in a fresh child process (a policy must be set before the memory it governs is
allocated and before TensorFlow starts its threads). Bandwidth: median of 5 copies of a
--copy-gib array (bytes read + written per second). Step time: median of the steps after the
first, from the run's metrics.jsonl. On a one-node machine the policies should tie; the script
still runs every one of them. Prints a table and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_results

REPEATS = 5


def child(args) -> dict:
    from bigmem.numa.apply import place

    placement = place(args.child)
    import numpy as np

    size = int(args.copy_gib * 2**30)
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    rates = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        np.copyto(dst, src)
        rates.append(2 * size / (time.perf_counter() - started))
    del src, dst
    import io

    from rich.console import Console

    from bigmem.config import resolve_config
    from bigmem.data.synth import cached_synthetic_store
    from bigmem.numa.observe import thread_policies
    from bigmem.rundir import read_jsonl
    from bigmem.train.trainer import train

    store = str(cached_synthetic_store(num_cases=4, volume=args.volume, num_classes=3))
    config = resolve_config(args.model, {"data": {"volume": args.volume, "store": store},
                                         "train": {"steps": args.steps, "checkpoint_every": args.steps},
                                         "numa": {"policy": args.child}})
    with tempfile.TemporaryDirectory() as tmp:
        train(config, f"{tmp}/run", console=Console(file=io.StringIO()))
        rows = read_jsonl(f"{tmp}/run/metrics.jsonl")
        observed = json.loads(Path(f"{tmp}/run/numa.json").read_text())["observed"]
    steps = [r["step_s"] for r in rows[1:]]
    return {"policy": args.child, "numa_maps_policy": placement.numa_maps_policy, "observed": observed,
            "copy_bytes_per_s": statistics.median(rates), "copy_spread": [min(rates), max(rates)],
            "step_s": statistics.median(steps), "step_spread": [min(steps), max(steps)],
            "threads_now": thread_policies()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="none,local,interleave,bind:0,preferred:0")
    parser.add_argument("--model", default="small")
    parser.add_argument("--volume", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--copy-gib", type=float, default=1.0)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    from rich.console import Console
    from rich.table import Table

    from bigmem.numa.topology import NUMATopology

    console = Console(soft_wrap=True)
    topology = NUMATopology.from_sysfs()
    rows = []
    for policy in args.policies.split(","):
        cmd = [sys.executable, __file__, "--child", policy, "--model", args.model, "--volume", str(args.volume),
               "--steps", str(args.steps), "--copy-gib", str(args.copy_gib)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            console.print(f"{policy}: failed: {result.stderr.strip().splitlines()[-1:]}")
            continue
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        console.print(f"{policy}: done", style="dim")
    table = Table(title=f"NUMA policies on {topology.num_nodes} node(s): {args.model} at {args.volume}^3")
    for column in ("policy", "observed on threads", "copy GB/s", "step s (median)", "step spread"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["policy"], ", ".join(f"{k} x{v}" for k, v in r["observed"].items()),
                      f"{r['copy_bytes_per_s'] / 1e9:.2f}", f"{r['step_s']:.3f}",
                      f"{r['step_spread'][0]:.3f}-{r['step_spread'][1]:.3f}")
    console.print(table)
    write_results("numa", {"machine": {"host": socket.gethostname(), "topology": topology.to_dict()},
                           "model": args.model, "volume": args.volume, "rows": rows}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
