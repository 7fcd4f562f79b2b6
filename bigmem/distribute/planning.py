"""What fits one GPU: the per-device footprint, the largest patch, the largest whole volume.

The estimate reuses bigmem's per-block counts and its calibrated activation multiplier (fitted on
the CPU: no GPU was available to calibrate on). Host-side parts (input pipeline, HDF5 cache, the
framework's host memory) are replaced by an allowance for the CUDA context and libraries.
"""

from __future__ import annotations

import dataclasses

from bigmem.config.schema import ExperimentConfig
from bigmem.memory.estimate import estimate

# CUDA context, cuDNN/cuBLAS handles and TensorFlow's GPU runtime: an allowance, not a measurement
# (no GPU here); ~0.5-1 GiB is what a CUDA 12 context with cuDNN takes on recent GPUs.
GPU_RUNTIME_BYTES = 1 << 30
HOST_ONLY = ("framework", "input_pipeline", "hdf5_chunk_cache")


def gpu_footprint_bytes(config: ExperimentConfig, counts_for, edge: int, batch: int) -> int:
    sized = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=batch))
    predicted = estimate(sized, counts_for((edge,) * 3), (edge,) * 3)
    return sum(v for k, v in predicted.components.items() if k not in HOST_ONLY) + GPU_RUNTIME_BYTES


def largest_edge(config: ExperimentConfig, counts_for, gpu_memory_bytes: int, batch: int,
                 upper: int) -> int | None:
    """The largest multiple of 2^depth, at most ``upper``, whose footprint at ``batch`` fits."""
    divisor = config.model.divisor
    best = None
    for edge in range(divisor, upper + 1, divisor):
        if gpu_footprint_bytes(config, counts_for, edge, batch) > gpu_memory_bytes:
            break
        best = edge
    return best
