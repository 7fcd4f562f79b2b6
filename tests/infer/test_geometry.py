"""bigmem.infer.geometry: store grid -> source grid, pinned against the source files convert read."""

from __future__ import annotations

from pathlib import Path

import h5py
import nibabel as nib
import numpy as np
import pytest

from bigmem.data.convert import convert
from bigmem.data.nifti import SourceCase, SourceDataset
from bigmem.data.store import HDF5VolumeStore
from bigmem.errors import DataError
from bigmem.infer.modelcard import ModelCard
from bigmem.infer.geometry import (
    CaseGeometry,
    crop_padding,
    labels_to_source,
    pad_to_multiple,
    prepare_nifti,
    scores_to_source,
    source_label_from_store,
)

# Voxel axes (0, 1, 2) point along world (-y, z, -x): reorientation permutes to (2, 0, 1) and flips two.
PERMUTED_LPS = np.array([[0.0, 0.0, -2.0, 90.0], [-1.5, 0.0, 0.0, 120.0], [0.0, 1.2, 0.0, -60.0], [0, 0, 0, 1]])
LPS = np.array([[-0.9, 0.0, 0.0, 40.0], [0.0, -1.1, 0.0, 30.0], [0.0, 0.0, 1.3, -20.0], [0, 0, 0, 1]])
PLAIN = np.diag([0.8, 0.9, 1.1, 1.0])
LABELS = ("background", "kidney", "tumour")


def _blobs(shape, affine, margin=3):
    """A large ellipsoid in world coordinates, class 2 on one side of an oblique plane through it and
    class 1 on the other; nothing within ``margin`` voxels of a face."""
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), axis=-1).astype(np.float64)
    world = grid @ affine[:3, :3].T + affine[:3, 3]
    centre = np.array(shape, np.float64) / 2 - 0.5
    offset = world - (affine[:3, :3] @ centre + affine[:3, 3])
    extent = np.abs(affine[:3, :3]) @ (np.array(shape) / 2 - margin)  # half the usable field of view, per world axis
    inside = ((offset / (0.9 * extent)) ** 2).sum(-1) <= 1
    label = np.zeros(shape, np.uint8)
    label[inside] = 1
    label[inside & (offset @ np.array([1.0, 0.6, -0.4]) > 1.0)] = 2
    return label


def _write_case(root: Path, case_id: str, shape, affine, *, channels=1, seed=0, label=None):
    rng = np.random.default_rng(seed)
    label = _blobs(shape, affine) if label is None else label
    image = (rng.normal(0, 1, shape + (channels,)) + 5 * label[..., None]).astype(np.float32)
    (root / "imagesTr").mkdir(parents=True, exist_ok=True)
    (root / "labelsTr").mkdir(exist_ok=True)
    image_path, label_path = root / "imagesTr" / f"{case_id}.nii.gz", root / "labelsTr" / f"{case_id}.nii.gz"
    nib.save(nib.Nifti1Image(image if channels > 1 else image[..., 0], affine), str(image_path))
    nib.save(nib.Nifti1Image(label, affine), str(label_path))
    return SourceCase(case_id, image_path, label_path)


def _convert(tmp_path, cases, *, channels=1, **options) -> Path:
    dataset = SourceDataset(cases, [f"ch{i}" for i in range(channels)], list(LABELS), str(tmp_path))
    out = tmp_path / "store.h5"
    convert(dataset, out, **options)
    return out


def _source_label(case: SourceCase) -> np.ndarray:
    return np.asanyarray(nib.load(str(case.label)).dataobj).astype(np.uint8)


def _dice(a: np.ndarray, b: np.ndarray, k: int) -> float:
    return 2 * np.count_nonzero((a == k) & (b == k)) / (np.count_nonzero(a == k) + np.count_nonzero(b == k))


# ---- exact: reorientation, crop and pad ------------------------------------------------------

# canonical shapes: PERMUTED_LPS (23, 30, 17) -> (17, 23, 30); the others keep their axis order.
CASES = [("lps_perm", (23, 30, 17), PERMUTED_LPS, (20, 20, 30)),  # pad 17->20, crop 23->20, keep 30
         ("lps", (25, 19, 21), LPS, (22, 24, 21)),  # crop 25->22, pad 19->24 (odd: 2 before, 3 after), keep
         ("plain", (21, 22, 23), PLAIN, None)]


