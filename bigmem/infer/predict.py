"""``bigmem predict``'s API: segment new scans with a trained run, in the source file's geometry.

The model and its preprocessing come from the run directory alone: the network from config.json
and ``model.keras`` (or a checkpoint), the preprocessing from its ``preprocessing.json``
(``infer/modelcard.py``: canonical orientation, ``--spacing`` resampling, ``--shape`` crop/pad as
``infer/geometry.py`` applies them, and the normalisation of ``data/preprocess.py`` with the
training dataset's statistics). The training store is not needed. Each case then goes through the network
whole (one pass, padded to the size contract) or window by window (``infer/sliding.py``), and
the class probabilities are mapped back to the source grid before the argmax.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from bigmem.checkpoints import CheckpointManager
from bigmem.config.options import Precision, StrOption, look_up_option
from bigmem.config.schema import ExperimentConfig, check_shape
from bigmem.data.derived import region_order
from bigmem.errors import DataError, UsageError
from bigmem.infer import DEFAULT_OVERLAP
from bigmem.infer.forward import forward_probabilities, normalize_image
from bigmem.infer.geometry import CaseGeometry, crop_padding, labels_to_source, pad_to_multiple, scores_to_source
from bigmem.infer.modelcard import ModelCard
from bigmem.atomic import atomic_output
from bigmem.rundir import RunDir
from bigmem.units import format_count

NIFTI_SUFFIXES = (".nii.gz", ".nii")


class Mode(StrOption):
    """``--mode``: how a case goes through the network."""

    AUTO = "auto"  # whole where the inference plan fits the memory budget, else sliding
    WHOLE = "whole"
    SLIDING = "sliding"


@dataclass(frozen=True)
class Predictor:
    """A trained network and what it needs to segment a case as training saw it.

    Attributes:
        model: the built ``UNet3D``.
        config: the run's config (``data.store`` is the store it was trained on).
        source: what the weights came from ('model.keras', 'checkpoints/best', ...).
        training_patch: the patch ``(D, H, W)`` the network was trained on (a data-parallel run on
            patches), or None: it was trained on whole volumes.
        trained_shape: the largest step shape of a run on whole volumes (its plan.json's), or None.
        card: what the network expects of its input (the run's ``preprocessing.json``); None: that of
            ``config.data.store`` (a network being trained, validated on its own store).
    """

    model: object
    config: ExperimentConfig
    source: str
    training_patch: tuple[int, int, int] | None = None
    trained_shape: tuple[int, int, int] | None = None
    card: ModelCard | None = None

    @functools.cached_property
    def preparation(self) -> ModelCard:
        """The input preparation: ``card``, or the training store's."""
        return self.card or ModelCard.from_store(self.config.data.store)

    @property
    def window(self) -> tuple[int, int, int]:
        """The sliding window's default ``(D, H, W)``: what the network saw in training (its patch, its largest
        whole volume, or the fixed ``data.shape``; the reference cube for a run that recorded none)."""
        if self.training_patch:
            return tuple(self.training_patch)
        return tuple(self.trained_shape or self.config.data.shape or (self.config.data.reference_volume,) * 3)

    @property
    def num_classes(self) -> int:
        """The network's classes (background included); its outputs are ``num_outputs``."""
        return self.config.model.num_classes

    @property
    def num_outputs(self) -> int:
        """The network's output channels: the classes, or one per region (``model.region_outputs``)."""
        return self.config.model.num_outputs

    @functools.cached_property
    def region_order(self) -> list[int] | None:
        """The label value each region output paints (nnU-Net's ``regions_class_order``), or None for softmax
        classes: region ``i`` of the card's ``regions`` paints the value of the class named after it."""
        if not self.config.model.region_outputs:
            return None
        card = self.preparation
        order = region_order(card.label_names, card.regions, self.num_classes)
        if order is None:
            raise DataError(f"{self.source}: the model has {self.num_outputs} region outputs but its regions "
                            f"{list(card.regions)} do not name its classes {list(card.label_names)}; the run "
                            "directory is damaged.")
        return order

    @property
    def divisor(self) -> int:
        """A cube edge that meets the size contract on every axis (a ``--window`` edge must be its multiple)."""
        return self.config.model.divisor

    @property
    def divisors(self) -> tuple[int, int, int]:
        """The size contract per axis: whole-volume input is padded to a multiple of these."""
        return self.config.model.divisors


@dataclass(frozen=True)
class Ensemble:
    """Several trained networks segmenting as one: their class probabilities averaged (``bigmem predict RUN_DIR
    RUN_DIR ...``, e.g. the five folds of a cross-validation).

    The members run one after the other on each case, each as it would alone (its own window, padding and
    ``--tta``); the mean of their probabilities is mapped back and its argmax taken. They agree on the classes,
    the channels and the input's preparation (``load_ensemble`` checks), so the card, classes and region order
    are the first member's.

    Attributes:
        members: the networks.
        names: where each came from (its run directory), for messages.
    """

    members: tuple[Predictor, ...]
    names: tuple[str, ...]

    @property
    def config(self) -> ExperimentConfig:
        """The first member's config (its network names the ensemble in messages)."""
        return self.members[0].config

    @property
    def preparation(self) -> ModelCard:
        """The input preparation all members share (``load_ensemble`` checks)."""
        return self.members[0].preparation

    @property
    def num_classes(self) -> int:
        """The classes all members predict (background included)."""
        return self.members[0].num_classes

    @property
    def num_outputs(self) -> int:
        """The output channels all members have: classes, or one per region."""
        return self.members[0].num_outputs

    @property
    def region_order(self) -> list[int] | None:
        """The label value each region output paints (``Predictor.region_order``), or None."""
        return self.members[0].region_order

    @property
    def divisor(self) -> int:
        """The coarsest member's size contract (each member pads for its own)."""
        return math.lcm(*(m.divisor for m in self.members))

    @property
    def divisors(self) -> tuple[int, int, int]:
        """Per axis, a multiple of every member's size contract."""
        return tuple(math.lcm(*axis) for axis in zip(*(m.divisors for m in self.members)))


def _agreement(predictor: Predictor) -> list[tuple[str, object]]:
    """What members of an ensemble must share, each with how it is shown: the classes, the outputs (softmax
    classes or regions), the channels, the preparation of the scan (resampling, crop/pad, normalisation)."""
    card = predictor.preparation
    return [("classes", list(card.label_names)), ("number of classes", predictor.num_classes),
            ("outputs", "regions " + ", ".join(card.regions) if predictor.config.model.region_outputs
             else "softmax classes"),
            ("channels", list(card.channel_names)), ("number of channels", predictor.config.model.in_channels),
            ("spacing", card.spacing), ("shape", card.shape),
            ("normalisation", "; ".join(card.preprocessing.describe(card.channel_names)))]


def load_ensemble(run_dirs: Sequence[str | os.PathLike], checkpoint: str = "final", *,
                  verbose: bool = False) -> Predictor | Ensemble:
    """The trained networks of several run directories, as one ``Ensemble`` (one run: its ``Predictor``).

    Args:
        run_dirs: ``bigmem train`` run directories (or exported models), e.g. the folds of a cross-validation.
        checkpoint: which weights of each ('final', 'best', 'latest', 'ckpt-N'; ``load_predictor``).

    Returns:
        The ``Ensemble``, or the ``Predictor`` of a single run.

    Raises:
        DataError: a run that cannot be loaded (``load_predictor``), or one that disagrees with the first on
            the classes, the outputs, the channels or the scan's preparation (naming both runs and the values).
        UsageError: no run directory, or one given twice.

    Example:
        >>> ensemble = load_ensemble([f"runs/fold{k}" for k in range(5)], "best")
    """
    names = [str(r) for r in run_dirs]
    if not names:
        raise UsageError("predict needs at least one RUN_DIR.")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"RUN_DIR {twice[0]!r} is given twice: an ensemble averages different runs.")
    for name in names:  # every run directory is checked before TensorFlow starts and any model loads
        run_config(name)
    members = [load_predictor(name, checkpoint, verbose=verbose) for name in names]
    if len(members) == 1:
        return members[0]
    first = _agreement(members[0])
    for name, member in zip(names[1:], members[1:]):
        for (what, ours), (_, theirs) in zip(first, _agreement(member)):
            if ours != theirs:
                raise DataError(f"Run {name!r} cannot join the ensemble: {what} {theirs} where {names[0]!r} has "
                                f"{ours}; an ensemble averages the probabilities of one set of classes over one "
                                "preparation of the scan.")
    return Ensemble(tuple(members), tuple(names))


def run_config(run_dir: str | os.PathLike) -> ExperimentConfig:
    """The config a run was trained with (its config.json's sections).

    Raises:
        DataError: not a bigmem run directory.
    """
    run = RunDir(run_dir)
    saved = run.read_config() if run.config.is_file() else None
    if saved is None:
        raise DataError(f"{str(run_dir)!r} is not a bigmem run directory: no config.json there.")
    return ExperimentConfig.from_dict(ExperimentConfig.sections_of(saved), source=str(run.config))


def _largest_trained_shape(plan) -> tuple[int, int, int] | None:
    """The largest case shape (by voxels) a run trained on, from its plan.json's per-case table; else its step's.

    A batch of several is planned at a bounding shape no case may have; the window is a case's.
    """
    if not isinstance(plan, dict):
        return None
    cases = plan.get("cases")
    shapes = [c.get("padded_shape") for c in cases if isinstance(c, dict)] if isinstance(cases, list) else []
    chosen = plan.get("chosen")
    if not shapes and isinstance(chosen, dict):
        shapes = [chosen.get("spatial_shape")]
    shapes = [tuple(int(v) for v in s) for s in shapes if isinstance(s, list) and len(s) == 3]
    return max(shapes, key=lambda s: (math.prod(s), s)) if shapes else None


def _patch_of(patch) -> tuple[int, int, int] | None:
    """plan.json's ``data_parallel.patch``: a ``[D, H, W]``, or an edge (plans from before patches took the
    dataset's aspect); None for whole volumes or anything else."""
    if isinstance(patch, int) and not isinstance(patch, bool) and patch > 0:
        return (patch,) * 3
    if isinstance(patch, list) and len(patch) == 3 and all(isinstance(v, int) and v > 0 for v in patch):
        return tuple(patch)
    return None


def load_predictor(run_dir: str | os.PathLike, checkpoint: str = "final", *, verbose: bool = False) -> Predictor:
    """The trained network of a run directory.

    Args:
        run_dir: a ``bigmem train`` run directory.
        checkpoint: 'final' (``model.keras``), 'best' (best validation Dice, ``--val-every``),
            'latest', or 'ckpt-N' / 'N' (the checkpoint of step N).

    Returns:
        The ``Predictor``.

    Raises:
        DataError: no such run, model or checkpoint, or one that does not fit the config.

    Example:
        >>> predictor = load_predictor("runs/kits19-1", "best")
    """
    from bigmem.tfenv import import_tensorflow

    config = run_config(run_dir)
    run = RunDir(run_dir)
    # Which file is read is settled before TensorFlow starts: a missing one is refused in a moment.
    if checkpoint == "final" and not run.model.is_file():
        raise DataError(f"No model.keras in {str(run.path)!r}: the run has not finished. Use "
                        "{predict.checkpoint} latest (or best) to predict with a checkpoint.")
    path = None if checkpoint == "final" else CheckpointManager(run.checkpoints).find(checkpoint)
    card = ModelCard.of_run(run_dir, config.data.store)
    plan = run.read_plan() if run.plan.is_file() else None
    parallel = plan.get("data_parallel") if isinstance(plan, dict) else None
    patch = parallel.get("patch") if isinstance(parallel, dict) else None
    trained_patch = _patch_of(patch)
    trained = _largest_trained_shape(plan)
    import_tensorflow(verbose=verbose)
    import keras

    from bigmem.nets.unet3d import UNet3D

    if checkpoint == "final":
        try:
            model = keras.models.load_model(run.model)
        except Exception as exc:  # Keras raises many types for a damaged archive
            raise DataError(f"Cannot load {run.model}: {type(exc).__name__}: {exc}") from None
        return Predictor(model, config, "model.keras", trained_patch, trained, card)
    policy = "mixed_bfloat16" if config.train.precision is Precision.BF16 else "float32"
    model = UNet3D(config.model, dtype=policy, name="unet3d").build_for()
    CheckpointManager(run.checkpoints).restore(path, model)
    return Predictor(model, config, f"checkpoints/{path.name}", trained_patch, trained, card)


# ---- inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseInput:
    """One case to segment: its id and how to read it onto the network's grid."""

    case_id: str
    where: str
    load: Callable[[], tuple[np.ndarray, CaseGeometry, dict | None]]  # -> (image (D,H,W,C) float32, geometry,
    # the case's intensity statistics, or None: take them from the image)


def _nifti_name(path: Path) -> bool:
    return path.is_file() and path.name.endswith(NIFTI_SUFFIXES)


def _existing_input(source: str | os.PathLike) -> Path:
    path = Path(source)
    if not path.exists():
        raise DataError(f"Cannot read INPUT {str(path)!r}: no such file or folder.")
    return path


def find_inputs(source: str | os.PathLike, card: ModelCard, *, cases: Sequence[str] | None = None,
                say: Callable[[str], None] | None = None, cases_flag: str = "{predict.cases}") -> list[CaseInput]:
    """The cases of INPUT: a NIfTI file, a folder of them, an MSD or nnU-Net v2 folder, KiTS case folders, or a
    bigmem store (NIfTI input as ``bigmem.data.layouts.list_images`` finds and names its cases).

    Args:
        source: the input path.
        card: what the model expects (``Predictor.preparation``); NIfTI inputs are prepared as
            ``bigmem convert`` prepared its training cases.
        cases: only these case ids (a store or folder); None: all.
        say: called with one line saying what NIfTI input holds ("KiTS case folders: 3 cases in kits/").
        cases_flag: how ``cases`` were given, for the message naming an unknown one (default
            '{predict.cases}', a ``BigmemError`` placeholder).

    Returns:
        One ``CaseInput`` per case, sorted by id.

    Raises:
        DataError: nothing to read, an unknown case, two inputs that would be written to one output
            name, or a case missing a channel file.
    """
    from bigmem.data.layouts import list_images

    path = _existing_input(source)
    if path.suffix == ".h5":
        return _pick(_store_inputs(path), cases, str(path), cases_flag)
    if path.is_file() and not _nifti_name(path):
        raise DataError(f"INPUT {str(path)!r} is not a NIfTI file (.nii, .nii.gz) or a bigmem store (.h5).")
    listing = list_images(path)
    if say is not None:
        say(listing.summary)
    inputs = [_nifti_input(case_id, paths, card) for case_id, paths in listing.cases.items()]
    return _pick(inputs, cases, str(path), cases_flag)


def _nifti_input(case_id: str, paths: list[Path], card: ModelCard) -> CaseInput:
    from bigmem.infer.geometry import prepare_nifti

    return CaseInput(case_id, ", ".join(map(str, paths)), lambda: prepare_nifti(paths, card, case_id))


def _store_inputs(path: Path) -> list[CaseInput]:
    from bigmem.data.store import HDF5VolumeStore

    def loader(case_id: str):
        def load():
            with HDF5VolumeStore(path) as store:
                image, stats = store.read_case(case_id)[0], store.case_stats(case_id)
            return image, CaseGeometry.from_store(path, case_id), stats
        return load

    with HDF5VolumeStore(path) as store:
        ids = list(store.case_ids)
    return [CaseInput(case_id, f"{path}:{case_id}", loader(case_id)) for case_id in ids]


def _pick(inputs: list[CaseInput], cases: Sequence[str] | None, where: str,
          flag: str = "{predict.cases}") -> list[CaseInput]:
    if not cases:
        return inputs
    by_id = {item.case_id: item for item in inputs}
    unknown = [c for c in cases if c not in by_id]
    if unknown:
        raise DataError(f"{flag}: {', '.join(map(repr, unknown))} not in {where!r} "
                        f"(it has {format_count(len(by_id), 'case')}, e.g. {', '.join(list(by_id)[:3])}).")
    return [by_id[c] for c in cases]


def validation_cases(run_dir: str | os.PathLike) -> list[str]:
    """The cases a run held out for validation: its fold's ``val`` cases (config.json's ``data.fold`` in its
    splits_final.json; every case of its store for fold ``all``), or its store's ``--holdout`` cases.

    Predicting each fold's validation cases into one folder and evaluating that folder is nnU-Net v2's
    cross-validation summary (``nnunetv2/evaluation/accumulate_cv_results.py``: every fold's validation
    predictions merged, each case once, then scored together).

    Raises:
        UsageError: the run held out no case (trained with neither ``--fold`` nor ``--holdout``).
        DataError: its splits_final.json (or, for fold ``all`` and ``--holdout``, its store) cannot be read.

    Example:
        >>> validation_cases("runs/fold1")
        ['case_003', 'case_009']
    """
    config = run_config(run_dir)
    fold, run = config.data.fold, RunDir(run_dir)
    if fold is not None and fold != "all":
        from bigmem.data.splits import read_splits

        splits = read_splits(run.splits)
        if not int(fold) < len(splits):
            raise DataError(f"{str(run.splits)!r} has {len(splits)} folds; the run trained fold {fold}: the run "
                            "directory is damaged.")
        return list(splits[int(fold)]["val"])
    if fold is None and not config.data.holdout:
        raise UsageError(f"{{predict.validation}}: the run {str(run_dir)!r} held out no case (it trained with neither "
                         "{data.fold} nor {data.holdout}); give {predict.cases} instead.")
    from bigmem.data.store import HDF5VolumeStore

    with HDF5VolumeStore(config.data.store, holdout=config.data.holdout, fold=fold, splits=config.data.splits) as store:
        return list(store.held_out)


# ---- one case -------------------------------------------------------------------------------


def predict_probabilities(predictor: Predictor, image: np.ndarray, *, stats: dict | None = None,
                          mode: Mode = Mode.WHOLE,
                          window: int | tuple[int, int, int] | None = None, overlap: float = DEFAULT_OVERLAP,
                          accumulate: str = "float32",
                          tta: bool = False, progress=None) -> np.ndarray:
    """Class probabilities of one case on the network's grid.

    Args:
        predictor: the trained network.
        image: ``(D, H, W, C)`` float32 on the store grid, not yet normalised.
        stats: the whole case's intensity statistics (``preprocess.case_statistics``, as the store or
            ``prepare_nifti`` gives them); None: taken from ``image``.
        mode: ``whole`` (one pass, padded to a multiple of ``2**depth``) or ``sliding``.
        window: the sliding window's edge N or ``(D, H, W)`` (default: ``predictor.window``, the training patch
            or largest volume).
        overlap: the sliding windows' overlap fraction.
        accumulate: 'float32' or 'float16' sliding-window accumulators.
        tta: average the 8 mirrored passes.
        progress: ``(windows_done, windows_total)`` for sliding.

    Returns:
        ``(D, H, W, num_classes)`` float32 probabilities.
    """
    normalized, background = normalize_image(predictor.preparation.preprocessing, image, stats)
    if mode is Mode.WHOLE:
        padded, slices = pad_to_multiple(normalized, predictor.divisors, background)
        del normalized
        probabilities = forward_probabilities(predictor.model, padded[None], tta=tta)[0]
        return np.ascontiguousarray(crop_padding(probabilities, slices))
    from bigmem.infer.sliding import sliding_window

    window = window or predictor.window
    return sliding_window(normalized, lambda batch: forward_probabilities(predictor.model, batch, tta=tta), window,
                          num_classes=predictor.num_outputs, overlap=overlap, accumulate=accumulate, progress=progress,
                          pad_value=background)


def ensemble_probabilities(predictor: Predictor | Ensemble, image: np.ndarray, **options) -> np.ndarray:
    """The mean class probabilities of an ensemble's members on one case (one ``Predictor``: its own).

    The members run one after the other through ``predict_probabilities`` (``options``: its ``stats``, ``mode``,
    ``window``, ``overlap``, ``accumulate``, ``tta``); the sum is one more float32 array per class at the case's
    shape, which the inference memory plan counts (``memory.estimate``'s ``ensemble``).

    nnU-Net v2 averages its folds' logits (``nnUNetPredictor.predict_logits_from_preprocessed_data``) and the
    probabilities of different configurations (``nnUNetv2_ensemble``); this is the mean of the probabilities.

    Returns:
        ``(D, H, W, num_outputs)`` float32.
    """
    members = predictor.members if isinstance(predictor, Ensemble) else (predictor,)
    total = None
    for member in members:
        probabilities = predict_probabilities(member, image, **options)
        if total is None:
            total = probabilities if probabilities.flags.writeable else probabilities.copy()
        else:
            total += probabilities
        del probabilities
    if len(members) > 1:
        total /= len(members)
    return total


def write_nifti(array: np.ndarray, affine: np.ndarray, path: Path) -> Path:
    """Write ``array`` as a NIfTI file through ``atomic_output``: whole under its name, or not at all.

    Raises:
        DiskFullError: the filesystem is full or failing (nothing is left behind).
    """
    import nibabel as nib

    image = nib.Nifti1Image(array, np.asarray(affine, np.float64))
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    # needed: the voxels and NIfTI-1's 352-byte header (vox_offset); compressed (.nii.gz), an upper bound
    with atomic_output(path, needed_bytes=array.nbytes + 352) as tmp:
        nib.save(image, tmp)  # the temporary keeps the .nii.gz suffix nibabel picks the format by
    return path


def write_probabilities(probabilities: np.ndarray, affine: np.ndarray, path: Path) -> Path:
    """``probabilities`` (float16, ``(X, Y, Z, K)``) and the affine as a compressed .npz, atomically.

    NIfTI-1 has no float16 type, so the probabilities go where nnU-Net v2 puts its own: an .npz
    (``probabilities``, ``affine``), read with ``np.load``.

    Raises:
        DiskFullError: the filesystem is full or failing (nothing is left behind).
    """
    with atomic_output(path, needed_bytes=probabilities.nbytes + 4 * 4 * 8) as tmp:  # compressed: an upper bound
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, probabilities=probabilities, affine=np.asarray(affine, np.float64))
    return path


