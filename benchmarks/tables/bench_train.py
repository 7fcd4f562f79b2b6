"""Training throughput side by side: bigmem, plain Keras and PyTorch, against the machine's ceilings.

    python benchmarks/tables/bench_train.py [--presets small,kits19] [--volumes 64,96,128] [--steps 5]
        [--warmup 2] [--paths bigmem,keras,torch] [--scaling kits19:32,48,64,96,128,160] [--out DIR]
        [--write-table]

One run, one machine, every figure it compares. Each measurement runs in a fresh child process
(its own threads, allocator state and VmHWM), trains batch 1 whole volumes, drops ``--warmup``
steps (tracing, oneDNN primitive creation) and reports the median and spread of ``--steps``:

- ceilings: TF ``conv3d`` forward + both gradients at the model's dominant layer shape (the
  full-resolution C -> C 3x3x3 convolution, C = base filters), and a 4096^2 matmul, fp32 and bf16;
- bigmem: ``bigmem.train.train`` itself (input pipeline, NUMA placement, thread pools, fused
  norm, two-input skip convolutions), fp32 and bf16 (mixed);
- keras: the same architecture from Keras's stock layers (``model.stock_layers``: Concatenate,
  Conv3D, GroupNormalization, ReLU), ``compile`` + ``train_on_batch`` with defaults, fp32 and
  ``mixed_bfloat16``;
- torch: the same architecture in PyTorch (benchmarks/tables/torch_unet3d.py), eager, fp32 (needs
  ``pip install .[bench]``; skipped with a note when torch is missing).

GFLOP/s count 3x the forward multiply-adds x 2 (``UNet3D.train_flops``) for every path.
``--scaling`` times bigmem fp32 from 32^3 up and prints the cost per voxel relative to its
median, at batch 1, and once more the smallest size with a batch that holds as many voxels as
the next size (32^3 x 8 = 64^3), to show how much of the smallest step is per-step work, and
the least that work can cost here: the optimizer update timed alone, plus the convolutions' own
passes over the weights at the bandwidth that update reaches.
Prints a table and writes JSON keyed by machine (never run by pytest). ``--write-table`` replaces
this machine's entry of bigmem/measured/step_rates.json with the bigmem path's rates: per preset
(its base filters) and precision, the median GFLOP/s over ``--volumes`` per core.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

from _results import write_table
from harness import bench_parser, run_function, spread, time_calls, write_results
from rich.console import Console
from rich.table import Table

from bigmem.config import resolve_config
from bigmem.memory.calibration import machine_cpu_model, tensorflow_version
from bigmem.units import format_bytes

MATMUL_EDGE = 4096
# --variant: the environment of every child, per path ("*": every path). A capped oneDNN
# (ONEDNN_MAX_CPU_ISA) emulates a smaller CPU's convolutions on this one; TensorFlow's own Eigen
# kernels keep this CPU's ISA. Plain Keras runs as a user would: with TF's default, which leaves
# oneDNN off on AVX2 and AVX-512 without VNNI/BF16, while bigmem turns it on.
VARIANTS = {
    "native": {},
    "onednn-off": {"*": {"TF_ENABLE_ONEDNN_OPTS": "0"}},
    "avx512": {"*": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "keras": {"TF_ENABLE_ONEDNN_OPTS": "0"}},
    "avx2": {"*": {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "keras": {"TF_ENABLE_ONEDNN_OPTS": "0"}},
}
_variant = "native"


def variant_env(kind: str) -> dict[str, str]:
    """The environment variables --variant sets for a child of ``kind``."""
    table = VARIANTS[_variant]
    return {**table.get("*", {}), **table.get(kind, {})}
# Every path trains with this learning rate: speed does not depend on it, and a preset's own
# (kits19: 1e-2, momentum 0.99) can diverge within a few steps on two phantoms, ending the run.
BENCH_LR = 1e-3


# ---- child processes: one measurement each (run_function), one function per kind -------------------

def _with_runtime(result: dict) -> dict:
    """``result`` with what the child ran with, where it imported TensorFlow: oneDNN on or off, its thread pools."""
    if "tensorflow" in sys.modules:
        from bigmem.sysinfo import tensorflow_description

        runtime = tensorflow_description()
        result["runtime"] = {key: runtime.get(key) for key in ("onednn_enabled", "intra_op_threads",
                                                                "inter_op_threads", "TF_ENABLE_ONEDNN_OPTS")}
        result["runtime"]["ONEDNN_MAX_CPU_ISA"] = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return result


def _sample_case(config, volume: int):
    """One synthetic case at ``volume``^3 (the same phantoms every path trains on), normalised."""
    import h5py
    import numpy as np

    from bigmem.data.synth import cached_synthetic_store

    path = cached_synthetic_store(num_cases=2, volume=volume, num_classes=config.model.num_classes)
    with h5py.File(path, "r") as store:
        case = next(iter(store["cases"].values()))
        image = case["image"][...].astype(np.float32)
        label = case["label"][...].astype(np.int64)
    image = (image - image.mean()) / (image.std() + 1e-6)
    return image[None], label[None]  # (1, D, H, W, C), (1, D, H, W)


def child_ceiling(request: dict) -> dict:
    import tensorflow as tf

    dtype = tf.bfloat16 if request["precision"] == "bf16" else tf.float32
    if request["what"] == "matmul":
        a = tf.cast(tf.random.normal((MATMUL_EDGE, MATMUL_EDGE)), dtype)

        @tf.function
        def matmul():
            return tf.reduce_sum(tf.cast(tf.matmul(a, a), tf.float32))

        times = time_calls(lambda: matmul().numpy(), repeats=request["steps"], warmup=request["warmup"]).times_s
        return _with_runtime({"step_s": times, "flops": 2 * MATMUL_EDGE**3})
    volume, channels = request["volume"], request["channels"]
    x = tf.cast(tf.random.normal((1, volume, volume, volume, channels)), dtype)
    kernel = tf.cast(tf.random.normal((3, 3, 3, channels, channels)) * 0.05, dtype)

    @tf.function
    def conv_forward_backward():
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = tf.nn.conv3d(x, kernel, [1] * 5, "SAME")
            total = tf.reduce_sum(tf.cast(y, tf.float32))
        dx, dkernel = tape.gradient(total, [x, kernel])
        # The result depends on the forward output and on both gradients (nothing is pruned).
        return total + tf.reduce_sum(tf.cast(dx, tf.float32)) + tf.reduce_sum(tf.cast(dkernel, tf.float32))

    times = time_calls(lambda: conv_forward_backward().numpy(), repeats=request["steps"],
                       warmup=request["warmup"]).times_s
    return _with_runtime({"step_s": times, "flops": 3 * 2 * 27 * channels * channels * volume**3})


def child_bigmem(request: dict) -> dict:
    import io

    from bigmem.config.schema import ExperimentConfig
    from bigmem.data.synth import cached_synthetic_store
    from bigmem.numa.apply import place
    from bigmem.rundir import read_jsonl
    from bigmem.tfenv import import_tensorflow

    config = ExperimentConfig.from_dict(request["config"], source="bench request")
    place(config.numa.policy, config.numa.cpus, config.numa.threads)  # before TensorFlow starts its threads
    import_tensorflow()
    from bigmem.train.trainer import train

    volume = config.data.shape[0]
    store = str(cached_synthetic_store(num_cases=2, volume=volume, num_classes=config.model.num_classes))
    total = request["warmup"] + request["steps"]
    config = config.updated({"data": {"store": store}, "train": {
        "steps": total, "epochs": None, "log_every": 1,
        "checkpoint_every": total + 1}})  # one checkpoint, after the last step (not timed)
    with tempfile.TemporaryDirectory(prefix="bigmem-bench-") as run_dir:
        train(config, f"{run_dir}/run", console=Console(file=io.StringIO()))
        rows = read_jsonl(f"{run_dir}/run/metrics.jsonl")
    return _with_runtime({"step_s": [r["step_s"] for r in rows[request["warmup"]:]],
                          "input_wait_s": [r["input_wait_s"] for r in rows[request["warmup"]:]]})


def child_keras(request: dict) -> dict:
    import tensorflow as tf  # noqa: F401  (TF defaults: a plain Keras user sets no threads)
    import keras

    from bigmem.config.schema import ExperimentConfig
    from bigmem.nets.unet3d import UNet3D
    from bigmem.train.losses import dice_ce_loss

    # plain Keras's fit has one softmax output: the baseline is the network without deep supervision or regions
    config = ExperimentConfig.from_dict(request["config"], source="bench request").updated(
        {"model": {"stock_layers": True, "deep_supervision": False, "region_outputs": False}})
    keras.utils.set_random_seed(config.train.seed)
    policy = "mixed_bfloat16" if request["precision"] == "bf16" else "float32"
    model = UNet3D(config.model, dtype=policy).build_for()
    model.compile(optimizer=keras.optimizers.SGD(config.train.lr, momentum=config.train.momentum, nesterov=True),
                  loss=dice_ce_loss)
    image, label = _sample_case(config, config.data.shape[0])
    times = time_calls(lambda: model.train_on_batch(image, label), repeats=request["steps"],
                       warmup=request["warmup"]).times_s
    return _with_runtime({"step_s": times, "param_count": model.count_params()})


def child_torch(request: dict) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from torch_unet3d import TorchUNet3D, dice_ce_loss, parameter_count

    from bigmem.config.schema import ExperimentConfig

    config = ExperimentConfig.from_dict(request["config"], source="bench request")
    torch.manual_seed(config.train.seed)
    model = TorchUNet3D(config.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.train.lr, momentum=config.train.momentum,
                                nesterov=True)
    image, label = _sample_case(config, config.data.shape[0])
    images = torch.from_numpy(image).permute(0, 4, 1, 2, 3).contiguous()
    labels = torch.from_numpy(label)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = dice_ce_loss(model(images), labels)
        loss.backward()
        optimizer.step()
        return loss.item()

    times = time_calls(step, repeats=request["steps"], warmup=request["warmup"]).times_s
    return _with_runtime({"step_s": times, "param_count": parameter_count(model), "torch": torch.__version__,
                          "threads": torch.get_num_threads()})


def child_optimizer(request: dict) -> dict:
    """One optimizer update over every weight of the model, as bigmem's trainer makes it (gradients are constants)."""
    from bigmem.config.schema import ExperimentConfig
    from bigmem.numa.apply import place
    from bigmem.tfenv import import_tensorflow

    config = ExperimentConfig.from_dict(request["config"], source="bench request")
    place(config.numa.policy, config.numa.cpus, config.numa.threads)  # the threads bigmem's training uses
    tf = import_tensorflow()
    from bigmem.nets.unet3d import UNet3D
    from bigmem.train.trainer import make_optimizer

    model = UNet3D(config.model).build_for()
    optimizer = make_optimizer(config, config.train.lr)
    optimizer.build(model.trainable_variables)
    gradients = [tf.fill(v.shape, 1e-3) for v in model.trainable_variables]

    @tf.function
    def update():
        optimizer.apply(gradients, model.trainable_variables)
        return optimizer.iterations.value  # reads back after the update, so the call blocks on it

    times = time_calls(lambda: update().numpy(), repeats=request["steps"], warmup=request["warmup"]).times_s
    return _with_runtime({"step_s": times, "param_count": model.count_params(), "optimizer": type(optimizer).__name__})