@pytest.mark.parametrize("case_id, shape, affine, fit", CASES)
def test_store_labels_map_back_to_the_source_file_exactly(tmp_path, case_id, shape, affine, fit):
    case = _write_case(tmp_path / "src", case_id, shape, affine)
    store = _convert(tmp_path, [case], shape=fit)
    geometry = CaseGeometry.from_store(store, case_id)
    assert geometry.source_shape == shape
    assert not geometry.resampled
    if fit is not None:  # the fit really crops one axis and pads another
        crops, pads = zip(*geometry.crop_pad)
        assert max(crops) > 0
        assert max(pads) > 0
        assert geometry.store_shape == fit
    expected = _source_label(case)
    label, out_affine, spacing = source_label_from_store(store, case_id)
    assert label.dtype == np.uint8
    assert label.shape == shape
    assert np.array_equal(label, expected)
    np.testing.assert_allclose(out_affine, affine, atol=1e-6)
    np.testing.assert_allclose(spacing, np.linalg.norm(affine[:3, :3], axis=0), atol=1e-6)
    # One-hot scores through scores_to_source and labels_to_source land on the same labels.
    with HDF5VolumeStore(store) as opened:
        store_label = opened.read_label(case_id)
    one_hot = np.eye(len(LABELS), dtype=np.float32)[store_label]
    before = one_hot.copy()
    assert np.array_equal(labels_to_source(one_hot, geometry), expected)
    assert np.array_equal(one_hot, before)  # the running argmax never writes into its input
    scores = scores_to_source(one_hot, geometry)
    assert scores.shape == shape + (3,)
    assert scores.dtype == np.float32
    assert np.array_equal(scores.argmax(-1), expected)
    np.testing.assert_array_equal(scores.sum(-1), 1.0)


def test_cropped_away_voxels_become_background(tmp_path):
    shape = (23, 30, 17)
    label = np.zeros(shape, np.uint8)
    label[:, 10:20, 5:12] = 1  # reaches every source axis-0 voxel, which canonical axis 1 crops 23 -> 20
    case = _write_case(tmp_path / "src", "edge", shape, PERMUTED_LPS, label=label)
    store = _convert(tmp_path, [case], shape=(17, 20, 30))
    geometry = CaseGeometry.from_store(store, "edge")
    assert geometry.crop_pad == ((0, 0), (1, 0), (0, 0))
    mapped, _, _ = source_label_from_store(store, "edge")
    # Canonical axis 1 is source axis 0 flipped: canonical 0 and 21, 22 are source 22 and 1, 0.
    kept = np.ones(shape, bool)
    kept[[0, 1, 22]] = False
    assert np.array_equal(mapped[kept], label[kept])
    assert not mapped[~kept].any()
    assert label[~kept].any()
    scores = scores_to_source(np.eye(3, dtype=np.float32)[HDF5VolumeStore(store).read_label("edge")], geometry)
    np.testing.assert_array_equal(scores[~kept], [[1.0, 0.0, 0.0]] * int((~kept).sum()))


# ---- resampled: Dice and world positions -------------------------------------------------------

# Blobs of ~4,000-5,000 voxels (radius ~10): a half-voxel shift costs them ~5% Dice.
RESAMPLED = [
    # canonical (27, 39, 34) at (2.0, 1.5, 1.2) mm -> (43, 47, 33) at 1.25 mm (two axes up, one down): pad, crop, pad
    ("perm", (39, 34, 27), PERMUTED_LPS, (1.25, 1.25, 1.25), (48, 40, 36)),
    # (41, 37, 29) at (0.9, 1.1, 1.3) mm -> (41, 51, 38) at (0.9, 0.8, 1.0) mm: crop, pad, crop
    ("lps", (41, 37, 29), LPS, (0.9, 0.8, 1.0), (36, 56, 30)),
]


@pytest.mark.parametrize("case_id, shape, affine, spacing, fit", RESAMPLED)
def test_resampled_labels_map_back_within_dice(tmp_path, case_id, shape, affine, spacing, fit):
    case = _write_case(tmp_path / "src", case_id, shape, affine)
    store = _convert(tmp_path, [case], spacing=spacing, shape=fit)
    geometry = CaseGeometry.from_store(store, case_id)
    assert geometry.resampled
    assert geometry.grid_shape != geometry.canonical_shape
    crops, pads = zip(*geometry.crop_pad)
    assert max(crops) > 0
    assert max(pads) > 0
    expected = _source_label(case)
    label, out_affine, spacing_out = source_label_from_store(store, case_id)
    assert label.shape == shape
    assert label.dtype == np.uint8
    np.testing.assert_allclose(out_affine, affine, atol=1e-6)
    np.testing.assert_allclose(spacing_out, np.linalg.norm(affine[:3, :3], axis=0), atol=1e-6)
    for k in (1, 2):
        assert _dice(label, expected, k) >= 0.99, (k, _dice(label, expected, k))
    # One-hot scores go back linearly, class by class: close to the source as well.
    with HDF5VolumeStore(store) as opened:
        one_hot = np.eye(3, dtype=np.float32)[opened.read_label(case_id)]
    from_scores = labels_to_source(one_hot, geometry)
    assert np.array_equal(from_scores, scores_to_source(one_hot, geometry).argmax(-1))
    for k in (1, 2):
        assert _dice(from_scores, expected, k) >= 0.98, (k, _dice(from_scores, expected, k))


