"""The planning API: whether a job fits its memory budget, and what does. Every command asks here.

- ``plan_job``: one fixed job (its largest step), refused (exit 3) unless it fits: ``bigmem train``'s
  pre-flight, ``bigmem compare``'s runs and the per-node launcher's workers.
- ``plan_search``: the largest volume, then batch, that fits (``bigmem plan``): at ``--shape``, or
  over a store's cases (``store_cases``) as ``bigmem train --data`` steps through them.
- ``plan_inference``: segmenting one whole volume (``bigmem predict``, ``bigmem plan --inference``):
  whether one shape fits, or the largest cube that does.
- ``plan_layouts``: on a machine of several NUMA nodes, one interleaved process against one
  worker per node, for the chosen candidate.

Each returns a ``memory.search.Plan``, whose ``to_dict`` (``plan_dict`` with the layouts) is
plan.json's one schema; ``write_plan`` writes it; ``require_fit`` / ``require_plan`` refuse a plan
in which nothing fits. The estimates are ``memory.estimate.estimate``'s, in either pass; the
budget is ``memory.budget.resolve_budget``'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from bigmem.atomic import atomic_write_json
from bigmem.config.options import Recompute
from bigmem.config.schema import ExperimentConfig
from bigmem.errors import ConfigError, InsufficientMemoryError
from bigmem.memory.calibration import INFERENCE_MODE, calibration_for
from bigmem.memory.estimate import NetworkCounts, Pass, estimate, mode_stages
from bigmem.numa.layouts import evaluate_layouts
from bigmem.memory.search import Candidate, Plan, Planner, check_fits, make_plan
from bigmem.memory.records import Budget, CaseRow, ValidationPass
from bigmem.numa.capacity import check_nodes_fit, interleave_budget
from bigmem.numa.topology import NUMATopology
from bigmem.units import format_bytes

CountsFor = Callable[[tuple[int, int, int]], NetworkCounts]


def recompute_stages(config: ExperimentConfig, counts_for: CountsFor, shape: Sequence[int],
                     budget_bytes: int | None = None, *, planner: Planner | None = None) -> list[str]:
    """The stages a job recomputes in backward: the one place ``--recompute`` becomes stage names.

    Args:
        config: the job (``memory.recompute``, ``train.precision``, ``train.batch_size``).
        counts_for: ``memory.profile.counts_function(config)``.
        shape: the spatial shape ``(D, H, W)``.
        budget_bytes: the budget ``auto`` fits (``resolve_budget``); unused by none and stages.
        planner: the ``Planner`` to evaluate ``auto``'s candidates with (it keeps them);
            default: a new one for ``budget_bytes``.

    Returns:
        none: ``[]``; stages: every stage; auto: the fewest stages, those that save most first,
        whose predicted peak fits ``budget_bytes`` (every stage when none does).

    Raises:
        UsageError: auto without a budget.

    Example:
        >>> recompute_stages(config, counts_for, (128, 128, 128), 8 * 2**30)
        ['dec0', 'enc0']
    """
    recompute = config.memory.recompute
    if recompute is not Recompute.AUTO:
        return mode_stages(recompute, counts_for(tuple(shape)))
    if planner is None:
        if budget_bytes is None:
            raise ConfigError("memory.recompute", "{field} auto needs a memory budget to fit; "
                              "give {memory.budget_bytes}.")
        planner = Planner(config, counts_for, budget_bytes)
    chosen = planner.fewest_recomputed_stages(tuple(shape), config.train.batch_size, config.train.precision)
    return chosen.recompute_stages


@dataclass(frozen=True)
class CaseShape:
    """One training case as the pre-flight plans it: its id, its own shape and the shape it trains at."""

    case_id: str
    shape: tuple[int, int, int]
    trained_shape: tuple[int, int, int]


def planned_shape(shapes: Sequence[Sequence[int]], batch_size: int) -> tuple[int, int, int]:
    """The spatial shape whose step the pre-flight plans: the largest a step of this job can have.

    At batch 1 that is the largest case's shape (by voxels); a batch of several is padded to its
    members' bounding shape, and any cases may share one, so it is the bounding shape of all of
    them (an upper bound).
    """
    shapes = [tuple(int(v) for v in s) for s in shapes]
    if batch_size == 1:
        return max(shapes, key=lambda s: (math.prod(s), s))
    return tuple(max(axis) for axis in zip(*shapes))  # type: ignore[return-value]


def plan_job(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, *, shape: Sequence[int] | None = None,
             stages: Sequence[str] | None = None, force: bool = False, check: bool = True,
             cases: Sequence[CaseShape] = (), validation_shape: Sequence[int] | None = None,
             validation_case: str = "") -> Plan:
    """The plan of one fixed job (its largest step at ``train.batch_size``), refused unless it fits.

    Args:
        config: the job as it will run.
        counts_for: ``memory.profile.counts_function(config)``.
        budget: ``resolve_budget(...)``.
        shape: the ``(D, H, W)`` of the job's largest step (``planned_shape``); default: the
            fixed ``data.shape``, else the cube of ``data.reference_volume``.
        stages: the recomputed stages, if the caller fixed them (default: ``recompute_stages``).
        force: run past the budget: no refusal, and the plan says ``forced``.
        check: refuse at all (False where the host does not hold the model, e.g. real GPUs).
        cases: the training cases and the shapes they train at: plan.json gets a per-case table,
            and a refusal names the largest case that does not fit.
        validation_shape: the padded shape of the largest held-out case, when the run validates
            (``--val-every``): its whole-volume forward pass runs beside the trained model and its
            optimizer, and the plan takes the larger of the two peaks.
        validation_case: that case's id, for the table and messages.

    Returns:
        A ``Plan`` whose ``chosen`` is the job, ``fits`` whether its predicted peak is within the
        budget, ``candidates`` every configuration evaluated (the stages ``auto`` tried),
        ``cases`` the per-case table and ``validation`` the validation pass's figures.

    Raises:
        InsufficientMemoryError: (exit 3) the predicted peak exceeds the budget, unless ``force``
            or not ``check``. When the placement's nodes set the budget the message names the
            nodes; otherwise it names the case (if any) and the cheapest change that fits.

    Example:
        >>> plan = plan_job(config, counts_for, resolve_budget(64 * 2**30), shape=(240, 240, 160))
        >>> plan.chosen.recompute_stages, plan.fits
        ([], True)
    """
    if shape is None:
        shape = config.data.shape or (config.data.reference_volume,) * 3
    shape = tuple(int(s) for s in shape)
    planner = Planner(config, counts_for, budget.budget_bytes)
    stages = list(recompute_stages(config, counts_for, shape, planner=planner) if stages is None else stages)
    candidate, table = _job_candidate(planner, config, counts_for, budget, shape, stages, cases)
    shape = candidate.shape
    predicted = candidate.estimate
    validation = None
    if validation_shape is not None:
        validation = validation_figures(config, counts_for, predicted, tuple(int(s) for s in validation_shape),
                                        validation_case)
        candidate = _with_validation(planner, candidate, validation, budget)
    fits = candidate.predicted_peak_bytes <= budget.budget_bytes
    if check and not force and not fits:
        _refuse(config, counts_for, budget, predicted, candidate.predicted_peak_bytes, shape, table, validation)
    return Plan(fits, budget, candidate, candidate, tuple(planner.candidates), (candidate,),
                forced=force and not fits, calibration=predicted.calibration, cases=table,
                validation=validation, precision_note=planner.precision_note(candidate))


def _job_candidate(planner: Planner, config: ExperimentConfig, counts_for: CountsFor, budget: Budget,
                   shape: tuple[int, ...], stages: list[str],
                   cases: Sequence[CaseShape]) -> tuple[Candidate, tuple[CaseRow, ...] | None]:
    """The fixed job's candidate and the store's case table (None without ``cases``): the step at ``shape``, or
    at batch 1 over a store's cases, at the case whose step peaks highest (not only the largest).

    A step ``recompute_stages`` already evaluated (auto's last try) is taken as it is; the step at the
    largest case, evaluated only to compare, leaves the planner's candidates when another case decides. The
    table takes the step's estimate for the cases that train at its shape instead of estimating it again.
    """
    candidate, new = _job_step(planner, config, shape, stages)
    if not cases:
        return candidate, None
    table = case_table(config, counts_for, budget, cases, stages,
                       known={candidate.shape: candidate.estimate.predicted_peak_bytes})
    if config.train.batch_size == 1:
        worst = max(table, key=lambda c: c.predicted_peak_bytes)
        if worst.predicted_peak_bytes > candidate.predicted_peak_bytes:
            if new:
                planner.candidates.remove(candidate)
            candidate, _ = _job_step(planner, config, tuple(worst.padded_shape), stages)
    return candidate, table


def _job_step(planner: Planner, config: ExperimentConfig, shape: tuple[int, ...],
              stages: list[str]) -> tuple[Candidate, bool]:
    """The job's step at ``shape`` among the planner's candidates, else evaluated now; and whether it was new."""
    mode = (list(shape), config.train.batch_size, config.train.precision.value, config.memory.recompute.value,
            stages)
    candidate = next((c for c in planner.candidates
                      if (c.spatial_shape, c.batch_size, c.precision, c.recompute, c.recompute_stages) == mode), None)
    if candidate is not None:
        return candidate, False
    return planner.evaluate(shape, config.train.batch_size, config.train.precision, config.memory.recompute,
                            stages), True


def _with_validation(planner: Planner, candidate: Candidate, validation: ValidationPass, budget: Budget) -> Candidate:
    """The job's candidate whose peak is the larger of training's and validation's (a ``validation`` component
    says by how much), in the planner's candidates in its place."""
    extra = validation.excess_bytes
    if not extra:
        return candidate
    peak = candidate.predicted_peak_bytes + extra
    validated = dataclasses.replace(candidate, components={**candidate.components, "validation": extra},
                                    predicted_peak_bytes=peak, fits=peak <= budget.budget_bytes and candidate.fits)
    planner.candidates = [validated if c is candidate else c for c in planner.candidates]
    return validated