CHILDREN = {"ceiling": child_ceiling, "bigmem": child_bigmem, "keras": child_keras, "torch": child_torch,
            "optimizer": child_optimizer}


# ---- parent: plan, run, tabulate ------------------------------------------------------------------

def run_child(request: dict, timeout_s: float = 3600.0) -> dict:
    """``CHILDREN[request["kind"]](request)`` in a fresh process with --variant's environment, and its peak.

    Returns:
        The child's result with ``peak_bytes`` (its peak resident set), or ``{"error": "exit N: why"}``.
    """
    kind = request["kind"]
    run = run_function(CHILDREN[kind], request, what=f"The {kind} measurement", timeout_s=timeout_s,
                       env={**os.environ, **variant_env(kind)})
    if not run.ok:
        return {"error": f"exit {run.returncode}: {run.failure()}"}
    return {**run.result, "peak_bytes": run.peak_rss_bytes}


def summarise(times: list[float]) -> dict:
    stats = spread(times)
    return {**stats.as_dict(), "spread_pct": stats.spread_pct, "n": stats.n}


def torch_available() -> str | None:
    try:
        from importlib import metadata

        return metadata.version("torch")
    except Exception:  # noqa: BLE001  (any failure means: not usable here)
        return None


def train_flops_of(config, volume: int) -> tuple[int, int]:
    """(training FLOPs per batch-1 step, parameter count) of ``config`` at ``volume``^3."""
    from bigmem.nets.unet3d import UNet3D

    model = UNet3D(config.model).build_for()
    return model.train_flops((volume,) * 3), model.count_params()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, warmup=2, warmup_help="untimed warm-up steps before the timed ones")
    parser.add_argument("--presets", default="small,kits19")
    parser.add_argument("--volumes", default="64,96,128")
    parser.add_argument("--paths", default="bigmem,keras,torch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--scaling", default="kits19:32,64,96,128,160,192",
                        help="PRESET:V1,V2,... timed for bigmem fp32 (cost per voxel); '' to skip")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--variant", default="native", choices=sorted(VARIANTS),
                        help="the children's environment: oneDNN off, or oneDNN capped at a smaller ISA")
    parser.add_argument("--write-table", action="store_true",
                        help="replace this machine's entry of bigmem/measured/step_rates.json with the bigmem path's "
                             "median GFLOP/s per core")
    args = parser.parse_args(argv)
    if args.write_table and (args.variant != "native" or "bigmem" not in args.paths.split(",")
                             or set(args.precisions.split(",")) != {"fp32", "bf16"}):
        parser.error("--write-table needs --variant native, the bigmem path and both precisions: the table is what "
                     "bigmem's step reaches on this CPU as it is, in fp32 and bf16 (got --variant "
                     f"{args.variant}, --paths {args.paths}, --precisions {args.precisions})")
    global _variant
    _variant = args.variant
    precisions = tuple(args.precisions.split(","))

    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 180)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    torch_version = torch_available()
    paths = args.paths.split(",")
    if "torch" in paths and torch_version is None:
        console.print("torch is not installed (pip install .[bench]): the PyTorch column is skipped.", markup=False)
        paths.remove("torch")
    volumes = [int(v) for v in args.volumes.split(",")]
    common = {"warmup": args.warmup, "steps": args.steps}
    rows, ceilings = [], {}

    def note(text: str) -> None:
        console.print(text, style="dim")

    for volume in volumes:  # ceilings are per volume (the dominant layer's size), shared by the presets
        for preset in args.presets.split(","):
            channels = resolve_config(preset).model.base_filters
            for precision in precisions:
                key = (preset, volume, precision)
                conv = run_child({"kind": "ceiling", "what": "conv3d", "volume": volume, "channels": channels,
                                  "precision": precision, **common})
                ceilings[key] = {"conv3d": conv}
                if (precision, "matmul") not in ceilings:
                    ceilings[(precision, "matmul")] = run_child({"kind": "ceiling", "what": "matmul",
                                                                 "precision": precision, **common})
                for result in (conv, ceilings[(precision, "matmul")]):
                    if "error" not in result:
                        result["gflops"] = result["flops"] / statistics.median(result["step_s"]) / 1e9
                note(f"ceiling {preset} {volume}^3 {precision}: conv3d {conv.get('gflops', float('nan')):.0f} "
                     f"GFLOP/s, matmul {ceilings[(precision, 'matmul')].get('gflops', float('nan')):.0f} GFLOP/s")

    for preset in args.presets.split(","):
        for volume in volumes:
            flops, params = train_flops_of(resolve_config(preset), volume)
            for path in paths:
                for precision in (("fp32",) if path == "torch" else precisions):
                    config = resolve_config(preset, {"data": {"volume": volume}, "train": {
                        "batch_size": 1, "precision": precision, "lr": BENCH_LR}})
                    request = {"kind": path, "precision": precision, "config": config.to_dict(), **common}
                    result = run_child(request)
                    row = {"preset": preset, "volume": volume, "path": path, "precision": precision,
                           "train_flops": flops, "bigmem_param_count": params}
                    if "error" in result:
                        row["error"] = result["error"]
                        note(f"{preset} {volume}^3 {path} {precision}: FAILED {result['error']}")
                        rows.append(row)
                        continue
                    stats = summarise(result.pop("step_s"))
                    row.update(stats, **result)
                    row["voxels_per_s"] = volume**3 / stats["median_s"]
                    row["gflops"] = flops / stats["median_s"] / 1e9
                    row["peak_bytes_per_voxel"] = result["peak_bytes"] / volume**3
                    conv = ceilings[(preset, volume, precision)]["conv3d"].get("gflops")
                    matmul = ceilings[(precision, "matmul")].get("gflops")
                    row["pct_conv3d_ceiling"] = 100 * row["gflops"] / conv if conv else None
                    row["pct_matmul_ceiling"] = 100 * row["gflops"] / matmul if matmul else None
                    rows.append(row)
                    note(f"{preset} {volume}^3 {path} {precision}: {stats['median_s']:.3f} s/step, "
                         f"{row['gflops']:.0f} GFLOP/s, peak {format_bytes(result['peak_bytes'])}"
                         + (f", {result['param_count']:,} parameters (bigmem {params:,})" if "param_count" in result
                            else ""))
    _speedups(rows)
    scaling = _scaling(args, rows, common, note) if args.scaling else None
    _print(console, rows, ceilings, scaling)
    report = {"machine": {"host": socket.gethostname(), "cpu": machine_cpu_model(), "cpus": os.cpu_count(),
                          "tensorflow": tensorflow_version(), "torch": torch_version, "isa_class": _isa_class(),
                          "variant": args.variant, "variant_env": {k: variant_env(k) for k in paths}},
              "warmup": args.warmup, "steps": args.steps,
              "ceilings": [{"preset": k[0], "volume": k[1], "precision": k[2],
                            "conv3d_gflops": v["conv3d"].get("gflops")} for k, v in ceilings.items() if len(k) == 3]
              + [{"what": "matmul", "precision": k[0], "gflops": v.get("gflops")}
                 for k, v in ceilings.items() if len(k) == 2],
              "rows": rows, "scaling": scaling}
    path = write_results("train", report, args.out, console)
    if args.write_table:
        from bigmem.speed import usable_cores

        cores, rates = usable_cores(), []
        for precision in precisions:
            for preset in args.presets.split(","):
                gflops = [r["gflops"] for r in rows if (r["path"], r["precision"], r["preset"]) == (
                    "bigmem", precision, preset) and "error" not in r]
                if gflops:
                    rates.append({"precision": precision, "base_filters": resolve_config(preset).model.base_filters,
                                  "gflops_per_core": round(statistics.median(gflops) / cores, 1)})
        write_table("step_rates", {"rates": rates}, results=path, console=console,
                    summary=f"{_isa_class()}: measured (bench_train, {machine_cpu_model()}, TF {tensorflow_version()})",
                    notes=[f"bigmem's own training step, batch 1, median of {args.steps} after {args.warmup} warm-up "
                           f"steps on {cores} cores; each rate is the median over {args.volumes.replace(',', ', ')}^3, "
                           "per core."])
    return 0


