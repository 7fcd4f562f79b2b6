"""The memory budget and whether a job fits it: one budget rule, one choice of recomputed stages, one ``Plan``.

Every command that asks "does this fit?" asks here: ``bigmem train`` before anything large is
allocated, ``bigmem plan`` for the largest volume and batch, ``bigmem profile --recompute auto``
for its stages, ``bigmem compare`` for the largest whole volume in host RAM, and ``bigmem plan
--inference`` for the largest whole volume one forward pass can segment (``inference_plan``,
``search_inference_plan``: batch 1, no gradients, no optimizer; ``memory.inference``'s estimate). What they get
back is a ``memory.planner.Plan``, whose ``to_dict`` is plan.json's one schema.

The budget, in one rule (``resolve_budget``):

1. an explicit budget (``--memory-budget SIZE``; ``--budget`` on ``bigmem plan``) wins;
2. else what the NUMA placement bigmem runs under can use: ``bind:NODES`` the bound nodes' free
   memory, ``interleave[:NODES]`` the smallest node's free memory times the nodes
   (``numa.capacity.placement_budget``);
3. else (no placement, or ``local``, ``preferred`` or ``none``, which may spill anywhere)
   MemAvailable.

An explicit budget larger than a bind or interleave placement can use is capped to it, with a
one-line note: the pages cannot land anywhere else. An explicit budget above MemAvailable is
kept (a plan for a bigger machine, or page cache the user knows can be dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from bigmem.config.options import Recompute
from bigmem.config.schema import ExperimentConfig
from bigmem.errors import ConfigError, InsufficientMemoryError
from bigmem.memory.estimate import NetworkCounts, estimate, mode_stages
from bigmem.memory.inference import estimate_inference, inference_calibration
from bigmem.memory.planner import (
    MAX_VOLUME, Candidate, Plan, Planner, available_memory_bytes, check_fits, largest_fitting, machine_memory_bytes,
    make_plan,
)
from bigmem.numa.capacity import check_nodes_fit, placement_budget
from bigmem.numa.policy import Placement, PolicyKind
from bigmem.numa.topology import NUMATopology
from bigmem.units import format_bytes

CountsFor = Callable[[tuple[int, int, int]], NetworkCounts]
EXPLICIT_FLAG = "--memory-budget"
# Policies whose pages stay on the placement's nodes: their free memory is the most a job can use.
NODE_BOUND_POLICIES = (PolicyKind.BIND, PolicyKind.INTERLEAVE)


@dataclass(frozen=True)
class Budget:
    """A resolved memory budget and where it came from.

    Attributes:
        budget_bytes: the most the job's predicted peak may be.
        source: what set it, as messages and plan.json's ``budget_source`` name it: the flag
            (``"--memory-budget"``, ``"--budget"``), the placement (``"free memory of node(s) 1"``)
            or ``"MemAvailable"``.
        note: one line to show the user when an explicit budget was capped ("" otherwise).
        placement: the placement whose nodes set the budget, when they did (the refusal then names
            the nodes); None otherwise.
        topology: the topology ``placement`` was measured on.
    """

    budget_bytes: int
    source: str
    note: str = ""
    placement: Placement | None = None
    topology: NUMATopology | None = None


def resolve_budget(explicit_bytes: int | None = None, *, flag: str = EXPLICIT_FLAG,
                   placement: Placement | None = None, topology: NUMATopology | None = None,
                   available_bytes: int | None = None) -> Budget:
    """The memory budget, by the one precedence rule of this module's docstring.

    Args:
        explicit_bytes: the budget the user gave, or None.
        flag: how the user spelled it (``--memory-budget``, or ``--budget`` on ``bigmem plan``);
            it becomes the budget's source.
        placement: the NUMA placement the job runs under (applied, or resolved for planning);
            None for none.
        topology: the machine's nodes (default: read from sysfs when a bind or interleave
            placement needs them).
        available_bytes: MemAvailable (default: read now, when the rule falls through to it).

    Returns:
        The ``Budget``.

    Example:
        >>> resolve_budget(2**30, available_bytes=2**40)
        Budget(budget_bytes=1073741824, source='--memory-budget', note='', placement=None, topology=None)
    """
    limit = None
    if placement is not None and placement.kind in NODE_BOUND_POLICIES:
        topology = topology or NUMATopology.from_sysfs()
        limit = placement_budget(placement, topology, 0)  # bind/interleave: the nodes' free memory only
    if explicit_bytes is not None:
        if limit is None or explicit_bytes <= limit[0]:
            return Budget(int(explicit_bytes), flag)
        note = (f"note: {flag} {format_bytes(explicit_bytes)} is more than --numa {placement.text} can use; "
                f"budgeting {format_bytes(limit[0])} ({limit[1]})")
        return Budget(limit[0], limit[1], note, placement, topology)
    if limit is not None:
        return Budget(limit[0], limit[1], placement=placement, topology=topology)
    available = available_memory_bytes() if available_bytes is None else int(available_bytes)
    return Budget(available, "MemAvailable")


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


def check_budget_within_machine(budget: Budget, *, force: bool = False, machine_bytes: int | None = None) -> None:
    """Refuse (exit 3) an explicit budget above the machine's memory: the kernel, not bigmem, would stop the run.

    Args:
        budget: ``resolve_budget(...)``.
        force: keep it anyway (a user who knows better, e.g. swap the kernel will use).
        machine_bytes: MemTotal (default: read now).

    Raises:
        InsufficientMemoryError: an explicit (flag-given) budget exceeds MemTotal, unless ``force``.
    """
    if force or not budget.source.startswith("--"):
        return
    total = machine_memory_bytes() if machine_bytes is None else int(machine_bytes)
    if budget.budget_bytes > total:
        raise InsufficientMemoryError(
            f"{budget.source} {format_bytes(budget.budget_bytes)} is more than this machine's memory "
            f"({format_bytes(total)}, MemTotal): a job planned for it would be killed by the kernel, not stopped by "
            f"bigmem. Give at most {format_bytes(total)}, or --force to run anyway.", budget.budget_bytes, total)


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


def job_plan(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, *, shape: Sequence[int] | None = None,
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
        >>> plan = job_plan(config, counts_for, resolve_budget(64 * 2**30), shape=(240, 240, 160))
        >>> plan.chosen.recompute_stages, plan.fits
        ([], True)
    """
    batch = config.train.batch_size
    if shape is None:
        shape = config.data.shape or (config.data.reference_volume,) * 3
    shape = tuple(int(s) for s in shape)
    planner = Planner(config, counts_for, budget.budget_bytes)
    stages = list(recompute_stages(config, counts_for, shape, planner=planner) if stages is None else stages)
    table = case_table(config, counts_for, budget, cases, stages) if cases else None
    if table and batch == 1:  # each step is one case: the one with the highest peak decides (not only the largest)
        worst = max(table, key=lambda c: c["predicted_peak_bytes"])
        if worst["predicted_peak_bytes"] > estimate(config, counts_for(shape), shape,
                                                    recompute_stages=stages).predicted_peak_bytes:
            shape = tuple(worst["padded_shape"])
    mode = (list(shape), batch, config.train.precision.value, config.memory.recompute.value, stages)
    candidate = next((c for c in planner.candidates  # auto's last try is the job itself
                      if (c.spatial_shape, c.batch_size, c.precision, c.recompute, c.recompute_stages) == mode), None)
    candidate = candidate or planner.evaluate(shape, batch, config.train.precision, config.memory.recompute, stages)
    predicted = estimate(config, counts_for(shape), shape, recompute_stages=stages)
    validation = None
    if validation_shape is not None:
        validation = validation_figures(config, counts_for, predicted, tuple(int(s) for s in validation_shape),
                                        validation_case)
        extra = validation["excess_bytes"]
        if extra:  # the plan's peak is the larger of the two: the component says by how much validation's is
            candidate.components["validation"] = extra
            candidate.predicted_peak_bytes += extra
            candidate.fits = candidate.predicted_peak_bytes <= budget.budget_bytes and candidate.fits
    peak = candidate.predicted_peak_bytes
    fits = peak <= budget.budget_bytes
    if check and not force and not fits:
        _refuse(config, counts_for, budget, predicted, peak, shape, table, validation)
    return Plan(fits, budget.budget_bytes, budget.source, candidate, candidate, list(planner.candidates), [candidate],
                forced=force and not fits, calibration=predicted.calibration.to_dict(), cases=table,
                validation=validation)