def _refuse(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, predicted, peak: int,
            shape: tuple[int, ...], table: tuple[CaseRow, ...] | None, validation: ValidationPass | None) -> None:
    """Raise the one error that says why a fixed job does not fit, and what would.

    The placement's nodes first (their memory set the budget); then validation, when training
    alone would fit; else the job itself, naming its largest case that does not fit.
    """
    if budget.placement is not None:
        check_nodes_fit(peak, budget.placement, budget.topology)
    if validation is not None and validation.excess_bytes and predicted.predicted_peak_bytes <= budget.budget_bytes:
        raise InsufficientMemoryError(
            f"Validating held-out case {validation.case!r} ({'x'.join(map(str, validation.shape))}) whole "
            f"beside the model needs {format_bytes(peak)}, more than the memory budget "
            f"{format_bytes(budget.budget_bytes)} ({budget.source}); training alone would fit "
            f"({format_bytes(predicted.predicted_peak_bytes)}). Drop {{train.val_every}}, hold out smaller cases, or "
            "pass {train.force} to try anyway.", peak, budget.budget_bytes)
    what = ""
    unfit = [c for c in table or () if not c.fits] if config.data.shape is None else []
    if unfit:  # each case at its own shape: name the one that does not fit
        worst = max(unfit, key=lambda c: c.predicted_peak_bytes)
        what = (f" (case {worst.case!r}, {'x'.join(map(str, worst.shape))}"
                + ("" if worst.shape == worst.padded_shape else " padded") + ")")
    check_fits(predicted, config, counts_for, budget.budget_bytes, budget.source, shape, what)