def _isa_class() -> str:
    from bigmem.sysinfo import cpu_description, isa_class

    return isa_class(cpu_description()["isa"])


def _speedups(rows: list[dict]) -> None:
    """bigmem's speed over plain Keras at the same precision, and over PyTorch (fp32), per volume."""
    by_key = {(r["preset"], r["volume"], r["path"], r["precision"]): r for r in rows if "error" not in r}
    for row in rows:
        if row["path"] != "bigmem" or "error" in row:
            continue
        key = (row["preset"], row["volume"])
        keras_row = by_key.get((*key, "keras", row["precision"]))
        torch_row = by_key.get((*key, "torch", "fp32")) if row["precision"] == "fp32" else None
        row["speedup_vs_keras"] = keras_row["median_s"] / row["median_s"] if keras_row else None
        row["speedup_vs_torch"] = torch_row["median_s"] / row["median_s"] if torch_row else None
        row["memory_vs_keras"] = row["peak_bytes"] / keras_row["peak_bytes"] if keras_row else None


def _scaling(args, rows, common, note) -> dict:
    preset, volumes = args.scaling.split(":")
    divisor = resolve_config(preset).model.divisor
    points = []
    for volume in (int(v) for v in volumes.split(",")):
        if volume % divisor:
            note(f"scaling {preset} {volume}^3: skipped (not a multiple of {divisor})")
            continue
        done = [r for r in rows if (r["preset"], r["volume"], r["path"], r["precision"])
                == (preset, volume, "bigmem", "fp32") and "error" not in r]
        median_s = done[0]["median_s"] if done else _bigmem_fp32_median(preset, volume, 1, common, note)
        if median_s is None:
            continue
        points.append({"volume": volume, "median_s": median_s, "s_per_mvoxel": median_s / volume**3 * 1e6})
        note(f"scaling {preset} {volume}^3: {median_s:.3f} s/step, {points[-1]['s_per_mvoxel']:.3f} s per Mvoxel")
    reference = statistics.median(p["s_per_mvoxel"] for p in points) if points else None
    for point in points:
        point["relative_to_median"] = point["s_per_mvoxel"] / reference
    worst = max((abs(p["relative_to_median"] - 1) for p in points), default=None)
    batched = _batched_point(preset, points, reference, common, note) if len(points) >= 2 else None
    floor = _weight_traffic_floor(preset, points, reference, common, note) if points else None
    return {"preset": preset, "points": points, "worst_deviation_pct": None if worst is None else 100 * worst,
            "batched": batched, "weight_traffic_floor": floor}


