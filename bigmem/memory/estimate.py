"""Predicted peak resident memory, per component, before anything is allocated: one model, two passes.

``estimate(config, counts, shape, pass_=Pass.TRAIN)`` is a training step: every block's feature
maps kept for backward, weights, gradients, optimizer slots, the input pipeline. ``Pass.FORWARD``
is segmenting one whole volume (``bigmem predict``): no gradients and no optimizer, and a forward
pass frees each tensor after its last use, so its footprint is the largest set of tensors alive at
once, not their sum. Either way the model follows nnU-Net's planner: each block counts its own
feature-map elements (``UNet3D.block_feature_map_elements``, ``inference_live_elements`` in
nets/blocks.py) and the estimate sums blocks. What the framework keeps beyond those tensors
(gradient buffers in flight, allocator slack) depends on the machine and the TensorFlow version,
so it is a *calibrated* multiplier and fixed overhead (calibration.py, one lookup for both
passes), never a guess.

What TensorFlow adds in a forward pass is calibrated the same way. Its CPU allocator (with oneDNN
on, a caching best-fit allocator) keeps the buffers it has held and reuses freed ones: the
resident set never shrank during a pass (kits19, fp32, 128^3-256^3, RSS read after every stage),
and the buffers left free at a stage are not always where the next stage's tensors fit (at 256^3
the last decoder stage grew the resident set by one full-resolution tensor more than its new
tensors needed), so the peak is the live set plus fragmentation, which varies with the size.
Predict's host arrays around the forward pass (the case's image, its normalised or padded copy,
the probabilities copied out of TensorFlow, the source mapping's arrays) are numpy's, allocated
outside that allocator, and are added on top of its peak.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from bigmem.config.options import OptimizerName, Precision, Recompute
from bigmem.config.schema import ExperimentConfig
from bigmem.data.derived import augmentation
from bigmem.memory.calibration import INFERENCE_MODE, Calibration, added_sample_keeps, calibration_for, recompute_key
from bigmem.nets.limits import exceeds_limit, max_kernel_elements, slab_elements
from bigmem.nets.slabplan import min_frame_planes, plane_runnable

FLOAT32_BYTES = 4
BFLOAT16_BYTES = 2
LABEL_BYTES = 1  # labels travel as uint8 (and predict's labels are uint8)
BOOL_BYTES = 1  # numpy's bool: predict's running argmax's "better" mask
# Keras optimizer slots per trainable weight: SGD momentum keeps 1 (velocity), Adam 2 (m, v).
OPTIMIZER_SLOTS = {OptimizerName.SGD: 1, OptimizerName.ADAM: 2}
# HDF5's default raw-data chunk cache is 1 MiB per open dataset (H5Pset_chunk_cache default
# rdcc_nbytes); a reader holds two datasets (image, label) open at a time.
HDF5_CHUNK_CACHE_BYTES = 1 << 20
# In the backward pass of the widest full-resolution block (norm_act.py) three tensors of that
# shape are live in the compute dtype (the gated gradient dz, a product, the outgoing dx) plus
# one float32 upcast feeding a reduction.
WORKSPACE_TENSORS = 3
WORKSPACE_FLOAT32_TENSORS = 1
# The input pipeline holds `prefetch` finished batches, the batch the step consumes and the one
# being assembled.
PIPELINE_EXTRA_BATCHES = 2
# What a training run's peak grows to past the few steps its tables measured, as a share of the
# activations and workspace (``allocator_growth``). With oneDNN on, TensorFlow's CPU allocator is
# MklCPUAllocator (tensorflow/core/common_runtime/mkl_cpu_allocator.h): every tensor of 4 KiB or
# more comes from a BFCAllocator that grows and never hands a page back, so the resident set is
# every page the pool has touched, and a step that places a tensor where none was before raises it
# for the rest of the run. The pool holds the step's feature maps and temporaries, so the growth
# follows them, not the framework or the weights: on an AMX Xeon (family 6 model 207, TF 2.21),
# the 24 configurations of every preset, both modes and three sizes peaked after 20 steps between
# -0.4% and +17% above their 3-step peaks, and 15% of activations and workspace puts 20 of them
# within -2%/+5% of the 20-step peak (the rest: -9.3%, -2.3%, +5.1%, +5.9%). A share of the whole
# prediction does no better here (before the 2% margin, 21 at best, at 4.8%, as this term's 21) but adds a third as
# much at the sizes users run, where the feature maps are nearly all of it and the growth at the
# largest sizes measured needed 5-27% of them (benchmarks/results/memory_model.md, "A run's peak
# grows past its first steps").
# TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1 (glibc's malloc instead) is no way out: intelai-brats 64^3
# peaked at 1,568 MiB after 20 steps against BFC's 1,222-1,257, and kits19's step ran 5% slower.
ALLOCATOR_GROWTH_FRACTION = 0.15


class Pass(enum.Enum):
    """What runs: a training step, or one whole-volume forward pass (``bigmem predict``, validation)."""

    TRAIN = "train"
    FORWARD = "forward"


@dataclass
class Estimate:
    """A footprint prediction: bytes per component and what it assumed.

    For ``Pass.FORWARD`` (batch 1, no recomputation) ``host_phases`` are the numpy arrays of each
    phase after the forward pass (the peak is TensorFlow's peak plus the largest of them),
    ``forward_flops`` 2 per multiply-add of the pass and ``source_shape`` the case's own shape.
    """

    components: dict[str, int]
    param_count: int
    spatial_shape: tuple[int, int, int]
    batch_size: int
    precision: str
    recompute_stages: list[str]
    calibration: Calibration
    train_flops_per_step: int = 0
    notes: list[str] = field(default_factory=list)
    partitioned_stages: list[str] = field(default_factory=list)  # stages run in depth slabs
    runnable: bool = True  # False where one depth plane is too wide for any slab (see slab_verdict)
    pass_: Pass = Pass.TRAIN
    host_phases: dict[str, int] = field(default_factory=dict)
    forward_flops: int = 0
    source_shape: tuple[int, int, int] | None = None

    @property
    def predicted_peak_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def first_steps_bytes(self) -> int:
        """The peak of the first few steps, which the memory tables hold: the prediction less ``allocator_growth``.

        What a fit or a measured fixed term compares a few steps' measured peak with.
        """
        return self.predicted_peak_bytes - self.components.get("allocator_growth", 0)

    def to_dict(self) -> dict:
        """The fields as JSON; a forward pass's add ``kind`` ("inference"), ``host_phases``, ``forward_flops``
        and ``source_shape``."""
        data = {
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "components": dict(self.components),
            "param_count": self.param_count,
            "spatial_shape": list(self.spatial_shape),
            "batch_size": self.batch_size,
            "precision": self.precision,
            "recompute_stages": list(self.recompute_stages),
            "calibration": self.calibration.to_dict(),
            "train_flops_per_step": self.train_flops_per_step,
            "partitioned_stages": list(self.partitioned_stages),
            "runnable": self.runnable,
        }
        if self.pass_ is Pass.FORWARD:
            data.update(kind="inference", host_phases=dict(self.host_phases), forward_flops=self.forward_flops,
                        source_shape=list(self.source_shape or self.spatial_shape))
        return data


@dataclass(frozen=True)
class NetworkCounts:
    """What the estimator needs from a built UNet3D, per sample and for one spatial shape."""

    param_count: int
    trainable_count: int
    block_elements: dict[str, int]  # every tensor each block creates
    block_outputs: dict[str, int]  # the block's output alone (what a recomputed stage keeps)
    largest_tensor: int  # elements of the largest single feature map
    head_elements: int
    forward_macs: int = 0  # multiply-adds of one sample's forward pass
    # Per stage, the elements live at its peak in an inference pass (nothing kept for backward):
    # its own (the stage reports them), its inputs and the encoder outputs held for later decoder
    # stages; the network's input is not included (memory/estimate.py counts it).
    stage_inference_live: dict[str, int] = field(default_factory=dict)
    # Per stage, the largest tensor it reads or creates, per sample (the stage reports it): its ops
    # that touch it run in depth slabs past the kernel limit (nets/slabs.py), in either pass. A
    # decoder stage whose blocks take the skip as a second input (nets/blocks.py) counts no
    # concatenation.
    stage_largest_tensor: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_model(cls, model, spatial_shape: Sequence[int]) -> "NetworkCounts":
        model.build_for()
        elements = model.block_feature_map_elements(spatial_shape)
        voxels = math.prod(spatial_shape)
        outputs, shape = {}, tuple(spatial_shape)
        for stage in (*model.encoder, *model.decoder):
            shape = stage.output_spatial_shape(shape)
            outputs[stage.name] = stage.filters * math.prod(shape)
        inference, tensors, shape = _inference_live(model, spatial_shape), {}, tuple(spatial_shape)
        for stage in (*model.encoder, *model.decoder):
            tensors[stage.name] = stage.largest_tensor_elements(shape)
            shape = stage.output_spatial_shape(shape)
        cfg = model.model_config
        # The widest full-resolution tensor: a decoder concat (2 x level-0 filters) or the input.
        largest = max(2 * cfg.filters[0], cfg.in_channels) * voxels
        trainable = sum(math.prod(v.shape) for v in model.trainable_weights)
        # The heads (the main one and deep supervision's, ``head<level>``) are not stages: their logits are
        # float32 whatever the precision, and never recomputed.
        heads = {k for k in elements if k == "head" or k.startswith("head") and k[4:].isdigit()}
        return cls(model.count_params(), int(trainable), {k: v for k, v in elements.items() if k not in heads},
                   outputs, int(largest), int(sum(elements[k] for k in heads)),
                   int(model.forward_macs(spatial_shape)),
                   {name: int(n) for name, n in inference.items()},
                   {name: int(n) for name, n in tensors.items()})


def _inference_live(model, spatial_shape: Sequence[int]) -> dict[str, int]:
    """Per stage, the elements live at its peak in an inference pass (``NetworkCounts.stage_inference_live``)."""
    inference, shape, encoder_outputs = {}, tuple(spatial_shape), []
    for stage in model.encoder:  # every earlier encoder output is still held: skips, and this stage's input
        inference[stage.name] = sum(encoder_outputs) + stage.inference_live_elements(shape)
        shape = stage.output_spatial_shape(shape)
        encoder_outputs.append(stage.filters * math.prod(shape))
    below, skips = encoder_outputs[-1], encoder_outputs[:-1]
    for stage in model.decoder:  # the skips not yet taken, the input from below and this stage's skip
        skip = skips.pop()
        inference[stage.name] = sum(skips) + below + skip + stage.inference_live_elements(shape)
        shape = stage.output_spatial_shape(shape)
        below = stage.filters * math.prod(shape)
    return inference


def partitioned_stages(counts: NetworkCounts, batch_size: int) -> list[str]:
    """Stages with a tensor past the kernel limit: their ops run in depth slabs (nets/slabs.py)."""
    limit = max_kernel_elements()
    return [name for name, n in counts.stage_largest_tensor.items() if n * batch_size > limit]


def slab_verdict(widest_plane: int) -> tuple[bool, list[str]]:
    """Whether a shape runs at all, by its widest depth plane, and the note that says why not.

    The planner's rule (``nets.slabplan.plane_runnable``): a plane too wide for
    ``min_frame_planes()`` of it under the kernel limit makes a conv the planner refuses
    (``SlabTooLargeError``), so the shape is not runnable at any budget.

    Args:
        widest_plane: elements of the widest tensor's depth plane, ``H * W * C``.

    Returns:
        ``(runnable, notes)``: notes is empty when runnable, else one ``"not runnable: ..."`` line.

    Example:
        >>> slab_verdict(512 * 512 * 32)
        (True, [])
    """
    if plane_runnable(widest_plane):
        return True, []
    return False, [f"not runnable: a depth plane of {widest_plane:,} elements is too wide for any slab under the "
                   f"kernel limit of {max_kernel_elements():,} elements (needs {min_frame_planes()} planes)"]


def _margin(components: dict[str, int], calibration: Calibration, advice: str = "") -> list[str]:
    """Add ``safety_margin`` to ``components`` where the calibration stands in for an unmeasured one (both passes);
    the note that says so."""
    if not calibration.has_margin:
        return []
    components["safety_margin"] = calibration.safety_margin(sum(components.values()))
    return [f"calibration: {calibration.source}{advice}"]


def planewise_copy_bytes(config: ExperimentConfig, spatial_shape: Sequence[int], table_isa: str) -> int:
    """The stride-2 planewise weight gradients' plane copies that this CPU makes and the table's CPU did not.

    A strided conv's planewise weight gradient (nets/conv.py) copies its input's even and odd
    depth planes, about the input's size, live in backward. A shipped memory table includes the
    copies its own ISA class made; where this process's kernel choices (tuned or shipped) take
    the planewise path at a channel count the table's class did not, the largest such input is
    added (kits19 fp32 at 160^3 on AVX2, planewise from 32 channels against avx512_bf16's 64:
    predicted 7.0% under without it; benchmarks/results/profile_accuracy-avx2-*.json).

    Args:
        config: the job (model, batch, precision).
        spatial_shape: ``(D, H, W)`` of one input.
        table_isa: the ISA class the calibration's table was measured on ("" for a fit made here,
            which includes this CPU's own copies).

    Returns:
        Bytes (0 where no strided conv differs, or for a fit made here).
    """
    from bigmem.nets.choices import CHOICES, kernel_choices

    model = config.model
    if not table_isa or table_isa not in CHOICES or model.downsampling.value != "strided":
        return 0
    precision = config.train.precision.value
    here, there = kernel_choices()[1], CHOICES[table_isa]
    bytes_per = BFLOAT16_BYTES if config.train.precision is Precision.BF16 else FLOAT32_BYTES
    largest = 0
    scales = model.level_scales()
    for level in range(model.depth):  # the strided conv into level + 1 reads level's channels at its shape
        channels = model.filters[level]
        if model.stage_strides[level + 1] != (2, 2, 2):  # the planewise gradient takes cubic strides only
            continue
        if here.takes_planewise(precision, 2, channels) and not there.takes_planewise(precision, 2, channels):
            voxels = math.prod(size // scale for size, scale in zip(spatial_shape, scales[level]))
            largest = max(largest, config.train.batch_size * voxels * channels * bytes_per)
    return largest


def slab_notes(sliced: Sequence[str], widest_plane: int) -> tuple[bool, list[str]]:
    """Whether a shape runs at all, and the notes on its stages that run in depth slabs (both passes').

    Args:
        sliced: the stages with a tensor past the kernel limit.
        widest_plane: elements of the widest tensor's depth plane, ``H * W * C``.

    Returns:
        ``(runnable, notes)``: ``slab_verdict``'s, then one line naming ``sliced`` where there are any.
    """
    runnable, notes = slab_verdict(widest_plane)
    if sliced:
        notes.append(f"{len(sliced)} stages hold tensors past {max_kernel_elements():,} elements, the limit bigmem "
                     f"keeps TF's CPU kernels under, and run in depth slabs of at most "
                     f"{slab_elements(widest_plane):,} elements: {', '.join(sliced)}")
    return runnable, notes


def activation_elements(counts: NetworkCounts, recompute: Sequence[str]) -> int:
    """Feature-map elements kept for backward with the stages in ``recompute`` recomputed.

    A recomputed stage keeps only its output during the forward pass; in backward, one stage at
    a time is recomputed, so the largest recomputed stage's tensors are added once.
    """
    kept = sum(n for name, n in counts.block_elements.items() if name not in recompute)
    kept += sum(counts.block_outputs[name] for name in recompute)
    if recompute:
        kept += max(counts.block_elements[name] for name in recompute)
    return kept + counts.head_elements


def mode_stages(recompute: Recompute, counts: NetworkCounts) -> list[str]:
    """The stages a fixed ``--recompute`` mode recomputes: every stage for STAGES, none otherwise.

    AUTO has no fixed stages: ``memory.plans.recompute_stages`` chooses them against a budget.
    """
    return list(counts.block_elements) if recompute is Recompute.STAGES else []


def recompute_order(counts: NetworkCounts) -> list[str]:
    """Stages by how much recomputing them saves (their elements beyond their output), most first."""
    return sorted(counts.block_elements, key=lambda n: counts.block_outputs[n] - counts.block_elements[n])


def estimate(config: ExperimentConfig, counts: NetworkCounts, spatial_shape: Sequence[int], *,
             pass_: Pass = Pass.TRAIN, recompute_stages: Sequence[str] | None = None,
             calibration: Calibration | None = None, source_shape: Sequence[int] | None = None,
             save_probabilities: bool = False, ensemble: int = 1) -> Estimate:
    """The predicted peak resident memory of one pass of ``config`` on ``spatial_shape`` volumes.

    ``Pass.TRAIN``: a training step at ``train.batch_size``. Components: each block's feature maps
    kept for backward (``activations``), a backward ``workspace``, ``weights``, ``gradients``,
    ``optimizer_slots``, the ``input_pipeline``'s batches, the ``hdf5_chunk_cache``, the
    ``augmentation``'s working memory in each reader (``data.transforms.Compose.working_bytes``),
    the ``framework``, and the ``allocator_growth`` a long run adds to the few steps the tables
    measured (``ALLOCATOR_GROWTH_FRACTION`` of the activations and workspace).

    ``Pass.FORWARD``: segmenting one whole volume (batch 1). Components: ``framework``, ``weights``
    (float32; Keras 3 keeps no bfloat16 copy), ``input_tensor`` (TensorFlow's copy of the network's
    input), ``forward_activations`` (the live set at the forward pass's peak, ``forward_live_bytes``),
    ``allocator_slack`` (what the allocator holds beyond them, calibrated), and predict's host arrays
    of the phase that peaks after the pass: ``input_image``, ``network_input``, ``probabilities``,
    ``output_mapping``; for an ensemble of ``ensemble`` networks run one after the other, ``weights`` counts
    every member's (all stay loaded) and ``ensemble_sum`` the running sum of their probabilities (one more
    float32 array per class at the case's shape, beside each later member's pass).

    Either adds ``safety_margin`` only where the calibration was not measured for this machine
    and model (``calibration.unmeasured_margin``).

    Args:
        config: the job (``model``; ``train.batch_size``, ``train.precision``, ``train.optimizer``,
            ``memory.recompute``, ``data.prefetch``, ``data.num_workers``).
        counts: the model's per-block element counts at ``spatial_shape`` (``NetworkCounts.from_model``).
        spatial_shape: ``(D, H, W)`` of one input volume, in voxels (a multiple of ``2**depth``).
        pass_: ``Pass.TRAIN`` (default) or ``Pass.FORWARD``.
        recompute_stages: training: the stages whose activations backward recomputes; None: those
            ``memory.recompute`` implies.
        calibration: the multiplier and overhead to use; None: ``calibration.calibration_for`` this
            preset, precision and mode (the recompute mode, or inference).
        source_shape: forward: the case's own shape before padding (default: ``spatial_shape``).
        save_probabilities: forward: predict writes the probabilities too (``--save-probabilities``).
        ensemble: forward: the networks whose probabilities predict averages (``bigmem predict RUN_DIR RUN_DIR
            ...``; default 1), each of this one's size (a member of another architecture: plan with the largest).

    Returns:
        An ``Estimate``: bytes per component (``predicted_peak_bytes`` is their sum), the stages
        that run in depth slabs, and whether it can run at all.

    Example:
        >>> counts = NetworkCounts.from_model(UNet3D(config.model).build_for(), (128, 128, 128))
        >>> estimate(config, counts, (128, 128, 128)).predicted_peak_bytes  # bytes
        >>> estimate(config, counts, (128, 128, 128), pass_=Pass.FORWARD).components["forward_activations"]
    """
    if pass_ is Pass.FORWARD:
        return _forward(config, counts, spatial_shape, calibration, source_shape, save_probabilities, ensemble)
    return _train(config, counts, spatial_shape, recompute_stages, calibration)


def _train(config: ExperimentConfig, counts: NetworkCounts, spatial_shape: Sequence[int],
           recompute_stages: Sequence[str] | None, calibration: Calibration | None) -> Estimate:
    """``estimate``'s training step."""
    train, data = config.train, config.data
    batch = train.batch_size
    precision = train.precision
    if recompute_stages is None:
        recompute_stages = mode_stages(config.memory.recompute, counts)
    calibration = calibration or calibration_for(config.model.name, precision.value,
                                                 recompute_key(recompute_stages))
    voxels = math.prod(spatial_shape)
    compute_bytes = BFLOAT16_BYTES if precision is Precision.BF16 else FLOAT32_BYTES
    channels = config.model.in_channels

    # Past the kernel limit the widest ops run in depth slabs. Their temporaries are one slab's, but
    # the workspace term keeps the whole tensor's: kits19 bf16 + stages at 288^3 (dec0 in slabs)
    # peaked at 17.77 GiB against 17.65 unpartitioned, so the slabs lower nothing the estimate
    # counts, and shrinking the term to a slab under-predicted that run by 26%.
    sliced = partitioned_stages(counts, batch)
    workspace_elements = counts.largest_tensor * batch
    kept = activation_elements(counts, recompute_stages) * batch
    # The head's logits leave the network in float32 whatever the compute precision.
    float32_extra = counts.head_elements * batch * (FLOAT32_BYTES - compute_bytes) // 2
    activation_bytes = kept * compute_bytes + float32_extra
    workspace_bytes = workspace_elements * (WORKSPACE_TENSORS * compute_bytes
                                            + WORKSPACE_FLOAT32_TENSORS * FLOAT32_BYTES)
    framework_bytes = calibration.fixed_bytes()
    scale = _resident_scale(config, calibration, activation_bytes + workspace_bytes, framework_bytes)
    keeps_all = calibration.borrowed
    components = {
        "framework": framework_bytes,
        "weights": counts.param_count * FLOAT32_BYTES,
        "gradients": counts.trainable_count * FLOAT32_BYTES,
        "optimizer_slots": OPTIMIZER_SLOTS[train.optimizer] * counts.trainable_count * FLOAT32_BYTES,
        "activations": int(round(scale * activation_bytes)),
        "workspace": int(round(scale * workspace_bytes)),
        "input_pipeline": (data.prefetch + PIPELINE_EXTRA_BATCHES) * batch * voxels
                          * (channels * FLOAT32_BYTES + LABEL_BYTES),
        "hdf5_chunk_cache": 2 * HDF5_CHUNK_CACHE_BYTES * max(1, data.num_workers),
        # each reader (the training process itself without reader processes) augments one sample at a time
        "augmentation": max(1, data.num_workers) * augmentation(config).working_bytes(
            spatial_shape, channels, cropped=data.shape is not None or config.distribute.patch is not None),
    }
    # Where the batch keeps every counted tensor, the strided convolutions' plane copies (made in the
    # backward pass after the full-resolution workspace is freed) fit in what the estimate already holds:
    # kits19 at batch 2 measured 1.2% under and 2.7% over without them on an AVX2 EPYC that takes them.
    copies = 0 if keeps_all or batch > calibration.batch_size else planewise_copy_bytes(config, spatial_shape,
                                                                                      calibration.table_isa)
    if copies:
        components["planewise_copies"] = copies
    components["allocator_growth"] = int(round(ALLOCATOR_GROWTH_FRACTION * (components["activations"]
                                                                        + components["workspace"])))
    notes, runnable = _train_notes(components, calibration, config, sliced, counts.largest_tensor // spatial_shape[0])
    # Training FLOPs: 2 per multiply-add, backward twice the forward; recomputed stages run their
    # forward once more (not counted: the figure is the model's arithmetic, not bigmem's overhead).
    train_flops = 3 * 2 * counts.forward_macs * batch
    return Estimate(components, counts.param_count, tuple(spatial_shape), batch, precision.value,
                    list(recompute_stages), calibration, train_flops, notes, partitioned_stages=sliced,
                    runnable=runnable)


def _train_notes(components: dict[str, int], calibration: Calibration, config: ExperimentConfig, sliced: list[str],
                 widest_plane: int) -> tuple[list[str], bool]:
    """The training estimate's margin (added to ``components``) and its notes, and whether its slabs can run."""
    notes = _margin(components, calibration, f"; run `bigmem profile --calibrate --model {config.model.name}` to "
                                             "measure this machine")
    runnable, slab_lines = slab_notes(sliced, widest_plane)
    notes += slab_lines
    if config.data.num_workers:
        notes.append(f"{config.data.num_workers} reader processes hold their own memory (not in this process's "
                     "peak)")
    return notes, runnable


def _resident_scale(config: ExperimentConfig, calibration: Calibration, counted_bytes: int,
                    framework_bytes: int) -> float:
    """The share of the counted activations and workspace a training step keeps resident at its peak.

    The calibration scales the workspace with the activations: both count tensors assumed live at the peak,
    and neither is exact (kits19 bf16+stages, batch 1: the measured peak grew by 617 bytes per voxel from
    256^3 to 288^3, where the workspace alone counts 640). The fixed part is the framework's cost at no
    volume; what the calibrated line adds beyond it is shared by the activations and the workspace in
    proportion to their counts.

    A network no curve was measured for keeps every counted tensor, at any batch: nnU-Net-style networks
    configured per axis held 99% at 64x128x128, where another preset's curve was 29% low. The curve was
    measured at its own batch (the shipped ones at 1), where a preset's peak holds 68-86% of what its blocks
    count (kits19 at 64-160^3 on an AVX2 EPYC); each sample past that batch adds its own counted bytes times
    what the network's added samples were measured to keep: 0.60 for intelai-brats, 1.05-1.11 for small,
    kits19 and resenc-m at 64^3 (``calibration.added_sample_keeps``; 1 unmeasured). Taking the curve at the
    whole batch's count was 4-12% low for small and kits19; keeping every counted tensor of the whole batch
    28-48% high for intelai-brats at 2-8 and 8.6% for resenc-m at 2 (benchmarks/results/memory_model.md,
    "Batches of several and configured networks", "What an added sample keeps").
    """
    if calibration.borrowed:
        return 1.0
    batch = config.train.batch_size
    scale, intercept = calibration.line_for(counted_bytes)
    scale = (intercept + scale * counted_bytes - framework_bytes) / counted_bytes if counted_bytes else 0.0
    if batch > calibration.batch_size and counted_bytes:
        first = counted_bytes * calibration.batch_size / batch  # what the curve's own batch counts
        first_scale, first_intercept = calibration.line_for(first)
        resident = first_intercept + first_scale * first - framework_bytes
        resident += (counted_bytes - first) * added_sample_keeps(config.model.name)
        scale = resident / counted_bytes
    return scale


def forward_live_bytes(config: ExperimentConfig, counts: NetworkCounts, spatial_shape: Sequence[int]) -> int:
    """TensorFlow's live bytes at the forward pass's peak, the network's input excepted.

    The largest of: each stage's live elements (``counts.stage_inference_live``) in the compute
    dtype; the head (the last decoder stage's output, the head's logits, and under bf16 their
    float32 cast, plus one depth slab where the head runs in slabs); the softmax (float32 logits
    and probabilities).

    Args:
        config: the network (``model``) and its precision (``train.precision``).
        counts: ``NetworkCounts.from_model`` for ``spatial_shape``.
        spatial_shape: the network's input ``(D, H, W)``.

    Returns:
        Bytes.
    """
    compute_bytes = BFLOAT16_BYTES if config.train.precision is Precision.BF16 else FLOAT32_BYTES
    voxels = math.prod(spatial_shape)
    classes = config.model.num_outputs  # the probabilities: per class, or per region
    stages = max(counts.stage_inference_live.values()) * compute_bytes
    last_output = list(counts.block_outputs.values())[-1]  # the last decoder stage's (the head's input)
    head_in = (1, *spatial_shape, last_output // voxels)
    slab = slab_elements(math.prod(head_in[2:])) if exceeds_limit(head_in) else 0
    head = (last_output + classes * voxels + slab) * compute_bytes
    if compute_bytes != FLOAT32_BYTES:
        head += classes * voxels * FLOAT32_BYTES  # the logits leave the network in float32
    softmax = 2 * classes * voxels * FLOAT32_BYTES
    return max(stages, head, softmax)


def _margin_within_training(components: dict[str, int], config: ExperimentConfig, counts: NetworkCounts,
                            spatial_shape: Sequence[int]) -> list[str]:
    """Cap a forward pass's safety margin so that the pass is planned no higher than the training step of the same
    network, shape and batch (1, nothing recomputed), whose curve was measured for this network.

    The step runs that forward pass and keeps more (every activation for backward, gradients, optimizer state):
    measured on an avx512_bf16 EPYC, small's whole-volume pass peaked at 0.70 and 0.76 GB at 32^3 and 64^3
    against 0.77 and 0.92 GB for its step. The inference tables cover fewer networks and CPUs than the training
    tables, so a borrowed inference curve carries the blanket margin (15% + 256 MiB): that margin, and only
    it, is what the cap takes back. A measured excess (no margin) is left as measured.
    """
    single = replace(config, train=replace(config.train, batch_size=1))
    training = _train(single, counts, spatial_shape, [], None).predicted_peak_bytes
    excess = sum(components.values()) - training
    if excess <= 0:
        return []
    margin = components["safety_margin"]
    components["safety_margin"] = max(0, margin - excess)
    return [f"safety margin capped at {components['safety_margin']:,} B: a forward pass is planned no higher than "
            f"the training step of the same network and shape ({training:,} B)"]


def _host_phases(channels: int, classes: int, voxels: int, source_voxels: int, save_probabilities: bool,
                 ensemble: int) -> tuple[dict[str, int], str, dict[str, int]]:
    """The host arrays of a whole-volume prediction after its forward pass: each phase's bytes, the phase that
    peaks, and that phase's arrays as components."""
    image = channels * source_voxels * FLOAT32_BYTES
    network_input = channels * voxels * FLOAT32_BYTES
    probabilities = classes * voxels * FLOAT32_BYTES
    cropped = classes * source_voxels * FLOAT32_BYTES if source_voxels != voxels else 0
    mapping = source_voxels * (FLOAT32_BYTES + LABEL_BYTES + BOOL_BYTES)
    saved = classes * source_voxels * (FLOAT32_BYTES + 2) if save_probabilities else 0  # float32, then float16
    # an ensemble: the members' running sum (infer.predict.ensemble_probabilities), held while each later member runs;
    # once the last has run it is the probabilities the mapping phases take
    summed = classes * source_voxels * FLOAT32_BYTES if ensemble > 1 else 0
    phases = {
        # predict_probabilities: the image, the network's input and the probabilities' copy (and its crop)
        "probabilities": image + network_input + probabilities + cropped + summed,
        # labels_to_source after the image is dropped: the (cropped) probabilities and the running argmax
        "mapping": (cropped or probabilities) + mapping,
    }
    if save_probabilities:
        phases["saved_probabilities"] = (cropped or probabilities) + saved
    peak_phase = max(phases, key=phases.get)
    host = {
        "probabilities": {"input_image": image, "network_input": network_input,
                          "probabilities": probabilities + cropped, "output_mapping": 0},
        "mapping": {"input_image": 0, "network_input": 0, "probabilities": cropped or probabilities,
                    "output_mapping": mapping},
        "saved_probabilities": {"input_image": 0, "network_input": 0, "probabilities": cropped or probabilities,
                                "output_mapping": saved},
    }[peak_phase]
    if ensemble > 1:
        host["ensemble_sum"] = summed if peak_phase == "probabilities" else 0
    return phases, peak_phase, host


def _forward(config: ExperimentConfig, counts: NetworkCounts, spatial_shape: Sequence[int],
             calibration: Calibration | None, source_shape: Sequence[int] | None, save_probabilities: bool,
             ensemble: int = 1) -> Estimate:
    """``estimate``'s whole-volume forward pass (batch 1): TensorFlow's peak plus the host arrays of the
    largest phase after it, which is why some of those components may be 0."""
    precision = config.train.precision
    calibration = calibration or calibration_for(config.model.name, precision.value, INFERENCE_MODE)
    voxels = math.prod(spatial_shape)
    source_shape = tuple(source_shape) if source_shape is not None else tuple(spatial_shape)
    source_voxels = math.prod(source_shape)
    channels, classes = config.model.in_channels, config.model.num_outputs

    input_tensor = channels * voxels * (FLOAT32_BYTES + (BFLOAT16_BYTES if precision is Precision.BF16 else 0))
    forward = forward_live_bytes(config, counts, spatial_shape)
    counted = input_tensor + forward
    scale, intercept = calibration.line_for(counted)
    framework = calibration.fixed_bytes()
    slack = int(round(intercept + scale * counted)) - framework - counted

    phases, peak_phase, host = _host_phases(channels, classes, voxels, source_voxels, save_probabilities, ensemble)
    weights = ensemble * counts.param_count * FLOAT32_BYTES  # every member stays loaded
    components = {"framework": framework, "weights": weights, "input_tensor": input_tensor,
                  "forward_activations": forward, "allocator_slack": slack, **host}
    notes = [f"host arrays peak in the {peak_phase.replace('_', ' ')} phase, after the forward pass "
             f"(phases: {', '.join(f'{k} {v:,} B' for k, v in phases.items())})"]
    notes += _margin(components, calibration)
    if components.get("safety_margin") and ensemble == 1 and not save_probabilities:
        notes += _margin_within_training(components, config, counts, spatial_shape)
    sliced = partitioned_stages(counts, 1)
    widest_plane = max(counts.stage_largest_tensor.values(), default=counts.largest_tensor) // spatial_shape[0]
    runnable, slab_lines = slab_notes(sliced, widest_plane)
    notes += slab_lines
    return Estimate(components, counts.param_count, tuple(spatial_shape), 1, precision.value, [], calibration, 0,
                    notes, partitioned_stages=sliced, runnable=runnable, pass_=Pass.FORWARD, host_phases=phases,
                    forward_flops=2 * counts.forward_macs, source_shape=source_shape)
