"""Whole-volume loader: shapes, normalisation, crop/pad alignment, deterministic resume order."""

from __future__ import annotations

import numpy as np
import pytest

from bigmem.data.pipeline import WholeVolumeLoader, case_for_sample, fit_to_volume
from bigmem.errors import DataError


def test_batches_are_normalised_whole_volumes(tiny_store):
    with WholeVolumeLoader(tiny_store, volume=16, batch_size=2, flip=False) as loader:
        images, labels = next(loader.batches())
    assert images.shape == (2, 16, 16, 16, 1) and images.dtype == np.float32
    assert labels.shape == (2, 16, 16, 16) and labels.dtype == np.uint8
    for image in images:
        assert abs(float(image.mean())) < 1e-4
        assert abs(float(image.std()) - 1.0) < 1e-3


@pytest.mark.parametrize("shape", [(33, 34, 35), (13, 16, 19), (32, 32, 32)])
@pytest.mark.parametrize("volume", [16, 32, 40])
def test_fit_to_volume_keeps_image_and_label_aligned(shape, volume):
    rng = np.random.default_rng(0)
    label = rng.integers(0, 5, shape).astype(np.uint8)
    image = label[..., np.newaxis].astype(np.float32) + 1.0  # image encodes the label, 0 only where padded
    fitted_image, fitted_label = fit_to_volume(image, label, volume, np.random.default_rng(1))
    assert fitted_image.shape == (volume, volume, volume, 1) and fitted_label.shape == (volume,) * 3
    real = fitted_image[..., 0] > 0
    np.testing.assert_array_equal(fitted_image[..., 0][real] - 1.0, fitted_label[real])
    assert np.all(fitted_label[~real] == 0)
    assert int(real.sum()) == int(np.prod([min(s, volume) for s in shape]))


def test_every_epoch_visits_every_case_once():
    for epoch in range(3):
        seen = sorted(case_for_sample(epoch * 7 + i, 7, seed=5) for i in range(7))
        assert seen == list(range(7))
    assert [case_for_sample(i, 7, 5) for i in range(7)] != [case_for_sample(i, 7, 6) for i in range(7)]


def test_order_resumes_at_any_step(tiny_store):
    with WholeVolumeLoader(tiny_store, volume=16, batch_size=3, seed=2) as loader:
        stream = loader.batches(0)
        from_start = [next(stream) for _ in range(4)]
        resumed = next(loader.batches(3))
    np.testing.assert_array_equal(resumed[0], from_start[3][0])
    np.testing.assert_array_equal(resumed[1], from_start[3][1])
    assert not np.array_equal(from_start[0][0], from_start[1][0])


def test_worker_processes_deliver_the_same_batches(tiny_store):
    with WholeVolumeLoader(tiny_store, volume=16, batch_size=2, seed=1) as serial:
        expected = [b for b, _ in zip(serial.batches(1), range(3))]
    with WholeVolumeLoader(tiny_store, volume=16, batch_size=2, seed=1, num_workers=2, prefetch=1) as parallel:
        got = [b for b, _ in zip(parallel.batches(1), range(3))]
    for (ei, el), (gi, gl) in zip(expected, got):
        np.testing.assert_array_equal(ei, gi)
        np.testing.assert_array_equal(el, gl)


def test_tf_dataset_matches_the_numpy_batches(tiny_store):
    with WholeVolumeLoader(tiny_store, volume=24, batch_size=2, seed=3) as loader:
        dataset = loader.dataset(start_step=2)
        images, labels = next(iter(dataset))
        expected = next(loader.batches(2))
    assert tuple(images.shape) == (2, 24, 24, 24, 1) and labels.dtype.name == "uint8"
    np.testing.assert_array_equal(images.numpy(), expected[0])
    np.testing.assert_array_equal(labels.numpy(), expected[1])


def test_reader_errors_keep_their_message_through_tf_data(corrupt_store):
    import tensorflow as tf

    from helpers import poison_labels

    with WholeVolumeLoader(corrupt_store(poison_labels(9)), volume=16, batch_size=1) as loader:
        with pytest.raises(tf.errors.OpError):
            next(iter(loader.dataset()))
        assert isinstance(loader.error, DataError)
        assert "label value 9 >= number of classes 3" in str(loader.error)


def test_repr_states_memory(tiny_store):
    with WholeVolumeLoader(tiny_store, volume=32, batch_size=2) as loader:
        assert repr(loader) == ("WholeVolumeLoader(volume: 32^3; batch: 2; workers: 0; prefetch: 2; "
                                "memory per batch: 0.3 MiB)")


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
            image, label = load_patch(store, index, patch=6, seed=0, flip=False, foreground_fraction=fraction)
            assert image.shape == (6, 6, 6, 1) and label.shape == (6, 6, 6)
            hits[fraction] += int(label.any())
    assert hits[1.0] == 40  # every patch centred on foreground holds some
    assert hits[1.0] > hits[0.0]


def test_patch_loader_batches(tiny_store):
    with WholeVolumeLoader(tiny_store, volume=16, batch_size=2, patch=8, seed=1) as loader:
        images, labels = next(loader.batches())
        again = next(loader.batches())
    assert images.shape == (2, 8, 8, 8, 1) and labels.shape == (2, 8, 8, 8)
    np.testing.assert_array_equal(images, again[0])
    with WholeVolumeLoader(tiny_store, volume=16, batch_size=2, patch=8, seed=1, num_workers=1) as parallel:
        np.testing.assert_array_equal(next(parallel.batches())[0], images)


def test_the_pipeline_catches_non_finite_values_in_normalisation(corrupt_store):
    from bigmem.errors import DataError

    def poison(handle):
        data = handle["cases/synth_0002/image"]
        values = data[...]
        values[1, 1, 1, 0] = np.nan
        data[...] = values

    path = corrupt_store(poison)
    with WholeVolumeLoader(path, volume=16, batch_size=4, flip=False) as loader:
        assert loader.store.check_finite is False
        with pytest.raises(DataError, match=r"^Case 'synth_0002': image has 1 non-finite values \(NaN/Inf\) "):
            next(loader.batches())


def test_shards_split_every_global_batch_in_the_order_of_one_process(tiny_store):
    """Two workers' loaders together load exactly one process's batches of twice their size."""
    with WholeVolumeLoader(tiny_store, volume=16, batch_size=4, seed=5) as one:
        whole = [next(one.batches(step)) for step in range(3)]
    for index in range(2):
        with WholeVolumeLoader(tiny_store, volume=16, batch_size=2, seed=5, shard=(index, 2)) as worker:
            assert worker.steps_per_epoch == one.steps_per_epoch
            for step in range(3):
                images, labels = next(worker.batches(step))
                np.testing.assert_array_equal(images, whole[step][0][2 * index:2 * index + 2])
                np.testing.assert_array_equal(labels, whole[step][1][2 * index:2 * index + 2])
    with pytest.raises(ValueError, match=r"shard \(2, 2\)"):
        WholeVolumeLoader(tiny_store, volume=16, batch_size=2, shard=(2, 2))