def _bigmem_fp32_median(preset: str, volume: int, batch: int, common: dict, note) -> float | None:
    """bigmem's median fp32 step time for ``preset`` at ``volume``^3 and ``batch`` (None if the child failed)."""
    config = resolve_config(preset, {"data": {"volume": volume}, "train": {"batch_size": batch, "lr": BENCH_LR}})
    result = run_child({"kind": "bigmem", "precision": "fp32", "config": config.to_dict(), **common})
    if "error" in result:
        note(f"scaling {preset} {volume}^3 x batch {batch}: FAILED {result['error']}")
        return None
    return statistics.median(result["step_s"])


def _batched_point(preset: str, points: list[dict], reference: float, common: dict, note) -> dict | None:
    """The smallest volume again, with a batch that holds as many voxels as the next size's step.

    Part of a step's cost does not grow with the volume (the optimizer's pass over every weight,
    oneDNN's reorders of every kernel), so batch 1 at the smallest size pays it for few voxels;
    this point shows the per-voxel cost once a step holds as many voxels as the next size. It is
    printed beside the batch-1 series, never in its place (worst_deviation_pct is batch 1 only).
    """
    smallest, following = points[0]["volume"], points[1]["volume"]
    batch = round((following / smallest) ** 3)
    if batch < 2 or batch * smallest**3 != following**3:
        return None
    median_s = _bigmem_fp32_median(preset, smallest, batch, common, note)
    if median_s is None:
        return None
    s_per_mvoxel = median_s / (batch * smallest**3) * 1e6
    note(f"scaling {preset} {smallest}^3 x batch {batch}: {median_s:.3f} s/step, {s_per_mvoxel:.3f} s per Mvoxel")
    return {"volume": smallest, "batch_size": batch, "median_s": median_s, "s_per_mvoxel": s_per_mvoxel,
            "relative_to_median": s_per_mvoxel / reference}