def _refuse(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, predicted, peak: int,
            shape: tuple[int, ...], table: list[dict] | None, validation: dict | None) -> None:
    """Raise the one error that says why a fixed job does not fit, and what would.

    The placement's nodes first (their memory set the budget); then validation, when training
    alone would fit; else the job itself, naming its largest case that does not fit.
    """
    if budget.placement is not None:
        check_nodes_fit(peak, budget.placement, budget.topology)
    if validation is not None and validation["excess_bytes"] and predicted.predicted_peak_bytes <= budget.budget_bytes:
        raise InsufficientMemoryError(
            f"Validating held-out case {validation['case']!r} ({'x'.join(map(str, validation['shape']))}) whole "
            f"beside the model needs {format_bytes(peak)}, more than the memory budget "
            f"{format_bytes(budget.budget_bytes)} ({budget.source}); training alone would fit "
            f"({format_bytes(predicted.predicted_peak_bytes)}). Drop --val-every, hold out smaller cases, or pass "
            "--force to try anyway.", peak, budget.budget_bytes)
    what = ""
    unfit = [c for c in table or [] if not c["fits"]] if config.data.shape is None else []
    if unfit:  # each case at its own shape: name the one that does not fit
        worst = max(unfit, key=lambda c: c["predicted_peak_bytes"])
        what = (f" (case {worst['case']!r}, {'x'.join(map(str, worst['shape']))}"
                + ("" if worst["shape"] == worst["padded_shape"] else " padded") + ")")
    check_fits(predicted, config, counts_for, budget.budget_bytes, budget.source, shape, what)