@dataclass(frozen=True)
class CaseResult:
    """One segmented case: the mode used, its source shape, seconds, this case's peak RSS, the files written."""

    case_id: str
    mode: str
    shape: tuple[int, ...]
    seconds: float
    peak_rss_bytes: int
    labels_path: Path
    probabilities_path: Path | None


@dataclass(frozen=True)
class KeptOutput:
    """A case whose output was there already and is kept (``predict`` without ``force``): nothing computed."""

    case_id: str
    labels_path: Path


def labels_path_of(out_dir: Path, case_id: str) -> Path:
    """Where ``predict`` writes a case's labels: ``OUT/<case id>.nii.gz``."""
    return Path(out_dir) / f"{case_id}.nii.gz"


def predict_case(predictor: Predictor | Ensemble, item: CaseInput, out_dir: Path, *, mode: Mode | Callable,
                 window: int | tuple[int, int, int] | None = None, overlap: float = DEFAULT_OVERLAP,
                 accumulate: str = "float32", tta: bool = False, save_probabilities: bool = False) -> CaseResult:
    """Segment one case and write ``<case>.nii.gz`` (uint8 labels in the source geometry).

    Args:
        predictor: the trained network, or an ``Ensemble`` (its members' probabilities averaged).
        item: the case.
        out_dir: the output folder.
        mode: a ``Mode``, or ``(predictor, spatial_shape) -> Mode`` to choose once the case's
            shape is known ('auto').
        window, overlap, accumulate, tta: as ``predict_probabilities``.
        save_probabilities: also write ``<case>_probabilities.npz``: ``probabilities`` ``(*source_shape, K)``
            float16 and ``affine`` (NIfTI-1 has no float16).

    Returns:
        The ``CaseResult`` (mode used, source shape, seconds, paths written).
    """
    from bigmem.memory.procfs import peak_rss_bytes, reset_peak_rss

    reset_peak_rss()  # this case's peak, not the largest so far (where the kernel allows the reset)
    started = time.perf_counter()
    image, geometry, stats = item.load()
    if not isinstance(mode, Mode):
        mode = mode(predictor, image.shape[:3])
    probabilities = ensemble_probabilities(predictor, image, stats=stats, mode=mode, window=window, overlap=overlap,
                                           accumulate=accumulate, tta=tta)
    del image
    labels_path = write_nifti(labels_to_source(probabilities, geometry, predictor.region_order), geometry.source_affine,
                              labels_path_of(out_dir, item.case_id))
    probabilities_path = None
    if save_probabilities:
        mapped = scores_to_source(probabilities, geometry, predictor.region_order is not None).astype(np.float16)
        probabilities_path = write_probabilities(mapped, geometry.source_affine,
                                                 out_dir / f"{item.case_id}_probabilities.npz")
    return CaseResult(item.case_id, mode.value, tuple(geometry.source_shape), time.perf_counter() - started,
                      peak_rss_bytes(), labels_path, probabilities_path)