@pytest.mark.parametrize("affine, spacing, fit", [
    (PERMUTED_LPS, (1.0, 1.3, 0.7), (30, 30, 34)),  # resampled (34, 27, 51): crop, pad, crop
    (LPS, (1.2, 0.8, 1.0), (16, 28, 24)),  # resampled (19, 26, 27): crop, pad, crop
])
def test_resampled_scores_keep_their_world_position(tmp_path, affine, spacing, fit):
    """World coordinates as class scores on the store grid map back to the source voxels' coordinates.

    Linear interpolation reproduces a linear field exactly, so any shift or scale error shows.
    """
    shape = (23, 30, 17)
    case = _write_case(tmp_path / "src", "w", shape, affine)
    store = _convert(tmp_path, [case], spacing=spacing, shape=fit)
    geometry = CaseGeometry.from_store(store, "w")
    assert any(c for c, _ in geometry.crop_pad)
    assert any(p for _, p in geometry.crop_pad)
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in geometry.store_shape], indexing="ij"), -1)
    world = (grid @ geometry.store_affine[:3, :3].T + geometry.store_affine[:3, 3]).astype(np.float32)
    kept = np.ones(geometry.store_shape + (1,), np.float32)  # 0 where convert cropped (a class >= 1's fill)
    scores = np.concatenate([kept, kept, world], axis=-1)
    mapped = scores_to_source(scores, geometry)
    source_grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), -1)
    expected = source_grid @ affine[:3, :3].T + affine[:3, 3]
    np.testing.assert_array_equal(mapped[..., 0], 1.0)  # class 0: its fill is 1 too
    check = mapped[..., 1] == 1.0  # interpolated from kept voxels only
    assert 0.5 * np.prod(shape) < check.sum() < np.prod(shape)  # most voxels, not all (something was cropped)
    faces = np.ones(shape, bool)  # past the outermost coarse voxel centre the edge value repeats (mode="nearest")
    faces[1:-1, 1:-1, 1:-1] = False
    check &= ~faces
    np.testing.assert_allclose(mapped[..., 2:][check], expected[check], atol=1e-3)


# ---- prepare_nifti ---------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"shape": (20, 20, 30)}, {"spacing": (1.0, 1.3, 0.7), "shape": (30, 26, 34)}])
def test_prepare_nifti_matches_convert(tmp_path, options):
    case = _write_case(tmp_path / "src", "p", (23, 30, 17), PERMUTED_LPS)
    store = _convert(tmp_path, [case], **options)
    image, geometry, stats = prepare_nifti(case.image, store)
    with HDF5VolumeStore(store) as opened:
        stored, _ = opened.read_case("p")
        dtype = opened.cases[0].image_dtype  # the store keeps the image in the smallest dtype that holds it
        assert stats == opened.case_stats("p")  # taken where convert takes them: after resampling, before the fit
    assert image.dtype == np.float32
    assert np.array_equal(image.astype(dtype).astype(np.float32), stored)
    expected = CaseGeometry.from_store(store, "p")
    for name in ("source_shape", "grid_shape", "store_shape", "crop_pad", "spacing"):
        assert getattr(geometry, name) == getattr(expected, name), name
    np.testing.assert_allclose(geometry.grid_affine, expected.grid_affine, atol=1e-9)
    np.testing.assert_allclose(geometry.source_affine, expected.source_affine)
    card = ModelCard.from_store(store)
    assert (card.spacing, card.shape) == (options.get("spacing"), options.get("shape"))


def test_prepare_nifti_one_file_per_channel(tmp_path):
    case = _write_case(tmp_path / "src", "m", (19, 18, 17), LPS, channels=2)
    store = _convert(tmp_path, [case], channels=2, shape=(16, 20, 17))
    data = np.asanyarray(nib.load(str(case.image)).dataobj)
    paths = []
    for c in range(2):
        paths.append(tmp_path / f"m_{c:04d}.nii.gz")
        nib.save(nib.Nifti1Image(data[..., c], LPS), str(paths[-1]))
    image, geometry, _ = prepare_nifti(paths, store)
    assert geometry.case_id == "m"
    assert image.shape == (16, 20, 17, 2)
    assert geometry.source_shape == (19, 18, 17)
    with HDF5VolumeStore(store) as opened:  # an open store works as well as a path, and the 4D source maps back
        assert CaseGeometry.from_store(opened, "m").source_shape == (19, 18, 17)
        label, _, _ = source_label_from_store(opened, "m")
        assert np.array_equal(label, _source_label(case))
    with HDF5VolumeStore(store) as opened:
        dtype = opened.cases[0].image_dtype
        assert np.array_equal(image.astype(dtype).astype(np.float32), opened.read_case("m")[0])
    with pytest.raises(DataError, match=r"Case 'm': 1 channel in .*m_0000.nii.gz; the model takes 2 "
                                        r"\(ch0, ch1\)\."):
        prepare_nifti(paths[:1], store)


