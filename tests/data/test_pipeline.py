"""Whole-volume loader: native and fixed shapes, padding, normalisation, crop/pad alignment, resume order."""

from __future__ import annotations

import numpy as np
import pytest

from bigmem.data.pipeline import (
    PAD_LABEL, VolumeLoader, bounding_shape, case_for_sample, epoch_order, fit_to_shape, padded_shape, trained_shape,
)
from bigmem.errors import DataError


def test_batches_are_normalised_whole_volumes(tiny_store):
    with VolumeLoader(tiny_store, pad_multiple=16, batch_size=2) as loader:
        images, labels = next(loader.batches())
    assert images.shape == (2, 16, 16, 16, 1)
    assert images.dtype == np.float32
    assert labels.shape == (2, 16, 16, 16)
    assert labels.dtype == np.uint8
    for image in images:
        assert abs(float(image.mean())) < 1e-4
        assert abs(float(image.std()) - 1.0) < 1e-3


@pytest.mark.parametrize("shape", [(33, 34, 35), (13, 16, 19), (32, 32, 32)])
@pytest.mark.parametrize("target", [(16, 16, 16), (32, 40, 24), (40, 40, 40)])
def test_fit_to_shape_keeps_image_and_label_aligned(shape, target):
    rng = np.random.default_rng(0)
    label = rng.integers(0, 5, shape).astype(np.uint8)
    image = label[..., np.newaxis].astype(np.float32) + 1.0  # image encodes the label; padding is -7
    fitted_image, fitted_label = fit_to_shape(image, label, target, np.random.default_rng(1), np.array([-7.0]))
    assert fitted_image.shape == (*target, 1)
    assert fitted_label.shape == target
    real = fitted_image[..., 0] > 0
    np.testing.assert_array_equal(fitted_image[..., 0][real] - 1.0, fitted_label[real])
    assert np.all(fitted_label[~real] == PAD_LABEL)
    assert np.all(fitted_image[..., 0][~real] == -7.0)
    assert int(real.sum()) == int(np.prod([min(s, t) for s, t in zip(shape, target)]))


@pytest.mark.parametrize("shape, multiple, expected", [((240, 240, 155), 16, (240, 240, 160)),
                                                       ((33, 34, 35), 16, (48, 48, 48)),
                                                       ((512, 512, 29), 32, (512, 512, 32)),
                                                       ((16, 1, 17), 8, (16, 8, 24))])
def test_padded_shape_rounds_each_axis_up(shape, multiple, expected):
    assert padded_shape(shape, multiple) == expected
    assert bounding_shape([(16, 32, 8), (24, 8, 8), (8, 8, 40)]) == (24, 32, 40)


@pytest.mark.parametrize("shape, multiple, fixed, expected", [((33, 34, 35), 8, None, (40, 40, 40)),
                                                              ((33, 34, 35), 4, None, (36, 36, 36)),
                                                              ((33, 34, 35), None, (32, 16, 48), (32, 16, 48)),
                                                              ((16, 1, 17, 2), 8, None, (16, 8, 24))])
def test_trained_shape_is_the_fixed_shape_or_the_own_shape_padded(shape, multiple, fixed, expected):
    assert trained_shape(shape, pad_multiple=multiple, fixed=fixed) == expected


@pytest.mark.parametrize("multiple", [None, 0, 2.5])
def test_trained_shape_needs_a_positive_multiple_for_a_native_shape(multiple):
    with pytest.raises(ValueError, match=rf"^pad_multiple {multiple!r}: expected a positive integer"):
        trained_shape((33, 34, 35), pad_multiple=multiple)


def test_the_loader_needs_a_pad_multiple_for_native_shapes_only(tiny_store):
    with pytest.raises(ValueError, match=r"^VolumeLoader: pad_multiple is needed to train each case at its own shape"):
        VolumeLoader(tiny_store, batch_size=1)
    with VolumeLoader(tiny_store, shape=(8, 8, 8), batch_size=1) as fixed, \
            VolumeLoader(tiny_store, patch=8, batch_size=1) as patches:
        assert fixed.shapes == [(8, 8, 8)] * 4
        assert patches.shapes == [(8, 8, 8)] * 4


def _shaped_store(tmp_path, shapes, name="shapes.h5", channels=1):
    from bigmem.data.synth import write_synthetic_store

    return write_synthetic_store(tmp_path / name, num_cases=len(shapes), volume=0, shapes=shapes, channels=channels)