def case_table(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, cases: Sequence[CaseShape],
               stages: Sequence[str]) -> list[dict]:
    """Per case: its shape, the shape it trains at, the predicted peak of a step of ``train.batch_size`` of it, fits.

    Cases of one trained shape share one estimate (a store of 484 scans has far fewer shapes).
    """
    peaks: dict[tuple, int] = {}
    rows = []
    for case in cases:
        trained = tuple(case.trained_shape)
        if trained not in peaks:
            peaks[trained] = estimate(config, counts_for(trained), trained,
                                      recompute_stages=stages).predicted_peak_bytes
        rows.append({"case": case.case_id, "shape": list(case.shape), "padded_shape": list(trained),
                     "predicted_peak_bytes": peaks[trained], "fits": peaks[trained] <= budget.budget_bytes})
    return rows


def validation_figures(config: ExperimentConfig, counts_for: CountsFor, training, shape: tuple[int, int, int],
                       case_id: str) -> dict:
    """The held-out validation pass beside training: its predicted peak and how far it exceeds training's.

    Validation segments a held-out case whole while the model, its gradients' buffers, the
    optimizer's slots and the input pipeline's prefetched batches stay allocated: its peak is
    those plus the inference pass's own (``memory.inference``: input copies, live feature maps,
    probabilities), without the inference estimate's own framework and weights (already counted).
    """
    inference = estimate_inference(config, counts_for(shape), shape)
    kept = ("framework", "weights", "gradients", "optimizer_slots", "input_pipeline", "hdf5_chunk_cache")
    resident = sum(training.components.get(name, 0) for name in kept)
    own = sum(v for k, v in inference.components.items() if k not in ("framework", "weights"))
    peak = resident + own
    return {"case": case_id, "shape": list(shape), "predicted_peak_bytes": int(peak),
            "training_peak_bytes": int(training.predicted_peak_bytes),
            "excess_bytes": int(max(0, peak - training.predicted_peak_bytes))}


def search_plan(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, *,
                volume: int | Sequence[int] | None = None,
                batch_size: int | None = None, allow_bf16: bool | None = None) -> Plan:
    """The largest volume (unless fixed), then batch (unless fixed), that fits ``budget`` (``make_plan``).

    Args:
        config: the model and training settings.
        counts_for: ``memory.profile.counts_function(config)``.
        budget: ``resolve_budget(...)``.
        volume: fix the volume edge (or the ``(D, H, W)`` shape) and search the batch.
        batch_size: fix the batch and search the volume.
        allow_bf16: consider bf16 (default: only where the CPU has it natively).

    Returns:
        The ``Plan``; ``chosen`` is None when nothing fits (``require_fit`` refuses it).
    """
    return make_plan(config, counts_for, budget.budget_bytes, budget_source=budget.source, volume=volume,
                     batch_size=batch_size, allow_bf16=allow_bf16)


def require_fit(plan: Plan) -> None:
    """Refuse (exit 3) a searched plan in which nothing fits, naming the closest candidate.

    Raises:
        InsufficientMemoryError: ``plan.fits`` is False.
    """
    if plan.fits:
        return
    c = plan.closest
    if plan.kind == "inference":
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
                        shape: Sequence[int]) -> Candidate:
    """Whole-volume inference of ``shape`` as a plan ``Candidate`` (batch 1, ``memory.inference`` estimate).

    Args:
        config: the network and its precision (``train.precision``).
        counts_for: ``memory.profile.counts_function(config)``.
        budget_bytes: what ``fits`` is judged against.
        shape: ``(D, H, W)``, each a multiple of ``2**depth``.

    Returns:
        The ``Candidate``: ``volume`` the largest edge, ``spatial_shape`` the shape, ``fits`` whether
        the prediction is within the budget and runnable, ``components`` the estimate's.
    """
    shape = tuple(int(s) for s in shape)
    result = estimate_inference(config, counts_for(shape), shape)
    return Candidate(max(shape), 1, result.precision, "none", result.predicted_peak_bytes,
                     result.predicted_peak_bytes <= budget_bytes and result.runnable, [],
                     components=dict(result.components), partitioned_stages=list(result.partitioned_stages),
                     spatial_shape=list(shape))


