"""Synthetic phantoms: the embedded default dataset.

Each case is a noisy volume with a smooth multiplicative bias field, a large "body" ellipsoid
and ``num_classes - 1`` foreground classes drawn as lumpy ellipsoids, each class with its own
mean intensity (varied per case) so that segmentation is learnable but not a threshold.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from bigmem.cache import cache_dir
from bigmem.data.store import StoreWriter
from bigmem.units import as_shape

SYNTH_VERSION = 2  # bump when the phantoms change, so cached datasets are regenerated

# Intensities are in arbitrary units. Odd classes are darker than the body and even classes
# brighter (as a necrotic core and an enhancing rim are on MRI), each further out than the last:
# class k sits at 1.0 -+ (0.5 + 0.3 * ((k - 1) // 2)), jittered per case by 0.05; the noise
# (sigma 0.25) and the +-20% bias field make neighbouring classes overlap in intensity alone.
BODY_INTENSITY = 1.0
CLASS_OFFSET = 0.5
CLASS_OFFSET_STEP = 0.3
CLASS_JITTER = 0.05
NOISE_SIGMA = 0.25
BIAS_AMPLITUDE = 0.2


def _grid(shape: tuple[int, int, int]) -> list[np.ndarray]:
    return np.meshgrid(*[np.linspace(-1.0, 1.0, s, dtype=np.float32) for s in shape], indexing="ij")


def _lumpy_ellipsoid(rng: np.random.Generator, grid, center, radii) -> np.ndarray:
    """A boolean mask of an ellipsoid whose radius is modulated by low-frequency ripples."""
    z, y, x = (g - c for g, c in zip(grid, center))
    r = np.sqrt((z / radii[0]) ** 2 + (y / radii[1]) ** 2 + (x / radii[2]) ** 2)
    ripple = 1.0 + 0.15 * np.sin(3 * np.arctan2(y, x) + rng.uniform(0, 2 * np.pi)) \
                 * np.cos(2 * np.arctan2(z, np.hypot(x, y)) + rng.uniform(0, 2 * np.pi))
    return r < ripple


def make_phantom(rng: np.random.Generator, shape: tuple[int, int, int], num_classes: int):
    """One (image (D,H,W,1) float32, label (D,H,W) uint8) phantom."""
    grid = _grid(shape)
    label = np.zeros(shape, np.uint8)
    image = np.zeros(shape, np.float32)
    body = _lumpy_ellipsoid(rng, grid, rng.uniform(-0.05, 0.05, 3), rng.uniform(0.75, 0.9, 3))
    image[body] = BODY_INTENSITY
    for cls in range(1, num_classes):
        for _ in range(rng.integers(1, 3)):
            center = rng.uniform(-0.4, 0.4, 3)
            mask = _lumpy_ellipsoid(rng, grid, center, rng.uniform(0.25, 0.45, 3)) & body
            label[mask] = cls
    for cls in range(1, num_classes):
        sign = 1.0 if cls % 2 == 0 else -1.0
        offset = CLASS_OFFSET + CLASS_OFFSET_STEP * ((cls - 1) // 2)
        image[label == cls] = BODY_INTENSITY + sign * offset + rng.normal(0, CLASS_JITTER)
    bias = 1.0 + BIAS_AMPLITUDE * np.sin(np.pi * (grid[0] * rng.uniform(0.3, 0.8) + grid[1] * rng.uniform(0.3, 0.8)
                                                  + grid[2] * rng.uniform(0.3, 0.8) + rng.uniform(0, 2)))
    image = image * bias + rng.normal(0, NOISE_SIGMA, shape).astype(np.float32)
    return image[..., np.newaxis].astype(np.float32), label


def write_synthetic_store(path: str | os.PathLike, *, num_cases: int, volume: int | Sequence, num_classes: int = 3,
                          seed: int = 0, progress=None, shapes: Sequence[Sequence[int]] | None = None,
                          channels: int = 1) -> Path:
    """Write ``num_cases`` phantoms to a store at ``path`` (atomically).

    Args:
        path: the store to write.
        num_cases: phantoms.
        volume: their shape: an edge N (N^3) or ``(D, H, W)``.
        num_classes: background and foreground classes (default 3).
        seed: the phantoms' seed (default 0).
        progress: ``(done, total)`` after each case.
        shapes: one ``(D, H, W)`` per case instead of ``volume`` (a store of differently shaped
            scans, as real datasets are); ``num_cases`` must match.
        channels: image channels (default 1); channel c > 0 is the phantom under a different
            contrast (intensities scaled by 1 + c / 2, independent noise), as MRI sequences differ.

    Returns:
        The store's path.
    """
    if shapes is not None and len(shapes) != num_cases:
        raise ValueError(f"shapes: {len(shapes)} shapes for {num_cases} cases")
    names = ["synthetic"] if channels == 1 else [f"synthetic{c}" for c in range(channels)]
    with StoreWriter(path, num_classes=num_classes, channel_names=names,
                     label_names=["background"] + [f"class{k}" for k in range(1, num_classes)]) as writer:
        for index in range(num_cases):
            rng = np.random.default_rng([seed, index])
            shape = tuple(shapes[index]) if shapes is not None else as_shape(volume)
            image, label = make_phantom(rng, shape, num_classes)
            if channels > 1:
                extra = [image * (1.0 + c / 2) + rng.normal(0, NOISE_SIGMA, image.shape).astype(np.float32)
                         for c in range(1, channels)]
                image = np.concatenate([image, *extra], axis=-1)
            writer.add_case(f"synth_{index:04d}", image, label,
                            source_image=f"synthetic:v{SYNTH_VERSION}:seed={seed}:index={index}")
            if progress is not None:
                progress(index + 1, num_cases)
        return writer.commit()


def default_cache_dir() -> Path:
    """bigmem's cache folder (``bigmem.cache.cache_dir``)."""
    return cache_dir()


def cached_synthetic_store(*, num_cases: int, volume: int | Sequence[int], num_classes: int, seed: int = 0,
                           progress=None) -> Path:
    """The synthetic store for these parameters (``volume`` an edge or a ``(D, H, W)``), generated once, then cached."""
    shape = as_shape(volume)
    size = str(shape[0]) if len(set(shape)) == 1 else "x".join(map(str, shape))  # cubes keep their older cache name
    key = f"v{SYNTH_VERSION}-n{num_cases}-s{size}-k{num_classes}-seed{seed}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    path = default_cache_dir() / f"synth-{key}-{digest}.h5"
    if not path.exists():
        write_synthetic_store(path, num_cases=num_cases, volume=shape, num_classes=num_classes, seed=seed,
                              progress=progress)
    return path