def test_native_shapes_pad_never_crop_at_the_background_value(tmp_path):
    shapes = [(16, 24, 13), (20, 16, 16), (16, 16, 35)]
    with VolumeLoader(_shaped_store(tmp_path, shapes), pad_multiple=8, batch_size=1) as loader:
        assert loader.shapes == [padded_shape(s, 8) for s in shapes]
        assert loader.cropped_share() == 0.0
        seen = {}
        for step in range(3):
            images, labels = next(loader.batches(step))
            case = loader.case_index(step)
            seen[case] = images.shape
            real = labels[0] != PAD_LABEL
            assert int(real.sum()) == int(np.prod(shapes[case])) == loader.real_voxels(step)  # nothing cropped
            background = images[0][real].min()
            assert np.all(images[0][~real] == background)
            assert background < -0.5  # not the mean (0)
        assert sorted(seen) == [0, 1, 2]
        assert {seen[c][1:4] for c in seen} == {(16, 24, 16), (24, 16, 16), (16, 16, 40)}
        voxels = sum(np.prod(s) for s in shapes)
        assert loader.padding_share(0) == pytest.approx(1 - voxels / sum(np.prod(padded_shape(s, 8)) for s in shapes))
        assert "3 cases whole at their own shape (16..20x16..24x13..35), padded to multiples of 8: 3 distinct " \
               "shapes" in loader.describe()


def test_a_fixed_shape_crops_and_says_how_much(tmp_path):
    with VolumeLoader(_shaped_store(tmp_path, [(16, 16, 32), (16, 16, 16)]), shape=(16, 16, 16),
                           batch_size=2) as loader:
        images, labels = next(loader.batches())
        assert images.shape == (2, 16, 16, 16, 1)
        assert not np.any(labels == PAD_LABEL)
        assert loader.cropped_share() == pytest.approx(1 / 3)
        assert loader.describe() == "2 cases cropped (random offset)/padded to 16^3: 33.3% of their voxels cropped away"


def test_batches_of_different_shapes_pad_to_their_bounding_shape_and_group_similar_ones(tmp_path):
    shapes = [(16, 16, 8), (16, 16, 8), (16, 16, 48), (16, 16, 48), (16, 16, 16), (16, 16, 16)]
    with VolumeLoader(_shaped_store(tmp_path, shapes), pad_multiple=8, batch_size=2, seed=3) as loader:
        for step in range(6):  # two epochs
            images, labels = next(loader.batches(step))
            members = [loader.case_index(i) for i in loader.step_samples(step)]
            assert images.shape[1:4] == loader.batch_shape(step) == bounding_shape([shapes[m] for m in members])
            assert len({shapes[m] for m in members}) == 1  # grouped: equal shapes share a batch
            assert int((labels != PAD_LABEL).sum()) == sum(np.prod(shapes[m]) for m in members)
        assert loader.padding_share(0) == 0.0
    equal = ((8, 8, 4), (4, 8, 8), (8, 8, 4), (4, 8, 8))  # the same voxels, different shapes: grouped apart
    for epoch in range(3):
        order = epoch_order(epoch, equal, 2, 3)
        assert sorted(order) == [0, 1, 2, 3]
        assert all(equal[order[i]] == equal[order[i + 1]] for i in range(0, 4, 2))
    cube = ((8, 8, 8),) * 6
    assert epoch_order(0, cube, 2, 3) == tuple(case_for_sample(i, 6, 3) for i in range(6))  # one shape: as before


@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_odd_number_of_shapes_keeps_every_batch_grouped_across_shards_and_epochs(tmp_path, num_workers):
    """7 cases in 3 shapes, global batch 4 over 2 shards: each epoch is 2 whole batches (one case seen twice),
    every batch one shape, and the shards together load exactly one process's batches."""
    shapes = [(8, 8, 8)] * 3 + [(8, 8, 16)] * 3 + [(16, 8, 8)]
    store = _shaped_store(tmp_path, shapes)
    with VolumeLoader(store, pad_multiple=8, batch_size=4, seed=1) as one:
        assert one.steps_per_epoch == 2
        whole = [next(one.batches(step)) for step in range(6)]  # three epochs
        for step in range(6):
            members = [one.case_index(i) for i in one.step_samples(step)]
            assert len({shapes[m] for m in members}) <= 2  # the short group's batch is filled from its neighbours
            assert whole[step][0].shape[1:4] == bounding_shape([shapes[m] for m in members])
        for epoch in range(3):
            seen = {one.case_index(i) for step in (2 * epoch, 2 * epoch + 1) for i in one.step_samples(step)}
            assert seen == set(range(7))
    for index in range(2):
        with VolumeLoader(store, pad_multiple=8, batch_size=2, seed=1, shard=(index, 2),
                               num_workers=num_workers, prefetch=1) as worker:
            assert worker.steps_per_epoch == 2
            stream = worker.batches(0)
            for step in range(6):
                images, labels = next(stream)
                np.testing.assert_array_equal(images, whole[step][0][2 * index:2 * index + 2])
                np.testing.assert_array_equal(labels, whole[step][1][2 * index:2 * index + 2])


