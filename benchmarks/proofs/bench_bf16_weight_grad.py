"""Is TensorFlow's bf16 3-D weight gradient right on this CPU? Against float32's, per input shape and channels.

    python benchmarks/proofs/bench_bf16_weight_grad.py [--repeats 3] [--out DIR]

For a 3x3x3 "same" convolution (stride 1, and stride 2 where the input is at least 4 planes deep),
the weight gradient ``Conv3DBackpropFilterV2`` computes in bfloat16 (oneDNN's kernel where it is on)
against the float32 one of the same bf16-rounded inputs, and the planewise gradient bigmem can take
instead (``nets.conv.planewise_weight_grad``, three 2-D gradients). The figure is the relative error
of the whole gradient, the largest over ``--repeats`` calls (a kernel that reads memory it did not
write differs from call to call). bf16's own rounding puts a right kernel near 0.002.

On an avx512_bf16 EPYC (TF 2.21, oneDNN on) the 3-D kernel was 0.85-1.1 (and sometimes inf) for
inputs two planes deep with 32 or more channels, and right everywhere else measured: why
``nets/conv.py`` sends such convolutions to the planewise gradient. Run it on each new CPU class.
Prints a table and writes JSON keyed by machine (never run by pytest).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _results

SHAPES = ((1, 1, 1), (2, 1, 1), (2, 2, 2), (2, 4, 4), (2, 8, 8), (3, 3, 3), (4, 2, 2), (4, 4, 4), (8, 8, 8))
CHANNELS = (16, 32, 64, 128, 256)
RIGHT = 0.01  # bf16 keeps 8 bits: a right kernel is about 0.002 off float32's here


def relative_error(shape, channels: int, stride: int, repeats: int, planewise: bool) -> float:
    """The largest relative error over ``repeats`` calls of the bf16 weight gradient against float32's."""
    import numpy as np
    import tensorflow as tf

    from bigmem.nets.conv import planewise_weight_grad

    x = tf.random.stateless_normal((1, *shape, channels), seed=[1, 2])
    out = tuple(-(-s // stride) for s in shape)
    dy = tf.random.stateless_normal((1, *out, channels), seed=[3, 4])
    x16, dy16 = tf.cast(x, tf.bfloat16), tf.cast(dy, tf.bfloat16)
    strides = [1, stride, stride, stride, 1]
    sizes = [3, 3, 3, channels, channels]
    want = tf.raw_ops.Conv3DBackpropFilterV2(input=tf.cast(x16, tf.float32), filter_sizes=sizes,
                                             out_backprop=tf.cast(dy16, tf.float32), strides=strides,
                                             padding="SAME").numpy()
    worst = 0.0
    for _ in range(repeats):
        if planewise:
            got = planewise_weight_grad(x16, dy16, sizes, stride)
        else:
            got = tf.raw_ops.Conv3DBackpropFilterV2(input=x16, filter_sizes=sizes, out_backprop=dy16, strides=strides,
                                                    padding="SAME")
        got = tf.cast(got, tf.float32).numpy()
        error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        worst = error if not np.isfinite(error) else max(worst, error)
        if not np.isfinite(worst):
            break
    return worst


def main(argv: list[str] | None = None) -> int:
    from _results import REPO, write_results

    from bigmem.tfenv import import_tensorflow

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    import_tensorflow()
    rows = []
    print(f"{'input':<10} {'stride':>6} {'path':<10} " + " ".join(f"{c:>8}" for c in CHANNELS))
    for shape in SHAPES:
        for stride in (1, 2):
            if stride == 2 and shape[0] < 4:
                continue
            eligible = shape[0] >= 2 if stride == 1 else all(s % 2 == 0 and s >= 4 for s in shape)
            for planewise in (False, True) if eligible else (False,):  # where Conv3D could take it
                errors = [relative_error(shape, c, stride, args.repeats, planewise) for c in CHANNELS]
                path = "planewise" if planewise else "3d"
                rows.append({"input": list(shape), "stride": stride, "path": path,
                             "relative_error": dict(zip(map(str, CHANNELS), errors))})
                marks = " ".join(f"{e:>7.3f}{'!' if not e < RIGHT else ' '}" for e in errors)
                print(f"{'x'.join(map(str, shape)):<10} {stride:>6} {path:<10} {marks}", flush=True)
    wrong = [r for r in rows if any(not e < RIGHT for e in r["relative_error"].values())]
    print(f"{len(wrong)} of {len(rows)} (input, stride, path) rows have a channel count off by {RIGHT} or more")
    write_results("bf16_weight_grad", {"command": "python benchmarks/proofs/bench_bf16_weight_grad.py",
                                       "right_below": RIGHT, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