def test_prepare_nifti_for_a_store_without_convert_options(tmp_path, tiny_store):
    """A synthetic store was neither resampled nor fitted: a NIfTI case is only reoriented."""
    case = _write_case(tmp_path / "src", "s", (17, 18, 19), PLAIN)
    image, geometry, stats = prepare_nifti(case.image, tiny_store)
    assert image.shape[:3] == geometry.source_shape == (17, 18, 19)
    assert not geometry.resampled
    assert stats["mean"][0] == pytest.approx(float(image.mean()), rel=1e-5)


# ---- errors ------------------------------------------------------------------------------------------


def test_a_synthetic_case_is_its_own_source(tiny_store):
    """A phantom has no source file: predictions are written in its store grid, its labels are the reference."""
    geometry = CaseGeometry.from_store(tiny_store, "synth_0000")
    assert geometry.source_shape == geometry.store_shape == (16, 16, 16)
    assert not geometry.resampled
    with HDF5VolumeStore(tiny_store) as store:
        label = store.read_label("synth_0000")
    mapped, affine, spacing = source_label_from_store(tiny_store, "synth_0000")
    np.testing.assert_array_equal(mapped, label)
    np.testing.assert_allclose(affine, np.eye(4))
    assert spacing == (1.0, 1.0, 1.0)
    one_hot = np.eye(3, dtype=np.float32)[label]
    np.testing.assert_array_equal(labels_to_source(one_hot, geometry), label)


def test_geometry_errors(tmp_path, tiny_store):
    partial = tmp_path / "partial.h5"
    partial.write_bytes(tiny_store.read_bytes())
    with h5py.File(partial, "r+") as handle:
        handle["cases/synth_0000"].attrs["crop_pad"] = np.zeros((3, 2), np.int64)
    with pytest.raises(DataError, match=r"Case 'synth_0000': no source_shape, .* attribute\(s\) in .*expected a "
                                        r"store written by 'bigmem convert'"):
        CaseGeometry.from_store(partial, "synth_0000")
    case = _write_case(tmp_path / "src", "e", (17, 18, 19), PLAIN)
    store = _convert(tmp_path, [case])
    with pytest.raises(DataError, match=r"Case 'nope' is not in store"):
        CaseGeometry.from_store(store, "nope")
    geometry = CaseGeometry.from_store(store, "e")
    with pytest.raises(DataError, match=r"Case 'e': scores has shape \(17, 18, 3\); expected the store grid's "
                                        r"\(17, 18, 19, 'C'\)\."):
        scores_to_source(np.zeros((17, 18, 3), np.float32), geometry)
    with pytest.raises(DataError, match=r"crop_pad \(\(3, 0\), \(0, 0\), \(0, 0\)\) does not fit axis 0"):
        CaseGeometry("x", (17, 18, 19), PLAIN, (17, 18, 19), PLAIN, (16, 18, 19), ((3, 0), (0, 0), (0, 0)),
                     (1, 1, 1))
    with h5py.File(store) as handle:  # convert writes what prepare_nifti needs
        assert "convert_options" in handle.attrs


# ---- pad_to_multiple -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, divisor, padded_shape, before", [
    ((33, 34, 35), 16, (48, 48, 48), (7, 7, 6)),
    ((32, 17, 1), 16, (32, 32, 16), (0, 7, 7)),
    ((5, 6, 7), 1, (5, 6, 7), (0, 0, 0)),
])
def test_pad_to_multiple_round_trips(shape, divisor, padded_shape, before):
    image = np.random.default_rng(0).normal(size=shape + (2,)).astype(np.float32)
    padded, slices = pad_to_multiple(image, divisor)
    assert padded.shape == padded_shape + (2,)
    assert tuple(s.start for s in slices) == before
    assert np.array_equal(crop_padding(padded, slices), image)
    inside = np.zeros(padded.shape[:3], bool)
    inside[slices] = True
    assert np.all(padded[~inside] == image.min(axis=(0, 1, 2)))  # the padding is each channel's background
    labels, label_slices = pad_to_multiple(np.ones(shape, np.uint8), divisor)  # 3D works the same
    assert labels.shape == padded_shape
    assert label_slices == slices
    if padded_shape == shape:
        assert padded is image


def test_pad_to_multiple_errors():
    with pytest.raises(DataError, match=r"divisor 0 must be a positive integer"):
        pad_to_multiple(np.zeros((4, 4, 4)), 0)
    with pytest.raises(DataError, match=r"image has shape \(4, 4\); expected \(D, H, W\) or \(D, H, W, C\)"):
        pad_to_multiple(np.zeros((4, 4)), 2)