def case_table(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, cases: Sequence[CaseShape],
               stages: Sequence[str], *, known: dict[tuple, int] | None = None) -> tuple[CaseRow, ...]:
    """Per case: its shape, the shape it trains at, the predicted peak of a step of ``train.batch_size`` of it, fits.

    Cases of one trained shape share one estimate (a store of 484 scans has far fewer shapes); ``known`` gives
    the peaks of trained shapes already estimated (the job's own step), which are not estimated again.
    """
    peaks: dict[tuple, int] = dict(known or {})
    rows = []
    for case in cases:
        trained = tuple(case.trained_shape)
        if trained not in peaks:
            peaks[trained] = estimate(config, counts_for(trained), trained,
                                      recompute_stages=stages).predicted_peak_bytes
        rows.append(CaseRow(case.case_id, list(case.shape), list(trained), peaks[trained],
                            peaks[trained] <= budget.budget_bytes))
    return tuple(rows)


def validation_figures(config: ExperimentConfig, counts_for: CountsFor, training, shape: tuple[int, int, int],
                       case_id: str) -> ValidationPass:
    """The held-out validation pass beside training: its predicted peak and how far it exceeds training's.

    Validation segments a held-out case whole while the model, its gradients' buffers, the
    optimizer's slots and the input pipeline's prefetched batches stay allocated: its peak is
    those (``resident_bytes``) plus the inference pass's own (``pass_bytes``: ``memory.estimate``
    in its forward pass: input copies, live feature maps, allocator slack, probabilities), without
    the inference estimate's own framework and weights (already counted).

    The margin (``safety_margin_bytes``) is each part's own: the training calibration's on the
    resident part (its framework is training's), and the inference calibration's fraction on the
    pass's parts. The inference estimate's own margin is not taken: it is sized for a predict
    process of its own, a fraction of a peak that holds the framework and fixed bytes that stand
    in for the framework's term, both counted here already (on an AVX2 CPU with no inference table,
    +15% of the whole pass and 256 MiB put a run validating at 2 mm after training at 4 mm 33%
    over its measured peak; benchmarks/results/validation_memory-*.json).
    """
    inference = estimate(config, counts_for(shape), shape, pass_=Pass.FORWARD)
    kept = ("framework", "weights", "gradients", "optimizer_slots", "input_pipeline", "hdf5_chunk_cache")
    resident = sum(training.components.get(name, 0) for name in kept)
    own = sum(v for k, v in inference.components.items() if k not in ("framework", "weights", "safety_margin"))
    margin = training.calibration.safety_margin(resident) + int(round(inference.calibration.margin_fraction * own))
    peak = resident + own + margin
    return ValidationPass(case_id, list(shape), int(peak), int(resident), int(own), int(margin),
                          int(training.predicted_peak_bytes), int(max(0, peak - training.predicted_peak_bytes)))