def _checked_options(mode: str, choose_mode, overlap: float, window) -> tuple:
    """``predict``'s mode, window edge (a cube's, else None) and window shape, refused before TensorFlow starts
    where they cannot be used."""
    chosen = look_up_option(mode, Mode, flag="{predict.mode}")
    if chosen is Mode.AUTO and choose_mode is None:
        raise UsageError("{predict.mode} auto needs a way to choose (the inference plan); give {predict.mode} "
                         "whole or sliding.")
    if not 0 <= overlap < 1:
        raise UsageError(f"Invalid {{predict.overlap}} {overlap:g}: expected a fraction in [0, 1).")
    edge = window if isinstance(window, int) else None
    window = None if window is None else ((int(window),) * 3 if edge is not None else tuple(window))
    if window is not None and (len(window) != 3 or min(window) < 1):
        raise UsageError(f"Invalid {{predict.window}} {edge if edge is not None else ','.join(map(str, window))}: "
                         "expected a positive integer N or D,H,W.")
    return chosen, edge, window


def _check_window(predictor, edge: int | None, window) -> None:
    """The window fits every member's size contract (a multiple of its divisor per axis)."""
    for member in predictor.members if isinstance(predictor, Ensemble) else (predictor,):
        if edge is not None and edge % member.divisor:
            raise UsageError(f"Invalid {{predict.window}} {edge}: expected a positive multiple of {member.divisor} "
                             f"(the network downsamples {member.config.model.depth} times).")
        if window is not None:
            check_shape("predict.window", window, member.config.model)


