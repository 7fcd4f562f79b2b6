"""Where a training step's time goes, against the whole-network ceiling, before and after ``bigmem tune``.

    python benchmarks/tables/bench_ceiling.py [--model kits19] [--volumes 64,96,128] [--precisions fp32,bf16]
        [--steps 3] [--warmup 2] [--no-profile] [--out DIR]

For each volume and precision (bf16 only where the CPU has it natively), in fresh child processes:

- **ceiling**: every distinct convolution of one training step at its own shape and channels
  (``bigmem.tune.network_convolutions``), each kernel timed alone (forward, input gradient, and
  the weight gradient both ways: oneDNN's 3-D and the planewise one); the ceiling is the sum of
  the fastest time TF has for each. Beside it: the same sum with the weight gradients the layers
  take (shipped choices, then tuned), and the single-layer yardstick this replaces (the
  full-resolution C -> C convolution's rate, as bench_train.py's ``ceiling`` row).
- **bigmem**: the trainer's own step (``bigmem.train.trainer``: ``build``, ``step_and_batches``),
  first with the shipped tables, then after the tuning pass at this shape (its time is recorded);
- **keras**: the same network from Keras's stock layers, ``compile`` + ``train_on_batch``
  (bench_train.py's plain-Keras path), run as a user would: TF's default oneDNN setting (off on
  AVX2 and on AVX-512 without VNNI/BF16); and once more with oneDNN on, as bigmem runs.

The per-op profile (TensorFlow's profiler, two steps after the timed ones) gives each op type's
time per step for bigmem and for Keras, and the convolutions' share. The step's share of the
ceiling is ceiling / step. Prints tables and writes JSON keyed by machine (never run by pytest).
Run alone on the machine.
"""

from __future__ import annotations

import collections
import glob
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_train's plain-Keras path

from _results import write_results
from harness import bench_parser, command_line, run_function
from rich.console import Console
from rich.table import Table

from bigmem.config import resolve_config

BENCH_LR = 1e-3  # as bench_train.py: speed does not depend on it


def _config(request: dict):
    volume = request["volume"]
    return resolve_config(request["model"], {"train": {"batch_size": 1, "precision": request["precision"],
                                                       "lr": BENCH_LR, "tune": False},
                                             "data": {"shape": [volume] * 3}})


def _op_profile(run_steps, steps: int) -> dict[str, float]:
    """Seconds per step of each TF op type over ``steps`` calls of ``run_steps`` (the profiler's op events)."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    folder = tempfile.mkdtemp(prefix="bigmem-profile-")
    tf.profiler.experimental.start(folder)
    run_steps(steps)
    tf.profiler.experimental.stop()
    totals: dict[str, float] = collections.Counter()
    for path in glob.glob(f"{folder}/**/*.xplane.pb", recursive=True):
        space = xplane_pb2.XSpace()
        space.ParseFromString(Path(path).read_bytes())
        for plane in space.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_"):  # the executor's threads: one event per op run
                    continue
                for event in line.events:
                    name = plane.event_metadata[event.metadata_id].name
                    if ":" in name and "::" not in name:  # "scope/op_name:OpType"; not the executor's own
                        totals[name.rsplit(":", 1)[1]] += event.duration_ps * 1e-12 / steps
    return dict(totals)


def _timed(run, request: dict) -> tuple[list[float], dict[str, float]]:
    """``run(n)`` runs n steps: the warm-up, then each timed step alone, then (if asked) two profiled ones."""
    import time

    run(request["warmup"])
    times = []
    for _ in range(request["steps"]):
        started = time.perf_counter()
        run(1)
        times.append(time.perf_counter() - started)
    return times, (_op_profile(run, 2) if request["profile"] else {})


def child_network(request: dict) -> dict:
    """The ceiling: each convolution's kernels timed alone; the paths the layers take (shipped, or tuned)."""
    from bigmem.tfenv import import_tensorflow

    import_tensorflow()
    from bigmem.tune import network_convolutions, time_convolution

    config = _config(request)
    calls = network_convolutions(config, [request["volume"]] * 3)
    rows = []
    for call, count in calls:
        timed = time_convolution(call, count, repeats=request["repeats"], max_elements=2**31)  # whole tensors
        row = timed.to_dict()
        row["path"] = call.path
        weight = (timed.weight_grad_planewise_s if call.path == "planewise" and timed.weight_grad_planewise_s
                  else timed.weight_grad_3d_s)
        row["as_taken_s"] = (timed.forward_s + timed.input_grad_s + weight) * count
        row["all_3d_s"] = (timed.forward_s + timed.input_grad_s + timed.weight_grad_3d_s) * count
        rows.append(row)
    return {"rows": rows, "ceiling_s": sum(r["fastest_s"] for r in rows),
            "as_taken_s": sum(r["as_taken_s"] for r in rows), "all_3d_s": sum(r["all_3d_s"] for r in rows),
            "conv_flops": sum(r["flops"] for r in rows)}


