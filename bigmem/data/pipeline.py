"""Whole-volume input for the big-memory path.

Cases are read whole from the store, cropped or padded to ``volume``^3, normalised (z-score per
channel) and randomly flipped, then batched into a ``tf.data`` pipeline that prefetches ahead
of the training step.

The order is a pure function of (seed, sample index): step ``s`` always sees the same cases with
the same flips, so a resumed run continues exactly where the checkpoint left it. Reads happen
in the training process (``num_workers=0``) or in worker processes started with 'spawn', each
opening its own HDF5 handle (h5py's global lock makes reader threads useless).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import resource_tracker, shared_memory
from typing import Iterator

import numpy as np

from bigmem.data.store import HDF5VolumeStore
from bigmem.errors import DataError

NORM_EPSILON = 1e-6  # guards the z-score of a constant channel


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


def fit_to_volume(image: np.ndarray, label: np.ndarray, volume: int, rng: np.random.Generator):
    """Crop (at a random offset) or zero-pad (centred) each spatial axis to ``volume``.

    Args:
        image: ``(D, H, W, C)``.
        label: ``(D, H, W)``.
        volume: the target edge in voxels.
        rng: draws the crop offsets (one per cropped axis).

    Returns:
        ``(image (volume, volume, volume, C), label (volume, volume, volume))``, dtypes kept;
        padding is 0 (the mean, for an image already z-scored by ``normalize``).

    Example:
        >>> image, label = fit_to_volume(np.ones((40, 70, 64, 1), np.float32), np.zeros((40, 70, 64), np.uint8),
        ...                              64, np.random.default_rng(0))  # image (64, 64, 64, 1), label (64, 64, 64)
    """
    for axis in range(3):
        size = label.shape[axis]
        if size > volume:
            start = int(rng.integers(0, size - volume + 1))
            image = np.take(image, np.arange(start, start + volume), axis=axis)
            label = np.take(label, np.arange(start, start + volume), axis=axis)
        elif size < volume:
            before = (volume - size) // 2
            pad = [(0, 0)] * image.ndim
            pad[axis] = (before, volume - size - before)
            image = np.pad(image, pad)
            label = np.pad(label, pad[:3])
    return image, label


def normalize(image: np.ndarray, case_id: str = "?", where: str = "") -> np.ndarray:
    """Z-score each channel over the whole volume (in place on a float32 array).

    A NaN/Inf voxel makes its channel's mean non-finite: that is where the input pipeline checks
    values (the store reads with check_finite=False), without another pass over the data.
    Statistics are float64; a constant channel becomes 0 (NORM_EPSILON guards the division).

    Args:
        image: ``(D, H, W, C)`` float32, changed in place.
        case_id: the case, for the error message.
        where: the store's path, for the error message.

    Returns:
        ``image`` itself, each channel with mean 0 and standard deviation 1.

    Raises:
        DataError: the image has NaN or Inf values.
    """
    mean = image.mean(axis=(0, 1, 2), keepdims=True, dtype=np.float64)
    if not np.all(np.isfinite(mean)):
        bad = int(np.count_nonzero(~np.isfinite(image)))
        if bad:
            raise DataError(f"Case {case_id!r}: image has {bad} non-finite values (NaN/Inf) ({where}); "
                            "fix the source and convert again.")
    std = image.std(axis=(0, 1, 2), keepdims=True, dtype=np.float64)
    image -= mean.astype(np.float32)
    image /= (std + NORM_EPSILON).astype(np.float32)
    return image


def load_sample(store: HDF5VolumeStore, sample_index: int, *, volume: int, seed: int, flip: bool):
    """One training sample: read, z-scored, cropped/padded to ``volume``^3, randomly flipped.

    Which case, the crop offsets and the flips are a pure function of ``(seed, sample_index)``.

    Args:
        store: the store to read from.
        sample_index: the sample's position in the stream (``case_for_sample``).
        volume: the edge of the returned cube, in voxels.
        seed: the run's seed.
        flip: flip each spatial axis with probability 0.5.

    Returns:
        ``(image (volume, volume, volume, C) float32, label (volume, volume, volume) uint8)``,
        both C-contiguous.

    Raises:
        DataError: the case cannot be read, has NaN/Inf image values, or a label value past the
            store's classes.
    """
    case_id = store.case_ids[case_for_sample(sample_index, len(store), seed)]
    image, label = store.read_case(case_id)
    rng = np.random.default_rng([seed, sample_index, 1])
    image = normalize(image, case_id, str(store.path))
    image, label = fit_to_volume(image, label, volume, rng)
    if flip:
        axes = tuple(int(a) for a in np.flatnonzero(rng.random(3) < 0.5))
        if axes:
            image, label = np.flip(image, axes), np.flip(label, axes)
    return np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(label, dtype=np.uint8)


FOREGROUND_FRACTION = 0.4  # MLPerf 3D U-Net: share of patches centred on a foreground voxel


def patch_start(label: np.ndarray | None, shape: tuple[int, ...], patch: int, rng: np.random.Generator) -> tuple:
    """A patch origin: centred on a random foreground voxel of ``label`` if given (and any), else uniform.

    Args:
        label: ``(D, H, W)``, or None for a uniform origin.
        shape: the case's ``(D, H, W)``.
        patch: the patch edge in voxels.
        rng: draws the voxel or the origin.

    Returns:
        ``(d, h, w)``, clipped so the patch stays inside the case where it fits.
    """
    if label is not None:
        foreground = np.flatnonzero(label)
        if foreground.size:
            centre = np.unravel_index(int(foreground[rng.integers(foreground.size)]), shape)
            return tuple(int(min(max(c - patch // 2, 0), max(s - patch, 0))) for c, s in zip(centre, shape))
    return tuple(int(rng.integers(0, max(s - patch, 0) + 1)) for s in shape)


def load_patch(store: HDF5VolumeStore, sample_index: int, *, patch: int, seed: int, flip: bool,
               foreground_fraction: float = FOREGROUND_FRACTION):
    """One training patch (patch^3), foreground-centred with probability ``foreground_fraction``.

    Only the chunks the patch overlaps are read (plus the label, 1 byte/voxel, for a foreground
    patch). The patch is z-scored on its own values.

    Args:
        store, sample_index, seed, flip: as ``load_sample``.
        patch: the patch edge in voxels (smaller cases are zero-padded to it).
        foreground_fraction: the probability of a foreground-centred patch (default
            FOREGROUND_FRACTION, MLPerf's 0.4).

    Returns:
        ``(image (patch, patch, patch, C) float32, label (patch, patch, patch) uint8)``.

    Raises:
        DataError: as ``load_sample``.
    """
    info = store.cases[case_for_sample(sample_index, len(store), seed)]
    rng = np.random.default_rng([seed, sample_index, 2])
    label = store.read_label(info.case_id) if rng.random() < foreground_fraction else None
    start = patch_start(label, info.shape, patch, rng)
    size = tuple(min(patch, s) for s in info.shape)
    image, label = store.read_patch(info.case_id, start, size)
    image, label = fit_to_volume(normalize(image, info.case_id, str(store.path)), label, patch, rng)
    if flip:
        axes = tuple(int(a) for a in np.flatnonzero(rng.random(3) < 0.5))
        if axes:
            image, label = np.flip(image, axes), np.flip(label, axes)
    return np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(label, dtype=np.uint8)


_WORKER_STORE: HDF5VolumeStore | None = None
_WORKER_SLOTS: dict[str, shared_memory.SharedMemory] = {}


def _init_worker(store_path: str, cold_cache: bool, holdout: int) -> None:
    global _WORKER_STORE
    _WORKER_STORE = HDF5VolumeStore(store_path, cold_cache=cold_cache, check_finite=False, holdout=holdout)


def _slot_views(buffer, volume: int, channels: int):
    """(image, label) arrays laid out in one shared-memory slot."""
    image_bytes = volume**3 * channels * 4
    image = np.ndarray((volume, volume, volume, channels), np.float32, buffer=buffer)
    label = np.ndarray((volume, volume, volume), np.uint8, buffer=buffer, offset=image_bytes)
    return image, label


def _worker_load(slot: str, sample_index: int, volume: int, seed: int, flip: bool, patch: int | None) -> None:
    """Load one sample into the shared-memory ``slot``: only the slot's name crosses the pipe,
    not the volume (pickling one would cost two extra copies of it and the pipe)."""
    if slot not in _WORKER_SLOTS:
        _WORKER_SLOTS[slot] = shared_memory.SharedMemory(name=slot)
        # The training process owns the slot; this process must not unlink it when it exits.
        resource_tracker.unregister(_WORKER_SLOTS[slot]._name, "shared_memory")
    if patch:
        image, label = load_patch(_WORKER_STORE, sample_index, patch=patch, seed=seed, flip=flip)
    else:
        image, label = load_sample(_WORKER_STORE, sample_index, volume=volume, seed=seed, flip=flip)
    image_view, label_view = _slot_views(_WORKER_SLOTS[slot].buf, volume, image.shape[3])
    image_view[...] = image
    label_view[...] = label


class WholeVolumeLoader:
    """Batches of whole volumes (or, with ``patch``, of patch^3 patches) in a deterministic order.

    Each case is read whole, z-scored per channel, cropped (random offset) or zero-padded
    (centred) to ``volume``^3 and randomly flipped; the order, crops and flips are a pure
    function of ``(seed, sample index)``, so a resumed run continues exactly where it stopped.
    Image and label values are checked as they are read.

    Args:
        store_path: a bigmem HDF5 store (``bigmem synth`` or ``bigmem convert`` writes one).
        volume: the cube edge in voxels that cases are cropped or padded to (with ``patch``, the
            patch edge is used instead).
        batch_size: samples per batch (per process when sharded).
        seed: the order, crops and flips (default 0).
        flip: flip each spatial axis with probability 0.5 (default True).
        num_workers: 0 (default): read in this process; N: N reader processes (spawned), which
            hand samples over through shared memory.
        prefetch: batches ``dataset`` prepares ahead of the training step (default 2; 0: none);
            reader processes keep ``(prefetch + 1) * batch_size`` samples in flight.
        cold_cache: drop the store's pages from the page cache after every read (default False),
            to behave as a dataset larger than RAM.
        patch: read ``patch``^3 patches instead of whole volumes, foreground-centred with
            probability FOREGROUND_FRACTION (default None: whole volumes).
        holdout: the last N cases (sorted ids) are kept out, for evaluation (default 0).
        shard: ``(index, count)``: load only slice ``index`` of each global batch of
            ``count * batch_size`` samples (default ``(0, 1)``: all of it).

    Raises:
        DataError: the store is missing, not a bigmem store, newer than this bigmem, has no
            cases or an inconsistent case, or ``holdout`` leaves no case to train on.
        ValueError: ``shard`` is not ``(index, count)`` with ``0 <= index < count``.

    Example:
        >>> with WholeVolumeLoader("synth.h5", volume=64, batch_size=2) as loader:
        ...     images, labels = next(loader.batches())  # (2, 64, 64, 64, C) float32, (2, 64, 64, 64) uint8
    """

    def __init__(self, store_path: str | os.PathLike, *, volume: int, batch_size: int, seed: int = 0,
                 flip: bool = True, num_workers: int = 0, prefetch: int = 2, cold_cache: bool = False,
                 patch: int | None = None, holdout: int = 0, shard: tuple[int, int] = (0, 1)):
        self.store = HDF5VolumeStore(store_path, cold_cache=cold_cache, check_finite=False, holdout=holdout)
        # (index, count): this process loads only its slice of each global batch of count x batch_size
        # samples (a worker of a multi-host run); the sample order stays that of one process.
        self.shard_index, self.num_shards = (int(shard[0]), int(shard[1]))
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard {shard}: expected (index, count) with 0 <= index < count")
        self.holdout = holdout
        self.cold_cache = cold_cache
        self.patch = patch
        self.volume = int(patch or volume)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.flip = bool(flip)
        self.num_workers = int(num_workers)
        self.prefetch = int(prefetch)
        self._pool: ProcessPoolExecutor | None = None
        self._slots: list[shared_memory.SharedMemory] = []
        self.error: Exception | None = None  # a reader error, kept so tf.data cannot blur it

    @property
    def num_channels(self) -> int:
        """Image channels C of every sample."""
        return self.store.num_channels

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per pass over the training cases: ``ceil(cases / (batch_size * shards))``."""
        return -(-len(self.store) // (self.batch_size * self.num_shards))

    def sample_indices(self, start_step: int = 0) -> Iterator[int]:
        """The sample indices this process loads, batch after batch, from ``start_step`` on."""
        step = start_step
        while True:
            first = (step * self.num_shards + self.shard_index) * self.batch_size
            yield from range(first, first + self.batch_size)
            step += 1

    def _submit(self, sample_index: int, slot: int) -> Future:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.num_workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(str(self.store.path), self.cold_cache, self.holdout))
        return self._pool.submit(_worker_load, self._slots[slot].name, sample_index, self.volume, self.seed,
                                 self.flip, self.patch)

    def _load(self, index: int):
        if self.patch:
            return load_patch(self.store, index, patch=self.patch, seed=self.seed, flip=self.flip)
        return load_sample(self.store, index, volume=self.volume, seed=self.seed, flip=self.flip)

    def samples(self, start_step: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """An endless stream of this process's samples, from the first of batch ``start_step`` on.

        With reader processes the arrays are views of shared memory, valid only until the next
        sample is requested: copy what you keep (``batches`` copies each into its batch).

        Args:
            start_step: the batch to start from (default 0).

        Yields:
            ``(image (V, V, V, C) float32, label (V, V, V) uint8)`` with V = ``volume``.

        Raises:
            DataError: a case cannot be read or holds invalid values.
        """
        indices = self.sample_indices(start_step)
        if self.num_workers == 0:
            for index in indices:
                yield self._load(index)
        ahead = max(self.num_workers, (self.prefetch + 1) * self.batch_size)
        sample_bytes = self.volume**3 * (4 * self.num_channels + 1)
        while len(self._slots) < ahead:
            self._slots.append(shared_memory.SharedMemory(create=True, size=sample_bytes))
        pending: collections.deque[tuple[Future, int]] = collections.deque()
        free = collections.deque(range(len(self._slots)))
        while True:
            while free:
                slot = free.popleft()
                pending.append((self._submit(next(indices), slot), slot))
            future, slot = pending.popleft()
            future.result()
            # Views of the slot: valid until the next sample is requested, when the slot is refilled.
            yield _slot_views(self._slots[slot].buf, self.volume, self.num_channels)
            free.append(slot)

    def batches(self, start_step: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """An endless stream of batches from ``start_step`` on.

        Args:
            start_step: the batch to start from (default 0), e.g. a resumed run's next step.

        Yields:
            ``(images (batch_size, V, V, V, C) float32, labels (batch_size, V, V, V) uint8)``,
            new arrays each step, V = ``volume``.

        Raises:
            DataError: a case cannot be read or holds invalid values.
        """
        stream = self.samples(start_step)
        shape = (self.batch_size, self.volume, self.volume, self.volume)
        while True:
            images = np.empty(shape + (self.num_channels,), np.float32)
            labels = np.empty(shape, np.uint8)
            for i in range(self.batch_size):
                images[i], labels[i] = next(stream)  # one copy, straight into the batch
            yield images, labels

    def dataset(self, start_step: int = 0):
        """The batches as a prefetching ``tf.data.Dataset`` (imports TensorFlow).

        Built as range -> map(numpy_function) over one stream, not ``Dataset.from_generator``:
        merely creating a from_generator dataset slowed every later training step, even after
        it was gone (benchmarks/results/input_pipeline.md); range + numpy_function does not.

        Args:
            start_step: the batch to start from (default 0).

        Returns:
            A ``tf.data.Dataset`` of ``(images (batch_size, V, V, V, C) float32, labels
            (batch_size, V, V, V) uint8)``, prefetching ``prefetch`` batches. A reader error
            surfaces from TensorFlow as an op error; the original is kept in ``self.error``.
        """
        import tensorflow as tf

        shape = (self.batch_size, self.volume, self.volume, self.volume)
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

    def __enter__(self) -> "WholeVolumeLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        batch_bytes = self.batch_size * self.volume**3 * (4 * self.num_channels + 1)
        return (f"WholeVolumeLoader(volume: {self.volume}^3; batch: {self.batch_size}; workers: {self.num_workers}; "
                f"prefetch: {self.prefetch}; memory per batch: {batch_bytes / 2**20:.1f} MiB)")
