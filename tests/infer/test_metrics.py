"""Segmentation metrics against cases computed by hand, including empty classes and anisotropic spacing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bigmem.infer.metrics import (
    absent_class_metrics,
    aggregate,
    case_metrics,
    confusion_counts,
    hausdorff95_mm,
    overlap_metrics,
    region_metrics,
    voxel_volume_ml,
)


def _labels(shape, boxes) -> np.ndarray:
    """A uint8 label map with ``boxes``: [(label, (slice, slice, slice))], later boxes on top."""
    out = np.zeros(shape, np.uint8)
    for label, box in boxes:
        out[box] = label
    return out


def test_counts_dice_iou_by_hand():
    # reference class 1: x 0..3 (4 planes of 2x2 = 16 voxels); prediction: x 2..5 (16 voxels); overlap x 2..3 (8)
    ref = _labels((7, 2, 2), [(1, np.s_[0:4])])
    pred = _labels((7, 2, 2), [(1, np.s_[2:6])])
    metrics = case_metrics(ref, pred, [1], (1.0, 1.0, 1.0))[1]
    assert (metrics["TP"], metrics["FP"], metrics["FN"]) == (8, 8, 8)
    assert (metrics["n_ref"], metrics["n_pred"]) == (16, 16)
    assert metrics["Dice"] == pytest.approx(2 * 8 / (2 * 8 + 8 + 8))  # 0.5
    assert metrics["IoU"] == pytest.approx(8 / 24)


def test_confusion_counts_two_classes():
    ref = np.array([0, 1, 1, 2, 2, 2, 0], np.uint8)
    pred = np.array([1, 1, 2, 2, 2, 0, 0], np.uint8)
    counts = confusion_counts(ref, pred, 3)
    assert counts.tolist() == [[1, 1, 0], [0, 1, 1], [1, 0, 2]]
    metrics = case_metrics(ref.reshape(7, 1, 1), pred.reshape(7, 1, 1), [1, 2], (1, 1, 1), hausdorff=False)
    assert (metrics[2]["TP"], metrics[2]["FP"], metrics[2]["FN"]) == (2, 1, 1)
    assert metrics[2]["Dice"] == pytest.approx(4 / 6)
    assert (metrics[1]["TP"], metrics[1]["FP"], metrics[1]["FN"]) == (1, 1, 1)
    assert metrics[1]["IoU"] == pytest.approx(1 / 3)


def test_confusion_counts_in_slabs_match_one_bincount(monkeypatch):
    import bigmem.infer.metrics as metrics_module

    monkeypatch.setattr(metrics_module, "_SLAB_VOXELS", 7)  # many slabs and a ragged last one over 9*10*11
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 4, (9, 10, 11), dtype=np.uint8)
    pred = rng.integers(0, 4, (9, 10, 11), dtype=np.uint8)
    expected = np.bincount(ref.reshape(-1).astype(int) * 4 + pred.reshape(-1), minlength=16).reshape(4, 4)
    np.testing.assert_array_equal(confusion_counts(ref, pred, 4), expected)


def test_confusion_counts_rejects_labels_out_of_range():
    with pytest.raises(ValueError, match=r"labels must be in 0\.\.1"):
        confusion_counts(np.array([0, 2], np.uint8), np.array([0, 1], np.uint8), 2)


def test_volumes_in_ml_with_anisotropic_spacing():
    spacing = (0.5, 0.8, 2.5)  # 1 mm^3 per voxel = 0.001 mL
    assert voxel_volume_ml(spacing) == pytest.approx(0.001)
    ref = _labels((10, 10, 10), [(1, np.s_[0:5, 0:4, 0:10])])  # 200 voxels
    pred = _labels((10, 10, 10), [(1, np.s_[0:5, 0:4, 0:5])])  # 100 voxels, all inside ref
    metrics = case_metrics(ref, pred, [1], spacing, hausdorff=False)[1]
    assert metrics["ref_volume_ml"] == pytest.approx(0.2)
    assert metrics["pred_volume_ml"] == pytest.approx(0.1)
    assert metrics["Dice"] == pytest.approx(2 * 100 / (2 * 100 + 0 + 100))


def test_volume_scales_with_voxel_size():
    assert voxel_volume_ml((2.0, 2.0, 5.0)) == pytest.approx(0.02)  # 20 mm^3
    metrics = overlap_metrics(10, 5, 0, voxel_volume_ml((2.0, 2.0, 5.0)))
    assert metrics["pred_volume_ml"] == pytest.approx(0.3)
    assert metrics["ref_volume_ml"] == pytest.approx(0.2)


@pytest.mark.parametrize("axis, spacing, k, expected_mm", [
    (0, (0.5, 1.0, 1.0), 3, 1.5),
    (2, (1.0, 1.0, 2.5), 3, 7.5),
    (1, (0.7, 1.3, 3.0), 1, 1.3),
])
def test_hd95_of_parallel_planes_is_the_offset_in_mm(axis, spacing, k, expected_mm):
    # one full plane against the same plane k voxels further along ``axis``: every surface voxel is
    # k * spacing[axis] from the other surface, in both directions
    shape = (9, 8, 7)
    ref, pred = np.zeros(shape, bool), np.zeros(shape, bool)
    ref[(slice(None),) * axis + (1,)] = True
    pred[(slice(None),) * axis + (1 + k,)] = True
    assert hausdorff95_mm(ref, pred, spacing) == pytest.approx(expected_mm)
    assert hausdorff95_mm(pred, ref, spacing) == pytest.approx(expected_mm)


def test_hd95_of_a_voxel_inside_a_cube_by_hand():
    # reference: a 3x3x3 cube, surface = the 26 voxels around its centre; prediction: the centre voxel.
    # prediction -> reference: 1. reference -> prediction: 6 faces at 1, 12 edges at sqrt 2, 8 corners
    # at sqrt 3; sorted, the 95th percentile (index 0.95 * 25 = 23.75) falls among the corners: sqrt 3.
    ref = np.zeros((7, 7, 7), bool)
    ref[2:5, 2:5, 2:5] = True
    pred = np.zeros_like(ref)
    pred[3, 3, 3] = True
    assert hausdorff95_mm(ref, pred, (1.0, 1.0, 1.0)) == pytest.approx(math.sqrt(3))


def test_hd95_of_identical_masks_is_zero():
    mask = np.zeros((11, 12, 13), bool)
    mask[2:9, 3:7, 4:12] = True
    assert hausdorff95_mm(mask, mask.copy(), (0.8, 0.8, 3.0)) == 0.0


@pytest.mark.parametrize("shape", [(9, 10, 11), (16, 5, 7)])
def test_hd95_matches_a_brute_force_over_all_surface_pairs(shape):
    # the crop and the feature-transform shortcut must give what every pairwise distance gives
    from scipy import ndimage

    rng = np.random.default_rng(sum(shape))
    spacing = np.array([0.6, 1.1, 2.7])
    ref = ndimage.binary_opening(rng.random(shape) > 0.6)
    pred = ndimage.binary_opening(rng.random(shape) > 0.7)
    ref[0, 0, 0] = pred[-1, -1, -1] = True  # surfaces touching the array's border

    def surface_points(mask):
        return np.argwhere(mask & ~ndimage.binary_erosion(mask)) * spacing

    a, b = surface_points(ref), surface_points(pred)
    pairwise = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))
    expected = max(np.percentile(pairwise.min(axis=1), 95), np.percentile(pairwise.min(axis=0), 95))
    assert hausdorff95_mm(ref, pred, spacing) == pytest.approx(expected)


def test_hd95_is_nan_when_either_side_is_empty():
    mask = np.zeros((5, 5, 5), bool)
    mask[1:3, 1:3, 1:3] = True
    empty = np.zeros_like(mask)
    assert math.isnan(hausdorff95_mm(mask, empty, (1, 1, 1)))
    assert math.isnan(hausdorff95_mm(empty, mask, (1, 1, 1)))
    assert math.isnan(hausdorff95_mm(empty, empty, (1, 1, 1)))


def test_hd95_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match=r"reference shape \(2, 2, 2\) != prediction shape \(2, 2, 3\)"):
        hausdorff95_mm(np.ones((2, 2, 2), bool), np.ones((2, 2, 3), bool), (1, 1, 1))
    with pytest.raises(ValueError, match="spacing .* has 2 values for a 3D mask"):
        hausdorff95_mm(np.ones((2, 2, 2), bool), np.ones((2, 2, 2), bool), (1, 1))


def test_empty_rule_both_empty_is_undefined():
    ref = _labels((4, 4, 4), [(1, np.s_[0:2])])
    metrics = case_metrics(ref, ref.copy(), [1, 2], (1, 1, 1))
    assert metrics[1]["Dice"] == 1.0
    assert metrics[1]["HD95_mm"] == 0.0
    absent = metrics[2]
    assert (absent["TP"], absent["FP"], absent["FN"], absent["ref_volume_ml"]) == (0, 0, 0, 0.0)
    assert math.isnan(absent["Dice"])
    assert math.isnan(absent["IoU"])
    assert math.isnan(absent["HD95_mm"])
    for key, value in absent_class_metrics().items():
        assert (math.isnan(value) and math.isnan(absent[key])) or value == absent[key]


def test_empty_rule_one_side_empty_scores_zero_and_no_hd95():
    ref = _labels((4, 4, 4), [(1, np.s_[0:2])])  # 32 voxels of class 1, none of class 2
    pred = _labels((4, 4, 4), [(2, np.s_[0:1])])  # 16 voxels of class 2, none of class 1
    metrics = case_metrics(ref, pred, [1, 2], (1, 1, 1))
    missed, false_positive = metrics[1], metrics[2]
    assert (missed["Dice"], missed["IoU"], missed["FN"], missed["TP"]) == (0.0, 0.0, 32, 0)
    assert (false_positive["Dice"], false_positive["IoU"], false_positive["FP"]) == (0.0, 0.0, 16)
    assert math.isnan(missed["HD95_mm"])
    assert math.isnan(false_positive["HD95_mm"])


def test_aggregate_leaves_undefined_out_and_counts_it():
    def case(dice, hd):
        metrics = dict(absent_class_metrics())
        metrics.update(Dice=dice, IoU=dice, HD95_mm=hd)
        return metrics

    per_case = [
        {1: case(0.8, 2.0), 2: case(math.nan, math.nan)},
        {1: case(0.4, math.nan), 2: case(math.nan, math.nan)},
        {1: case(0.0, 6.0), 2: case(0.5, 1.0)},
    ]
    result = aggregate(per_case, [1, 2])
    assert result["mean"][1]["Dice"] == pytest.approx(0.4)  # (0.8 + 0.4 + 0) / 3
    assert result["mean"][1]["HD95_mm"] == pytest.approx(4.0)  # (2 + 6) / 2, one case undefined
    assert result["mean"][2]["Dice"] == pytest.approx(0.5)  # the only defined case
    assert result["foreground_mean"]["Dice"] == pytest.approx(0.45)  # (0.4 + 0.5) / 2
    assert result["foreground_mean_defined"]["Dice"] == pytest.approx(0.45)
    assert result["num_undefined"] == {1: {"Dice": 0, "IoU": 0, "HD95_mm": 1}, 2: {"Dice": 2, "IoU": 2, "HD95_mm": 2}}


def test_aggregate_all_undefined_is_nan():
    result = aggregate([{1: absent_class_metrics()}], [1])
    assert math.isnan(result["mean"][1]["Dice"])
    assert math.isnan(result["foreground_mean"]["Dice"])
    assert result["mean"][1]["TP"] == 0.0


def test_foreground_mean_is_nnunets_nan_when_one_class_is_undefined_everywhere():
    """nnU-Net's compute_metrics_on_folder: foreground_mean = np.mean(class means), so a class undefined
    in every case (NaN after nanmean) makes it NaN; bigmem's own reading leaves that class out."""
    def case(dice):
        metrics = absent_class_metrics()
        metrics.update(Dice=dice, IoU=dice, HD95_mm=1.0)
        return metrics

    per_case = [{1: case(0.6), 2: absent_class_metrics()}, {1: case(0.8), 2: absent_class_metrics()}]
    result = aggregate(per_case, [1, 2])
    assert math.isnan(result["foreground_mean"]["Dice"])
    assert result["foreground_mean_defined"]["Dice"] == pytest.approx(0.7)  # class 1 alone: (0.6 + 0.8) / 2
    assert result["foreground_mean"]["TP"] == 0.0  # counts are defined for every class: a plain mean



