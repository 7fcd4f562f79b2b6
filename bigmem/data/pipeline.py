"""Whole-volume input for the big-memory path.

Each case is read whole from the store and normalised as the store's scheme says (``preprocess``:
CT window or per-case z-score, with the statistics convert recorded). By default it is
then trained at its own shape, padded (never cropped) up to a multiple of ``2**depth`` on each
axis; with a fixed ``shape`` it is cropped (at a random offset) or padded to that shape instead.
Padded voxels hold the channel's background value (what its darkest voxel normalises to, not the
mean) and the label ``PAD_LABEL``, which the loss, the Dice and the metrics leave out. Samples
are augmented at their own shape before any padding (``transforms``: one chain, built once, run
here or in the reader processes) and batched (a batch of different shapes is padded to its
bounding shape; batches group similar shapes) into a ``tf.data`` pipeline that prefetches ahead
of the step.

The order, crops and augmentation draws are a pure function of (seed, sample index): step ``s``
always sees the same cases augmented the same way, so a resumed run continues exactly where the
checkpoint left it. Reads happen
in the training process (``num_workers=0``) or in worker processes started with 'spawn', each
opening its own HDF5 handle (h5py's global lock makes reader threads useless).
"""

from __future__ import annotations

import collections
import functools
import math
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import shared_memory
from typing import Iterator, Sequence

import numpy as np

from bigmem.data.preprocess import case_statistics
from bigmem.data.store import HDF5VolumeStore
from bigmem.data.transforms import PAD_LABEL, Compose, Sample
from bigmem.errors import DataError
from bigmem.units import as_shape, format_shape

# PAD_LABEL (255, from transforms): the label of padded voxels. one_hot of it is all zeros, so the loss,
# the Dice and the metrics leave those voxels out without a second mask tensor (classes are 0..254).
__all__ = ["PAD_LABEL", "VolumeLoader", "load_sample", "load_patch", "fit_to_shape", "padded_shape", "trained_shape"]

Shape = tuple[int, int, int]


