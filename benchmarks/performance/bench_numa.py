"""Memory bandwidth and training step time under each NUMA policy available on this machine.

    python benchmarks/performance/bench_numa.py [--policies none,local,interleave,bind:0,preferred:0]
        [--model small] [--volume 64] [--steps 6] [--copy-gib 1] [--repeats 5] [--quick] [--out DIR]

Each policy runs in a fresh child process (a policy must be set before the memory it governs is
allocated and before TensorFlow starts its threads). Bandwidth: median of ``--repeats`` copies of a
--copy-gib array (bytes read + written per second). Step time: median of the steps after the
first, from the run's metrics.jsonl. On a one-node machine the policies should tie; the script
still runs every one of them. Prints a table and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from harness import bench_parser, run_function, spread, time_calls, write_results


def child(request: dict) -> dict:
    """One policy, in its own process (``run_function``): placed first, then the copies, then training."""
    from bigmem.numa.apply import place

    policy = request["policy"]
    placement = place(policy)
    import numpy as np

    size = int(request["copy_gib"] * 2**30)
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    copy = partial(np.copyto, dst, src)
    rates = spread(2 * size / t for t in time_calls(copy, repeats=request["repeats"]).times_s)  # read + written
    del src, dst, copy
    import io

    from rich.console import Console

    from bigmem.config import resolve_config
    from bigmem.data.synth import cached_synthetic_store
    from bigmem.numa.observe import thread_policies
    from bigmem.rundir import read_jsonl
    from bigmem.train.trainer import train

    volume, steps = request["volume"], request["steps"]
    store = str(cached_synthetic_store(num_cases=4, volume=volume, num_classes=3))
    config = resolve_config(request["model"], {"data": {"volume": volume, "store": store},
                                               "train": {"steps": steps, "checkpoint_every": steps},
                                               "numa": {"policy": policy}})
    with tempfile.TemporaryDirectory() as tmp:
        train(config, f"{tmp}/run", console=Console(file=io.StringIO()))
        rows = read_jsonl(f"{tmp}/run/metrics.jsonl")
        observed = json.loads(Path(f"{tmp}/run/numa.json").read_text())["observed"]
    step = spread(r["step_s"] for r in rows[1:])  # the first, traced step left out
    return {"policy": policy, "numa_maps_policy": placement.numa_maps_policy, "observed": observed,
            "copy_bytes_per_s": rates.median, "copy_spread": [rates.min, rates.max],
            "step_s": step.median, "step_spread": [step.min, step.max], "threads_now": thread_policies()}


def main(argv=None) -> int:
    parser = bench_parser(__doc__, repeats=5, repeats_help="timed copies of the array",
                          quick={"policies": "none,local", "model": "tiny", "volume": 32, "steps": 3,
                                 "copy_gib": 0.05, "repeats": 2})
    parser.add_argument("--policies", default="none,local,interleave,bind:0,preferred:0")
    parser.add_argument("--model", default="small")
    parser.add_argument("--volume", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--copy-gib", type=float, default=1.0)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from bigmem.numa.topology import NUMATopology

    console = Console(soft_wrap=True)
    topology = NUMATopology.from_sysfs()
    rows = []
    for policy in args.policies.split(","):
        request = {"policy": policy, "model": args.model, "volume": args.volume, "steps": args.steps,
                   "copy_gib": args.copy_gib, "repeats": args.repeats}
        run = run_function(child, request, what=f"NUMA policy {policy}")
        if not run.ok:
            console.print(f"{policy}: failed: {run.failure()}")
            continue
        rows.append(run.result)
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