def test_every_epoch_visits_every_case_once():
    for epoch in range(3):
        seen = sorted(case_for_sample(epoch * 7 + i, 7, seed=5) for i in range(7))
        assert seen == list(range(7))
    assert [case_for_sample(i, 7, 5) for i in range(7)] != [case_for_sample(i, 7, 6) for i in range(7)]


def test_order_resumes_at_any_step(tiny_store):
    with VolumeLoader(tiny_store, pad_multiple=16, batch_size=3, seed=2) as loader:
        stream = loader.batches(0)
        from_start = [next(stream) for _ in range(4)]
        resumed = next(loader.batches(3))
    np.testing.assert_array_equal(resumed[0], from_start[3][0])
    np.testing.assert_array_equal(resumed[1], from_start[3][1])
    assert not np.array_equal(from_start[0][0], from_start[1][0])


def test_worker_processes_deliver_the_same_batches(tiny_store):
    with VolumeLoader(tiny_store, pad_multiple=16, batch_size=2, seed=1) as serial:
        expected = [b for b, _ in zip(serial.batches(1), range(3))]
    with VolumeLoader(tiny_store, pad_multiple=16, batch_size=2, seed=1, num_workers=2, prefetch=1) as parallel:
        got = [b for b, _ in zip(parallel.batches(1), range(3))]
    for (ei, el), (gi, gl) in zip(expected, got):
        np.testing.assert_array_equal(ei, gi)
        np.testing.assert_array_equal(el, gl)


def test_tf_dataset_matches_the_numpy_batches(tiny_store):
    with VolumeLoader(tiny_store, shape=(24, 16, 24), batch_size=2, seed=3) as loader:
        dataset = loader.dataset(start_step=2)
        images, labels = next(iter(dataset))
        expected = next(loader.batches(2))
    assert tuple(images.shape) == (2, 24, 16, 24, 1)
    assert labels.dtype.name == "uint8"
    np.testing.assert_array_equal(images.numpy(), expected[0])
    np.testing.assert_array_equal(labels.numpy(), expected[1])


def test_reader_errors_keep_their_message_through_tf_data(corrupt_store):
    import tensorflow as tf

    from helpers import poison_labels

    with VolumeLoader(corrupt_store(poison_labels(9)), pad_multiple=16, batch_size=1) as loader:
        with pytest.raises(tf.errors.OpError):
            next(iter(loader.dataset()))
        assert isinstance(loader.error, DataError)
        assert "label value 9 >= number of classes 3" in str(loader.error)


def test_tf_dataset_of_several_shapes_gives_each_batch_its_own(tmp_path):
    shapes = [(16, 16, 8), (16, 16, 24)]
    with VolumeLoader(_shaped_store(tmp_path, shapes), pad_multiple=8, batch_size=1, seed=0,
                           num_workers=1, prefetch=1) as loader:
        got = [tuple(images.shape) for (images, _), _ in zip(loader.dataset(), range(2))]
        assert sorted(got) == [(1, 16, 16, 8, 1), (1, 16, 16, 24, 1)]


def test_repr_states_memory(tiny_store):
    with VolumeLoader(tiny_store, shape=(32, 32, 32), batch_size=2) as loader:
        assert repr(loader) == ("VolumeLoader(shape: 32^3; batch: 2; workers: 0; prefetch: 2; "
                                "memory per batch: 0.3 MiB)")
    with VolumeLoader(tiny_store, pad_multiple=16, batch_size=1) as loader:
        assert repr(loader).startswith("VolumeLoader(shape: native, at most 16^3; batch: 1;")