def padded_shape(shape: Sequence[int], multiple: int | Sequence[int]) -> Shape:
    """``shape`` with each axis rounded up to a multiple of ``multiple`` (one for every axis, or per axis).

    Example:
        >>> padded_shape((240, 240, 155), 16), padded_shape((33, 96, 96), (4, 32, 32))
        ((240, 240, 160), (36, 96, 96))
    """
    return tuple(-(-int(s) // m) * m for s, m in zip(shape[:3], as_shape(multiple)))  # type: ignore[return-value]


def trained_shape(shape: Sequence[int], *, pad_multiple: int | Sequence[int] | None,
                  fixed: Sequence[int] | None = None) -> Shape:
    """The shape a case trains at on its own: ``fixed`` when given, else its own ``shape`` padded (never
    cropped) up to a multiple of ``pad_multiple`` on each axis.

    The one rule ``VolumeLoader.case_shape`` and ``data.derived.trained_shapes`` (which the memory
    pre-flight, ``bigmem plan`` and ``bigmem compare`` read) share; ``data.derived.pad_multiple``
    decides a config's multiple.

    Args:
        shape: the case's own ``(D, H, W)`` in voxels (further axes are ignored).
        pad_multiple: the multiple each axis is padded up to (one, or per axis); needed unless ``fixed`` is given.
        fixed: the ``(D, H, W)`` every case is cropped or padded to (``data.shape``); None
            (default): each case at its own shape.

    Returns:
        ``(D, H, W)``.

    Raises:
        ValueError: ``fixed`` is None and ``pad_multiple`` is not a positive integer.

    Example:
        >>> trained_shape((33, 34, 35), pad_multiple=8), trained_shape((33, 34, 35), pad_multiple=8, fixed=(32, 32, 32))
        ((40, 40, 40), (32, 32, 32))
    """
    if fixed is not None:
        return tuple(int(s) for s in fixed)  # type: ignore[return-value]
    multiples = (pad_multiple,) * 3 if isinstance(pad_multiple, (int, float)) else tuple(pad_multiple or ())
    if len(multiples) != 3 or any(isinstance(m, bool) or int(m) != m or m < 1 for m in multiples):
        raise ValueError(f"pad_multiple {pad_multiple!r}: expected a positive integer to pad a case's own shape to "
                         "(the network's size contract, 2**depth: data.derived.pad_multiple), or a fixed shape.")
    return padded_shape(shape, pad_multiple)


def bounding_shape(shapes: Sequence[Sequence[int]]) -> Shape:
    """The smallest shape that holds each of ``shapes`` (their elementwise maximum)."""
    return tuple(int(max(axis)) for axis in zip(*shapes))  # type: ignore[return-value]


def case_for_sample(sample_index: int, num_cases: int, seed: int) -> int:
    """The case index of the ``sample_index``-th sample: a fresh permutation every epoch.

    Args:
        sample_index: the sample's position in the stream, from 0 (epoch = index // num_cases).
        num_cases: cases in the store.
        seed: the run's seed.

    Returns:
        An index into the store's sorted case ids, in ``[0, num_cases)``.
    """
    epoch, position = divmod(sample_index, num_cases)
    return int(np.random.default_rng([seed, epoch]).permutation(num_cases)[position])


def grouped(shapes: Sequence[Sequence[int]], batch_size: int) -> bool:
    """Whether batches group shapes (``epoch_order``): several shapes and more than one sample a batch."""
    return batch_size > 1 and len({tuple(s) for s in shapes}) > 1


@functools.lru_cache(maxsize=8)
def epoch_order(epoch: int, shapes: tuple[tuple[int, int, int], ...], batch_size: int, seed: int) -> tuple[int, ...]:
    """The cases of one epoch in sample order; where batches group shapes, each batch holds one group.

    A fresh permutation per epoch (``case_for_sample``'s). Where cases differ in shape and batches
    hold more than one (``grouped``), the permutation is sorted by (voxels, shape) (stable, so
    equal shapes keep their random order) and cut into whole batches; a short last batch is filled
    with the cases just before it in that order (each case is seen at least once an epoch, a few
    twice), and the batches are shuffled. A batch is padded to its bounding shape, and similar
    shapes waste the least. Otherwise it is the permutation itself, and batches may run across
    epochs as they always did.

    Args:
        epoch: the epoch, from 0.
        shapes: each case's shape as trained alone (its padded shape).
        batch_size: samples per (global) batch.
        seed: the run's seed.

    Returns:
        Case indices, one per sample of the epoch: ``len(shapes)`` of them, or, when grouped, a
        whole number of batches.
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(shapes))
    if not grouped(shapes, batch_size):
        return tuple(int(i) for i in order)
    order = [int(i) for i in order[np.argsort(_sort_keys([shapes[i] for i in order]), kind="stable")]]
    short = -len(order) % batch_size  # samples the last batch lacks
    if short:  # filled with the cases just before it in the sorted order: its own group's neighbours
        last = len(order) - (batch_size - short)
        order += (order[max(0, last - short):last] + order * batch_size)[:short]
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    return tuple(int(i) for b in rng.permutation(len(batches)) for i in batches[b])


def _sort_keys(shapes: Sequence[Sequence[int]]) -> np.ndarray:
    """One integer rank per shape, ordered by (voxels, shape): argsort's key for grouping."""
    keys = sorted({(math.prod(s), *s) for s in shapes})
    rank = {key: i for i, key in enumerate(keys)}
    return np.array([rank[(math.prod(s), *s)] for s in shapes])


def random_crop(image: np.ndarray, label: np.ndarray, shape: Sequence[int], rng: np.random.Generator):
    """Crop each spatial axis longer than ``shape`` at a random offset (one draw per cropped axis, in axis order).

    Returns:
        ``(image, label)``, views where nothing was cropped.
    """
    for axis in range(3):
        size, target = label.shape[axis], int(shape[axis])
        if size > target:
            start = int(rng.integers(0, size - target + 1))
            image = np.take(image, np.arange(start, start + target), axis=axis)
            label = np.take(label, np.arange(start, start + target), axis=axis)
    return image, label


def with_margin(start: Sequence[int], size: Sequence[int], case_shape: Sequence[int],
                augment: Compose | None) -> tuple[tuple[int, ...], tuple[int, ...], tuple | None]:
    """The region to read for a window ``(start, size)`` of a case: grown to the chain's ``read_shape`` where it
    resamples (nnU-Net's initial patch), clipped to the case.

    Returns:
        ``(read_start, read_size, window)``: ``window`` is ``(start, size)`` within the region read, or None
        where the region is the window itself.
    """
    start, size = [int(v) for v in start], [int(v) for v in size]
    if not augment or tuple(size) == tuple(int(v) for v in case_shape):
        return tuple(start), tuple(size), None
    read = augment.read_shape(size)
    low = [max(0, a - (r - n) // 2) for a, r, n in zip(start, read, size)]
    high = [min(c, a + n + (r - n) // 2) for a, r, n, c in zip(start, read, size, case_shape)]
    if low == start and [a + n for a, n in zip(start, size)] == high:
        return tuple(start), tuple(size), None
    window = (tuple(a - b for a, b in zip(start, low)), tuple(size))
    return tuple(low), tuple(b - a for a, b in zip(low, high)), window


def crop_window(case_shape: Sequence[int], shape: Sequence[int], rng: np.random.Generator):
    """``random_crop``'s window of a case: ``(start, size)``, drawn as it draws (one draw per cropped axis)."""
    start, size = [], []
    for axis in range(3):
        full, target = int(case_shape[axis]), int(shape[axis])
        start.append(int(rng.integers(0, full - target + 1)) if full > target else 0)
        size.append(min(full, target))
    return tuple(start), tuple(size)


def fit_to_shape(image: np.ndarray, label: np.ndarray, shape: Sequence[int], rng: np.random.Generator,
                 background: np.ndarray | float = 0.0):
    """Crop (at a random offset) or pad (centred) each spatial axis to ``shape``.

    Args:
        image: ``(D, H, W, C)``.
        label: ``(D, H, W)``.
        shape: the target ``(D, H, W)`` in voxels.
        rng: draws the crop offsets (one per cropped axis).
        background: the value padded image voxels take, per channel (``(C,)``) or one for all
            (default 0.0); padded label voxels are ``PAD_LABEL``.

    Returns:
        ``(image (*shape, C), label shape)``, dtypes kept.

    Example:
        >>> image, label = fit_to_shape(np.ones((40, 70, 64, 1), np.float32), np.zeros((40, 70, 64), np.uint8),
        ...                             (48, 64, 64), np.random.default_rng(0))  # (48, 64, 64, 1), (48, 64, 64)
    """
    image, label = random_crop(image, label, shape, rng)
    if tuple(label.shape) == tuple(shape):
        return image, label
    padded_label = np.full(tuple(shape), PAD_LABEL, np.uint8)
    padded_image = np.empty(tuple(shape) + image.shape[3:], image.dtype)
    padded_image[...] = np.asarray(background, image.dtype)
    where = tuple(slice((t - s) // 2, (t - s) // 2 + s) for s, t in zip(label.shape, shape))
    padded_label[where] = label
    padded_image[where] = image
    return padded_image, padded_label


def normalized(store: HDF5VolumeStore, case_id: str, image: np.ndarray, *, whole: bool = True):
    """``image`` (the case or a crop of it) normalised in place by the store's scheme, and the padding value.

    The statistics are the whole case's, as convert recorded them, so a patch gets exactly the
    values of the same voxels in the normalised whole case (``preprocess``). A store from an
    older bigmem that recorded none has them computed from the whole case: ``image`` itself when
    ``whole``, else the case read once more.

    Returns:
        ``(image, background)``: the normalised image and the per-channel padding value.

    Raises:
        DataError: the case cannot be read, or holds NaN/Inf.
    """
    stats = store.case_stats(case_id)
    if stats is None:
        source = image if whole else store.read_case(case_id)[0]
        try:
            stats = case_statistics(source)
        except DataError as exc:
            raise DataError(f"Case {case_id!r}: {exc.template} ({store.path}); fix the source and convert "
                            f"again.") from None
        store.remember_stats(case_id, stats)
    return store.preprocessing.normalize(image, stats), store.preprocessing.background(stats)


def augmented(image: np.ndarray, label: np.ndarray, background, *, augment: Compose | None, seed: int,
              sample_index: int, window=None):
    """A normalised sample through the chain ``augment`` (None: unchanged): ``(image, label, background)``;
    where the sample was read with a margin, ``window`` (``with_margin``) is what comes out."""
    if not augment:
        return image, label, background
    sample = augment(Sample(np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(label),
                            np.asarray(background, np.float32).copy(), window), seed=seed, sample_index=sample_index)
    return sample.image, sample.label, sample.background


def load_sample(store: HDF5VolumeStore, sample_index: int, *, case_index: int, shape: Sequence[int], seed: int,
                augment: Compose | None = None):
    """One training sample: read, normalised, cropped to ``shape`` where larger, augmented, padded to ``shape``.

    The crop offsets are a pure function of ``(seed, sample_index)``; the augmentation's draws of
    ``(seed, sample_index, transform)`` (``transforms.stream``).

    Args:
        store: the store to read from.
        sample_index: the sample's position in the stream.
        case_index: which of the store's cases it is (``VolumeLoader.case_index``).
        shape: the ``(D, H, W)`` of the returned sample: the case's own padded shape, its
            batch's bounding shape, or the fixed training shape (cases larger are cropped).
        seed: the run's seed.
        augment: the augmentation chain (``transforms.chain``; default None: none).

    Returns:
        ``(image (*shape, C) float32, label shape uint8)``, both C-contiguous; padded voxels
        hold each channel's background value and ``PAD_LABEL``.

    Raises:
        DataError: the case cannot be read, has NaN/Inf image values, or a label value past the
            store's classes.
    """
    case_id = store.case_ids[case_index]
    image, label = store.read_case(case_id)
    rng = np.random.default_rng([seed, sample_index, 1])
    image, background = normalized(store, case_id, image)  # the whole case's statistics, then any crop
    # A case larger than ``shape`` (a fixed training shape) is cropped before it is augmented, with the margin
    # a resampling chain reads around the crop (nnU-Net's initial patch): the chain's time and working memory
    # are about those of the shape trained, as with patches, and a rotation turns in anatomy, not padding.
    start, size, window = with_margin(*crop_window(label.shape, shape, rng), label.shape, augment)
    where = tuple(slice(a, a + n) for a, n in zip(start, size))
    image, label = image[where], label[where]
    image, label, background = augmented(image, label, background, augment=augment, seed=seed,
                                         sample_index=sample_index, window=window)
    image, label = fit_to_shape(image, label, shape, rng, background)
    return np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(label, dtype=np.uint8)


FOREGROUND_FRACTION = 0.4  # MLPerf 3D U-Net: share of patches centred on a foreground voxel


def patch_start(label: np.ndarray | None, shape: tuple[int, ...], patch: Sequence[int],
                rng: np.random.Generator) -> tuple:
    """A patch origin: centred on a random foreground voxel of ``label`` if given (and any), else uniform.

    Args:
        label: ``(D, H, W)``, or None for a uniform origin.
        shape: the case's ``(D, H, W)``.
        patch: the patch ``(D, H, W)`` in voxels.
        rng: draws the voxel or the origin.

    Returns:
        ``(d, h, w)``, clipped so the patch stays inside the case where it fits.
    """
    if label is not None:
        foreground = np.flatnonzero(label)
        if foreground.size:
            centre = np.unravel_index(int(foreground[rng.integers(foreground.size)]), shape)
            return tuple(int(min(max(c - p // 2, 0), max(s - p, 0))) for c, s, p in zip(centre, shape, patch))
    return tuple(int(rng.integers(0, max(s - p, 0) + 1)) for s, p in zip(shape, patch))


def load_patch(store: HDF5VolumeStore, sample_index: int, *, patch: int, seed: int,
               foreground_fraction: float = FOREGROUND_FRACTION, augment: Compose | None = None):
    """One training patch, foreground-centred with probability ``foreground_fraction``.

    Only the chunks the patch overlaps are read (plus the label, 1 byte/voxel, for a foreground
    patch). The patch is normalised with the whole case's statistics, so its voxels get the values
    they have in the normalised whole case (as at inference, where windows are cut from it).

    Args:
        store, sample_index, seed, augment: as ``load_sample`` (a resampling chain reads the patch with a
            margin around it, nnU-Net's initial patch, and returns the patch).
        patch: the patch ``(D, H, W)``, or an edge N for N^3 (smaller cases are padded to it, as
            ``fit_to_shape`` pads).
        foreground_fraction: the probability of a foreground-centred patch (default
            FOREGROUND_FRACTION, MLPerf's 0.4).

    Returns:
        ``(image (*patch, C) float32, label patch uint8)``.

    Raises:
        DataError: as ``load_sample``.
    """
    info = store.cases[case_for_sample(sample_index, len(store), seed)]
    rng = np.random.default_rng([seed, sample_index, 2])
    label = store.read_label(info.case_id) if rng.random() < foreground_fraction else None
    patch = as_shape(patch)
    start = patch_start(label, info.shape, patch, rng)
    size = tuple(min(p, s) for p, s in zip(patch, info.shape))
    start, size, window = with_margin(start, size, info.shape, augment)  # nnU-Net's initial patch
    image, label = store.read_patch(info.case_id, start, size)
    image, background = normalized(store, info.case_id, image, whole=False)
    image, label, background = augmented(image, label, background, augment=augment, seed=seed,
                                         sample_index=sample_index, window=window)
    image, label = fit_to_shape(image, label, patch, rng, background)
    return np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(label, dtype=np.uint8)


_WORKER_STORE: HDF5VolumeStore | None = None
_WORKER_SLOTS: dict[str, shared_memory.SharedMemory] = {}


def _init_worker(store_path: str, cold_cache: bool, holdout: int, fold: str | None, splits: str | None) -> None:
    global _WORKER_STORE
    _WORKER_STORE = HDF5VolumeStore(store_path, cold_cache=cold_cache, holdout=holdout, fold=fold, splits=splits)


def _slot_views(buffer, shape: Sequence[int], channels: int):
    """(image, label) arrays of ``shape`` laid out in one shared-memory slot (sized for the largest)."""
    shape = tuple(int(s) for s in shape)
    image_bytes = math.prod(shape) * channels * 4
    image = np.ndarray(shape + (channels,), np.float32, buffer=buffer)
    label = np.ndarray(shape, np.uint8, buffer=buffer, offset=image_bytes)
    return image, label


def _worker_load(slot: str, sample_index: int, case_index: int, shape: tuple, seed: int, patch: Shape | None,
                 augment: Compose | None) -> None:
    """Load one sample into the shared-memory ``slot``: only the slot's name crosses the pipe,
    not the volume (pickling one would cost two extra copies of it and the pipe)."""
    if slot not in _WORKER_SLOTS:
        # Attaching registers the slot with the resource tracker, which a spawned reader shares with the
        # training process (one tracker, one entry per name): the slot is unlinked once, by its owner, and
        # unregistering it here as well made the tracker print a KeyError traceback at that unlink.
        _WORKER_SLOTS[slot] = shared_memory.SharedMemory(name=slot)
    if patch:
        image, label = load_patch(_WORKER_STORE, sample_index, patch=patch, seed=seed, augment=augment)
    else:
        image, label = load_sample(_WORKER_STORE, sample_index, case_index=case_index, shape=shape, seed=seed,
                                   augment=augment)
    image_view, label_view = _slot_views(_WORKER_SLOTS[slot].buf, shape, image.shape[3])
    image_view[...] = image
    label_view[...] = label


class VolumeLoader:
    """Batches of whole volumes (or, with ``patch``, of patches) in a deterministic order.

    Each case is read whole and normalised (``normalized``). With ``shape`` None it keeps its own shape,
    padded (never cropped) to a multiple of ``pad_multiple`` on each axis; a batch of different
    shapes is padded to their bounding shape, and batches group similar shapes
    (``epoch_order``). With ``shape`` every case is cropped (random offset) or padded (centred)
    to it. Padding takes the channel's background value and the label ``PAD_LABEL``. Samples
    are augmented (``augment``); the order, crops and draws are a pure function of ``(seed, sample
    index)``, so a resumed run continues exactly where it stopped. Image and label values are
    checked when the loader is made (``HDF5VolumeStore.validate_for_training``: from the store's
    records, or one scan of a store without them), and again as they are read.

    Args:
        store_path: a bigmem HDF5 store (``bigmem synth`` or ``bigmem convert`` writes one).
        shape: the ``(D, H, W)`` every case is cropped or padded to; None (default): each case
            at its own shape, padded to a multiple of ``pad_multiple``.
        pad_multiple: the multiple native shapes are padded to: the network's size contract
            (``2**depth``) or a coarser multiple of it (``data.derived.pad_multiple`` decides a
            config's); needed when ``shape`` and ``patch`` are None.
        batch_size: samples per batch (per process when sharded).
        seed: the order, crops and augmentation draws (default 0).
        augment: the augmentation chain each sample goes through after normalisation
            (``transforms.chain``; default None: none).
        num_workers: 0 (default): read in this process; N: N reader processes (spawned), which
            hand samples over through shared memory.
        prefetch: batches ``dataset`` prepares ahead of the training step (default 2; 0: none);
            reader processes keep ``(prefetch + 1) * batch_size`` samples in flight.
        cold_cache: drop the store's pages from the page cache after every read (default False),
            to behave as a dataset larger than RAM.
        patch: read patches of this ``(D, H, W)`` (or N^3 for an edge N) instead of whole volumes,
            foreground-centred with probability FOREGROUND_FRACTION (default None: whole volumes).
        holdout: the last N cases (sorted ids) are kept out, for evaluation (default 0).
        fold, splits: train nnU-Net v2's cross-validation fold ``fold`` of the folds in ``splits``
            (``HDF5VolumeStore``; default None: every case, less ``holdout``).
        shard: ``(index, count)``: load only slice ``index`` of each global batch of
            ``count * batch_size`` samples (default ``(0, 1)``: all of it).

    Raises:
        DataError: the store is missing, not a bigmem store, newer than this bigmem, has no
            cases or an inconsistent case, a case with a label value >= its ``num_classes`` or a
            NaN/Inf voxel, or ``holdout`` leaves no case to train on; splits that cannot be read.
        ConfigError: (``data.fold``) a fold the splits do not have.
        ValueError: ``shard`` is not ``(index, count)`` with ``0 <= index < count``, or native
            shapes without a ``pad_multiple``.

    Example:
        >>> with VolumeLoader("synth.h5", pad_multiple=16, batch_size=2) as loader:
        ...     images, labels = next(loader.batches())  # (2, D, H, W, C) float32, (2, D, H, W) uint8
    """

    def __init__(self, store_path: str | os.PathLike, *, shape: Sequence[int] | None = None,
                 pad_multiple: int | Sequence[int] | None = None, batch_size: int, seed: int = 0,
                 augment: Compose | None = None,
                 num_workers: int = 0, prefetch: int = 2, cold_cache: bool = False,
                 patch: int | Sequence[int] | None = None, holdout: int = 0, fold: str | None = None,
                 splits: str | None = None, shard: tuple[int, int] = (0, 1)):
        if shape is None and not patch and pad_multiple is None:  # before the store is opened
            raise ValueError("VolumeLoader: pad_multiple is needed to train each case at its own shape (shape and "
                             "patch None): the network's size contract 2**depth, or a multiple of it "
                             "(data.derived.pad_multiple).")
        self.store = HDF5VolumeStore(store_path, cold_cache=cold_cache, holdout=holdout, fold=fold, splits=splits)
        try:  # a bad label or voxel is refused here, before the first training step, not when its case is read
            self.store.validate_for_training()
        except BaseException:
            self.store.close()
            raise
        # (index, count): this process loads only its slice of each global batch of count x batch_size
        # samples (a worker of a multi-host run); the sample order stays that of one process.
        self.shard_index, self.num_shards = (int(shard[0]), int(shard[1]))
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard {shard}: expected (index, count) with 0 <= index < count")
        self.holdout = holdout
        self.fold, self.splits = fold, splits
        self.cold_cache = cold_cache
        self.patch = as_shape(patch) if patch else None
        self.shape = tuple(int(s) for s in shape) if shape is not None else None
        self.pad_multiple = (None if pad_multiple is None else int(pad_multiple) if isinstance(pad_multiple, int)
                             else as_shape(pad_multiple))
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.augment = augment if augment else None
        self.num_workers = int(num_workers)
        self.prefetch = int(prefetch)
        self._shapes = tuple(self.case_shape(i) for i in range(len(self.store)))
        global_batch = self.batch_size * self.num_shards
        # Samples per epoch: the cases, or whole batches where batches group shapes (epoch_order).
        self._epoch_samples = (-(-len(self.store) // global_batch) * global_batch
                               if grouped(self._shapes, global_batch) else len(self.store))
        self._pool: ProcessPoolExecutor | None = None
        self._slots: list[shared_memory.SharedMemory] = []
        self.error: Exception | None = None  # a reader error, kept so tf.data cannot blur it

    @property
    def num_channels(self) -> int:
        """Image channels C of every sample."""
        return self.store.num_channels

    @property
    def native(self) -> bool:
        """True: each case at its own (padded) shape; False: a fixed shape or patches."""
        return self.shape is None and not self.patch

    def case_shape(self, case_index: int) -> Shape:
        """The shape case ``case_index`` is trained at on its own: its padded shape, the fixed shape or the patch."""
        if self.patch:
            return self.patch
        return trained_shape(self.store.cases[case_index].shape, pad_multiple=self.pad_multiple, fixed=self.shape)

    @property
    def shapes(self) -> list[Shape]:
        """Each training case's shape as trained alone (``case_shape``), in the store's order."""
        return list(self._shapes)

    @property
    def max_shape(self) -> Shape:
        """The largest batch shape any step can have: the bounding shape of every case's."""
        return bounding_shape(self.shapes)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per pass over the training cases: ``ceil(cases / (batch_size * shards))``."""
        return -(-len(self.store) // (self.batch_size * self.num_shards))

    def case_index(self, sample_index: int) -> int:
        """The store case of sample ``sample_index`` (``epoch_order``: batches group similar shapes)."""
        if self.patch:
            return case_for_sample(sample_index, len(self.store), self.seed)
        epoch, position = divmod(sample_index, self._epoch_samples)
        return epoch_order(epoch, self._shapes, self.batch_size * self.num_shards, self.seed)[position]

    def step_samples(self, step: int) -> list[int]:
        """The sample indices of global step ``step`` (every shard's)."""
        first = step * self.num_shards * self.batch_size
        return list(range(first, first + self.num_shards * self.batch_size))

    def batch_shape(self, step: int) -> Shape:
        """The spatial shape of step ``step``'s batch: the bounding shape of its samples' (the same on every shard)."""
        return bounding_shape([self._shapes[self.case_index(i)] for i in self.step_samples(step)])

    def real_voxels(self, step: int) -> int:
        """Voxels of step ``step`` that come from a scan (not padding), over this process's samples.

        The throughput column counts these: padding is neither data nor work worth reporting.
        """
        first = (step * self.num_shards + self.shard_index) * self.batch_size
        total = 0
        for sample in range(first, first + self.batch_size):
            case = self.store.cases[self.case_index(sample)].shape
            limit = self.case_shape(self.case_index(sample))
            total += math.prod(min(c, t) for c, t in zip(case, limit))
        return total

    def padding_share(self, epoch: int = 0) -> float:
        """The share of the voxels fed to the network in epoch ``epoch`` that are padding."""
        fed = real = 0
        for step in range(epoch * self.steps_per_epoch, (epoch + 1) * self.steps_per_epoch):
            fed += math.prod(self.batch_shape(step)) * self.batch_size * self.num_shards
            for sample in self.step_samples(step):
                index = self.case_index(sample)
                real += math.prod(min(c, t) for c, t in zip(self.store.cases[index].shape, self.case_shape(index)))
        return 1.0 - real / fed if fed else 0.0

    def cropped_share(self) -> float:
        """The share of the training cases' voxels a fixed ``shape`` (or patch) crops away (0 for native shapes)."""
        total = kept = 0
        for index, info in enumerate(self.store.cases):
            total += math.prod(info.shape)
            kept += math.prod(min(c, t) for c, t in zip(info.shape, self.case_shape(index)))
        return 1.0 - kept / total if total else 0.0

    def sample_indices(self, start_step: int = 0) -> Iterator[tuple[int, tuple]]:
        """``(sample index, batch shape)`` of each sample this process loads, batch by batch, from ``start_step``."""
        step = start_step
        while True:
            shape = self.batch_shape(step)
            first = (step * self.num_shards + self.shard_index) * self.batch_size
            for sample in range(first, first + self.batch_size):
                yield sample, shape
            step += 1

    def _submit(self, sample_index: int, shape: tuple, slot: int) -> Future:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.num_workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(str(self.store.path), self.cold_cache, self.holdout, self.fold,
                                                      self.splits))
        return self._pool.submit(_worker_load, self._slots[slot].name, sample_index, self.case_index(sample_index),
                                 shape, self.seed, self.patch, self.augment)

    def _load(self, index: int, shape: tuple):
        if self.patch:
            return load_patch(self.store, index, patch=self.patch, seed=self.seed, augment=self.augment)
        return load_sample(self.store, index, case_index=self.case_index(index), shape=shape, seed=self.seed,
                           augment=self.augment)

    def samples(self, start_step: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """An endless stream of this process's samples, from the first of batch ``start_step`` on.

        With reader processes the arrays are views of shared memory, valid only until the next
        sample is requested: copy what you keep (``batches`` copies each into its batch).

        Args:
            start_step: the batch to start from (default 0).

        Yields:
            ``(image (D, H, W, C) float32, label (D, H, W) uint8)`` at the sample's batch shape.

        Raises:
            DataError: a case cannot be read or holds invalid values.
        """
        indices = self.sample_indices(start_step)
        if self.num_workers == 0:
            for index, shape in indices:
                yield self._load(index, shape)
        ahead = max(self.num_workers, (self.prefetch + 1) * self.batch_size)
        sample_bytes = math.prod(self.max_shape) * (4 * self.num_channels + 1)
        while len(self._slots) < ahead:
            self._slots.append(shared_memory.SharedMemory(create=True, size=sample_bytes))
        pending: collections.deque[tuple[Future, int, tuple]] = collections.deque()
        free = collections.deque(range(len(self._slots)))
        while True:
            while free:
                slot = free.popleft()
                index, shape = next(indices)
                pending.append((self._submit(index, shape, slot), slot, shape))
            future, slot, shape = pending.popleft()
            future.result()
            # Views of the slot: valid until the next sample is requested, when the slot is refilled.
            yield _slot_views(self._slots[slot].buf, shape, self.num_channels)
            free.append(slot)

    def batches(self, start_step: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """An endless stream of batches from ``start_step`` on.

        Args:
            start_step: the batch to start from (default 0), e.g. a resumed run's next step.

        Yields:
            ``(images (batch_size, D, H, W, C) float32, labels (batch_size, D, H, W) uint8)``,
            new arrays each step, at that step's ``batch_shape``.

        Raises:
            DataError: a case cannot be read or holds invalid values.
        """
        stream = self.samples(start_step)
        step = start_step
        while True:
            shape = (self.batch_size, *self.batch_shape(step))
            images = np.empty(shape + (self.num_channels,), np.float32)
            labels = np.empty(shape, np.uint8)
            for i in range(self.batch_size):
                images[i], labels[i] = next(stream)  # one copy, straight into the batch
            yield images, labels
            step += 1

    def dataset(self, start_step: int = 0):
        """The batches as a prefetching ``tf.data.Dataset`` (imports TensorFlow).

        Built as range -> map(numpy_function) over one stream, not ``Dataset.from_generator``:
        merely creating a from_generator dataset slowed every later training step, even after
        it was gone (benchmarks/results/input_pipeline.md); range + numpy_function does not.

        Args:
            start_step: the batch to start from (default 0).

        Returns:
            A ``tf.data.Dataset`` of ``(images (batch_size, D, H, W, C) float32, labels
            (batch_size, D, H, W) uint8)``, prefetching ``prefetch`` batches; the spatial sizes
            are static where every batch has the same shape, else unknown (each batch's tensor
            has its own). A reader error surfaces from TensorFlow as an op error; the original
            is kept in ``self.error``.
        """
        import tensorflow as tf

        shapes = set(self._shapes)
        spatial = next(iter(shapes)) if len(shapes) == 1 else (None, None, None)
        shape = (self.batch_size, *spatial)
        image_shape = shape + (self.num_channels,)
        stream = self.batches(start_step)

        def next_batch(_step):
            try:
                return next(stream)
            except Exception as exc:  # the first failure is the cause; prefetching may call again after it
                self.error = self.error or exc
                raise

        def load(step):
            images, labels = tf.numpy_function(next_batch, [step], (tf.float32, tf.uint8), stateful=True)
            return tf.ensure_shape(images, image_shape), tf.ensure_shape(labels, shape)

        dataset = tf.data.Dataset.range(start_step, 2**62).map(load)
        return dataset.prefetch(self.prefetch) if self.prefetch else dataset

    def describe(self) -> str:
        """One line: what happens to each scan (whole at its own shape, or cropped/padded to a stated shape),
        and its augmentation when there is one."""
        augmented = f"; augmentation: {self.augment.name}" if self.augment else ""
        return self._shaping() + augmented

    def _shaping(self) -> str:
        cases = self.store.cases
        sources = {info.shape for info in cases}
        counted = f"{len(cases)} case{'' if len(cases) == 1 else 's'}"
        if self.patch:
            return f"{format_shape(self.patch)} patches of {counted}"
        if self.shape is not None:
            cropped = self.cropped_share()
            what = f"cropped (random offset)/padded to {format_shape(self.shape)}"
            return (f"{counted} {what}" + (f": {100 * cropped:.1f}% of their voxels cropped away"
                                                     if cropped > 0 else ", nothing cropped"))
        distinct = set(self._shapes)
        multiple = (self.pad_multiple if isinstance(self.pad_multiple, int)
                    else f"{format_shape(self.pad_multiple)} (per axis)")
        return (f"{counted} whole at their own shape ({_range_text(sources)}), padded to multiples of "
                f"{multiple}: {len(distinct)} distinct shape{'s' if len(distinct) != 1 else ''}, "
                f"{100 * self.padding_share():.1f}% padding")

    def close(self) -> None:
        """Stop the reader processes, free the shared memory and close the store."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
        for slot in self._slots:
            slot.close()
            slot.unlink()
        self._slots = []
        self.store.close()

    def __enter__(self) -> "VolumeLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        shape = self.max_shape
        batch_bytes = self.batch_size * math.prod(shape) * (4 * self.num_channels + 1)
        what = "native, at most " if self.native else ""
        return (f"VolumeLoader(shape: {what}{format_shape(shape)}; batch: {self.batch_size}; workers: "
                f"{self.num_workers}; prefetch: {self.prefetch}; memory per batch: {batch_bytes / 2**20:.1f} MiB)")


def _range_text(shapes) -> str:
    """'240x240x155' for one shape; else each axis's range: '256x256x48..256'."""
    if len(shapes) == 1:
        return format_shape(next(iter(shapes)))
    axes = list(zip(*shapes))
    return "x".join(f"{min(a)}" if min(a) == max(a) else f"{min(a)}..{max(a)}" for a in axes)