def child_bigmem(request: dict) -> dict:
    """bigmem's training step as the trainer builds it; with ``tune``, the tuning pass runs first at this shape."""

    from bigmem.data.synth import cached_synthetic_store
    from bigmem.tfenv import import_tensorflow

    import_tensorflow()
    config = _config(request)
    tuned = None
    if request.get("tune"):
        from bigmem.tune import tune

        tuning = tune(config, [request["volume"]] * 3, measure_memory=False, budget_s=request["tune_budget_s"])
        tuned = {"seconds": tuning.tuned[-1]["seconds"], "partial": tuning.tuned[-1]["partial"],
                 "planewise": tuning.planewise, "conv_gflops_per_core": tuning.conv_gflops_per_core}
    from rich.console import Console as RichConsole

    from bigmem.train.job import prepare_job
    from bigmem.train.trainer import build, step_and_batches

    store = str(cached_synthetic_store(num_cases=2, volume=request["volume"], num_classes=config.model.num_classes))
    config = config.updated({"data": {"store": store}, "train": {"steps": 100, "epochs": None}})
    with tempfile.TemporaryDirectory(prefix="bigmem-bench-") as run_dir:
        job = prepare_job(config, f"{run_dir}/run", force=True, console=RichConsole(file=open(os.devnull, "w")))
        try:
            model, optimizer, _ = build(job)
            step, batches = step_and_batches(job, model, optimizer, 0)
            batch = next(batches)

            def run(n):
                for _ in range(n):
                    loss, _ = step(*batch)
                    float(loss)

            times, ops = _timed(run, request)
        finally:
            job.close()
    return {"step_s": times, "ops": ops, "tuned": tuned}


def child_keras(request: dict) -> dict:
    """Plain Keras (bench_train.py's path), timed and then profiled."""

    import keras

    from bigmem.nets.unet3d import UNet3D
    from bigmem.train.losses import dice_ce_loss
    from bench_train import _sample_case

    config = _config(request).updated({"model": {"stock_layers": True, "deep_supervision": False,
                                                 "region_outputs": False}})
    keras.utils.set_random_seed(0)
    policy = "mixed_bfloat16" if request["precision"] == "bf16" else "float32"
    model = UNet3D(config.model, dtype=policy).build_for()
    model.compile(optimizer=keras.optimizers.SGD(BENCH_LR, momentum=0.99, nesterov=True), loss=dice_ce_loss)
    image, label = _sample_case(config, request["volume"])

    def run(n):
        for _ in range(n):
            model.train_on_batch(image, label)

    times, ops = _timed(run, request)
    return {"step_s": times, "ops": ops}


def child_layer(request: dict) -> dict:
    """The single-layer yardstick: bench_train.py's ceiling row (full-resolution C -> C conv, fwd + both grads)."""
    from bench_train import child_ceiling

    config = _config(request)
    result = child_ceiling({"what": "conv", "precision": request["precision"], "volume": request["volume"],
                            "channels": config.model.base_filters, "steps": request["steps"],
                            "warmup": request["warmup"]})
    return {"gflops": result["flops"] / statistics.median(result["step_s"]) / 1e9}


CHILDREN = {"network": child_network, "bigmem": child_bigmem, "keras": child_keras, "layer": child_layer}


def _child(request: dict) -> dict:
    return CHILDREN[request["kind"]](request)


def run_child(request: dict, env: dict | None = None) -> dict:
    merged = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    merged = {key: value for key, value in merged.items() if value is not None}  # None: unset (TF's default)
    run = run_function(_child, request, what=f"{request['kind']} at {request['volume']}^3 {request['precision']}",
                       env=merged)
    return run.result if run.ok else {"error": run.failure()}