def _largest_inference_volume(config: ExperimentConfig, counts_for: CountsFor, budget_bytes: int,
                              candidates: list[Candidate]) -> Candidate | None:
    """Binary search of the largest cube (a multiple of ``2**depth``) that fits; every try kept in ``candidates``."""
    divisor = config.model.divisor

    def make(k: int) -> Candidate:
        candidates.append(inference_candidate(config, counts_for, budget_bytes, (k * divisor,) * 3))
        return candidates[-1]

    return largest_fitting(make, MAX_VOLUME // divisor, lambda candidate: candidate.fits)


def inference_plan(config: ExperimentConfig, counts_for: CountsFor, budget: Budget, shape: Sequence[int], *,
                   force: bool = False, check: bool = True) -> Plan:
    """The plan of segmenting one whole volume of ``shape`` (``bigmem predict``), refused unless it fits.

    Args:
        config: the network and its precision (``train.precision``).
        counts_for: ``memory.profile.counts_function(config)``.
        budget: ``resolve_budget(...)``.
        shape: the padded ``(D, H, W)``, each a multiple of ``2**depth``.
        force: run past the budget: no refusal, and the plan says ``forced``.
        check: refuse at all.

    Returns:
        A ``Plan`` with ``kind`` "inference" whose ``chosen`` is the volume.

    Raises:
        InsufficientMemoryError: (exit 3) the predicted peak exceeds the budget, unless ``force`` or
            not ``check``; the message names the largest whole volume that fits (a cube), or the
            placement's nodes when they set the budget.

    Example:
        >>> inference_plan(config, counts_for, resolve_budget(20 * 2**30), (256, 256, 256)).fits
        True
    """
    candidate = inference_candidate(config, counts_for, budget.budget_bytes, shape)
    calibration = inference_calibration(config.model.name, config.train.precision.value).to_dict()
    if check and not force and not candidate.fits:
        if budget.placement is not None:
            check_nodes_fit(candidate.predicted_peak_bytes, budget.placement, budget.topology)
        largest = _largest_inference_volume(config, counts_for, budget.budget_bytes, [])
        fix = (f"the largest whole volume that fits is {largest.volume}^3 (est. "
               f"{format_bytes(largest.predicted_peak_bytes)})" if largest is not None
               else f"not even {config.model.divisor}^3 fits")
        raise InsufficientMemoryError(
            f"Predicted peak {format_bytes(candidate.predicted_peak_bytes)} for {config.model.name} at "
            f"{candidate.shape_text} (inference, {candidate.precision}) exceeds the memory budget "
            f"{format_bytes(budget.budget_bytes)} ({budget.source}): {fix}; segment it in sliding windows, "
            "or predict with --ignore-plan to try anyway.", candidate.predicted_peak_bytes, budget.budget_bytes)
    return Plan(candidate.fits, budget.budget_bytes, budget.source, candidate, candidate, [candidate], [candidate],
                forced=force and not candidate.fits, calibration=calibration, kind="inference")


def search_inference_plan(config: ExperimentConfig, counts_for: CountsFor, budget: Budget) -> Plan:
    """The largest whole cubic volume one pass can segment within ``budget`` (batch 1, ``config``'s precision).

    Args:
        config: the network and its precision (``train.precision``).
        counts_for: ``memory.profile.counts_function(config)``.
        budget: ``resolve_budget(...)``.

    Returns:
        A ``Plan`` with ``kind`` "inference": ``chosen`` the largest cube that fits (None when not
        even ``2**depth`` does; ``require_fit`` refuses it), ``candidates`` every size tried.

    Example:
        >>> search_inference_plan(config, counts_for, resolve_budget(20 * 2**30)).chosen.volume
        288
    """
    candidates: list[Candidate] = []
    chosen = _largest_inference_volume(config, counts_for, budget.budget_bytes, candidates)
    closest = chosen or min(candidates, key=lambda c: c.predicted_peak_bytes)
    calibration = inference_calibration(config.model.name, config.train.precision.value).to_dict()
    return Plan(chosen is not None, budget.budget_bytes, budget.source, chosen, closest, candidates,
                [chosen] if chosen is not None else [], calibration=calibration, kind="inference")


__all__ = ["Budget", "CaseShape", "case_table", "check_budget_within_machine", "inference_candidate", "inference_plan",
           "job_plan", "planned_shape",
           "recompute_stages", "require_fit", "resolve_budget", "search_inference_plan", "search_plan",
           "validation_figures"]
