"""The tuning pass (``bigmem tune``): the network's kernel choices timed at its own shapes, on this machine.

The shipped kernel choices (nets/choices.py) were timed on a few CPUs at a grid of cubes; this
pass times, for one network, shape, batch and precision, every distinct convolution the training
step runs (recorded by tracing the model, ``nets.conv.observe_convolutions``):

- the forward pass and the input gradient (TensorFlow's only kernels: they enter the ceiling);
- the weight gradient of each 3x3x3 convolution with stride 1 or 2 both ways: oneDNN's 3-D
  kernel and the planewise one (three batched 2-D gradients, nets/conv.py), where the layer
  could take either;
- the other weight gradients (1x1x1 heads, transposed convolutions) TF's way.

From the weight-gradient timings it decides, per (precision, stride, input channels) timed,
whether the planewise gradient won (``planewise_from``; counts not timed keep the shipped
range), and from all of them the whole-network ceiling: the sum over the convolutions of the fastest
time TF has for each. It also measures the framework's fixed memory in training steps at the
smallest shape of the network (``memory.measure``, the lowest of ``FIXED_MEMORY_DRAWS`` children), so
that the footprint estimate does not borrow that term from another CPU. Everything goes into this
machine's tuning file (nets/tuning.py), which the layers and the planner read before the shipped tables.

Bounded: convolutions are timed from the most expensive down until ``budget_s`` is spent (1
untimed call, then the fastest of ``repeats``); those left keep the shipped choice, and the file
says the pass was partial. A convolution larger than ``MAX_TIMED_ELEMENTS`` is timed on a depth
slab of that size (and a crop of its planes where one plane is larger) and its time scaled by the
voxels, and the network is traced at its smallest shape: the pass costs the same at any volume.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from bigmem.config.options import Precision
from bigmem.config.schema import ExperimentConfig
from bigmem.nets.tuning import Tuning, key_here, load_tuning, overhead_key, save_tuning
from bigmem.units import as_shape

DEFAULT_BUDGET_S = 60.0
REPEATS = 2
DECISIVE_MARGIN = 0.05  # a tuned choice needs a win this large; closer, the shipped choice stays
MIN_TIMING_S = 10.0  # the timings' share of the budget, however long the memory step took
# A timed tensor holds at most this many elements (16 Mi: 64 MiB in fp32); a larger convolution is
# timed on a depth slab and scaled by its depth, so the pass costs about one training step at any
# size. Times are linear in depth once a slab has tens of planes (kits19 96^3 x 2: 28 of 96 planes).
MAX_TIMED_ELEMENTS = 2**24
MIN_TIMED_PLANES = 16  # a slab thinner than this times slower per voxel (see timed_shape)


@dataclass(frozen=True)
class TimedConv:
    """One distinct convolution of the step and its timings (seconds for the whole input, all slabs)."""

    kind: str
    input_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: int | tuple[int, int, int]  # per axis (D, H, W) where they differ
    precision: str
    count: int  # how many of the network's convolutions have this shape
    forward_s: float
    input_grad_s: float
    weight_grad_3d_s: float
    weight_grad_planewise_s: float | None  # None: the layer cannot take the planewise gradient
    depth_scale: float = 1.0  # timed on 1/depth_scale of the input voxels (a slab; its planes cropped past the bound)

    @property
    def flops(self) -> float:
        """Forward + both gradients: 3 x the forward's multiply-adds x 2, as ``UNet3D.train_flops`` counts."""
        k = self.kernel
        voxels = self.input_shape[0] * self.input_shape[1] * self.input_shape[2] * self.input_shape[3]
        if self.kind == "conv":
            macs = voxels // math.prod(_strides(self)) * k[0] * k[1] * k[2] * k[3] * k[4]
        else:  # a transposed conv: every input voxel writes k^3 outputs
            macs = voxels * k[0] * k[1] * k[2] * k[3] * k[4]
        return 6.0 * macs * self.count

    @property
    def fastest_s(self) -> float:
        """The fastest forward + input gradient + weight gradient TF has here, for all ``count`` of them."""
        weight = min(t for t in (self.weight_grad_3d_s, self.weight_grad_planewise_s) if t is not None)
        return (self.forward_s + self.input_grad_s + weight) * self.count

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["input_shape"], data["kernel"] = list(self.input_shape), list(self.kernel)
        data["flops"], data["fastest_s"] = self.flops, self.fastest_s
        return data