CONV_OPS = ("Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "Conv2D", "Conv2DBackpropFilter",
            "Conv2DBackpropInput", "_MklNativeConv3D", "_MklNativeConv3DBackpropInputV2",
            "_MklNativeConv3DBackpropFilterV2", "_MklNativeConv2D", "_MklNativeConv2DBackpropFilter",
            "_MklNativeConv2DBackpropInput", "_FusedConv3D", "_MklNativeFusedConv3D")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats=3, warmup=2, repeats_help="timed steps (and kernel calls)")
    parser.add_argument("--model", default="kits19")
    parser.add_argument("--volumes", default="64,96,128")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--tune-budget", type=float, default=60.0, help="the tuning pass's budget, seconds")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-op profiles")
    parser.add_argument("--profile-volumes", default="96", help="volumes that get the per-op profile (default 96)")
    parser.add_argument("--keras-default-volumes", default="64",
                        help="volumes at which plain Keras also runs with TF's default oneDNN setting (off on AVX2: "
                             "several times slower, so only the smallest by default)")
    parser.add_argument("--reuse", help="an earlier results file: its step timings (bigmem, keras, layer) are "
                                         "kept and only the network's ceiling is timed again")
    parser.add_argument("--onednn-cap", help="ONEDNN_MAX_CPU_ISA for every child (AVX2, AVX, SSE41, AVX512_CORE): "
                                             "oneDNN's kernels of a smaller CPU on this one (TF's Eigen keeps this "
                                             "CPU's ISA); the tuning file is then that class's")
    args = parser.parse_args(argv)
    from bigmem.memory.calibration import machine_cpu_model, machine_isa_class
    from bigmem.sysinfo import native_bf16

    console = Console(width=max(Console().width, 170))  # the summary table's 14 columns
    results = []
    reused = {}
    if args.reuse:
        import json

        reused = {(row["volume"], row["precision"]): row for row in json.loads(Path(args.reuse).read_text())["rows"]}
    for precision in args.precisions.split(","):
        if precision == "bf16" and not native_bf16():
            console.print("bf16: skipped (emulated on this CPU)")
            continue
        for volume in (int(v) for v in args.volumes.split(",")):
            profile = not args.no_profile and str(volume) in args.profile_volumes.split(",")
            base = {"model": args.model, "volume": volume, "precision": precision, "steps": args.repeats,
                    "warmup": args.warmup, "repeats": args.repeats, "profile": profile,
                    "tune_budget_s": args.tune_budget}
            cap = {"ONEDNN_MAX_CPU_ISA": args.onednn_cap} if args.onednn_cap else {}
            if (volume, precision) in reused:
                row = dict(reused[(volume, precision)])
                console.print(f"{args.model} {volume}^3 {precision}: steps from {args.reuse}; network ceiling ...")
                row["network_shipped"] = row["network_tuned"] = run_child(
                    {**base, "kind": "network"}, {"BIGMEM_TUNING_DIR": tempfile.mkdtemp(prefix="bigmem-untuned-")})
                row["reused_steps_from"] = args.reuse
                results.append(row)
                continue
            with tempfile.TemporaryDirectory(prefix="bigmem-tuning-") as tuned_dir:
                shipped_env = {"BIGMEM_TUNING_DIR": tempfile.mkdtemp(prefix="bigmem-untuned-"), **cap}
                tuned_env = {"BIGMEM_TUNING_DIR": tuned_dir, **cap}
                row = {"volume": volume, "precision": precision}
                console.print(f"{args.model} {volume}^3 {precision}: layer, network (shipped), bigmem (shipped) ...")
                row["layer"] = run_child({**base, "kind": "layer"}, shipped_env)
                row["network_shipped"] = run_child({**base, "kind": "network"}, shipped_env)
                row["bigmem_shipped"] = run_child({**base, "kind": "bigmem"}, shipped_env)
                console.print("  ... tuning, bigmem (tuned), network (tuned), keras")
                row["bigmem_tuned"] = run_child({**base, "kind": "bigmem", "tune": True}, tuned_env)
                row["network_tuned"] = run_child({**base, "kind": "network"}, tuned_env)
                if str(volume) in args.keras_default_volumes.split(","):
                    row["keras"] = run_child({**base, "kind": "keras", "profile": False},
                                             {"TF_ENABLE_ONEDNN_OPTS": None, **cap})
                row["keras_onednn"] = run_child({**base, "kind": "keras"}, {"TF_ENABLE_ONEDNN_OPTS": "1", **cap})
            results.append(row)
    table = Table(title=f"{args.model}: step against the whole-network ceiling on {machine_isa_class()} "
                        f"{machine_cpu_model()}" + (f", oneDNN capped at {args.onednn_cap}" if args.onednn_cap else ""))
    for column in ("volume", "prec.", "ceiling", "layer GFLOP/s", "net ceiling GFLOP/s", "bigmem shipped",
                   "share", "bigmem tuned", "share", "tune s", "keras", "bigmem/keras", "keras oneDNN on",
                   "bigmem/keras on"):
        table.add_column(column, justify="right")
    for row in results:
        if any("error" in row.get(k, {}) for k in ("network_shipped", "network_tuned", "bigmem_shipped",
                                                   "bigmem_tuned", "keras", "keras_onednn", "layer")):
            table.add_row(str(row["volume"]), row["precision"], "error: see JSON", *[""] * 11)
            continue
        ceiling = min(row["network_shipped"]["ceiling_s"], row["network_tuned"]["ceiling_s"])
        flops = row["network_shipped"]["conv_flops"]
        shipped = statistics.median(row["bigmem_shipped"]["step_s"])
        tuned = statistics.median(row["bigmem_tuned"]["step_s"])
        keras = statistics.median(row["keras"]["step_s"]) if "keras" in row else float("nan")
        keras_on = statistics.median(row["keras_onednn"]["step_s"])
        row["summary"] = {"ceiling_s": ceiling, "network_ceiling_gflops": flops / ceiling / 1e9,
                          "layer_gflops": row["layer"]["gflops"], "bigmem_shipped_s": shipped,
                          "bigmem_tuned_s": tuned, "keras_s": keras, "share_shipped": ceiling / shipped,
                          "share_tuned": ceiling / tuned, "bigmem_over_keras": keras / tuned,
                          "keras_onednn_s": keras_on, "bigmem_over_keras_onednn": keras_on / tuned}
        s = row["summary"]
        table.add_row(str(row["volume"]), row["precision"], f"{ceiling:.2f} s", f"{s['layer_gflops']:.0f}",
                      f"{s['network_ceiling_gflops']:.0f}", f"{shipped:.2f} s", f"{100 * s['share_shipped']:.0f}%",
                      f"{tuned:.2f} s", f"{100 * s['share_tuned']:.0f}%",
                      f"{row['bigmem_tuned']['tuned']['seconds']:.0f}", f"{keras:.2f} s",
                      f"{s['bigmem_over_keras']:.2f}x", f"{keras_on:.2f} s", f"{s['bigmem_over_keras_onednn']:.2f}x")
    console.print(table)
    for row in results:
        if "summary" not in row or not row["bigmem_tuned"]["ops"]:
            continue
        ops = Table(title=f"per-op time per step, {row['volume']}^3 {row['precision']} (profiler; ops overlap)")
        for column in ("op", "bigmem tuned (ms)", "keras oneDNN on (ms)"):
            ops.add_column(column, justify="right" if column != "op" else "left")
        mine, theirs = row["bigmem_tuned"]["ops"], row["keras_onednn"]["ops"]
        for name in sorted(set(mine) | set(theirs), key=lambda n: -max(mine.get(n, 0), theirs.get(n, 0)))[:18]:
            ops.add_row(name, f"{1e3 * mine.get(name, 0):.1f}", f"{1e3 * theirs.get(name, 0):.1f}")
        conv_mine = sum(v for k, v in mine.items() if k in CONV_OPS)
        conv_theirs = sum(v for k, v in theirs.items() if k in CONV_OPS)
        flops = row["network_shipped"]["conv_flops"]
        ops.add_row("all convolutions", f"{1e3 * conv_mine:.1f} ({flops / max(conv_mine, 1e-9) / 1e9:.0f} GFLOP/s)",
                    f"{1e3 * conv_theirs:.1f} ({flops / max(conv_theirs, 1e-9) / 1e9:.0f} GFLOP/s)")
        console.print(ops)
    write_results("ceiling" + (f"-cap-{args.onednn_cap.lower()}" if args.onednn_cap else ""),
                  {"command": command_line(__file__, argv), "model": args.model, "onednn_cap": args.onednn_cap,
                   "rows": results}, args.out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