def require_fit(plan: Plan) -> None:
    """Refuse (exit 3) a searched plan in which nothing fits, naming the closest candidate.

    Raises:
        InsufficientMemoryError: ``plan.fits`` is False.
    """
    if plan.fits:
        return
    c = plan.closest
    if plan.pass_ is Pass.FORWARD:
        raise InsufficientMemoryError(
            f"Nothing fits {format_bytes(plan.budget_bytes)} ({plan.budget_source}): the smallest whole volume, "
            f"{c.shape_text} (inference, {c.precision}), needs {format_bytes(c.predicted_peak_bytes)}.",
            c.predicted_peak_bytes, plan.budget_bytes)
    raise InsufficientMemoryError(
        f"Nothing fits {format_bytes(plan.budget_bytes)} ({plan.budget_source}): the closest candidate, "
        f"{c.shape_text} x batch {c.batch_size} {c.precision} recompute {c.recompute}, needs "
        f"{format_bytes(c.predicted_peak_bytes)}.", c.predicted_peak_bytes, plan.budget_bytes)


# ---- inference: one whole volume at batch 1, no gradients, no optimizer -------------------------


def inference_candidate(config: ExperimentConfig, counts_for: CountsFor, budget_bytes: int,
                        shape: Sequence[int], ensemble: int = 1) -> Candidate:
    """Whole-volume inference of ``shape`` as a plan ``Candidate``: ``Planner.evaluate_forward``.

    Example:
        >>> inference_candidate(config, counts_for, 20 * 2**30, (256, 256, 256)).fits
        True
    """
    return Planner(config, counts_for, budget_bytes).evaluate_forward(shape, ensemble)


