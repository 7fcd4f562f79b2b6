"""The tensor-size limit of TF's CPU kernels, and the slab size used past it (no TensorFlow import).

The memory estimate reads these without importing TensorFlow; nets/slabplan.py partitions by them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import os
from typing import Callable, Iterator, Sequence

# The most elements any one tensor handed to a TF CPU kernel may have: 2^30, the largest size
# every op was verified correct at with TF 2.21.0 (oneDNN on, x86). Convolutions crash just past
# 2^31 and the weight gradient is silently wrong below that, so not 2^31: a silent wrong gradient
# is worse than a crash, and other CPUs' oneDNN kernels may fail earlier (measurements:
# benchmarks/results/kernels.md; benchmarks/tables/bench_kernel_limits.py).
MAX_KERNEL_ELEMENTS = 2**30
# The most elements of one slab once an op is partitioned: 2 GiB in float32. Each slab's
# temporaries (its conv output; for strided convs also a zero-padded gradient slab) are the extra
# memory of the slab path, so slabs are kept well under the limit; the halo planes this adds are 2 of 64 at 512^2
# x 32 channels (about 3% more convolution work; benchmarks/tables/bench_slabs.py measures it).
MAX_SLAB_ELEMENTS = 2**29
# ... unless that is fewer than this many depth planes (wide planes of very large volumes): then
# slabs grow to this many planes, up to the kernel limit, so the halo stays a small share.
MIN_SLAB_PLANES = 32
# Pooling's own limit: TF's max_pool3d 2x2x2 and its gradient (oneDNN on, TF 2.21.0, Intel Xeon
# with AMX) were exact on (1, 2064, 1024, 1024, 2) = 4.33e9 elements in bfloat16, past 2^32
# (bench_slabs.py --proof --ops tf_max_pool3d_bf16; float32 ran past 2^31 too, and float32 past
# 2^32 does not fit 24 GiB). No size failed. Up to this, pooling runs whole, so a 512^3 x 32
# first level (2^32 elements) needs no pooling slabs; past it, depth slabs as every other op.
MAX_POOL_ELEMENTS = 2064 * 1024 * 1024 * 2
# For tests and benchmarks: run the slab path on small tensors (also in child processes).
LIMIT_ENVIRONMENT_VARIABLE = "BIGMEM_MAX_KERNEL_ELEMENTS"

_limit_override: list[int] = []


def _set_limit() -> int | None:
    """The limit a test or benchmark set: ``kernel_element_limit``'s, else the environment's, else None.

    Raises:
        ValueError: ``BIGMEM_MAX_KERNEL_ELEMENTS`` is set but not a positive whole number.
    """
    if _limit_override:
        return _limit_override[-1]
    value = os.environ.get(LIMIT_ENVIRONMENT_VARIABLE)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{LIMIT_ENVIRONMENT_VARIABLE}={value!r}: expected a positive whole number of elements")
    return int(value)


def max_kernel_elements() -> int:
    """The element limit in force: ``kernel_element_limit``'s, else the environment's, else the constant.

    Returns:
        Elements per tensor (MAX_KERNEL_ELEMENTS unless lowered for a test or benchmark).

    Raises:
        ValueError: ``BIGMEM_MAX_KERNEL_ELEMENTS`` is set but not a positive whole number.
    """
    limit = _set_limit()
    return MAX_KERNEL_ELEMENTS if limit is None else limit


@contextlib.contextmanager
def kernel_element_limit(elements: int) -> Iterator[int]:
    """Lower (or raise) the limit while tracing/running the ops inside the block.

    Args:
        elements: the limit, in elements per tensor.

    Yields:
        ``elements``.

    Raises:
        ValueError: ``elements`` is below 1.

    Example:
        >>> with kernel_element_limit(4096):
        ...     y = conv3d_slabs(x, kernel)  # slabs of at most 4096 elements
    """
    if elements < 1:
        raise ValueError(f"kernel element limit must be >= 1, got {elements}")
    _limit_override.append(int(elements))
    try:
        yield int(elements)
    finally:
        _limit_override.pop()


def slab_elements(plane_elements: int = 0, limit: int | None = None) -> int:
    """The most elements a slab's tensors may have, for depth planes of ``plane_elements`` elements.

    MAX_SLAB_ELEMENTS, or MIN_SLAB_PLANES planes where that is more, never past the kernel limit.

    Args:
        plane_elements: elements of one depth plane, ``H * W * C`` (default 0).
        limit: the kernel limit (default ``max_kernel_elements()``, the one in force).

    Returns:
        Elements per slab tensor.
    """
    limit = max_kernel_elements() if limit is None else limit
    return min(limit, max(MAX_SLAB_ELEMENTS, MIN_SLAB_PLANES * plane_elements))


def max_pool_elements() -> int:
    """Pooling's limit in force: MAX_POOL_ELEMENTS, unless a test or benchmark sets the limit (then that one).

    ``kernel_element_limit`` and ``BIGMEM_MAX_KERNEL_ELEMENTS`` lower every op's limit at once.

    Returns:
        Elements per tensor handed to TF's max_pool3d and its gradient.
    """
    limit = _set_limit()
    return MAX_POOL_ELEMENTS if limit is None else limit


def exceeds_limit(*shapes: Sequence[int | None], limit: int | None = None) -> bool:
    """Whether any of the (static) shapes has more elements than the limit; unknown sizes never do.

    Args:
        *shapes: tensor shapes such as ``(batch, D, H, W, C)``; a shape with a None is skipped.
        limit: the limit to judge by (default ``max_kernel_elements()``).

    Returns:
        True when one of them is past the limit.
    """
    limit = max_kernel_elements() if limit is None else limit
    return any(None not in tuple(shape) and math.prod(shape) > limit for shape in shapes)


# How many times each slab kernel was entered (at trace time, in graph mode): the proof that a
# layer past the limit dispatched to its slab path, which a test of equal results alone cannot give
# (both sides would run the same path if dispatch silently stopped partitioning).
SLAB_CALLS: collections.Counter = collections.Counter()


def counted(kind: str) -> Callable:
    """Decorate a slab kernel so each entry counts in ``SLAB_CALLS[kind]``."""
    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            SLAB_CALLS[kind] += 1
            return function(*args, **kwargs)
        return wrapper
    return decorate
