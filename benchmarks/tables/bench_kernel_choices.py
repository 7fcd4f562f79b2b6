"""The speed-motivated kernel choices of bigmem.nets, timed per ISA class: what nets/choices.py ships.

    python benchmarks/tables/bench_kernel_choices.py [--isa native,avx512,avx2] [--volumes 64,96]
        [--warmup 2] [--repeats 5] [--out DIR] [--write-table]

For each ISA class it starts child processes with oneDNN capped at that class
(``ONEDNN_MAX_CPU_ISA``: ``avx2`` -> AVX2, ``avx512`` -> AVX512_CORE; ``native`` leaves it alone)
and times, forward excluded, the choices bigmem makes by shape:

- the 3x3x3 conv's weight gradient: oneDNN's Conv3DBackpropFilterV2 against the planewise one
  (three batched 2-D weight gradients, nets/conv.py), stride 1 and 2, fp32 and (on CPUs with
  native bf16) bf16, at the channel counts of the presets' levels;
- the instance norm forward + backward: FusedBatchNormV3 on the 4-D view (oneDNN's kernel) against
  the 5-D form (Eigen's), for channel counts oneDNN vectorises.

A capped run is an emulation of the smaller CPU on this one: oneDNN picks its kernels for the
capped ISA, while TensorFlow's own Eigen kernels keep the full ISA of this CPU. Each row says
which is faster; a choice that flips between classes is one nets/choices.py must make per class.
Prints a table and writes JSON keyed by machine (never run by pytest). Run on a quiet machine.
``--write-table`` replaces each measured class's entry of bigmem/measured/kernel_choices.json with
the weight-gradient choice of ``planewise_ranges`` (keeping an entry's ``correctness``, which no
timing decides); review its diff against the shipped choices' notes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from _results import write_table
from harness import bench_parser, command_line, run_function, time_calls, write_results
from rich.console import Console
from rich.table import Table

# --isa name -> ONEDNN_MAX_CPU_ISA (None: as the CPU is). Names are bigmem's ISA classes.
ISA_CAPS = {"native": None, "avx512": "AVX512_CORE", "avx2": "AVX2"}
# (stride, in channels, out channels): the levels of small (8..64), kits19 / intelai-brats (16/32..320).
WEIGHT_GRAD_SHAPES = [(1, 8, 8), (1, 16, 16), (1, 32, 32), (1, 64, 64), (2, 8, 16), (2, 16, 32), (2, 32, 64),
                      (2, 64, 128)]
NORM_CHANNELS = [8, 16, 32, 64]


def child(request: dict) -> dict:
    from bigmem.tfenv import import_tensorflow

    tf = import_tensorflow()
    from bigmem.nets.conv import planewise_weight_grad

    dtype = tf.bfloat16 if request["precision"] == "bf16" else tf.float32
    volume, warmup, repeat = request["volume"], request["warmup"], request["repeat"]
    rows = []
    for stride, cin, cout in WEIGHT_GRAD_SHAPES:
        x = tf.cast(tf.random.normal((1, volume, volume, volume, cin)), dtype)
        dy = tf.cast(tf.random.normal((1, volume // stride, volume // stride, volume // stride, cout)), dtype)
        shape = [3, 3, 3, cin, cout]

        @tf.function
        def onednn(x=x, dy=dy, shape=shape, stride=stride):
            return tf.raw_ops.Conv3DBackpropFilterV2(input=x, filter_sizes=tf.constant(shape), out_backprop=dy,
                                                    strides=[1, stride, stride, stride, 1], padding="SAME")

        @tf.function
        def planes(x=x, dy=dy, shape=shape, stride=stride):
            return planewise_weight_grad(x, dy, shape, stride)

        row = {"op": "wgrad", "stride": stride, "in_channels": cin, "out_channels": cout}
        for name, fn in (("onednn", onednn), ("planewise", planes)):
            row[f"{name}_s"] = time_calls(lambda fn=fn: fn().numpy(), repeats=repeat, warmup=warmup).spread.median
        rows.append(row)
    for channels in NORM_CHANNELS:
        x = tf.cast(tf.random.normal((1, volume, volume, volume, channels)), dtype)
        gamma, beta = tf.ones((channels,)), tf.zeros((channels,))
        row = {"op": "norm", "channels": channels}
        view4 = (1, volume, volume * volume, channels)
        # 4d: oneDNN's kernel on the 4-D view; 5d: Eigen's on the 5-D tensor; 4d_fp32 (bf16 only):
        # oneDNN's float32 kernel between two casts, for channel counts its bf16 kernel does not vectorise.
        variants = [("4d", view4, None), ("5d", None, None)]
        if request["precision"] == "bf16":
            variants.append(("4d_fp32", view4, tf.float32))
        for name, view, work_dtype in variants:

            @tf.function
            def norm(x=x, view=view, work_dtype=work_dtype):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    t = tf.reshape(x, view) if view else x
                    t = tf.cast(t, work_dtype) if work_dtype else t
                    y = tf.compat.v1.nn.fused_batch_norm(t, gamma, beta, is_training=True,
                                                         data_format="NHWC" if view else "NDHWC")[0]
                    y = tf.reshape(tf.cast(y, x.dtype), x.shape)
                    total = tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(x, tf.float32))
                return tf.reduce_sum(tf.cast(tape.gradient(total, x), tf.float32))

            row[f"{name}_s"] = time_calls(lambda norm=norm: norm().numpy(), repeats=repeat,
                                          warmup=warmup).spread.median
        rows.append(row)
    return {"rows": rows}


def planewise_ranges(results: list[dict], isa: str) -> list[dict]:
    """The planewise weight gradient's input-channel range per (precision, stride) for ``isa``, from its rows.

    ``nets.choices.planewise_ranges`` over the times summed over the volumes (the largest volume
    weighs most, as the sizes bigmem trains at do). On the shipped avx512_bf16, avx512 and avx2
    runs this gives the shipped choices.
    """
    from bigmem.nets.choices import planewise_ranges as rule

    seconds: dict[tuple, list[float]] = {}  # (precision, stride, in channels) -> [planewise, oneDNN]
    for result in results:
        for row in result.get("rows", []) if result["isa"] == isa else []:
            if row["op"] == "wgrad":
                total = seconds.setdefault((result["precision"], row["stride"], row["in_channels"]), [0.0, 0.0])
                total[0], total[1] = total[0] + row["planewise_s"], total[1] + row["onednn_s"]
    return [{"precision": precision, "stride": stride, "in_channels": list(channels)}
            for (precision, stride), channels in rule(seconds).items()]


def run_child(request: dict, cap: str | None) -> dict:
    """``child(request)`` in a fresh process with oneDNN capped at ``cap`` (None: as the CPU is); or its error."""
    env = {key: value for key, value in os.environ.items() if key != "ONEDNN_MAX_CPU_ISA"}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", **({"ONEDNN_MAX_CPU_ISA": cap} if cap else {})})
    run = run_function(child, request, what=f"Timing the kernel choices (ONEDNN_MAX_CPU_ISA={cap})", env=env)
    return run.result if run.ok else {"error": run.failure()}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=5, warmup=2)
    parser.add_argument("--isa", default="native,avx512,avx2")
    parser.add_argument("--volumes", default="64,96")
    parser.add_argument("--write-table", action="store_true",
                        help="replace each measured class's entry of bigmem/measured/kernel_choices.json")
    args = parser.parse_args(argv)

    from bigmem.sysinfo import cpu_description, isa_class, native_bf16

    console = Console()
    cpu = cpu_description()
    native = isa_class(cpu["isa"])
    results = []
    for isa in args.isa.split(","):
        # bf16 only where it is native: elsewhere bigmem does not choose it, and it is emulated.
        precisions = ["fp32", "bf16"] if isa == "native" and native_bf16() else ["fp32"]
        for precision in precisions:
            for volume in (int(v) for v in args.volumes.split(",")):
                request = {"precision": precision, "volume": volume, "warmup": args.warmup, "repeat": args.repeats}
                result = run_child(request, ISA_CAPS[isa])
                results.append({"isa": native if isa == "native" else isa, "onednn_max_cpu_isa": ISA_CAPS[isa],
                                **request, **result})
                status = f"error: {result['error']}" if "error" in result else "ok"
                console.print(f"{isa} {precision} {volume}^3: {status}")
    table = Table(title="kernel choices: median seconds, forward excluded (faster in bold)")
    for column in ("ISA", "precision", "volume", "op", "shape", "oneDNN 3-D / 4-D", "planewise / 5-D", "choice"):
        table.add_column(column)
    for result in results:
        for row in result.get("rows", []):
            if row["op"] == "wgrad":
                shape = f"s{row['stride']} {row['in_channels']}->{row['out_channels']}"
                a, b, names = row["onednn_s"], row["planewise_s"], ("oneDNN", "planewise")
            else:
                shape = f"{row['channels']} ch"
                if "4d_fp32_s" in row:
                    shape += f" (fp32 4-D {row['4d_fp32_s'] * 1e3:.1f} ms)"
                a, b, names = row["4d_s"], row["5d_s"], ("4-D", "5-D")
            row["choice"] = names[0] if a <= b else names[1]
            if row.get("4d_fp32_s", float("inf")) < min(a, b):
                row["choice"] = "fp32 4-D"
            table.add_row(result["isa"], result["precision"], str(result["volume"]), row["op"], shape,
                          f"{a * 1e3:.1f} ms", f"{b * 1e3:.1f} ms", row["choice"])
    console.print(table)
    from bigmem.sysinfo import tensorflow_description

    machine = {"cpu": cpu["model"], "isa_class": native, "isa": cpu["isa"], "logical_cpus": os.cpu_count(),
               "tensorflow_runtime": tensorflow_description()}
    onednn = "on" if machine["tensorflow_runtime"]["onednn_enabled"] else "off"
    console.print(f"{cpu['model']} ({native}), oneDNN {onednn}")
    report = {"command": command_line(__file__, argv), "warmup": args.warmup, "repeat": args.repeats,
              "results": results, "machine": machine}
    path = write_results("kernel_choices", report, args.out, console)
    for isa, cap in dict.fromkeys((r["isa"], r["onednn_max_cpu_isa"]) for r in results) if args.write_table else ():
        where = f"measured with oneDNN capped at {cap}" if cap else f"measured on {isa}"
        write_table("kernel_choices", {"planewise": planewise_ranges(results, isa)}, key=isa, isa_class=isa,
                    results=path, console=console, summary=f"{where}: {path}", keep=("correctness",),
                    machine={"keras": machine["tensorflow_runtime"]["keras"], "onednn_max_cpu_isa": cap},
                    notes=[f"planewise_ranges of this run (median of {args.repeats} after {args.warmup} warm-up runs, "
                           f"forward excluded, at {args.volumes.replace(',', ', ')}^3)."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