def plan_inference(config: ExperimentConfig, counts_for: CountsFor, budget: Budget,
                   shape: Sequence[int] | None = None, *, force: bool = False, check: bool = True,
                   ensemble: int = 1) -> Plan:
    """Segmenting one whole volume (``bigmem predict``; batch 1, ``config``'s precision): whether ``shape``
    fits, or without one the largest cube that does.

    Args:
        config: the network and its precision (``train.precision``).
        counts_for: ``memory.profile.counts_function(config)``.
        budget: ``resolve_budget(...)``.
        shape: the padded ``(D, H, W)``, each a multiple of ``2**depth``; None: search the largest
            cube (a multiple of ``2**depth``) whose predicted peak fits.
        force: (with ``shape``) run past the budget: no refusal, and the plan says ``forced``.
        check: (with ``shape``) refuse at all.
        ensemble: the networks of ``config``'s size whose probabilities predict averages, one after the other
            (default 1): their weights and the probabilities' running sum are counted.

    Returns:
        A ``Plan`` of ``Pass.FORWARD``: ``chosen`` the volume (with ``shape``), or the largest
        cube that fits (None when not even ``2**depth`` does; ``require_fit`` refuses it), and
        ``candidates`` every size tried.

    Raises:
        InsufficientMemoryError: (exit 3, with ``shape``) the predicted peak exceeds the budget,
            unless ``force`` or not ``check``; the message names the largest whole volume that fits
            (a cube), or the placement's nodes when they set the budget.

    Example:
        >>> plan_inference(config, counts_for, resolve_budget(20 * 2**30), (256, 256, 256)).fits
        True
        >>> plan_inference(config, counts_for, resolve_budget(20 * 2**30)).chosen.volume
        288
    """
    calibration = calibration_for(config.model.name, config.train.precision.value, INFERENCE_MODE)
    planner = Planner(config, counts_for, budget.budget_bytes)
    if shape is None:
        chosen = planner.largest_forward_volume(ensemble)
        closest = chosen or min(planner.candidates, key=lambda c: c.predicted_peak_bytes)
        return Plan(chosen is not None, budget, chosen, closest, tuple(planner.candidates),
                    (chosen,) if chosen is not None else (), calibration=calibration, pass_=Pass.FORWARD)
    candidate = planner.evaluate_forward(shape, ensemble)
    if check and not force and not candidate.fits:
        if budget.placement is not None:
            check_nodes_fit(candidate.predicted_peak_bytes, budget.placement, budget.topology)
        largest = planner.largest_forward_volume(ensemble)
        fix = (f"the largest whole volume that fits is {largest.volume}^3 (est. "
               f"{format_bytes(largest.predicted_peak_bytes)})" if largest is not None
               else f"not even {config.model.divisor}^3 fits")
        raise InsufficientMemoryError(
            f"Predicted peak {format_bytes(candidate.predicted_peak_bytes)} for {config.model.name} at "
            f"{candidate.shape_text} (inference, {candidate.precision}) exceeds the memory budget "
            f"{format_bytes(budget.budget_bytes)} ({budget.source}): {fix}; segment it in sliding windows, "
            "or predict with {predict.ignore_plan} to try anyway.", candidate.predicted_peak_bytes, budget.budget_bytes)
    return Plan(candidate.fits, budget, candidate, candidate, (candidate,), (candidate,),
                forced=force and not candidate.fits, calibration=calibration, pass_=Pass.FORWARD)


def plan_layouts(plan, topology):
    """Interleave vs one worker per node for the chosen (else closest) candidate; None on one node."""
    c = plan.chosen or plan.closest
    return evaluate_layouts(c.predicted_peak_bytes, c.batch_size, topology)


def plan_dict(plan, layouts=None) -> dict:
    """plan.json: ``plan.to_dict()``, with ``layouts`` only on a machine of several nodes."""
    data = plan.to_dict()
    if layouts is not None:
        data["layouts"] = layouts.to_dict()
    return data


def write_plan(path: Path, plan, layouts=None) -> bool:
    """Write ``plan`` (and ``layouts``, ``plan_dict``) to ``path`` unless nothing fits and ``path`` exists.

    A plan in which nothing fits (exit 3) never replaces an existing file: the plan there was
    made for another budget or model and is still the one to use. Returns whether it wrote.
    """
    if not plan.fits and path.exists():
        return False
    atomic_write_json(path, plan_dict(plan, layouts))
    return True


def require_plan(plan, path: Path, kept: bool, check=None) -> None:
    """``require_fit(plan)`` (or ``check()``), saying in its message whether ``path`` was left as it was."""

    try:
        check() if check is not None else require_fit(plan)
    except InsufficientMemoryError as exc:
        where = (f"The plan already in {path} was kept (a failed plan replaces no file)." if kept
                 else f"Every candidate is in {path}.")
        raise InsufficientMemoryError(f"{exc.template} {where}", exc.required_bytes, exc.available_bytes) from None