def test_region_counts_unite_their_labels_by_hand():
    # BraTS-like: reference necrosis (1) x 0, edema (2) x 1..2, enhancing (3) x 3; prediction swaps 1 and 2
    ref = _labels((6, 2, 2), [(1, np.s_[0:1]), (2, np.s_[1:3]), (3, np.s_[3:4])])
    pred = _labels((6, 2, 2), [(2, np.s_[0:1]), (1, np.s_[1:3]), (3, np.s_[3:5])])
    regions = {"whole_tumor": [1, 2, 3], "tumor_core": [1, 3], "enhancing_tumor": [3]}
    metrics = region_metrics(ref, pred, regions, (1.0, 1.0, 1.0), hausdorff=False)
    assert list(metrics) == ["whole_tumor", "tumor_core", "enhancing_tumor"]
    whole = metrics["whole_tumor"]  # reference x 0..3 (16), prediction x 0..4 (20)
    assert (whole["TP"], whole["FP"], whole["FN"]) == (16, 4, 0)
    assert whole["Dice"] == pytest.approx(32 / 36)
    core = metrics["tumor_core"]  # reference x 0 and 3 (8), prediction x 1..2 and 3..4 (16): overlap x 3 (4)
    assert (core["TP"], core["FP"], core["FN"]) == (4, 12, 4)
    assert core["IoU"] == pytest.approx(4 / 20)
    # a one-label region is that class
    assert metrics["enhancing_tumor"] == case_metrics(ref, pred, [3], (1.0, 1.0, 1.0), hausdorff=False)[3]


def test_region_hd95_is_the_united_masks_and_empty_regions_follow_the_empty_rule():
    ref = _labels((9, 1, 1), [(1, np.s_[0:2]), (2, np.s_[2:4])])  # the union is x 0..3
    pred = _labels((9, 1, 1), [(2, np.s_[0:6])])  # x 0..5: the far face moved 2 voxels
    metrics = region_metrics(ref, pred, {"both": [1, 2], "absent": [4], "missed": [1]}, (2.0, 1.0, 1.0))
    assert metrics["both"]["HD95_mm"] == hausdorff95_mm(ref > 0, pred > 0, (2.0, 1.0, 1.0))
    # every voxel of a 1-voxel-thick line is surface: prediction -> union distances 0, 0, 0, 0, 2, 4 mm, whose
    # 95th percentile (linear, position 4.75) is 2 + 0.75 * 2; union -> prediction all 0
    assert metrics["both"]["HD95_mm"] == pytest.approx(3.5)
    assert math.isnan(metrics["absent"]["Dice"])
    assert metrics["absent"]["n_ref"] == 0
    assert metrics["missed"]["Dice"] == 0.0
    assert math.isnan(metrics["missed"]["HD95_mm"])
