"""Training augmentation as objects: a ``Transform`` takes a ``Sample`` and a generator and returns a sample.

MONAI's ``Randomizable`` + ``Compose`` is the model. A chain is a ``Compose`` of transforms built once
from a name in the config (``data.augment``: ``nnunet``, ``light`` or ``none``; ``chain``), and the same
chain runs in the training process and in reader processes, for whole volumes and patches alike.
Validation and predict apply none.

Each transform draws from its own generator, seeded from ``(run seed, sample index, transform name)``:
the sample index fixes the epoch and the case (``pipeline.VolumeLoader.case_index``), so a resumed
run sees exactly the draws an uninterrupted one saw, and adding a transform does not change the
draws of the others.

A sample carries its channels' background value (what padding holds). Pointwise intensity transforms
map it with the same function as the voxels, so padding added later (``pipeline.fit_to_shape``) is
still the background of the transformed image. Voxels a spatial transform brings in from outside the
scan hold the background image value and the background label 0, as nnU-Net trains them (its
out-of-bounds segmentation is -1, then ``RemoveLabelTansform(-1, 0)``). A whole volume keeps its own
shape: what a rotation turns out of the frame is lost, as in nnU-Net. A crop or a patch is read with a
margin (``margin_shape``, nnU-Net's ``initial_patch_size``) and the spatial transform returns the
window trained (``SpatialTransform.output``), so what it turns in is real anatomy, not padding.

``nnunet`` is nnU-Net v2's default training augmentation (``nnUNetTrainer.get_training_transforms``,
batchgeneratorsv2), with its probabilities and ranges; the parameters and the source each was checked
against are listed in docs/augmentation.md. Elastic deformation is off there and absent here.
Rotation, scaling and mirroring are composed into one affine resampling per case (``SpatialTransform``).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from bigmem.errors import ConfigError

PAD_LABEL = 255  # the label no loss or metric counts (``pipeline.PAD_LABEL`` is this value)

# nnU-Net treats a dataset as anisotropic ("dummy 2D" augmentation: rotation only in-plane, up to
# +-180 degrees; no scaling or low-resolution simulation along the thin axis) when its planned patch's
# largest edge is more than 3x its edge along the coarsest-spacing axis: ANISO_THRESHOLD = 3 in
# nnunetv2/configuration.py, decided once per configuration in nnUNetTrainer.
# configure_rotation_dummyDA_mirroring_and_inital_patch_size.
ANISO_THRESHOLD = 3.0


@dataclass
class Sample:
    """One training sample as the transforms see it.

    Attributes:
        image: ``(D, H, W, C)`` float32, normalised.
        label: ``(D, H, W)`` uint8; ``PAD_LABEL`` where nothing is known.
        background: ``(C,)`` float32: each channel's padding value.
        window: ``(start, shape)`` of the region trained, where the sample was read with a margin around it
            (``margin_shape``); the spatial transform resamples into it, and ``Compose`` cuts to it at the end.
    """

    image: np.ndarray
    label: np.ndarray
    background: np.ndarray
    window: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def cropped(self) -> "Sample":
        """The sample cut to its ``window`` (and the window cleared); itself when it has none."""
        if self.window is None:
            return self
        where = tuple(slice(a, a + n) for a, n in zip(*self.window))
        return replace(self, image=np.ascontiguousarray(self.image[where]),
                       label=np.ascontiguousarray(self.label[where]), window=None)

    def __repr__(self) -> str:
        nbytes = self.image.nbytes + self.label.nbytes
        return f"Sample(shape: {tuple(self.image.shape)}; memory: {nbytes / 2**20:.1f} MiB)"


def stream(seed: int, sample_index: int, name: str) -> np.random.Generator:
    """The generator of transform ``name`` for one sample: a pure function of (seed, sample index, name)."""
    return np.random.default_rng([int(seed), int(sample_index), 7, zlib.crc32(name.encode())])


def background_contrast(rng: np.random.Generator, low: float, high: float) -> float:
    """A factor from (low, high) drawn as nnU-Net's ``BGContrast``: below 1 or above 1 with equal chance.

    batchgeneratorsv2's ``BGContrast``: with probability 0.5 (and low < 1) uniform in (low, 1), else
    uniform in (max(low, 1), high); so 0.75..1.25 darkens as often as it brightens.
    """
    if rng.random() < 0.5 and low < 1:
        return float(rng.uniform(low, 1.0))
    return float(rng.uniform(max(low, 1.0), high))


def thin_axis(shape: Sequence[int], spacing: Sequence[float] | None = None) -> int | None:
    """The axis nnU-Net's dummy-2D augmentation leaves alone, or None for a dataset it treats as 3-D.

    Decided once per dataset from the planned shape (a patch, or the median case trained whole):
    the thin axis is the one of coarsest ``spacing`` (nnU-Net transposes it first), else the shortest
    edge; the dataset is anisotropic when the shape's largest edge is more than ``ANISO_THRESHOLD``
    times its edge along that axis.

    Example:
        >>> thin_axis((40, 256, 256)), thin_axis((128, 128, 128)), thin_axis((64, 200, 200), (5.0, 0.8, 0.8))
        (0, None, 0)
    """
    shape = [int(s) for s in shape[:3]]
    if spacing is not None and len(set(float(s) for s in spacing[:3])) > 1:
        axis = int(np.argmax([float(s) for s in spacing[:3]]))
    else:
        axis = int(np.argmin(shape))
    return axis if max(shape) / max(shape[axis], 1) > ANISO_THRESHOLD else None


# nnU-Net grows the region it reads by its smallest scale, 0.85, whatever its scaling range
# (configure_rotation_dummyDA_mirroring_and_inital_patch_size passes (0.85, 1.25) to get_patch_size).
MARGIN_SCALE = 0.85


def margin_shape(shape: Sequence[int], *, rotation_deg: float, rotation_2d_deg: float,
                 dummy_2d_axis: int | None) -> tuple[int, int, int]:
    """The region a crop of ``shape`` is read with, so that most rotation and scaling draws stay inside it.

    nnU-Net's ``initial_patch_size`` (nnunetv2's ``compute_initial_patch_size.get_patch_size``): the
    window's size vector turned by the largest angle (at most 90 degrees) about each axis on its own
    (batchgenerators' ``rotate_coords_3d``: the vector times each axis's rotation matrix), the largest
    absolute value per axis kept, divided by ``MARGIN_SCALE`` and truncated. The axis a dummy-2D dataset
    leaves alone keeps its size. Here an odd growth is rounded up to even, so the window sits centred at a
    whole-voxel offset.

    Example:
        >>> margin_shape((64, 64, 64), rotation_deg=30, rotation_2d_deg=180, dummy_2d_axis=None)
        (102, 102, 102)
    """
    size = np.asarray([int(s) for s in shape[:3]], np.float64)
    angle = math.radians(min(rotation_deg if dummy_2d_axis is None else rotation_2d_deg, 90.0))
    cos, sin = math.cos(angle), math.sin(angle)
    turns = (np.array([[1, 0, 0], [0, cos, -sin], [0, sin, cos]]),  # batchgenerators' x, y and z rotations
             np.array([[cos, 0, sin], [0, 1, 0], [-sin, 0, cos]]),
             np.array([[cos, -sin, 0], [sin, cos, 0], [0, 0, 1]]))
    grown = size.copy()
    for turn in turns:
        grown = np.maximum(grown, np.abs(size @ turn))
    grown = np.floor(grown / MARGIN_SCALE)
    if dummy_2d_axis is not None:
        grown[dummy_2d_axis] = size[dummy_2d_axis]
    extra = np.maximum(grown - size, 0)
    extra += extra % 2
    return tuple(int(s + e) for s, e in zip(size, extra))


TRANSFORMS: dict[str, type["Transform"]] = {}  # every transform by its name: Transform.from_dict reads it


@dataclass(repr=False)
class Transform(abc.ABC):
    """One augmentation: ``apply(sample, rng) -> sample``, run with probability ``probability``.

    A subclass sets ``name`` (unique in a chain: it seeds the transform's own stream), implements
    ``apply``, and says how many float32 channel-volumes it holds beyond its input
    (``extra_volumes``) for the readers' memory plan.
    """

    name: ClassVar[str] = "transform"
    probability: float = 1.0

    @abc.abstractmethod
    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        """The transform applied (always): the new sample (its arrays may be the input's, changed in place)."""

    def __call__(self, sample: Sample, rng: np.random.Generator) -> Sample:
        if self.probability >= 1.0 or rng.random() < self.probability:
            return self.apply(sample, rng)
        return sample

    def __init_subclass__(cls, **kwargs) -> None:
        """A transform that names itself is registered under its name (a subclass that keeps its parent's
        name is the parent's variant, not registered); two transforms of one name are refused."""
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return
        known = TRANSFORMS.get(cls.name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"two transforms are named {cls.name!r}: {known.__qualname__} and {cls.__qualname__}")
        TRANSFORMS[cls.name] = cls

    @abc.abstractmethod
    def extra_volumes(self, channels: int) -> float:
        """Float32 (D, H, W) volumes the transform allocates beyond its input, at most: the readers' memory plan
        counts them, so every transform says (none is assumed)."""

    def to_dict(self) -> dict[str, Any]:
        """The transform's name and parameters (config.json's ``augmentation``)."""
        values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items() if not k.startswith("_")}
        return {"name": self.name, **values}

    @staticmethod
    def from_dict(values: dict[str, Any]) -> "Transform":
        """The transform ``to_dict`` wrote: its class by ``name`` (``TRANSFORMS``), its tuples as tuples.

        Raises:
            ValueError: no transform has that name.
        """
        values = dict(values)
        name = values.pop("name", None)
        kind = TRANSFORMS.get(name)
        if kind is None:
            raise ValueError(f"no transform is named {name!r}: expected one of {', '.join(TRANSFORMS)}")
        tuples = {f.name for f in dataclasses.fields(kind) if str(f.type).startswith("tuple")}
        return kind(**{k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in values.items()})

    def __repr__(self) -> str:
        values = ", ".join(f"{k}={v}" for k, v in self.to_dict().items() if k != "name")
        return f"{type(self).__name__}({values})"


def _rotation(axis: int, angle: float) -> np.ndarray:
    """The 3x3 rotation by ``angle`` radians in the plane of the two axes other than ``axis``."""
    a, b = [i for i in range(3) if i != axis]
    matrix = np.eye(3)
    cos, sin = math.cos(angle), math.sin(angle)
    matrix[a, a], matrix[a, b], matrix[b, a], matrix[b, b] = cos, -sin, sin, cos
    return matrix


def affine_resample(sample: Sample, matrix: np.ndarray, *, outside_label: int = PAD_LABEL) -> Sample:
    """``sample`` resampled at ``matrix @ (x - centre) + centre`` for each voxel x, into its ``window``.

    The output is the sample's window (the whole sample where it has none), and ``centre`` is the
    window's centre in both grids, so rotation and scaling turn about the middle of what is trained.
    Image channels are interpolated trilinearly. The label follows nnU-Net (batchgeneratorsv2 0.3.6's
    ``SpatialTransform``, ``mode_seg='bilinear'``, ``seg_tiebreak='nearest'``): each label value's mask
    is interpolated trilinearly and a voxel takes the value whose mask is largest there; where the
    nearest neighbour's label shares the top score (a sample point exactly between two labels), it
    takes that label. Thin structures keep their interpolated outline rather than nearest-neighbour
    stairs. (At an exact half-voxel scipy's nearest neighbour rounds up, torch's rounds half to even.) What
    comes from outside the sample is the channel's background and ``outside_label``. A matrix that only
    flips axes is applied as flips (exact, and no resampling).

    Args:
        sample: the sample; its arrays are not changed.
        matrix: ``(3, 3)``: output voxel offsets from the centre -> input offsets.
        outside_label: the label of what comes from outside (nnU-Net's background 0 for its spatial
            transform; default ``PAD_LABEL``).

    Returns:
        A new ``Sample`` of the window's shape, without a window.
    """
    from scipy import ndimage

    matrix = np.asarray(matrix, np.float64)
    start, out_shape = sample.window or ((0, 0, 0), sample.label.shape)
    if np.allclose(np.abs(matrix), np.eye(3)):
        axes = tuple(int(a) for a in np.flatnonzero(np.diag(matrix) < 0))
        cut = sample.cropped()  # a window sits centred at a whole-voxel offset (margin_shape): flips stay exact
        if not axes:
            return cut
        return replace(cut, image=np.ascontiguousarray(np.flip(cut.image, axes)),
                       label=np.ascontiguousarray(np.flip(cut.label, axes)))
    out_shape = tuple(int(n) for n in out_shape)
    out_centre = (np.asarray(out_shape, np.float64) - 1.0) / 2.0
    centre = np.asarray(start, np.float64) + out_centre
    offset = centre - matrix @ out_centre
    image = np.empty(out_shape + sample.image.shape[3:], np.float32)
    channel = np.empty(out_shape, np.float32)
    for c in range(sample.image.shape[-1]):
        source = np.ascontiguousarray(sample.image[..., c])
        ndimage.affine_transform(source, matrix, offset, output=channel, output_shape=out_shape, order=1,
                                 mode="constant", cval=float(sample.background[c]), prefilter=False)
        image[..., c] = channel
    label = resample_label(sample.label, matrix, offset, out_shape)
    if outside_label != PAD_LABEL:
        label[label == PAD_LABEL] = outside_label
    return replace(sample, image=image, label=label, window=None)


# Mixed-cell points are interpolated slab by slab of the output, each slab at most 1/32 of the volume: their
# indices, coordinates and scores (~72 bytes a point) stay under 2.25 bytes per voxel however many mix.
LABEL_SLABS = 32


def resample_label(label: np.ndarray, matrix: np.ndarray, offset: np.ndarray,
                   out_shape: Sequence[int] | None = None) -> np.ndarray:
    """``label`` resampled as nnU-Net resamples segmentations, computing the interpolation only where it matters.

    The rule (batchgeneratorsv2's ``mode_seg='bilinear'``, ``seg_tiebreak='nearest'``): each label's mask
    is interpolated trilinearly and the largest wins; a tie goes to the nearest neighbour's label;
    outside the volume is ``PAD_LABEL``. Trilinear interpolation at ``x`` reads only the 2x2x2 source
    cell at ``floor(x)``: where that cell holds one label, every mask is 0 or 1 there and the answer is
    that label, which the nearest neighbour also is. So the nearest neighbour is taken everywhere (one
    uint8 pass), and the per-label interpolation runs only at the points whose cell mixes labels (or
    reaches past the volume), in batches (``scipy.ndimage.map_coordinates``). Exactly the per-label rule
    (``tests/data/test_transforms.py`` checks it against the plain loop over labels), several times
    faster: a boundary is a thin share of a scan.

    Args:
        label: ``(D, H, W)`` uint8.
        matrix, offset: output voxel x reads input ``matrix @ x + offset``.
        out_shape: the output grid (default: ``label``'s shape).

    Returns:
        The ``out_shape`` uint8 label of the output grid.
    """
    from scipy import ndimage

    shape = label.shape
    out_shape = tuple(int(n) for n in (out_shape or shape))
    # the nearest neighbour: the answer off boundaries
    out = ndimage.affine_transform(label, matrix, offset, output=np.uint8, output_shape=out_shape, order=0,
                                   mode="constant", cval=PAD_LABEL, prefilter=False)
    # the cell at floor(x): order-0 sampling at x - 0.5 rounds to it
    at_cell = ndimage.affine_transform(_mixed_cells(label).view(np.uint8), matrix, offset - 0.5, output=np.uint8,
                                       output_shape=out_shape, order=0, mode="constant", cval=1, prefilter=False)
    if not at_cell.any():
        return out
    values = np.unique(label)
    mask = np.empty(shape, np.float32)
    plane = out_shape[1] * out_shape[2]
    rows = max(1, out_shape[0] // LABEL_SLABS)
    flat_out = out.reshape(-1)
    for first in range(0, out_shape[0], rows):
        batch = np.flatnonzero(at_cell[first:first + rows]) + first * plane
        if batch.size:
            coords = matrix @ np.stack(np.unravel_index(batch, out_shape)).astype(np.float64) + offset[:, None]
            flat_out[batch] = _largest_mask(label, values, mask, coords, flat_out[batch])
    return out


def _mixed_cells(label: np.ndarray) -> np.ndarray:
    """``mixed[i, j, k]``: the cell of corners (i..i+1, j..j+1, k..k+1) holds more than one label (a cell past
    the last voxel counts as mixed: ``resample_label`` settles it exactly)."""
    shape = label.shape
    mixed = np.ones(shape, bool)
    inner = mixed[:-1, :-1, :-1]
    inner[...] = False
    corner = label[:-1, :-1, :-1]
    for dd in (0, 1):
        for dh in (0, 1):
            for dw in (0, 1):
                if dd or dh or dw:
                    inner |= label[dd:shape[0] - 1 + dd, dh:shape[1] - 1 + dh, dw:shape[2] - 1 + dw] != corner
    return mixed


def _largest_mask(label: np.ndarray, values: np.ndarray, mask: np.ndarray, coords: np.ndarray,
                  nearest: np.ndarray) -> np.ndarray:
    """At ``coords``, the label whose trilinearly interpolated mask is largest; a tie goes to ``nearest`` (the
    nearest neighbour's label there); nothing above 0 is ``PAD_LABEL``. ``mask``: a float32 buffer of the label's
    shape."""
    from scipy import ndimage

    best = np.zeros(len(nearest), np.float32)
    chosen = np.full(len(nearest), PAD_LABEL, np.uint8)
    nearest_score = np.full(len(nearest), -1.0, np.float32)
    for value in values:
        np.copyto(mask, label == value)
        score = ndimage.map_coordinates(mask, coords, output=np.float32, order=1, mode="constant", cval=0.0,
                                        prefilter=False)
        better = score > best
        chosen[better] = value
        np.maximum(best, score, out=best)
        mine = nearest == value
        nearest_score[mine] = score[mine]
    tied = (nearest_score == best) & (best > 0)
    chosen[tied] = nearest[tied]
    return chosen


@dataclass(repr=False)
class SpatialTransform(Transform):
    """Rotation, scaling and mirroring, composed into one affine resampling of the whole sample.

    nnU-Net's ``SpatialTransform`` (p_rotation 0.2, each axis's angle uniform in +-``rotation_deg``;
    p_scaling 0.2, one factor uniform in ``scaling`` for every axis) followed by its
    ``MirrorTransform`` (each axis flipped with probability 0.5). The shape is kept and rotation is
    about the centre of the sample's window; a factor above 1 samples a larger region (the anatomy
    looks smaller). On a dataset ``thin_axis`` calls anisotropic (``dummy_2d_axis``, decided once from
    its planned shape) rotation is only about the thin axis, up to +-``rotation_2d_deg``, and scaling is
    in-plane: nnU-Net's dummy-2D augmentation. What comes from outside the sample is background (label 0).

    Args:
        p_rotation, rotation_deg, rotation_2d_deg: probability and range of the rotation (degrees).
        p_scaling, scaling: probability and range of the scale factor.
        mirror_axes: the axes that may be flipped (each with probability 0.5; () for none).
        dummy_2d_axis: the axis dummy-2D augmentation leaves alone, or None (a 3-D dataset).
    """

    name: ClassVar[str] = "spatial"
    p_rotation: float = 0.2
    rotation_deg: float = 30.0
    rotation_2d_deg: float = 180.0
    p_scaling: float = 0.2
    scaling: tuple[float, float] = (0.7, 1.4)
    mirror_axes: tuple[int, ...] = (0, 1, 2)
    dummy_2d_axis: int | None = None

    def matrix(self, rng: np.random.Generator) -> np.ndarray:
        """The draw's 3x3 output -> input matrix: Rz @ Ry @ Rx @ scale (batchgeneratorsv2's order) @ mirror."""
        thin = self.dummy_2d_axis
        rotation = np.eye(3)
        if rng.random() < self.p_rotation:
            if thin is None:
                angles = [math.radians(rng.uniform(-self.rotation_deg, self.rotation_deg)) for _ in range(3)]
                rotation = _rotation(2, angles[2]) @ _rotation(1, angles[1]) @ _rotation(0, angles[0])
            else:
                rotation = _rotation(thin, math.radians(rng.uniform(-self.rotation_2d_deg, self.rotation_2d_deg)))
        scale = np.eye(3)
        if rng.random() < self.p_scaling:
            factor = rng.uniform(*self.scaling)
            scale = np.diag([1.0 if axis == thin else factor for axis in range(3)])
        flips = rng.random(3) < 0.5
        mirror = np.diag([-1.0 if flips[axis] and axis in self.mirror_axes else 1.0 for axis in range(3)])
        return rotation @ scale @ mirror

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        return affine_resample(sample, self.matrix(rng), outside_label=0)

    def margin(self, shape: Sequence[int]) -> tuple[int, int, int]:
        """The region a crop of ``shape`` is read with (``margin_shape``)."""
        return margin_shape(shape, rotation_deg=self.rotation_deg, rotation_2d_deg=self.rotation_2d_deg,
                            dummy_2d_axis=self.dummy_2d_axis)

    def extra_volumes(self, channels: int) -> float:
        # Counted: a new image (C channels) and one output channel; then, for the label, the mask being
        # resampled (float32), the new label, the mixed-cell flags and their resampling and one label == value
        # (uint8/bool: a quarter each), and one slab's mixed-cell points (``LABEL_SLABS``: at most 2.25 bytes
        # per voxel): C + 3.6 volumes. Measured (benchmarks/performance/bench_augment.py, the peak a fresh
        # process adds): 4.34 volumes at 512x512x256x1 and 8.19 at 240x240x155x4, so 1.28 per channel, not
        # 1: the line through both, rounded up, is what the plan takes.
        return 1.3 * channels + 3.1


@dataclass(repr=False)
class Mirror(Transform):
    """Each axis in ``axes`` flipped with probability 0.5 (no resampling)."""

    name: ClassVar[str] = "mirror"
    axes: tuple[int, ...] = (0, 1, 2)

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        flips = rng.random(3) < 0.5
        return affine_resample(sample, np.diag([-1.0 if flips[a] and a in self.axes else 1.0 for a in range(3)]))

    def extra_volumes(self, channels: int) -> float:
        return channels + 0.25


def _channels(image: np.ndarray, rng: np.random.Generator, p_per_channel: float) -> list[int]:
    """The channels a per-channel transform touches: each with probability ``p_per_channel``."""
    return [c for c in range(image.shape[-1]) if p_per_channel >= 1 or rng.random() < p_per_channel]


@dataclass(repr=False)
class GaussianNoise(Transform):
    """Additive Gaussian noise: nnU-Net's ``GaussianNoiseTransform`` (p 0.1, "noise_variance" (0, 0.1)).

    One draw for every channel (synchronize_channels), a fresh field per channel. batchgeneratorsv2
    uses the drawn "variance" as the noise's standard deviation (``normal_(mean=0.0, std=sigma)``),
    and so does bigmem. The background value is unchanged (the noise has mean 0).
    """

    name: ClassVar[str] = "noise"
    probability: float = 0.1
    variance: tuple[float, float] = (0.0, 0.1)

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        std = rng.uniform(*self.variance)
        image = sample.image
        for c in range(image.shape[-1]):
            noise = rng.standard_normal(image.shape[:3], dtype=np.float32)
            noise *= np.float32(std)
            image[..., c] += noise
        return sample

    def extra_volumes(self, channels: int) -> float:
        return 1.0  # one channel's noise field at a time


@dataclass(repr=False)
class GaussianBlur(Transform):
    """Gaussian smoothing: nnU-Net's ``GaussianBlurTransform`` (p 0.2, sigma (0.5, 1), p 0.5 per channel).

    Each chosen channel gets its own sigma per axis (synchronize_channels and synchronize_axes off).
    """

    name: ClassVar[str] = "blur"
    probability: float = 0.2
    sigma: tuple[float, float] = (0.5, 1.0)
    p_per_channel: float = 0.5

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        from scipy import ndimage

        image = sample.image
        for c in _channels(image, rng, self.p_per_channel):
            sigmas = [float(rng.uniform(*self.sigma)) for _ in range(3)]
            # batchgeneratorsv2 (gaussian_blur.py, blur_dimension with truncate=6 and _compute_kernel_size): a
            # separable kernel whose whole length is the odd number nearest 6 sigma + 0.5 (about +-3 sigma; scipy's
            # truncate is a radius, so the radius is given), reflect padding (scipy's "mirror")
            radius = [int(round((6.0 * s + 0.5 - 1) / 2)) for s in sigmas]
            image[..., c] = ndimage.gaussian_filter(image[..., c], sigmas, mode="mirror", radius=radius)
        return sample

    def extra_volumes(self, channels: int) -> float:
        return 2.0  # the filtered channel and scipy's buffer between the per-axis passes


@dataclass(repr=False)
class Brightness(Transform):
    """Each channel multiplied by a factor: nnU-Net's ``MultiplicativeBrightnessTransform`` (p 0.15, 0.75..1.25)."""

    name: ClassVar[str] = "brightness"
    probability: float = 0.15
    multiplier: tuple[float, float] = (0.75, 1.25)

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        for c in range(sample.image.shape[-1]):
            factor = np.float32(background_contrast(rng, *self.multiplier))
            sample.image[..., c] *= factor
            sample.background[c] *= factor
        return sample

    def extra_volumes(self, channels: int) -> float:
        return 0.0


@dataclass(repr=False)
class Contrast(Transform):
    """Contrast about each channel's mean: nnU-Net's ``ContrastTransform`` (p 0.15, 0.75..1.25, range kept).

    ``(x - mean) * factor + mean``, then clipped to the channel's former minimum and maximum
    (preserve_range).
    """

    name: ClassVar[str] = "contrast"
    probability: float = 0.15
    factor: tuple[float, float] = (0.75, 1.25)
    preserve_range: bool = True

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        image = sample.image
        for c in range(image.shape[-1]):
            factor = background_contrast(rng, *self.factor)
            channel = image[..., c]
            mean = float(channel.mean(dtype=np.float64))
            low, high = float(channel.min()), float(channel.max())
            channel -= np.float32(mean)
            channel *= np.float32(factor)
            channel += np.float32(mean)
            value = (float(sample.background[c]) - mean) * factor + mean
            if self.preserve_range:
                np.clip(channel, low, high, out=channel)
                value = min(max(value, low), high)
            sample.background[c] = value
        return sample

    def extra_volumes(self, channels: int) -> float:
        return 0.0


@dataclass(repr=False)
class LowResolution(Transform):
    """Simulated low resolution: nnU-Net's ``SimulateLowResolutionTransform`` (p 0.25, zoom 0.5..1, p 0.5 a channel).

    A chosen channel is downsampled by one factor on every axis (synchronize_axes; the thin axis of a
    dummy-2D dataset, ``dummy_2d_axis``, is left alone) with nearest-neighbour sampling, then upsampled back to its
    shape by linear interpolation.
    """

    name: ClassVar[str] = "lowres"
    probability: float = 0.25
    scale: tuple[float, float] = (0.5, 1.0)
    p_per_channel: float = 0.5
    dummy_2d_axis: int | None = None

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        from scipy import ndimage

        image = sample.image
        shape = image.shape[:3]
        thin = self.dummy_2d_axis
        for c in _channels(image, rng, self.p_per_channel):
            factor = float(rng.uniform(*self.scale))
            small = tuple(s if axis == thin else max(1, round(s * factor)) for axis, s in enumerate(shape))
            # nearest-exact down (each small voxel takes the source voxel under its centre), linear up
            index = np.ix_(*[np.minimum(((np.arange(n) + 0.5) * s / n).astype(np.int64), s - 1)
                             for n, s in zip(small, shape)])
            low = np.ascontiguousarray(image[..., c][index])
            image[..., c] = ndimage.zoom(low, [s / n for s, n in zip(shape, small)], order=1, mode="nearest",
                                         grid_mode=True, output=np.float32)
        return sample

    def extra_volumes(self, channels: int) -> float:
        return 2.0  # the downsampled channel (up to a whole one at zoom 1) and zoom's full-size output


@dataclass(repr=False)
class Gamma(Transform):
    """A gamma curve on each channel: nnU-Net's ``GammaTransform`` (gamma 0.7..1.5, statistics retained).

    The channel is scaled to [0, 1] by its minimum and range, raised to gamma, and scaled back;
    with ``retain_stats`` its mean and standard deviation are then restored. With ``invert`` it is
    negated before and after (the curve bends the other end). nnU-Net runs it twice: inverted with
    p 0.1, plain with p 0.3.
    """

    name: ClassVar[str] = "gamma"
    probability: float = 0.3
    gamma: tuple[float, float] = (0.7, 1.5)
    invert: bool = False
    retain_stats: bool = True

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        image = sample.image
        sign = -1.0 if self.invert else 1.0
        for c in range(image.shape[-1]):
            gamma = background_contrast(rng, *self.gamma)
            channel = image[..., c]
            work = channel.astype(np.float64)
            if self.invert:
                work *= -1.0
            value = float(sample.background[c]) * sign
            mean, std = work.mean(), work.std(ddof=1)  # torch.std: unbiased
            low = work.min()
            spread = max(work.max() - low, 1e-7)
            work -= low
            work /= spread
            np.power(work, gamma, out=work)
            work *= spread
            work += low
            value = min(max((value - low) / spread, 0.0), 1.0) ** gamma * spread + low
            if self.retain_stats:
                new_mean, new_std = work.mean(), max(work.std(ddof=1), 1e-7)
                work -= new_mean
                work *= std / new_std
                work += mean
                value = (value - new_mean) * std / new_std + mean
            if self.invert:
                work *= -1.0
            channel[...] = work
            sample.background[c] = value * sign
        return sample

    def extra_volumes(self, channels: int) -> float:
        return 4.0  # one channel in float64, and numpy's float64 deviations inside its std


@dataclass(repr=False)
class InvertedGamma(Gamma):
    """``Gamma`` on the negated channel (nnU-Net: p 0.1); its own name, so its own random stream."""

    name: ClassVar[str] = "gamma_inverted"
    probability: float = 0.1
    invert: bool = True


@dataclass(repr=False)
class ScaleShift(Transform):
    """Each channel scaled by U(1 - scale, 1 + scale) and shifted by U(-shift, shift) (standard deviations).

    MONAI's RandScaleIntensity and RandShiftIntensity; the ``light`` chain's intensity transform.
    """

    name: ClassVar[str] = "scale_shift"
    scale: float = 0.1
    shift: float = 0.1

    def apply(self, sample: Sample, rng: np.random.Generator) -> Sample:
        for c in range(sample.image.shape[-1]):
            factor = np.float32(rng.uniform(1.0 - self.scale, 1.0 + self.scale)) if self.scale else np.float32(1.0)
            offset = np.float32(rng.uniform(-self.shift, self.shift)) if self.shift else np.float32(0.0)
            sample.image[..., c] *= factor
            sample.image[..., c] += offset
            sample.background[c] = sample.background[c] * factor + offset
        return sample

    def extra_volumes(self, channels: int) -> float:
        return 0.0


@dataclass
class Compose:
    """Transforms applied in order, each with its own random stream.

    Args:
        transforms: the chain; their names must be unique.
        name: what the chain is called (config.json's ``augmentation.chain``).

    Example:
        >>> chain = Compose([Mirror(), GaussianNoise(probability=1.0)], name="custom")
        >>> out = chain(Sample(np.zeros((8, 8, 8, 1), np.float32), np.zeros((8, 8, 8), np.uint8),
        ...                    np.zeros(1, np.float32)), seed=0, sample_index=3)
    """

    transforms: list[Transform] = field(default_factory=list)
    name: str = "custom"

    def __post_init__(self) -> None:
        names = [t.name for t in self.transforms]
        if len(set(names)) != len(names):
            raise ValueError(f"transform names repeat in {names}: each seeds its own stream")

    def __call__(self, sample: Sample, *, seed: int, sample_index: int) -> Sample:
        for transform in self.transforms:
            sample = transform(sample, stream(seed, sample_index, transform.name))
        return sample.cropped()

    def __bool__(self) -> bool:
        return bool(self.transforms)

    @property
    def spatial(self) -> SpatialTransform | None:
        return next((t for t in self.transforms if isinstance(t, SpatialTransform)), None)

    def read_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The region a crop or patch of ``shape`` is read with: with a margin where the chain resamples
        (``SpatialTransform.margin``), else ``shape``."""
        spatial = self.spatial
        return spatial.margin(shape) if spatial else tuple(int(s) for s in shape[:3])

    def working_bytes(self, shape: Sequence[int], channels: int, *, cropped: bool = False) -> int:
        """Bytes the chain holds beyond a sample of ``shape`` at its worst transform (float32 volumes of ``shape``);
        with ``cropped`` (a crop or patch, read with ``read_shape``'s margin), also the margin's voxels as read
        (``channels`` float32 and a uint8 label each)."""
        voxels = math.prod(int(s) for s in shape[:3])
        worst = max((t.extra_volumes(channels) for t in self.transforms), default=0.0)
        margin = math.prod(self.read_shape(shape)) - voxels if cropped else 0
        return int(math.ceil(worst * voxels * 4 + margin * (channels * 4 + 1)))

    def to_dict(self) -> dict[str, Any]:
        """``{"chain": name, "transforms": [each transform's to_dict]}`` (config.json's ``augmentation``)."""
        return {"chain": self.name, "transforms": [t.to_dict() for t in self.transforms]}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Compose":
        """The chain ``to_dict`` wrote (config.json's ``augmentation``), each transform by its name.

        Example:
            >>> Compose.from_dict(chain("nnunet").to_dict()) == chain("nnunet")
            True
        """
        return cls([Transform.from_dict(t) for t in values["transforms"]], name=values["chain"])


@dataclass(frozen=True)
class _Parts:
    """What a named chain is built from: nnU-Net's spatial and intensity parts, and ``light``'s settings."""

    spatial: list[Transform]
    intensities: list[Transform]
    flip: bool
    intensity: tuple[float, float]


def _light(parts: _Parts) -> list[Transform]:
    transforms: list[Transform] = [Mirror()] if parts.flip else []
    if any(parts.intensity):
        transforms.append(ScaleShift(scale=float(parts.intensity[0]), shift=float(parts.intensity[1])))
    return transforms


# The named chains (``data.augment``): each builds its transforms from the parts.
CHAINS: dict[str, Callable[[_Parts], list[Transform]]] = {
    "nnunet": lambda parts: parts.spatial + parts.intensities,
    "spatial": lambda parts: parts.spatial,
    "intensity": lambda parts: parts.intensities,
    "light": _light,
    "none": lambda parts: [],
}


def chain(name: str, *, flip: bool = True, intensity: tuple[float, float] = (0.1, 0.1),
          planned_shape: Sequence[int] | None = None, spacing: Sequence[float] | None = None) -> Compose:
    """The named augmentation chain.

    Args:
        name: ``nnunet`` (nnU-Net v2's default training augmentation), ``spatial`` or ``intensity`` (its
            spatial part: rotation, scaling, mirroring; or its intensity part: noise, blur, brightness,
            contrast, low resolution, gamma), ``light`` (flips and a scale/shift of intensity) or ``none``.
        flip: mirror every axis (``light``; default True).
        intensity: ``(scale, shift)`` of ``light``'s ``ScaleShift`` (default (0.1, 0.1); (0, 0): none).
        planned_shape, spacing: the dataset's planned shape (the crop or patch trained, else the median
            case) and its voxel spacing, from which ``thin_axis`` decides dummy-2D augmentation once for
            every sample (default None: 3-D).

    Returns:
        The ``Compose``.

    Raises:
        ConfigError: an unknown name (naming ``data.augment`` and the valid names).

    Example:
        >>> [t.name for t in chain("nnunet").transforms][:3]
        ['spatial', 'noise', 'blur']
    """
    if name not in CHAINS:
        raise ConfigError("data.augment", f"Invalid {{field}} {name!r}: expected one of {', '.join(CHAINS)}.")
    thin = thin_axis(planned_shape, spacing) if planned_shape is not None else None
    parts = _Parts([SpatialTransform(dummy_2d_axis=thin)],
                   [GaussianNoise(), GaussianBlur(), Brightness(), Contrast(), LowResolution(dummy_2d_axis=thin),
                    InvertedGamma(), Gamma()], flip, intensity)
    return Compose(CHAINS[name](parts), name=name)
