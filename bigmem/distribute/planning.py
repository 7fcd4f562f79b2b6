"""What fits one GPU: the per-device footprint, the largest patch, the largest whole volume.

The estimate reuses bigmem's per-block counts and its calibrated activation multiplier (fitted on
the CPU: no GPU was available to calibrate on). Host-side parts (input pipeline, HDF5 cache, the
framework's host memory) are replaced by an allowance for the CUDA context and libraries.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


from bigmem.config.schema import ExperimentConfig
from bigmem.data.pipeline import Shape
from bigmem.memory.calibration import FALLBACK_ISA, recompute_key, shipped_calibration
from bigmem.memory.estimate import estimate, mode_stages
from bigmem.memory.search import largest_fitting
from bigmem.units import as_shape

# CUDA context, cuDNN/cuBLAS handles and TensorFlow's GPU runtime: an allowance, not a measurement
# (no GPU here); ~0.5-1 GiB is what a CUDA 12 context with cuDNN takes on recent GPUs.
GPU_RUNTIME_BYTES = 1 << 30
# What a GPU replica does not hold: the host's framework, input pipeline, chunk cache and augmenting readers,
# the margin bigmem adds on a CPU its calibration was not measured on, the plane copies of this CPU's
# planewise weight gradients and the growth of TensorFlow's CPU allocator over a run (CPU figures, not a GPU's).
HOST_ONLY = ("framework", "input_pipeline", "hdf5_chunk_cache", "augmentation", "safety_margin", "planewise_copies",
             "allocator_growth")
# The CPU curve a GPU replica's activations follow: the reference class's shipped table, never the planning
# host's (its class, its tuned fixed term, its own fits). A GPU's footprint is the same whichever CPU
# plans it, so the GPU machine (which cannot run the planner) can read a plan made on any CPU.
GPU_CURVE_ISA = FALLBACK_ISA


def gpu_footprint_bytes(config: ExperimentConfig, counts_for, patch: int | Sequence[int], batch: int) -> int:
    """The predicted footprint of one GPU replica training ``batch`` patches of ``patch`` (an edge or a shape)."""
    shape = as_shape(patch)
    sized = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=batch))
    counts = counts_for(shape)
    # The curve as measured at its batch, for any batch: what a step of several adds per sample was measured
    # on CPUs (memory/estimate.py), and a GPU's allocator and kernels are others.
    stages = mode_stages(config.memory.recompute, counts)
    curve = shipped_calibration(config.model.name, config.train.precision.value, recompute_key(stages),
                                isa=GPU_CURVE_ISA)
    predicted = estimate(sized, counts, shape, recompute_stages=stages,
                         calibration=dataclasses.replace(curve, batch_size=max(batch, 1)))
    return sum(v for k, v in predicted.components.items() if k not in HOST_ONLY) + GPU_RUNTIME_BYTES


def patch_shape(aspect: Sequence[int], longest: int, divisor: int) -> Shape:
    """The patch of ``aspect``'s proportions whose longest axis is ``longest``: each axis a multiple of ``divisor``.

    As nnU-Net shapes its patch after the dataset's median shape: a 240x240x155 median at longest 128 gives
    128x128x80, a cube gives a cube; no axis is shorter than ``divisor`` or longer than ``aspect``'s own
    (rounded up to the divisor).

    Example:
        >>> patch_shape((240, 240, 155), 128, 16)
        (128, 128, 80)
    """
    top = max(aspect)
    return tuple(int(min(max(divisor, round(a * longest / top / divisor) * divisor), -(-a // divisor) * divisor))
                 for a in aspect)


def largest_patch(config: ExperimentConfig, counts_for, gpu_memory_bytes: int, batch: int,
                  aspect: Sequence[int]) -> Shape | None:
    """The largest patch of ``aspect``'s proportions (``patch_shape``) whose footprint at ``batch`` fits one GPU.

    Args:
        config: the job (its model).
        counts_for: ``(D, H, W) -> NetworkCounts``.
        gpu_memory_bytes: one GPU's memory.
        batch: patches per replica per step.
        aspect: the shape the patch is proportioned after (the dataset's median trained shape); its
            longest axis bounds the patch's.

    Returns:
        The patch ``(D, H, W)``, or None when not even the smallest fits.
    """
    divisor = config.model.divisor
    # the footprint grows with the longest axis; at least one try: a median thinner than 2^depth still gets
    # the smallest patch
    return largest_fitting(lambda k: patch_shape(aspect, k * divisor, divisor), max(1, max(aspect) // divisor),
                           lambda shape: gpu_footprint_bytes(config, counts_for, shape, batch) <= gpu_memory_bytes)


def largest_edge(config: ExperimentConfig, counts_for, gpu_memory_bytes: int, batch: int,
                 upper: int) -> int | None:
    """The largest cube edge, a multiple of 2^depth at most ``upper``, whose footprint at ``batch`` fits."""
    best = largest_patch(config, counts_for, gpu_memory_bytes, batch, (upper,) * 3)
    return best[0] if best else None
