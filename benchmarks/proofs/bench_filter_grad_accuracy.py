"""How accurate TF's (oneDNN's) conv3d weight gradient is as the tensor grows toward 2^31 elements.

    python benchmarks/proofs/bench_filter_grad_accuracy.py [--depths 128,256,512,768,1000,1020] [--quick] [--out DIR]

For (1, D, 1024, 1024, 2) fp32 tensors, Conv3DBackpropFilterV2 (3x3x3, "SAME", oneDNN on) over the
whole tensor against the float64 sum of the same op over 16-plane output slabs (each with its one
halo plane and a zero-padded gradient). Each depth runs in its own child process under the shared
lock on /tmp/bigmem-heavy.lock (up to 3 tensors of 8.6 GB). This is where bigmem's kernel limit
(bigmem/nets/limits.py) comes from: the error grows slowly with size (fp32 summation), then jumps.
Prints a table and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from harness import bench_parser, heavy_turn, run_function, write_results

HW, CHANNELS, SLAB = 1024, 2, 16


def child(request: dict) -> dict:
    """One depth, in its own process (``run_function``): the whole op's error against the slabs' sum."""
    depth = request["depth"]
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    import numpy as np
    import tensorflow as tf

    def tiled(period, seed):  # a random block of `period` planes tiled along depth (1024 % period != 0)
        block = tf.random.stateless_uniform([1, period, HW, HW, CHANNELS], seed=seed, minval=-1, maxval=1)
        return tf.tile(block, [1, -(-depth // period), 1, 1, 1])[:, :depth]

    x, dy = tiled(3, [1, 2]), tiled(5, [3, 4])
    sizes = [3, 3, 3, CHANNELS, CHANNELS]

    def filter_grad(inputs, gradient):
        return tf.raw_ops.Conv3DBackpropFilterV2(input=inputs, filter_sizes=sizes, out_backprop=gradient,
                                                 strides=[1] * 5, padding="SAME").numpy().astype(np.float64)

    start = time.perf_counter()
    whole = filter_grad(x, dy)
    seconds = time.perf_counter() - start
    reference = np.zeros_like(whole)
    for o0 in range(0, depth, SLAB):
        o1 = min(depth, o0 + SLAB)
        a, b = max(0, o0 - 1), min(depth, o1 + 1)
        padded = tf.pad(dy[:, o0:o1], [[0, 0], [o0 - a, b - o1], [0, 0], [0, 0], [0, 0]])
        reference += filter_grad(x[:, a:b], padded)
    err = float(np.abs(whole - reference).max())
    return {"depth": depth, "elements": depth * HW * HW * CHANNELS, "max_abs_err": err,
            "relative_err": err / float(np.abs(reference).max()), "op_s": round(seconds, 2)}


def main(argv=None) -> int:
    parser = bench_parser(__doc__, quick={"depths": "16,32"})
    parser.add_argument("--depths", default="128,256,512,768,1000,1020")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from bigmem.memory.calibration import machine_cpu_model, tensorflow_version

    console = Console()
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        elements = depth * HW * HW * CHANNELS
        with heavy_turn(elements > 2**28, console.print):  # small tensors need no turn on the machine's memory
            run = run_function(child, {"depth": depth}, what=f"Conv3DBackpropFilterV2 at depth {depth}")
        if run.ok:
            rows.append(run.result)
        else:
            rows.append({"depth": depth, "elements": elements, "exit_code": run.returncode, "error": run.failure()})
    table = Table(title="Conv3DBackpropFilterV2 (oneDNN) vs float64 sum of 16-plane slabs, fp32")
    for column in ("D", "elements", "max abs err", "relative", "op s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["depth"]), f"{r['elements']:.3e}", f"{r.get('max_abs_err', float('nan')):.3g}",
                      f"{r.get('relative_err', float('nan')):.2e}" if "relative_err" in r else r.get("error", ""),
                      str(r.get("op_s", "")))
    console.print(table)
    from bigmem.sysinfo import cpu_description, isa_class

    write_results("filter_grad_accuracy", {
        "machine": {"cpu": machine_cpu_model(), "isa_class": isa_class(cpu_description()["isa"]),
                    "tensorflow": tensorflow_version(), "TF_ENABLE_ONEDNN_OPTS": "1"},
        "command": "python benchmarks/proofs/bench_filter_grad_accuracy.py --depths " + args.depths, "rows": rows},
        args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