def predict(run_dir: str | os.PathLike | Sequence[str | os.PathLike], source: str | os.PathLike,
            out_dir: str | os.PathLike, *,
            checkpoint: str = "final", cases: Sequence[str] | None = None, mode: str = "auto",
            window: int | tuple[int, int, int] | None = None, overlap: float = DEFAULT_OVERLAP,
            accumulate: str = "float32", tta: bool = False, save_probabilities: bool = False, choose_mode=None,
            verbose: bool = False, force: bool = False, validation: bool = False,
            say: Callable[[str], None] | None = None) -> Iterator[CaseResult | KeptOutput]:
    """Segment every case of ``source`` with the run in ``run_dir``; yields each case's result as it is written.

    Args:
        run_dir: a ``bigmem train`` run directory, or several: an ensemble whose class probabilities are
            averaged (``load_ensemble``; each with ``checkpoint``).
        source: a NIfTI file, a folder of them, an MSD or nnU-Net v2 folder, KiTS case folders (or one),
            or a bigmem store.
        out_dir: where ``<case>.nii.gz`` go (created), named after each case's id in its layout
            (``case_00000.nii.gz`` for a KiTS case folder, never ``imaging.nii.gz``).
        checkpoint: 'final', 'best', 'latest' or 'ckpt-N'.
        cases: only these case ids.
        mode: 'whole', 'sliding' or 'auto' (``choose_mode(predictor, spatial_shape) -> Mode``
            decides per case, e.g. by the inference memory plan).
        window, overlap, accumulate, tta: as ``predict_probabilities``.
        save_probabilities: also write the class probabilities (float16) in the source geometry.
        force: overwrite existing outputs (default False: a case whose ``<case>.nii.gz`` exists is
            kept, and yielded as a ``KeptOutput``).
        validation: only the run's validation cases (``validation_cases``; ``--val``), instead of ``cases``.
        say: called with one line saying what NIfTI input holds (``find_inputs``).

    Yields:
        A ``CaseResult`` per case segmented, a ``KeptOutput`` per case whose output was kept.

    Raises:
        DataError: bad run directory, input or checkpoint; runs of an ensemble that disagree; two inputs
            that would be written to one output name (before anything is written).
        UsageError: a bad mode, window or overlap.
    """
    chosen, edge, window = _checked_options(mode, choose_mode, overlap, window)
    _existing_input(source)
    run_dirs = [run_dir] if isinstance(run_dir, (str, os.PathLike)) else list(run_dir)
    if validation:
        if cases or len(run_dirs) != 1:
            raise UsageError("{predict.validation} segments one run's validation cases: give one RUN_DIR and no "
                             "{predict.cases}.")
        cases = validation_cases(run_dirs[0])
    predictor = load_ensemble(run_dirs, checkpoint, verbose=verbose)
    _check_window(predictor, edge, window)
    inputs = find_inputs(source, predictor.preparation, cases=cases, say=say,
                         cases_flag="{predict.validation} (the run's validation cases)" if validation
                         else "{predict.cases}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for item in inputs:
        wanted = [labels_path_of(out, item.case_id)] + ([out / f"{item.case_id}_probabilities.npz"]
                                                        if save_probabilities else [])
        if not force and all(path.exists() for path in wanted):  # kept only when everything asked for is there
            yield KeptOutput(item.case_id, labels_path_of(out, item.case_id))
            continue
        yield predict_case(predictor, item, out, mode=chosen if chosen is not Mode.AUTO else choose_mode,
                           window=window, overlap=overlap, accumulate=accumulate, tta=tta,
                           save_probabilities=save_probabilities)