# Full passes over a weight-sized fp32 array that one optimizer update makes: read weight, gradient and
# each slot, write weight and each slot (SGD with momentum: 1 slot; Adam: 2).
OPTIMIZER_PASSES = {"FusedSGD": 5, "FusedAdam": 7}
# And the passes the convolutions cannot avoid: the forward reads every kernel, the input gradient reads
# it again, the kernel gradient writes one weight-sized array.
CONVOLUTION_PASSES = 3


def _weight_traffic_floor(preset: str, points: list[dict], reference: float, common: dict, note) -> dict | None:
    """The per-step time that moving every weight costs at this machine's bandwidth, whatever the volume.

    The optimizer update is timed alone over the model's real weights (its passes over memory are
    known, so it gives the bandwidth); the convolutions' three unavoidable passes are added at that
    bandwidth. Unless hidden behind compute, the smallest batch-1 step pays at least this on top of
    its voxels' cost; ``pct_of_smallest`` is it as a share of that step at the median cost per voxel.
    """
    config = resolve_config(preset, {"train": {"lr": BENCH_LR}})
    result = run_child({"kind": "optimizer", "config": config.to_dict(), **common})
    if "error" in result or result["optimizer"] not in OPTIMIZER_PASSES:
        note(f"weight traffic {preset}: FAILED {result.get('error', result.get('optimizer'))}")
        return None
    update_s = statistics.median(result["step_s"])
    passes = OPTIMIZER_PASSES[result["optimizer"]]
    weight_bytes = 4 * result["param_count"]
    bandwidth = passes * weight_bytes / update_s
    floor_s = update_s + CONVOLUTION_PASSES * weight_bytes / bandwidth
    smallest = points[0]["volume"]
    pct = 100 * floor_s / (reference * smallest**3 / 1e6)
    note(f"weight traffic {preset}: {result['optimizer']} update {update_s * 1e3:.1f} ms "
         f"({bandwidth / 1e9:.0f} GB/s), floor {floor_s * 1e3:.1f} ms per step")
    return {"optimizer": result["optimizer"], "param_count": result["param_count"], "update_s": update_s,
            "passes": passes + CONVOLUTION_PASSES, "bandwidth_bytes_per_s": bandwidth, "floor_s": floor_s,
            "smallest_volume": smallest, "pct_of_smallest": pct}


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _print(console, rows, ceilings, scaling) -> None:
    table = Table(title="Training step, batch 1 whole volume: median of the timed steps (spread = (max-min)/median)")
    for column in ("preset", "volume", "path", "prec", "s/step", "spread", "Mvox/s", "GFLOP/s", "% conv3d",
                   "% matmul", "peak", "B/voxel", "vs keras", "vs torch"):
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["preset"], f"{r['volume']}^3", r["path"], r["precision"], "failed", *[""] * 9)
            continue
        table.add_row(r["preset"], f"{r['volume']}^3", r["path"], r["precision"], f"{r['median_s']:.3f}",
                      f"{r['spread_pct']:.0f}%", f"{r['voxels_per_s'] / 1e6:.2f}", f"{r['gflops']:.0f}",
                      _fmt(r["pct_conv3d_ceiling"], ".0f"), _fmt(r["pct_matmul_ceiling"], ".0f"),
                      format_bytes(r["peak_bytes"]), f"{r['peak_bytes_per_voxel']:.0f}",
                      _fmt(r.get("speedup_vs_keras"), ".2f"), _fmt(r.get("speedup_vs_torch"), ".2f"))
    console.print(table)
    ceiling_table = Table(title="Ceilings measured in this run (GFLOP/s)")
    for column in ("what", "preset", "volume", "precision", "GFLOP/s"):
        ceiling_table.add_column(column, justify="right")
    for key, value in ceilings.items():
        if len(key) == 3:
            ceiling_table.add_row("conv3d fwd+bwd", key[0], f"{key[1]}^3", key[2],
                                  _fmt(value["conv3d"].get("gflops"), ".0f", "failed"))
        else:
            ceiling_table.add_row(f"matmul {MATMUL_EDGE}^2", "", "", key[0], _fmt(value.get("gflops"), ".0f", "failed"))
    console.print(ceiling_table)
    if scaling and scaling["points"]:
        scale_table = Table(title=f"Scaling: bigmem fp32 {scaling['preset']}, cost per voxel")
        for column in ("volume", "s/step", "s per Mvoxel", "vs median"):
            scale_table.add_column(column, justify="right")
        for p in scaling["points"]:
            scale_table.add_row(f"{p['volume']}^3", f"{p['median_s']:.3f}", f"{p['s_per_mvoxel']:.3f}",
                                f"{100 * (p['relative_to_median'] - 1):+.1f}%")
        batched = scaling.get("batched")
        if batched:
            scale_table.add_row(f"{batched['volume']}^3 x batch {batched['batch_size']}", f"{batched['median_s']:.3f}",
                                f"{batched['s_per_mvoxel']:.3f}", f"{100 * (batched['relative_to_median'] - 1):+.1f}%")
        console.print(scale_table)
        console.print(f"worst deviation from the median cost per voxel (batch 1): "
                      f"{scaling['worst_deviation_pct']:.1f}%")
        floor = scaling.get("weight_traffic_floor")
        if floor:
            console.print(
                f"weight traffic per step, whatever the volume: {floor['passes']} passes over "
                f"{format_bytes(4 * floor['param_count'])} of fp32 weights at an effective "
                f"{floor['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s ({floor['optimizer']} update timed alone: "
                f"{floor['update_s'] * 1e3:.1f} ms) = {floor['floor_s'] * 1e3:.1f} ms, "
                f"+{floor['pct_of_smallest']:.0f}% on a {floor['smallest_volume']}^3 batch-1 step at the median "
                f"cost per voxel, unless hidden behind compute")


if __name__ == "__main__":
    sys.exit(main())
