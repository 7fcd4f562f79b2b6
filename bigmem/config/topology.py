"""A U-Net's topology from the dataset, by nnU-Net v2's 3d_fullres rules, for a whole case instead of a patch.

nnU-Net v2's ``ExperimentPlanner`` (``nnunetv2/experiment_planning/experiment_planners/
default_experiment_planner.py``) sets a network from the dataset's fingerprint: the target spacing
(``determine_fullres_target_spacing``), each stage's per-axis kernel and stride from the spacing and
the patch (``get_pool_and_conv_props`` in ``network_topology.py`` of the same folder), the features
per stage and a cap on the batch (``get_plans_for_configuration``). It shrinks its patch until the
network fits a GPU's memory. bigmem holds the whole case in RAM, so here the "patch" is the median
case at the target spacing, and the same rules give the stages; the batch is decided by the memory
planner, and ``batch_cap`` is the dataset-size bound nnU-Net puts on it.

The functions are written from those rules, not from nnU-Net's code; each docstring names the rule
it follows. They are pure (Python and numpy) and axis-order free: give spacings and shapes in one
axis order (a bigmem store's is ``(D, H, W)``, its array axes; ``bigmem.data.fingerprint`` reads
them) and the kernels and strides come back in that order. nnU-Net itself reads an image's axes
reversed (SimpleITK's ``z, y, x``) and moves the coarsest axis first (``determine_transpose``);
every rule here treats each axis alike, so the order changes nothing but the order of the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# nnU-Net's constants (ExperimentPlanner.__init__ and nnunetv2/configuration.py).
ANISOTROPY_THRESHOLD = 3.0  # an axis this many times coarser than the others is "anisotropic"
MIN_EDGE = 4  # UNet_featuremap_min_edge_length: the bottleneck's smallest edge, in voxels
BASE_FEATURES = 32  # UNet_base_num_features
MAX_FEATURES_3D = 320  # UNet_max_features_3d
MAX_DATASET_COVERED = 0.05  # max_dataset_covered: one batch sees at most 5% of the dataset's voxels
MIN_BATCH = 2  # UNet_min_batch_size
# The pooling limit the planners pass to get_pool_and_conv_props: none, so the edge rule alone stops it.
NO_POOL_LIMIT = 999_999

Triple = tuple[int, int, int]


@dataclass(frozen=True)
class Topology:
    """One U-Net's stages, as nnU-Net's 3d_fullres rules set them for ``median_shape`` at ``spacing``.

    Attributes:
        spacing: the target spacing in mm, per axis.
        median_shape: the shape the stages were planned for (the median case at ``spacing``, in
            voxels; a float where the median of an even number of cases falls between two).
        kernel_sizes: each stage's convolution kernel per axis, stage 0 (full resolution) first; a 1
            on an axis convolves each plane on its own (an anisotropic scan's coarse axis).
        strides: each stage's downsampling per axis, stage 0 first (always ``(1, 1, 1)``); the
            decoder upsamples by the same factors.
        features: each stage's channels, ``base * 2**stage`` capped at ``max_filters``.
        divisors: per axis, the product of the strides: every shape the network takes is a multiple.
        padded_shape: ``median_shape`` rounded up to ``divisors`` (nnU-Net's patch after its padding).
        max_filters: the cap on ``features``.

    Example:
        >>> t = pool_and_kernels((3.0, 0.8, 0.8), (100, 256, 256))
        >>> t.stages, t.strides[1], t.kernel_sizes[0], t.divisors, t.padded_shape
        (7, (1, 2, 2), (1, 3, 3), (16, 64, 64), (112, 256, 256))
        >>> t.to_model_table()["depth"], t.features[-1]
        (6, 320)
    """

    spacing: tuple[float, float, float]
    median_shape: tuple[float, float, float]
    kernel_sizes: tuple[Triple, ...]
    strides: tuple[Triple, ...]
    features: tuple[int, ...]
    divisors: Triple
    padded_shape: Triple
    max_filters: int = MAX_FEATURES_3D

    @property
    def stages(self) -> int:
        """Resolution stages, full resolution and bottleneck included."""
        return len(self.strides)

    @property
    def pools_per_axis(self) -> Triple:
        """How many times each axis is halved on the way down."""
        return tuple(int(round(math.log2(d))) for d in self.divisors)

    def to_model_table(self) -> dict:
        """The ``[model]`` table of a preset TOML that builds this network (``config.schema.ModelConfig``'s fields).

        Returns:
            ``{"depth": stages - 1, "base_filters", "max_filters", "kernel_sizes": [[d, h, w], ...],
            "strides": [[d, h, w], ...]}``, stage 0 first, as plain ints and lists.

        Example:
            >>> pool_and_kernels((1.0, 1.0, 1.0), (16, 16, 16)).to_model_table()["strides"]
            [[1, 1, 1], [2, 2, 2], [2, 2, 2]]
        """
        return {"depth": self.stages - 1, "base_filters": int(self.features[0]), "max_filters": int(self.max_filters),
                "kernel_sizes": [list(k) for k in self.kernel_sizes], "strides": [list(s) for s in self.strides]}


def target_spacing(spacings: Sequence[Sequence[float]], shapes: Sequence[Sequence[float]], *,
                   threshold: float = ANISOTROPY_THRESHOLD) -> tuple[float, float, float]:
    """The spacing every case is resampled to: nnU-Net's fullres rule (``determine_fullres_target_spacing``).

    The median spacing per axis, except on an anisotropic axis: where the coarsest median spacing is
    more than ``threshold`` times the largest of the other axes' medians, *and* that axis's median
    size in voxels times ``threshold`` is less than the smallest of the other axes' median sizes.
    Resampling every case to a median of a few thick slices would interpolate the finer cases from
    too few planes, so that axis takes the 10th percentile of its spacings (linear interpolation
    between cases) instead, kept above the others' largest median: a percentile below it becomes
    that median plus 1e-5 mm.

    Args:
        spacings: each case's spacing in mm, per axis.
        shapes: each case's shape in voxels (nnU-Net's: after cropping to the nonzero box), per axis.
        threshold: the anisotropy factor (nnU-Net's ``ANISO_THRESHOLD``, 3).

    Returns:
        The target spacing per axis, in mm.

    Example:
        >>> target_spacing([(1.0, 1.0, 1.0), (1.2, 1.0, 0.9), (1.0, 1.0, 1.0)], [(160, 192, 160)] * 3)
        (1.0, 1.0, 1.0)
        >>> sp = [(5.0, .7, .7), (4.0, .7, .7), (3.0, .7, .7), (5.0, .7, .7), (6.0, .7, .7)]
        >>> target_spacing(sp, [(20, 320, 320)] * 5)  # 5 mm median, 20 slices: the 10th percentile
        (3.4, 0.7, 0.7)
    """
    spacing = np.asarray(spacings, dtype=np.float64)
    sizes = np.asarray(shapes, dtype=np.float64)
    target = np.percentile(spacing, 50, axis=0)
    median_size = np.percentile(sizes, 50, axis=0)
    coarse = int(np.argmax(target))
    others = [axis for axis in range(len(target)) if axis != coarse]
    other_max = max(target[axis] for axis in others)
    coarse_spacing = target[coarse] > threshold * other_max
    few_voxels = median_size[coarse] * threshold < min(median_size[axis] for axis in others)
    if coarse_spacing and few_voxels:
        tenth = float(np.percentile(spacing[:, coarse], 10))
        target[coarse] = tenth if tenth >= other_max else other_max + 1e-5
    return tuple(float(s) for s in target)


def resampled_shape(shape: Sequence[float], spacing: Sequence[float], target: Sequence[float]) -> Triple:
    """A case's shape at ``target`` spacing: round(spacing / target x shape) per axis (nnU-Net's ``compute_new_shape``).

    Args:
        shape: the case's shape in voxels.
        spacing: its spacing in mm.
        target: the spacing it is resampled to.

    Returns:
        The new shape, per axis (Python's rounding: a half rounds to even).

    Example:
        >>> resampled_shape((100, 256, 256), (3.0, 0.78, 0.78), (3.0, 0.8, 0.8))
        (100, 250, 250)
    """
    return tuple(int(round(float(s) / float(t) * float(n))) for n, s, t in zip(shape, spacing, target))


def median_shape(spacings: Sequence[Sequence[float]], shapes: Sequence[Sequence[float]],
                 target: Sequence[float]) -> tuple[float, float, float]:
    """The median case at ``target`` spacing: per axis, the median of every case's ``resampled_shape``.

    This is the shape nnU-Net's ``plan_experiment`` hands ``get_plans_for_configuration`` (its
    ``new_median_shape``), and the whole case bigmem plans a network for. With an even number of
    cases an axis may fall half-way between two sizes; it is kept so, as nnU-Net keeps it.

    Args:
        spacings: each case's spacing in mm.
        shapes: each case's shape in voxels.
        target: the target spacing (``target_spacing``).

    Returns:
        The median shape per axis, in voxels.

    Example:
        >>> median_shape([(1.0, 1.0, 1.0)] * 2, [(100, 90, 80), (101, 90, 80)], (1.0, 1.0, 1.0))
        (100.5, 90.0, 80.0)
    """
    resampled = [resampled_shape(shape, spacing, target) for shape, spacing in zip(shapes, spacings)]
    return tuple(float(m) for m in np.median(np.asarray(resampled, dtype=np.float64), axis=0))


def _halved_axes(spacing: list[float], size: list[float], pools: list[int], min_edge: int,
                 max_pool: int) -> list[int]:
    """The axes the next stage halves (``pool_and_kernels``' rule); none when the descent stops."""
    big_enough = [axis for axis in range(len(size)) if size[axis] >= 2 * min_edge]
    if not big_enough:
        return []
    finest = min(spacing[axis] for axis in big_enough)
    halved = [axis for axis in big_enough if spacing[axis] / finest < 2 and pools[axis] < max_pool]
    if len(halved) == 1 and size[halved[0]] < 3 * min_edge:
        return []
    return halved


def pool_and_kernels(spacing: Sequence[float], shape: Sequence[float], min_edge: int = MIN_EDGE,
                     max_pool: int = NO_POOL_LIMIT, *, base_filters: int = BASE_FEATURES,
                     max_filters: int = MAX_FEATURES_3D) -> Topology:
    """Each stage's kernel and stride per axis for ``shape`` at ``spacing``: nnU-Net's ``get_pool_and_conv_props``.

    Stage by stage, an axis is halved when all of these hold: its current size is at least
    ``2 * min_edge``; its current spacing is less than twice the finest current spacing among the
    axes that may still be halved (coarse axes wait until pooling the fine ones has caught them up);
    it has been halved fewer than ``max_pool`` times. A lone such axis is halved only while its size
    is at least ``3 * min_edge``; when no axis qualifies, the descent stops. Sizes halve rounding
    up, spacings double. A stage's kernel is 3 on every axis whose current spacing is less than
    twice the finest current spacing of all axes, and 1 on the others; once 3, an axis stays 3. The
    bottleneck's kernel is 3 on every axis. Features double per stage from ``base_filters`` up to
    ``max_filters`` (``get_plans_for_configuration``'s ``_features_per_stage``).

    Args:
        spacing: the target spacing in mm, per axis.
        shape: the shape to plan for, in voxels (for bigmem, the median case at ``spacing``).
        min_edge: the smallest edge a feature map may reach (nnU-Net's 4).
        max_pool: the most times an axis may be halved (nnU-Net's planners: no limit).
        base_filters, max_filters: the features at full resolution and their cap (nnU-Net: 32, 320 in 3D).

    Returns:
        A ``Topology``; its ``padded_shape`` is ``shape`` rounded up to a multiple of ``divisors``
        per axis (nnU-Net's ``pad_shape``: a size already a multiple stays).

    Example:
        >>> t = pool_and_kernels((1.0, 1.0, 1.0), (160, 192, 160))
        >>> t.stages, set(t.strides[1:]), set(t.kernel_sizes), t.divisors
        (6, {(2, 2, 2)}, {(3, 3, 3)}, (32, 32, 32))
        >>> pool_and_kernels((3.6, 0.6, 0.6), (20, 320, 320)).strides[1:3]
        ((1, 2, 2), (1, 2, 2))
    """
    dims = len(spacing)
    current_spacing = [float(s) for s in spacing]
    current_size = [float(s) for s in shape]
    pools = [0] * dims
    kernel = [1] * dims
    strides: list[Triple] = [(1,) * dims]
    kernels: list[Triple] = []
    while True:
        halved = _halved_axes(current_spacing, current_size, pools, min_edge, max_pool)
        if not halved:
            break
        finest_of_all = min(current_spacing)
        kernel = [3 if k == 3 or current_spacing[axis] / finest_of_all < 2 else 1 for axis, k in enumerate(kernel)]
        kernels.append(tuple(kernel))
        strides.append(tuple(2 if axis in halved else 1 for axis in range(dims)))
        for axis in halved:
            pools[axis] += 1
            current_spacing[axis] *= 2
            current_size[axis] = float(math.ceil(current_size[axis] / 2))
    kernels.append((3,) * dims)
    divisors = tuple(2 ** p for p in pools)
    padded = tuple(int(math.ceil(float(s) / d) * d) for s, d in zip(shape, divisors))
    features = tuple(min(max_filters, base_filters * 2 ** stage) for stage in range(len(strides)))
    return Topology(spacing=tuple(float(s) for s in spacing), median_shape=tuple(float(s) for s in shape),
                    kernel_sizes=tuple(kernels), strides=tuple(strides), features=features, divisors=divisors,
                    padded_shape=padded, max_filters=max_filters)


def dataset_topology(spacings: Sequence[Sequence[float]], shapes: Sequence[Sequence[float]], *,
                     min_edge: int = MIN_EDGE) -> Topology:
    """The whole-case network for a dataset: ``target_spacing``, its ``median_shape``, then ``pool_and_kernels``.

    Args:
        spacings: each case's spacing in mm (a fingerprint's).
        shapes: each case's shape in voxels at that spacing.
        min_edge: the bottleneck's smallest edge.

    Returns:
        The ``Topology`` of the median case at the target spacing.

    Example:
        >>> dataset_topology([(0.6, 0.6, 3.6)] * 3, [(320, 320, 20)] * 3).kernel_sizes[0]
        (3, 3, 1)
    """
    spacing = target_spacing(spacings, shapes)
    return pool_and_kernels(spacing, median_shape(spacings, shapes, spacing), min_edge)


def batch_cap(dataset_voxels: float, patch_voxels: float, max_dataset_covered: float = MAX_DATASET_COVERED,
              min_batch: int = MIN_BATCH) -> int:
    """The largest batch nnU-Net allows: one step sees at most ``max_dataset_covered`` of the dataset.

    ``get_plans_for_configuration`` rounds ``dataset_voxels * max_dataset_covered / patch_voxels``
    (Python's rounding: a half rounds to even), takes the smaller of that and the batch its memory
    allows, then the larger of the result and ``min_batch``. For any batch of at least
    ``min_batch``, that is ``min(batch, batch_cap(...))``. Against overfitting: on a small dataset,
    a large batch would see much of it in every step. nnU-Net passes ``dataset_voxels`` as the
    median case's voxels at the target spacing times the number of training cases, and
    ``patch_voxels`` as its padded patch's; nnU-Net's ResEnc M, L and XL planners set
    ``max_dataset_covered`` to 1.

    Args:
        dataset_voxels: the dataset's voxels (nnU-Net: median case x cases).
        patch_voxels: one sample's voxels (nnU-Net: its patch; bigmem: the padded median case).
        max_dataset_covered: the share of the dataset one batch may cover.
        min_batch: the floor (nnU-Net's 2).

    Returns:
        The cap, at least ``min_batch``.

    Example:
        >>> batch_cap(70 * 32 ** 3, 32 ** 3), batch_cap(90 * 32 ** 3, 32 ** 3), batch_cap(10 * 32 ** 3, 32 ** 3)
        (4, 4, 2)
    """
    return max(int(round(float(dataset_voxels) * max_dataset_covered / float(patch_voxels))), min_batch)
