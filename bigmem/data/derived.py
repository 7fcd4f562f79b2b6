"""The config fields the data decides, filled in one place.

nnU-Net's planner reads the dataset before it fixes the network; so does bigmem: the store
(or, without ``--data``, the embedded synthetic dataset) decides ``data.store``,
``model.in_channels`` and ``model.num_classes``. Every command that builds a network from a
store asks ``with_data_fields`` rather than setting those fields itself.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, ContextManager

import numpy as np

from bigmem.config.options import Augment
from bigmem.config.schema import ExperimentConfig
from bigmem.data.store import HDF5VolumeStore
from bigmem.data.transforms import Compose, chain
from bigmem.errors import ConfigError, DataError
from bigmem.data.synth import cached_synthetic_store


def synthetic_store_path(config: ExperimentConfig) -> str:
    """The embedded synthetic dataset of ``config.data`` (generated once, then read from the cache)."""
    data = config.data
    return str(cached_synthetic_store(num_cases=data.synth_cases, volume=data.synth_volume,
                                      num_classes=data.synth_classes))


def with_data_fields(config: ExperimentConfig, *,
                     generating: Callable[[], ContextManager] | None = None) -> ExperimentConfig:
    """``config`` with the fields its data decides filled in.

    Args:
        config: a resolved config; ``data.store`` None means the embedded synthetic dataset.
        generating: a context manager factory wrapped around generating the synthetic dataset
            (e.g. a console status line), when it is not cached yet.

    Returns:
        A new config whose ``data.store`` is an absolute path, whose ``model.in_channels`` and
        ``model.num_classes`` are the store's and whose ``data.augment`` is resolved (``auto``:
        nnunet on a store given, light on the synthetic set), validated.

    Raises:
        DataError: the store cannot be opened or is not a bigmem store.
        ConfigError: the store's classes do not suit the model (e.g. ``model.groups``).

    Example:
        >>> with_data_fields(resolve_config("tiny")).model.num_classes  # the synthetic dataset's
        3
    """
    store = config.data.store
    augment = config.data.augment
    if augment is Augment.AUTO:  # nnU-Net's recipe on real data; the demo's phantoms keep the light one
        augment = Augment.LIGHT if store is None else Augment.NNUNET
    if store is None:
        with (generating or contextlib.nullcontext)():
            store = synthetic_store_path(config)
    with HDF5VolumeStore(store) as opened:
        channels, classes = opened.num_channels, opened.num_classes
        order = region_order(opened.label_names, opened.regions, classes)
    region_outputs = config.model.region_outputs
    if region_outputs is None:  # nnU-Net trains regions as sigmoid outputs
        region_outputs = order is not None
    elif region_outputs and order is None:
        raise ConfigError("model.region_outputs", f"{{field}} needs a store whose classes are nnU-Net regions; {store} "
                          "has none (convert an nnU-Net v2 dataset whose labels are lists, with regions_class_order).")
    # Saved absolute: a run resumed, or predicted with, from another folder finds the same file.
    filled = config.updated({"data": {"store": os.path.abspath(store), "augment": augment.value},
                             "model": {"in_channels": channels, "num_classes": classes,
                                       "region_outputs": region_outputs}})
    filled.validate()
    return filled


def region_order(label_names, regions, num_classes: int) -> list[int] | None:
    """The label value each region paints (nnU-Net's ``regions_class_order``), or None where the classes are
    not regions.

    A store converted from nnU-Net v2 regions names class ``v`` after the region painted ``v``
    (``nifti.region_classes``), one class per region; there region ``i`` of ``regions`` paints the value of
    the class named after it, and the regions train as sigmoid outputs. A store whose regions are only
    scored (classes with other names, or a region count other than the classes') trains classes.

    Example:
        >>> region_order(["background", "whole", "core"], {"whole": [1, 2], "core": [2]}, 3)
        [1, 2]
    """
    names = list(label_names)
    if not regions or len(regions) != num_classes - 1 or any(name not in names[1:] for name in regions):
        return None
    return [names.index(name) for name in regions]


def augmentation(config: ExperimentConfig) -> Compose:
    """The training augmentation chain ``config.data`` asks for (``augment``; ``auto`` as ``with_data_fields``
    resolves it, the light chain from ``flip`` and ``intensity_*``), with dummy-2D augmentation decided once
    for the store from its planned shape (``planned_geometry``).

    Example:
        >>> augmentation(resolve_config("tiny").updated({"data": {"augment": "none"}})).transforms
        []
    """
    data = config.data
    name = data.augment
    if name is Augment.AUTO:
        name = Augment.LIGHT if data.store is None else Augment.NNUNET
    planned, spacing = planned_geometry(config) if name in (Augment.NNUNET, Augment.SPATIAL, Augment.INTENSITY) \
        else (None, None)
    return chain(name.value, flip=data.flip, intensity=(data.intensity_scale, data.intensity_shift),
                 planned_shape=planned, spacing=spacing)


def planned_geometry(config: ExperimentConfig) -> tuple[tuple[int, int, int] | None, tuple | None]:
    """The shape a training sample is planned at and the store's target spacing: what nnU-Net decides
    dummy-2D augmentation from, once per configuration (its planned patch, axis 0 the coarsest).

    The shape is the fixed ``data.shape``, else the data-parallel patch, else the store's median case (the
    whole case is the patch); the spacing is nnU-Net's target spacing of the store's cases. The spacing is
    None on the synthetic set and where the store cannot be read (a run predicting without its store).
    """
    from bigmem.data.fingerprint import fingerprint

    fixed = tuple(int(s) for s in config.data.shape) if config.data.shape is not None else \
        (int(config.distribute.patch),) * 3 if config.distribute.patch is not None else None
    if config.data.store is None:
        return fixed, None
    try:
        prints = fingerprint(config.data.store)
    except DataError:  # a run's store moved away (a run predicting on its own): no training sample to plan
        return fixed, None
    return fixed or median_shape(config), prints.target_spacing()


def pad_multiple(config: ExperimentConfig) -> int | tuple[int, int, int]:
    """The multiple each axis of a case trained at its own shape is padded up to: ``data.pad_multiple``, else
    the size contract ``model.divisors``, ``2**depth`` on every axis by default: the U-Net halves every axis
    once per level (``depth`` poolings), so each size it trains on must divide by it. One int where every axis
    has the same; per axis ``(D, H, W)`` for a network configured per axis (``model.strides``).

    Example:
        >>> pad_multiple(resolve_config("small"))  # depth 3
        8
    """
    divisors = config.model.divisors
    return config.data.pad_multiple or (divisors[0] if len(set(divisors)) == 1 else divisors)


def trained_shapes(config: ExperimentConfig) -> list[tuple[str, tuple[int, int, int], tuple[int, int, int]]]:
    """Each training case of ``config.data.store`` (held-out ones left out): its id, its own shape and the shape
    it trains at (``pipeline.trained_shape``): ``data.shape`` when fixed, else its own padded to ``pad_multiple``.

    The loader (``VolumeLoader.case_shape``, made by ``train.job.make_loader``) applies the same rule, so the
    pre-flight, ``bigmem plan`` and ``compare`` plan the shapes training runs at.
    """
    from bigmem.data.pipeline import trained_shape

    multiple = pad_multiple(config)
    with HDF5VolumeStore(config.data.store, holdout=config.data.holdout, fold=config.data.fold,
                         splits=config.data.splits) as store:
        infos = list(store.cases)
    fixed = config.data.shape
    return [(i.case_id, i.shape, trained_shape(i.shape, pad_multiple=multiple, fixed=fixed)) for i in infos]


def median_shape(config: ExperimentConfig) -> tuple[int, int, int]:
    """The per-axis median of the training cases' own shapes (``data.shape`` when fixed): what the
    data-parallel patch is proportioned after, as nnU-Net's planner shapes its patch after the
    dataset's median shape (``distribute.planning.largest_patch``)."""
    if config.data.shape is not None:
        return tuple(int(s) for s in config.data.shape)
    shapes = np.array([own for _, own, _ in trained_shapes(config)])
    return tuple(int(round(v)) for v in np.median(shapes, axis=0))
