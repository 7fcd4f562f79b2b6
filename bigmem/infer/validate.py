"""Validation while training: the held-out cases through the prediction path, scored as evaluate scores.

``validate`` predicts each held-out case exactly as ``bigmem predict`` does: whole (normalise,
pad to the size contract, one forward pass, probabilities mapped to the source geometry, argmax),
or, for a run trained on patches, in sliding windows of its patch; and scores it in that geometry
against the reference ``bigmem evaluate`` uses (``infer.evaluate.store_reference``: the source label
file where convert resampled or cropped the case) with ``infer/metrics.py`` (the empty rule of
``bigmem evaluate``). So the final ``val_dice`` of a run equals ``bigmem predict`` + ``bigmem
evaluate`` against the original label files on the same cases with the final model.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from bigmem.data.store import HDF5VolumeStore
from bigmem.infer.evaluate import store_reference
from bigmem.infer.geometry import CaseGeometry, labels_to_source
from bigmem.infer.metrics import aggregate, case_metrics, region_metrics
from bigmem.infer import DEFAULT_OVERLAP
from bigmem.infer.predict import Mode, Predictor, predict_probabilities


def validate(predictor: Predictor, store_path: str | os.PathLike, case_ids: Sequence[str], *,
             overlap: float = DEFAULT_OVERLAP, warn: Callable[[str], None] | None = None) -> dict:
    """Dice of ``predictor`` on ``case_ids`` of a store, per class and its foreground mean, and per region.

    Args:
        predictor: the network being trained (``Predictor(model, config, "training")``).
        store_path: the store holding the cases (their labels are the reference).
        case_ids: the held-out cases.
        overlap: the sliding windows' overlap fraction (default 0.5), for a network trained on
            patches (``predictor.training_patch``), which is used, and so validated, in sliding
            windows of its patch; any other goes through whole.
        warn: called with a one-line message where a case's source label cannot be used
            (``store_reference``: it is scored against the store's label mapped back).

    Returns:
        ``{"val_dice": foreground mean, "val_dice_per_class": {"1": mean Dice, ...}}``, and
        ``"val_dice_per_region": {"whole_tumor": mean Dice, ...}`` where the store defines regions
        (``HDF5VolumeStore.regions``); a class or region absent from every case's reference and prediction is
        NaN and left out of the mean.

    Example:
        >>> validate(Predictor(model, config, "training"), "kits19.h5", ["case_00209"])["val_dice"]
    """
    classes = list(range(1, predictor.num_classes))
    mode = Mode.SLIDING if predictor.training_patch else Mode.WHOLE
    with HDF5VolumeStore(store_path) as store:
        regions = store.regions
    per_case, per_case_regions = [], []
    for case_id in case_ids:
        with HDF5VolumeStore(store_path) as store:
            image, stats = store.read_case(case_id)[0], store.case_stats(case_id)
        probabilities = predict_probabilities(predictor, image, stats=stats, mode=mode, overlap=overlap)
        del image
        predicted = labels_to_source(probabilities, CaseGeometry.from_store(store_path, case_id),
                                     predictor.region_order)
        del probabilities
        reference, _, spacing, _ = store_reference(store_path, case_id, warn=warn)
        per_case.append(case_metrics(reference, predicted, classes, spacing, hausdorff=False))
        if regions:  # one more pass over the case's counts: no HD95 here either
            per_case_regions.append(region_metrics(reference, predicted, regions, spacing, hausdorff=False))
    summary = aggregate(per_case, classes)
    # bigmem's reading (classes undefined in every held-out case left out), not nnU-Net's NaN: a model is chosen by it
    result = {"val_dice": float(summary["foreground_mean_defined"]["Dice"]),
              "val_dice_per_class": {str(c): float(summary["mean"][c]["Dice"]) for c in classes}}
    if regions:
        in_regions = aggregate(per_case_regions, list(regions))["mean"]
        result["val_dice_per_region"] = {name: float(in_regions[name]["Dice"]) for name in regions}
    return result