def test_direct_read_of_contiguous_datasets_matches_hdf5(tmp_path):
    from bigmem.data.store import HDF5VolumeStore
    from bigmem.data.synth import write_synthetic_store
    import h5py

    path = tmp_path / "s.h5"
    write_synthetic_store(path, num_cases=2, volume=12)
    with h5py.File(path, "r+") as handle:  # rewrite one case contiguous
        image, label = handle["cases/synth_0000/image"][...], handle["cases/synth_0000/label"][...]
        del handle["cases/synth_0000/image"], handle["cases/synth_0000/label"]
        handle["cases/synth_0000"].create_dataset("image", data=image)
        handle["cases/synth_0000"].create_dataset("label", data=label)
    direct = HDF5VolumeStore(path, cold_cache=True)
    through_hdf5 = HDF5VolumeStore(path, direct_read=False)
    for case_id in direct.case_ids:
        for a, b in zip(direct.read_case(case_id), through_hdf5.read_case(case_id)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(direct.read_case("synth_0000")[0], image)


def test_patches_are_foreground_oversampled(tiny_store):
    from bigmem.data.pipeline import load_patch
    from bigmem.data.store import HDF5VolumeStore

    store = HDF5VolumeStore(tiny_store)
    hits = {0.0: 0, 1.0: 0}
    for fraction in hits:
        for index in range(40):
            image, label = load_patch(store, index, patch=6, seed=0, foreground_fraction=fraction)
            assert image.shape == (6, 6, 6, 1)
            assert label.shape == (6, 6, 6)
            hits[fraction] += int(label.any())
    assert hits[1.0] == 40  # every patch centred on foreground holds some
    assert hits[1.0] > hits[0.0]


def test_patch_loader_batches(tiny_store):
    with VolumeLoader(tiny_store, batch_size=2, patch=8, seed=1) as loader:
        images, labels = next(loader.batches())
        again = next(loader.batches())
    assert images.shape == (2, 8, 8, 8, 1)
    assert labels.shape == (2, 8, 8, 8)
    np.testing.assert_array_equal(images, again[0])
    with VolumeLoader(tiny_store, batch_size=2, patch=8, seed=1, num_workers=1) as parallel:
        np.testing.assert_array_equal(next(parallel.batches())[0], images)


def test_the_pipeline_catches_non_finite_values(corrupt_store):
    """The statistics are the store's, taken before the damage: the read itself must refuse the NaN."""
    from bigmem.errors import DataError

    def poison(handle):
        data = handle["cases/synth_0002/image"]
        values = data[...]
        values[1, 1, 1, 0] = np.nan
        data[...] = values

    path = corrupt_store(poison)
    with VolumeLoader(path, pad_multiple=16, batch_size=4) as loader:
        assert loader.store.check_finite is True
        with pytest.raises(DataError, match=r"^Case 'synth_0002': image has 1 non-finite values \(NaN/Inf\) "):
            next(loader.batches())


def test_shards_split_every_global_batch_in_the_order_of_one_process(tiny_store):
    """Two workers' loaders together load exactly one process's batches of twice their size."""
    with VolumeLoader(tiny_store, pad_multiple=16, batch_size=4, seed=5) as one:
        whole = [next(one.batches(step)) for step in range(3)]
    for index in range(2):
        with VolumeLoader(tiny_store, pad_multiple=16, batch_size=2, seed=5, shard=(index, 2)) as worker:
            assert worker.steps_per_epoch == one.steps_per_epoch
            for step in range(3):
                images, labels = next(worker.batches(step))
                np.testing.assert_array_equal(images, whole[step][0][2 * index:2 * index + 2])
                np.testing.assert_array_equal(labels, whole[step][1][2 * index:2 * index + 2])
    with pytest.raises(ValueError, match=r"shard \(2, 2\)"):
        VolumeLoader(tiny_store, pad_multiple=16, batch_size=2, shard=(2, 2))


@pytest.mark.parametrize("bad", ["label", "nan"])
def test_the_loader_refuses_a_bad_case_when_it_is_made_not_when_it_is_read(tmp_path, bad):
    """Before the first step: the loader's construction is where a training job opens the store."""
    from bigmem.data.store import StoreWriter

    with StoreWriter(tmp_path / "s.h5", num_classes=3, channel_names=["x"]) as writer:
        for index in range(3):
            image, label = np.ones((8, 8, 8, 1), np.float32), np.zeros((8, 8, 8), np.uint8)
            if index == 2:
                label[1, 1, 1] = 5 if bad == "label" else 0
                image[1, 1, 1, 0] = np.nan if bad == "nan" else 1.0
            writer.add_case(f"c{index}", image, label)
        writer.commit()
    message = {"label": r"^Case 'c2': label value 5 >= number of classes 3 \(",
               "nan": r"^Case 'c2': image has 1 non-finite values \(NaN/Inf\) \("}[bad]
    with pytest.raises(DataError, match=message):
        VolumeLoader(tmp_path / "s.h5", pad_multiple=16, batch_size=1)


def test_a_case_larger_than_the_training_shape_is_cropped_before_it_is_augmented(tiny_store):
    """The chain's time and memory are those of the shape trained: it sees the crop, not the whole case."""
    from dataclasses import dataclass
    from typing import ClassVar

    from bigmem.data.pipeline import load_sample
    from bigmem.data.store import HDF5VolumeStore
    from bigmem.data.transforms import Compose, Transform

    seen = []

    @dataclass(repr=False)
    class Record(Transform):
        name: ClassVar[str] = "record"

        def apply(self, sample, rng):
            seen.append(sample.label.shape)
            return sample

        def extra_volumes(self, channels):
            return 0.0

    store = HDF5VolumeStore(tiny_store)  # 16^3 cases
    try:
        image, label = load_sample(store, 0, case_index=0, shape=(8, 16, 12), seed=0, augment=Compose([Record()]))
    finally:
        store.close()
    assert seen == [(8, 16, 12)]
    assert image.shape == (8, 16, 12, 1)


def test_a_resampling_chain_reads_the_crop_with_a_margin_and_returns_the_crop(tiny_store):
    """nnU-Net's initial patch: the spatial transform sees the crop plus its margin, clipped to the case."""
    from bigmem.data.pipeline import load_sample
    from bigmem.data.store import HDF5VolumeStore
    from bigmem.data.transforms import Compose, SpatialTransform

    seen = []

    class Recording(SpatialTransform):
        def apply(self, sample, rng):
            seen.append((sample.label.shape, sample.window))
            return super().apply(sample, rng)

    store = HDF5VolumeStore(tiny_store)  # 16^3 cases
    try:
        image, label = load_sample(store, 0, case_index=0, shape=(8, 8, 8), seed=0,
                                   augment=Compose([Recording(p_rotation=1.0)]))
    finally:
        store.close()
    # margin_shape(8^3) is 12^3: 2 voxels each side of the crop, clipped where the crop meets the case's edge
    assert all(10 <= n <= 12 for n in seen[0][0])
    assert seen[0][0] != (8, 8, 8)
    assert seen[0][1][1] == (8, 8, 8)
    assert label.shape == (8, 8, 8)


def test_a_crop_read_with_a_margin_turns_in_anatomy_not_padding(tmp_path):
    """A rotated crop from the middle of a larger case has no voxel from outside it."""
    from bigmem.data.pipeline import PAD_LABEL, load_sample
    from bigmem.data.store import HDF5VolumeStore, StoreWriter
    from bigmem.data.transforms import Compose, SpatialTransform

    rng = np.random.default_rng(0)
    with StoreWriter(tmp_path / "s.h5", num_classes=2, channel_names=["mr"]) as writer:
        writer.add_case("a", rng.normal(size=(48, 48, 48, 1)).astype(np.float32),
                        (rng.random((48, 48, 48)) < 0.5).astype(np.uint8))
        writer.commit()
    store = HDF5VolumeStore(tmp_path / "s.h5")
    chain = Compose([SpatialTransform(p_rotation=1.0, p_scaling=0.0, mirror_axes=())])
    try:
        labels = [load_sample(store, i, case_index=0, shape=(16, 16, 16), seed=1, augment=chain)[1] for i in range(4)]
    finally:
        store.close()
    assert all(not (label == PAD_LABEL).any() for label in labels)


def test_what_a_rotation_brings_in_from_outside_the_case_is_background():
    """nnU-Net pads the segmentation with -1, then RemoveLabelTansform(-1, 0): outside is background."""
    from bigmem.data.transforms import PAD_LABEL, Sample, SpatialTransform

    sample = Sample(np.zeros((16, 16, 16, 1), np.float32), np.ones((16, 16, 16), np.uint8), np.zeros(1, np.float32))
    out = SpatialTransform(p_rotation=1.0, p_scaling=0.0, mirror_axes=())(sample, np.random.default_rng(0))
    assert not (out.label == PAD_LABEL).any()
    assert out.label[0, 0, 0] == 0
