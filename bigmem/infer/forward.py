"""One forward pass of a trained network over a prepared volume: class probabilities.

Every prediction path goes through ``forward_probabilities``: whole-volume ``bigmem predict``,
each window of ``--mode sliding``, validation while training, and the inference memory probe
(so what the plan measures is what predict runs). The input is already in the network's grid
and normalised (``infer/predict.py`` prepares it); the output is float32 softmax
probabilities, channels last.
"""

from __future__ import annotations

import itertools

import numpy as np

# --tta: nnU-Net's mirroring, every combination of the three spatial axes (8 passes).
MIRROR_AXES = tuple(axes for count in range(4) for axes in itertools.combinations((0, 1, 2), count))


def normalize_image(preprocessing, image: np.ndarray, stats: dict | None = None):
    """A float32 copy of ``image`` normalised as training normalised it, and its padding value.

    Args:
        preprocessing: the model's ``data.preprocess.Preprocessing``.
        image: ``(D, H, W, C)``, the whole case (not yet normalised).
        stats: the case's ``case_statistics`` (None: taken from ``image``).

    Returns:
        ``(normalised copy, per-channel background value)``.
    """
    from bigmem.data.preprocess import case_statistics

    stats = case_statistics(image) if stats is None else stats
    normalized = preprocessing.normalize(np.array(image, dtype=np.float32, copy=True), stats)
    return normalized, preprocessing.background(stats)


def forward_probabilities(model, images: np.ndarray, *, tta: bool = False) -> np.ndarray:
    """Softmax probabilities of ``model`` on a batch of prepared volumes (sigmoid ones per region for a model
    with ``region_outputs``).

    Args:
        model: a built ``UNet3D`` (or any Keras model returning logits channels-last).
        images: ``(batch, D, H, W, C)`` float32, normalised; every spatial size a multiple of
            ``2**depth``.
        tta: average the 8 mirrored passes (every combination of flipping D, H and W).

    Returns:
        ``(batch, D, H, W, num_outputs)`` float32 probabilities.

    Example:
        >>> forward_probabilities(model, np.zeros((1, 32, 32, 32, 1), np.float32)).shape
        (1, 32, 32, 32, 3)
    """
    import tensorflow as tf

    config = getattr(model, "model_config", None)
    regions = bool(config is not None and config.region_outputs)

    def once(batch: np.ndarray) -> np.ndarray:
        logits = tf.cast(model(tf.convert_to_tensor(batch), training=False), tf.float32)
        return (tf.sigmoid(logits) if regions else tf.nn.softmax(logits, axis=-1)).numpy()

    if not tta:
        return once(images)
    total = None
    for axes in MIRROR_AXES:
        spatial = tuple(a + 1 for a in axes)
        flipped = np.flip(images, spatial) if axes else images
        probabilities = once(np.ascontiguousarray(flipped))
        probabilities = np.flip(probabilities, spatial) if axes else probabilities
        if total is None:
            total = np.array(probabilities, dtype=np.float32, copy=True)
        else:
            total += probabilities
        del probabilities
    total /= len(MIRROR_AXES)
    return total