def network_convolutions(config: ExperimentConfig, shape: Sequence[int]) -> list[tuple[object, int]]:
    """The distinct convolutions one training step of ``config`` runs at ``shape``, with how many of each.

    The network is traced at ``traced_shape``, the smallest shape with its size contract, never at
    ``shape``: every stage's feature map is the input's shape divided by that stage's strides, so the
    calls at ``shape`` are the traced ones with each axis scaled by ``shape / traced_shape``. A trace at
    the run's own shape grows with the volume (1280^3 through the depth-slab path took over ten minutes
    on a 2-core Xeon); this one costs the same at any size.

    Args:
        config: the run (model, batch size, precision).
        shape: ``(D, H, W)`` of one training volume; an axis that is not a multiple of the network's
            size contract is taken at the next multiple (the padded shape it trains at).

    Returns:
        ``[(ConvCall, count), ...]`` at ``shape``, most expensive first (input elements x kernel size).
        A call's ``path`` is the one the layer takes at the traced shape.

    Example:
        >>> [call.input_shape for call, _ in network_convolutions(resolve_config("tiny"), (64, 64, 64))][0]
        (1, 64, 64, 64, 1)
    """
    padded = tuple(-(-int(s) // d) * d for s, d in zip(as_shape(shape), config.model.divisors))
    traced = traced_shape(config)
    factors = tuple(p // t for p, t in zip(padded, traced))
    calls = convolutions_at(config, traced)
    counts = Counter(_scaled(dataclasses.replace(call, path=""), factors) for call in calls)
    paths = {_scaled(dataclasses.replace(call, path=""), factors): call.path for call in calls}
    ordered = sorted(counts, key=lambda c: -_elements(c.input_shape) * _kernel_volume(c.kernel) * c.kernel[-1])
    return [(dataclasses.replace(call, path=paths[call]), counts[call]) for call in ordered]


def traced_shape(config: ExperimentConfig) -> tuple[int, int, int]:
    """The shape ``network_convolutions`` traces at: the network's size contract per axis (``model.divisors``),
    where its deepest stage is one voxel."""
    return tuple(int(d) for d in config.model.divisors)


def convolutions_at(config: ExperimentConfig, shape: Sequence[int]) -> list:
    """Every convolution call of one training forward pass of ``config`` at exactly ``shape`` (traced, no compute).

    Returns:
        The ``nets.conv.ConvCall`` list, in call order, one per call.
    """
    import keras
    import tensorflow as tf

    from bigmem.nets.conv import observe_convolutions
    from bigmem.nets.unet3d import UNet3D

    policy = "mixed_bfloat16" if config.train.precision is Precision.BF16 else "float32"
    # Built first: building calls each layer symbolically (several times, nested), which is not a step.
    model = UNet3D(config.model, dtype=policy, name="unet3d").build_for()
    spec = tf.TensorSpec((config.train.batch_size, *as_shape(shape), config.model.in_channels), tf.float32)
    with observe_convolutions() as calls:
        tf.function(lambda x: model(x, training=True)).get_concrete_function(spec)
    keras.backend.clear_session()
    return list(calls)


def _scaled(call, factors: Sequence[int]):
    """``call`` with its input's spatial axes multiplied by ``factors`` ``(D, H, W)``."""
    batch, *spatial, channels = call.input_shape
    return dataclasses.replace(call, input_shape=(batch, *(s * f for s, f in zip(spatial, factors)), channels))


def _elements(shape: Sequence[int]) -> int:
    out = 1
    for size in shape:
        out *= int(size)
    return out


def _kernel_volume(kernel: Sequence[int]) -> int:
    return kernel[0] * kernel[1] * kernel[2]


def _strides(call) -> tuple[int, int, int]:
    """The call's stride per axis ``(D, H, W)``."""
    return (call.stride,) * 3 if isinstance(call.stride, int) else tuple(call.stride)


def _planewise_eligible(call) -> bool:
    """Whether the layer could take the planewise weight gradient (``Conv3D._planewise``'s shape rules)."""
    if call.kind != "conv" or call.kernel[:3] != (3, 3, 3) or not isinstance(call.stride, int) or call.stride > 2:
        return False
    spatial = call.input_shape[1:4]
    return spatial[0] >= 2 if call.stride == 1 else all(s % 2 == 0 and s >= 4 for s in spatial)


def timed_shape(call, max_elements: int = MAX_TIMED_ELEMENTS) -> tuple[int, int, int]:
    """The ``(D, H, W)`` of the input timed: the whole input, else a depth slab of whole planes (at least
    ``MIN_TIMED_PLANES``, a multiple of 2 x the stride) whose tensors hold at most ``max_elements``; where that many
    planes are larger still (a 1280^2 plane of 32 channels is 52 M elements), a crop of them, each side a multiple
    of 2 x its stride. The timing is scaled by the voxels left out: linear once a slab has tens of planes
    (a 2-plane slab of 362^2 timed the weight gradient 16x slower per voxel than the whole 16 x 384^2 input).
    """
    depth, height, width = (int(v) for v in call.input_shape[1:4])
    out_channels = call.kernel[-1] if call.kind == "conv" else call.kernel[3]
    channels = max(int(call.input_shape[-1]), int(out_channels)) * int(call.input_shape[0])
    per_plane = height * width * channels
    if per_plane * depth <= max_elements:
        return depth, height, width
    steps = [2 * s for s in _strides(call)]
    fewest = min(depth, -(-MIN_TIMED_PLANES // steps[0]) * steps[0])
    if per_plane * fewest <= max_elements:
        return max(fewest, max_elements // per_plane // steps[0] * steps[0]), height, width
    area = max(1, max_elements // (fewest * channels))  # voxels a plane may keep
    shrink = (area / (height * width)) ** 0.5
    crop = [max(step, min(size, int(size * shrink) // step * step)) for size, step in zip((height, width), steps[1:])]
    return fewest, crop[0], crop[1]


def time_convolution(call, count: int, repeats: int = REPEATS, max_elements: int = MAX_TIMED_ELEMENTS) -> TimedConv:
    """Time one convolution's kernels (1 untimed call, then the fastest of ``repeats``) on ``timed_shape``: at
    most ``max_elements`` per tensor, scaled to the whole input by its voxels."""
    import tensorflow as tf

    from bigmem.nets.conv import planewise_weight_grad

    dtype = tf.bfloat16 if call.precision == "bf16" else tf.float32
    timed = timed_shape(call, max_elements)
    scale = math.prod(call.input_shape[1:4]) / math.prod(timed)
    shape = (call.input_shape[0], *timed, call.input_shape[-1])
    s, k = call.stride, call.kernel
    strides = [1, *_strides(call), 1]
    x = tf.cast(tf.random.normal(shape), dtype)
    kernel = tf.cast(tf.random.normal(k) * 0.05, dtype)
    if call.kind == "conv":
        forward = tf.function(lambda: tf.nn.conv3d(x, kernel, strides, "SAME"))
        dy = tf.cast(tf.random.normal(forward().shape), dtype)
        input_grad = tf.function(lambda: tf.raw_ops.Conv3DBackpropInputV2(
            input_sizes=tf.constant(shape, tf.int32), filter=kernel, out_backprop=dy, strides=strides, padding="SAME"))
        weight_3d = tf.function(lambda: tf.raw_ops.Conv3DBackpropFilterV2(
            input=x, filter_sizes=tf.constant(k, tf.int32), out_backprop=dy, strides=strides, padding="SAME"))
        planes = tf.function(lambda: planewise_weight_grad(x, dy, k, s)) if _planewise_eligible(call) else None
    else:  # transposed: forward is the conv's input gradient, input gradient a conv, weight gradient with roles swapped
        out_shape = [shape[0], *(f * size for f, size in zip(_strides(call), shape[1:4])), k[3]]
        forward = tf.function(lambda: tf.raw_ops.Conv3DBackpropInputV2(
            input_sizes=tf.constant(out_shape, tf.int32), filter=kernel, out_backprop=x, strides=strides,
            padding="SAME"))
        dy = tf.cast(tf.random.normal(out_shape), dtype)
        input_grad = tf.function(lambda: tf.nn.conv3d(dy, kernel, strides, "SAME"))
        weight_3d = tf.function(lambda: tf.raw_ops.Conv3DBackpropFilterV2(
            input=dy, filter_sizes=tf.constant(k, tf.int32), out_backprop=x, strides=strides, padding="SAME"))
        planes = None

    def fastest(fn: Callable) -> float:
        fn().numpy()
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            fn().numpy()
            best = min(best, time.perf_counter() - started)
        return best * scale

    return TimedConv(call.kind, call.input_shape, call.kernel, call.stride, call.precision, count,
                     fastest(forward), fastest(input_grad), fastest(weight_3d),
                     fastest(planes) if planes is not None else None, round(scale, 4))


def planewise_from(rows: Sequence[dict]) -> dict[str, bool]:
    """Per ``"precision/stride/input channels"`` timed: whether the planewise weight gradient won.

    Its time and oneDNN's are summed over every shape timed with that count (each weighted by how
    many of the network's convolutions have it), so a count timed in several passes is decided
    by all of them. A count is decided only where one kernel was at least ``DECISIVE_MARGIN``
    faster; closer than that it keeps the shipped choice (kits19 at 64^3 on an AVX2 EPYC: a
    planewise gradient chosen on close timings at 64 and 128 channels made the step 42% slower,
    4.56 s against 3.22; benchmarks/results/ceiling.md).
    """
    seconds: dict[str, list[float]] = {}
    for row in rows:
        if row.get("weight_grad_planewise_s") is None:
            continue
        name = f"{row['precision']}/{row['stride']}/{row['input_shape'][-1]}"
        total = seconds.setdefault(name, [0.0, 0.0])
        total[0] += row["weight_grad_planewise_s"] * row["count"]
        total[1] += row["weight_grad_3d_s"] * row["count"]
    decided = {}
    for name, (planes, three_d) in seconds.items():
        if planes <= three_d * (1 - DECISIVE_MARGIN):
            decided[name] = True
        elif three_d <= planes * (1 - DECISIVE_MARGIN):
            decided[name] = False
    return decided


def _merged(config: ExperimentConfig, rows: list["TimedConv"], offsets: dict, record: dict) -> "Tuning":
    """This pass's timings, rate, fixed-memory offsets and record, merged into the machine's file as it was (its
    figures for another key are dropped: another CPU, TensorFlow or thread count)."""
    from bigmem.speed import usable_cores

    flops, fastest = sum(r.flops for r in rows), sum(r.fastest_s for r in rows)
    previous = load_tuning()
    key = dataclasses.asdict(key_here())
    same = previous is not None and previous.key == key
    rate = ({rate_key(config.train.precision.value, config.model.base_filters):
             round(flops / fastest / 1e9 / usable_cores(), 2)} if fastest else {})
    return Tuning(key=key, planewise=planewise_from([*(previous.rows if same else []), *(r.to_dict() for r in rows)]),
                  conv_gflops_per_core={**(previous.conv_gflops_per_core if same else {}), **rate},
                  overhead_offset_bytes={**(previous.overhead_offset_bytes if same else {}), **offsets},
                  tuned=[*(previous.tuned if same else []), record],
                  rows=[*(previous.rows if same else []), *(r.to_dict() for r in rows)])


def tune(config: ExperimentConfig, shape: Sequence[int], *, budget_s: float = DEFAULT_BUDGET_S,
         measure_memory: bool = True, progress: Callable[[str, float], None] | None = None) -> Tuning:
    """Time ``config``'s convolutions at ``shape`` and its precision; merge the result into this machine's file.

    Args:
        config: the run (model, batch size, precision, recompute mode).
        shape: ``(D, H, W)`` of one training volume.
        budget_s: the most seconds the pass may take. The memory step (``FIXED_MEMORY_DRAWS`` child
            processes of a few training steps at the smallest shape, 5-20 s each) runs first; the
            timings get the rest, at least ``MIN_TIMING_S``.
        measure_memory: also measure the framework's fixed memory at the network's smallest shape.
        progress: called with (what, fraction done) as the pass goes.

    Returns:
        The machine's ``Tuning`` after this pass (also written to its file).

    Example:
        >>> tune(resolve_config("kits19"), (96, 96, 96)).planewise
    """
    import logging

    from bigmem.tfenv import import_tensorflow

    say = progress or (lambda what, done: None)
    started = time.perf_counter()
    offsets = {}
    if measure_memory:
        say(f"the framework's fixed memory ({FIXED_MEMORY_DRAWS} runs at the smallest shape)", 0.0)
        offsets = fixed_memory(config)
    tf = import_tensorflow()
    timing_started = time.perf_counter()
    timing_budget = max(min(MIN_TIMING_S, budget_s), budget_s - (timing_started - started))
    calls = network_convolutions(config, shape)
    rows: list[TimedConv] = []
    partial = False
    quiet = tf.get_logger().level
    tf.get_logger().setLevel(logging.ERROR)  # each kernel is its own tf.function: TF warns of "retracing"
    try:
        for index, (call, count) in enumerate(calls):
            if time.perf_counter() - timing_started > timing_budget:
                partial = True
                break
            say(f"{call.kind} {'x'.join(map(str, call.input_shape[1:4]))} x {call.input_shape[-1]} -> "
                f"{call.kernel[-1] if call.kind == 'conv' else call.kernel[3]}", 0.1 + 0.9 * index / len(calls))
            rows.append(time_convolution(call, count))
    finally:
        tf.get_logger().setLevel(quiet)
    record = {"model": config.model.name, "shape": list(as_shape(shape)), "precision": config.train.precision.value,
              "batch_size": config.train.batch_size, "seconds": round(time.perf_counter() - started, 1),
              "partial": partial, "date": time.strftime("%Y-%m-%d"), "convolutions": len(calls), "timed": len(rows)}
    tuning = _merged(config, rows, offsets, record)
    say("done", 1.0)
    save_tuning(tuning)
    return tuning


def default_precisions() -> list[str]:
    """The precisions ``bigmem tune`` times when none is named: fp32, and bf16 too where the CPU has it natively
    (``cpu.native_bf16``; elsewhere bf16 is emulated and never chosen).

    Returns:
        ``["fp32"]`` or ``["fp32", "bf16"]``.

    Example:
        >>> default_precisions()  # on a CPU with AMX or AVX512_BF16
        ['fp32', 'bf16']
    """
    from bigmem.sysinfo import native_bf16

    return ["fp32"] + (["bf16"] if native_bf16() else [])


def tuning_bar(console):
    """The transient progress bar a tuning pass shows on ``console`` (rich): "tuning", the bar, the time, what it
    times; each pass adds its task (total 1.0) and updates it from ``tune``'s progress."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("tuning"), BarColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
                    console=console, transient=True)


def run_with_progress(config: ExperimentConfig, shape: Sequence[int], console, *,
                      budget_s: float = DEFAULT_BUDGET_S, measure_memory: bool = True) -> Tuning:
    """``tune`` with a progress bar on ``console`` (rich)."""
    with tuning_bar(console) as bar:
        task = bar.add_task("", total=1.0)
        return tune(config, shape, budget_s=budget_s, measure_memory=measure_memory,
                    progress=lambda what, done: bar.update(task, completed=done, description=what))


# How many child processes ``fixed_memory`` measures (5-20 s each at the smallest shape). On a Zen 4
# EPYC (TF 2.21, oneDNN on) kits19's term drew 207, 117 and 206 MiB in three identical runs, small's
# 85-87 and intelai-brats' 61-69: one draw can carry 90 MiB of pool placement into every plan.
FIXED_MEMORY_DRAWS = 3


def fixed_memory(config: ExperimentConfig) -> dict[str, int]:
    """How far this machine's overhead is from the shipped table's, measured at the network's smallest shape.

    At that shape the counted activations are a few MiB, so the difference between the measured
    peak and the shipped table's prediction (without its safety margin) is the framework's fixed
    term here against the CPU the table was measured on: the TensorFlow runtime, oneDNN's
    primitives and scratch, the allocator's arenas. ``calibration_for`` adds it to the table.

    The term is the lowest of ``FIXED_MEMORY_DRAWS`` measurements: what the framework always holds.
    A higher draw is where the allocator's pool happened to place the first steps' tensors, which
    the estimate's ``allocator_growth`` covers already; counted here too, it would be paid twice.

    Returns:
        ``{fixed_memory_key(config): bytes}`` (negative where this machine needs less).
    """
    import dataclasses as dc

    from bigmem.memory.calibration import DEFAULTS_BATCH_SIZE, machine_isa_class, recompute_key, shipped_calibration
    from bigmem.memory.estimate import estimate, mode_stages
    from bigmem.memory.measure import measure
    from bigmem.memory.profile import counts_function

    config = config.updated({"train": {"batch_size": DEFAULTS_BATCH_SIZE}})  # the batch the tables were measured at
    shape = config.model.divisors  # the network's smallest shape
    counts = counts_function(config)(shape)
    stages = mode_stages(config.memory.recompute, counts)
    mode = recompute_key(stages)
    table = shipped_calibration(config.model.name, config.train.precision.value, mode, isa=machine_isa_class())
    table = dc.replace(table, margin_fraction=0.0, margin_bytes=0)
    predicted = estimate(config, counts, shape, recompute_stages=stages, calibration=table).first_steps_bytes
    measured = min(measure(config, shape, recompute_stages=stages, force=True).peak_bytes
                   for _ in range(FIXED_MEMORY_DRAWS))
    return {fixed_memory_key(config): int(measured - predicted)}


def fixed_memory_key(config: ExperimentConfig) -> str:
    """The key ``fixed_memory`` keeps ``config``'s term under: its preset, precision, recompute mode and the
    digest of the shipped table it is measured against (``nets.tuning.overhead_key``). Nothing is built."""
    from bigmem.config.options import Recompute
    from bigmem.memory.calibration import machine_isa_class, shipped_calibration

    mode = "stages" if config.memory.recompute is Recompute.STAGES else "none"  # recompute_key(mode_stages(...))
    precision = config.train.precision.value
    table = shipped_calibration(config.model.name, precision, mode, isa=machine_isa_class())
    return overhead_key(config.model.name, precision, mode, table.table_digest())


def measure_fixed_memory(config: ExperimentConfig) -> Tuning | None:
    """``fixed_memory`` of ``config``, merged into this machine's tuning file (None where there is none)."""
    tuning = load_tuning()
    if tuning is None or tuning.key != dataclasses.asdict(key_here()):
        return None
    tuning = dataclasses.replace(tuning, overhead_offset_bytes={**tuning.overhead_offset_bytes,
                                                                **fixed_memory(config)})
    save_tuning(tuning)
    return tuning


def rate_key(precision: str, base_filters: int) -> str:
    """``Tuning.conv_gflops_per_core``'s key: ``"fp32/32"`` (precision / the network's base filters)."""
    return f"{precision}/{base_filters}"


