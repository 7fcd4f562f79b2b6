"""Region training: BCE + soft Dice over sigmoid outputs, checked by hand, in slabs, and without padding."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from bigmem.data.pipeline import PAD_LABEL
from bigmem.nets.limits import SLAB_CALLS, kernel_element_limit
from bigmem.train.losses import DICE_SMOOTH
from bigmem.train.region_loss import (
    membership,
    region_counts,
    region_dice_bce_per_sample,
    region_dice_from_counts,
)

# BraTS-like: whole tumour unites 1, 2, 3; tumour core 2, 3; enhancing 3
REGIONS = {"whole": [1, 2, 3], "core": [2, 3], "enhancing": [3]}
MEMBER = membership(REGIONS, 4)


def test_membership_marks_each_regions_label_values():
    np.testing.assert_array_equal(MEMBER, [[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])


def _by_hand(labels: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """nnU-Net's DC_and_BCE_loss per sample: mean BCE over voxels and regions + 1 - mean soft Dice (do_bg)."""
    losses = []
    for label, logit in zip(labels, logits):
        valid = label != PAD_LABEL
        target = MEMBER[np.where(valid, label, 0)] * valid[..., None]
        prob = 1.0 / (1.0 + np.exp(-logit.astype(np.float64)))
        bce = -(target * np.log(prob) + (1 - target) * np.log(1 - prob))
        bce = (bce * valid[..., None]).sum() / (valid.sum() * logit.shape[-1])
        prob = prob * valid[..., None]
        axes = (0, 1, 2)
        dice = (2 * (prob * target).sum(axes) + DICE_SMOOTH) / (prob.sum(axes) + target.sum(axes) + DICE_SMOOTH)
        losses.append(bce + 1 - dice.mean())
    return np.array(losses)


def test_loss_equals_bce_plus_soft_dice_by_hand():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, (2, 5, 6, 7)).astype(np.uint8)
    logits = rng.normal(0, 2, (2, 5, 6, 7, 3)).astype(np.float32)
    got = region_dice_bce_per_sample(tf.constant(labels), tf.constant(logits), MEMBER).numpy()
    np.testing.assert_allclose(got, _by_hand(labels, logits), rtol=1e-5)


def test_padding_counts_in_no_term():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 4, (1, 4, 4, 4)).astype(np.uint8)
    logits = rng.normal(size=(1, 4, 4, 4, 3)).astype(np.float32)
    padded_labels = np.full((1, 6, 4, 4), PAD_LABEL, np.uint8)
    padded_labels[:, :4] = labels
    padded_logits = rng.normal(size=(1, 6, 4, 4, 3)).astype(np.float32) * 5
    padded_logits[:, :4] = logits
    want = region_dice_bce_per_sample(tf.constant(labels), tf.constant(logits), MEMBER).numpy()
    got = region_dice_bce_per_sample(tf.constant(padded_labels), tf.constant(padded_logits), MEMBER).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 33, 4, 5, 3), (2, 17, 3, 3, 3)])
def test_loss_in_slabs_equals_whole(shape):
    logits = tf.random.stateless_normal(shape, seed=[1, 2]) * 3
    labels = tf.cast(tf.random.stateless_uniform(shape[:-1], seed=[3, 4], maxval=4, dtype=tf.int32), tf.uint8)
    labels = tf.tensor_scatter_nd_update(labels, [[0, 0, 0, 0]], tf.constant([PAD_LABEL], tf.uint8))
    upstream = tf.constant([1.0, -2.0][:shape[0]])

    def value_and_grad():
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = region_dice_bce_per_sample(labels, logits, MEMBER)
            total = tf.reduce_sum(loss * upstream)
        return loss, tape.gradient(total, logits)

    want_loss, want_grad = value_and_grad()
    before = SLAB_CALLS["loss"]
    with kernel_element_limit(shape[2] * shape[3] * shape[4] * 4):
        got_loss, got_grad = value_and_grad()
        counts = region_counts(MEMBER)(labels, logits)
    assert SLAB_CALLS["loss"] > before  # the slab path ran
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-6 * float(tf.reduce_max(tf.abs(want_grad))) + 1e-9)
    for got, want in zip(counts, region_counts(MEMBER)(labels, logits)):
        np.testing.assert_array_equal(got, want)


def test_counts_threshold_the_sigmoid_at_one_half():
    labels = tf.constant(np.array([[[[0, 1, 2, 3]]]], np.uint8))  # (1, 1, 1, 4)
    # whole predicted at voxels 1 and 2; core at voxel 3; enhancing nowhere
    logits = tf.constant(np.array([[[[[-1, -1, -1], [1, -1, -1], [1, -1, -1], [-1, 1, -1]]]]], np.float32))
    intersection, total = region_counts(MEMBER)(labels, logits)
    np.testing.assert_array_equal(intersection.numpy(), [2, 1, 0])  # whole: 1, 2; core: 3; enhancing: none
    np.testing.assert_array_equal(total.numpy(), [2 + 3, 1 + 2, 0 + 1])
    dice = region_dice_from_counts(intersection, total).numpy()
    assert dice == pytest.approx((4 / 5 + 2 / 3 + 0) / 3)


def test_region_training_end_to_end(tmp_path, tiny_store, capsys):
    """A store with regions trains sigmoid outputs, and predict paints them in regions_class_order."""
    import json

    import h5py
    import nibabel as nib

    from helpers import copy_store, run_cli

    store = copy_store(tiny_store, tmp_path / "regions.h5")
    with h5py.File(store, "r+") as handle:
        handle.attrs["label_names"] = ["background", "whole", "core"]
        handle.attrs["regions"] = json.dumps({"whole": [1, 2], "core": [2]})
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--model", "tiny", "--data", store, "--out", out, "--steps", 2,
                            "--monitor-interval", 0, "--augment", "none", "--recipe", "preset"], capsys)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["region_outputs"] is True
    code, _, err = run_cli(["predict", out, store, "-o", tmp_path / "pred", "--save-probabilities"], capsys)
    assert code == 0, err
    first = sorted((tmp_path / "pred").glob("*_probabilities.npz"))[0]
    probabilities = np.load(first)["probabilities"].astype(np.float32)
    assert probabilities.shape[-1] == 2  # one sigmoid output per region, no background
    labels = np.asarray(nib.load(str(first).replace("_probabilities.npz", ".nii.gz")).dataobj)
    painted = np.zeros(labels.shape, np.uint8)
    painted[probabilities[..., 0] > 0.5] = 1  # whole paints 1, then core paints 2 over it
    painted[probabilities[..., 1] > 0.5] = 2
    assert np.mean(painted == labels) > 0.999  # float16 probabilities on the threshold may round either way