def plan_search(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, *,
                cases: Sequence[CaseShape] = (), volume: int | Sequence[int] | None = None,
                batch_size: int | None = None, allow_bf16: bool | None = None) -> Plan:
    """The largest volume (unless fixed), then batch (unless fixed), that fits ``budget`` (``make_plan``).

    With ``cases`` (a store's, ``store_cases``) the shape is the one ``bigmem train`` steps at:
    batch 1 steps at the largest case, a batch of several at the bounding shape of all. When the
    search at the largest case chose a batch of several, it is searched again at the bounding
    shape, and kept only if batches still reach past one there. plan.json's ``cases`` then has
    a row per case.

    Args:
        config: the model and training settings.
        counts_for: ``memory.profile.counts_function(config)``.
        budget: ``resolve_budget(...)``.
        cases: the store's training cases (default none).
        volume: fix the volume edge (or the ``(D, H, W)`` shape) and search the batch.
        batch_size: fix the batch and search the volume.
        allow_bf16: consider bf16 (default: only where the CPU has it natively).

    Returns:
        The ``Plan``; ``chosen`` is None when nothing fits (``require_fit`` refuses it);
        ``searched_shape`` the shape searched at (None: the largest cube was searched).

    Example:
        >>> plan_search(config, counts_for, resolve_budget(20 * 2**30)).chosen.volume
        344
    """
    shape = volume
    if cases:
        shape = planned_shape([c.trained_shape for c in cases], batch_size or 1)
    plan = make_plan(config, counts_for, budget, volume=shape, batch_size=batch_size, allow_bf16=allow_bf16)
    if cases and batch_size is None and plan.chosen is not None and plan.chosen.batch_size > 1:
        bounding = planned_shape([c.trained_shape for c in cases], 2)
        if bounding != shape:
            wider = make_plan(config, counts_for, budget, volume=bounding, allow_bf16=allow_bf16)
            plan = wider if wider.chosen is not None and wider.chosen.batch_size > 1 else plan
            shape = bounding if plan is wider else shape
    table = None
    if cases:
        c = plan.chosen or plan.closest
        sized = config.updated({"train": {"batch_size": c.batch_size, "precision": c.precision}})
        table = case_table(sized, counts_for, budget, cases, c.recompute_stages)
    return dataclasses.replace(plan, cases=table, searched_shape=None if shape is None
                               else (shape if isinstance(shape, int) else tuple(shape)))


def search_budget(budget: Budget, topology: NUMATopology | None) -> Budget:
    """The budget a search sizes by: ``budget``, except MemAvailable on a machine of several NUMA nodes.

    There the total is more than any layout can hold (``plan_layouts``: one interleaved process
    holds an equal share on each node; one worker per node holds its whole peak on its own node),
    so the search is sized by what the larger layout holds, one process interleaved over every
    node with memory (``numa.capacity.interleave_budget``): the plan it finds fits that layout.
    An explicit budget or a placement's is kept as given.

    Example:
        >>> search_budget(resolve_budget(), topology).source  # four nodes
        '4 interleaved node(s) x the smallest free 380.12 GiB'
    """
    if budget.source != "MemAvailable" or topology is None or topology.num_nodes < 2:
        return budget
    nodes = [node.node_id for node in topology.nodes if node.total_bytes > 0]
    return Budget(*interleave_budget(nodes, topology))


def store_cases(config: ExperimentConfig) -> tuple[ExperimentConfig, list[CaseShape]]:
    """``config`` with its store's channels and classes, and the store's training cases as ``CaseShape``s."""
    from bigmem.data.derived import trained_shapes, with_data_fields

    config = with_data_fields(config)
    return config, [CaseShape(*case) for case in trained_shapes(config)]


__all__ = ["CaseShape", "case_table", "inference_candidate", "plan_dict", "plan_inference", "plan_job", "plan_layouts",
           "plan_search", "planned_shape", "recompute_stages", "require_fit", "require_plan", "search_budget",
           "store_cases", "validation_figures", "write_plan"]
