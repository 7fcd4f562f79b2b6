"""The search (the planner): the largest whole volume (then batch) whose predicted peak fits a budget; its records.

It chooses between fp32 and bf16 and between keeping and recomputing stage activations, in
that order of preference (cheaper in compute first), and records every candidate it evaluated.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import psutil

from bigmem.config.options import Precision, Recompute
from bigmem.config.schema import ExperimentConfig
from bigmem.errors import InsufficientMemoryError
from bigmem.memory.calibration import Calibration, calibration_for, recompute_key
from bigmem.memory.estimate import Estimate, NetworkCounts, Pass, estimate, mode_stages, recompute_order
from bigmem.memory.records import BatchCap, Budget, CaseRow, DataParallelRun, PlannedExperiment, ValidationPass
from bigmem.speed import (MachineSpeed, StepRate, predicted_step_s, recomputed_share, step_rate,
                                 tuned_step_rate)
from bigmem.units import as_shape, format_bytes, format_shape

# Modes in order of preference: on a tie the earlier (less recomputation, full precision) wins.
MODES: tuple[tuple[Precision, Recompute], ...] = (
    (Precision.FP32, Recompute.NONE), (Precision.BF16, Recompute.NONE),
    (Precision.FP32, Recompute.STAGES), (Precision.BF16, Recompute.STAGES),
)
# On a CPU without native bfloat16 (sysinfo.native_bf16) bf16 is emulated, ~20x slower than fp32
# (benchmarks/results/speed.md, "oneDNN and bf16 by ISA class"): the planner and the pre-flight's
# suggestions leave it out unless asked for.
FP32_MODES = tuple(mode for mode in MODES if mode[0] is Precision.FP32)
MAX_BATCH = 4096
MAX_VOLUME = 4096  # voxels per edge searched; 4096^3 is 64 Gi voxels


T = TypeVar("T")


def largest_fitting(make: Callable[[int], T], upper: int, fits: Callable[[T], bool]) -> T | None:
    """The candidate of the largest k in [1, upper] that fits, by binary search: the one "largest that fits".

    The planner's volumes and batches, the inference plan's largest cube and the data-parallel
    patch all search with it; each gives how to make its k-th candidate and whether one fits.

    Args:
        make: k -> a candidate (a volume of k x 2^depth, a batch of k, ...).
        upper: the largest k tried.
        fits: whether a candidate fits; must be monotone (if k fits, every smaller k does).

    Returns:
        The largest fitting candidate, or None when not even k = 1 fits.

    Example:
        >>> largest_fitting(lambda k: k * 16, 64, lambda edge: edge ** 3 <= 100**3)
        96
    """
    best, lo, hi = None, 1, upper
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = make(mid)
        if fits(candidate):
            best, lo = candidate, mid + 1
        else:
            hi = mid - 1
    return best


def machine_memory_bytes() -> int:
    """MemTotal: the machine's memory; no budget above it can be met."""
    return int(psutil.virtual_memory().total)


def available_memory_bytes() -> int:
    """MemAvailable: what the kernel says can be allocated without swapping."""
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner evaluated: its shape, batch and mode, and its estimate's figures.

    ``estimate`` is the estimate itself (not in plan.json): a plan that keeps its candidates asks
    for no estimate twice.
    """

    volume: int
    batch_size: int
    precision: str
    recompute: str
    predicted_peak_bytes: int
    fits: bool
    recompute_stages: list[str] = field(default_factory=list)
    components: dict[str, int] = field(default_factory=dict)  # the estimate's breakdown (bytes)
    predicted_step_s: float | None = None  # speed.py: FLOPs over this CPU's measured rate
    step_rate_source: str = ""
    partitioned_stages: list[str] = field(default_factory=list)  # stages run in depth slabs
    # The candidate's (D, H, W), which need not be a cube: then ``volume`` is its largest edge.
    spatial_shape: list[int] | None = None
    estimate: Estimate | None = field(default=None, compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(D, H, W)``: ``spatial_shape``, or the cube of ``volume``."""
        return tuple(self.spatial_shape) if self.spatial_shape else (self.volume,) * 3  # type: ignore[return-value]

    @property
    def shape_text(self) -> str:
        """'128^3' for a cube, else '240x240x144'."""
        return format_shape(self.shape)

    def shape_flag(self) -> str:
        """The setting that asks for this shape, as a field template (``bigmem.errors.render_fields``):
        ``{data.volume} N`` for a cube, else ``{data.shape} D,H,W``."""
        shape = self.shape
        return f"{{data.volume}} {shape[0]}" if len(set(shape)) == 1 else "{data.shape} " + ",".join(map(str, shape))

    def flags(self) -> str:
        """The settings beyond the defaults that ask for this candidate's mode, as a field template:
        ``{memory.recompute} stages {train.precision} bf16`` (empty for fp32 without recompute)."""
        parts = []
        if self.recompute != "none":
            parts.append(f"{{memory.recompute}} {self.recompute}")
        if self.precision != "fp32":
            parts.append(f"{{train.precision}} {self.precision}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        """plan.json's figures of this candidate (every field but ``estimate``)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "estimate"}


@dataclass(frozen=True)
class Plan:
    """What fits a memory budget: the one schema of plan.json (``bigmem plan`` and every run's).

    ``chosen`` is the configuration that will run: the planner's pick (None when nothing fits),
    or, for a fixed job (``memory.plans.plan_job``), the job itself, even when it is forced
    past the budget (then ``fits`` is False and ``forced`` True). Made whole where it is built;
    a later part (the dataset's batch cap, the experiment, the data-parallel run) comes by
    ``dataclasses.replace``.
    """

    fits: bool
    budget: Budget
    chosen: Candidate | None
    closest: Candidate
    candidates: tuple[Candidate, ...]
    best_per_mode: tuple[Candidate, ...]
    forced: bool = False  # a fixed job run past its budget (--force)
    calibration: Calibration | None = None  # the calibration behind the chosen (or closest) candidate's estimate
    data_parallel: DataParallelRun | None = None  # how the job runs: its patch and replicas, if data parallel
    pass_: Pass = Pass.TRAIN  # Pass.FORWARD: whole-volume segmentation at batch 1 (memory.plans.plan_inference)
    cases: tuple[CaseRow, ...] | None = None  # per training case, a job on a store's own shapes
    validation: ValidationPass | None = None  # the held-out validation pass (--val-every) beside training's
    # Where the chosen candidate is bf16 and bf16 is slower than fp32 here: what it costs (Planner.precision_note).
    precision_note: str | None = None
    batch_cap: BatchCap | None = None  # a store's cap on the batch (api.plan)
    experiment: PlannedExperiment | None = None  # the network configured from the store (bigmem plan --data)
    # The shape the search ran at (memory.plans.plan_search; None: the largest cube); not in plan.json.
    searched_shape: int | tuple[int, int, int] | None = None

    @property
    def budget_bytes(self) -> int:
        return self.budget.budget_bytes

    @property
    def budget_source(self) -> str:
        return self.budget.source

    @property
    def predicted_peak_bytes(self) -> int:
        return (self.chosen or self.closest).predicted_peak_bytes

    def to_dict(self) -> dict:
        """plan.json. ``components`` and ``predicted_peak_bytes`` are the chosen (else closest) candidate's."""
        chosen = self.chosen
        return {
            "kind": "inference" if self.pass_ is Pass.FORWARD else "train",
            "fits": self.fits,
            "forced": self.forced,
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "components": dict((chosen or self.closest).components),
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
            "chosen": {"volume": chosen.volume, "batch_size": chosen.batch_size, "precision": chosen.precision,
                       "recompute": chosen.recompute, "recompute_stages": chosen.recompute_stages,
                       "components": dict(chosen.components), "partitioned_stages": chosen.partitioned_stages,
                       "predicted_step_s": chosen.predicted_step_s, "step_rate_source": chosen.step_rate_source,
                       "spatial_shape": chosen.spatial_shape}
            if chosen is not None else None,
            "precision_note": self.precision_note,
            "batch_cap": dataclasses.asdict(self.batch_cap) if self.batch_cap is not None else None,
            "experiment": self.experiment.to_dict() if self.experiment is not None else None,
            "data_parallel": self.data_parallel.to_dict() if self.data_parallel is not None else None,
            "cases": [dataclasses.asdict(c) for c in self.cases] if self.cases is not None else None,
            "validation": dataclasses.asdict(self.validation) if self.validation is not None else None,
            "closest": self.closest.to_dict(),
            "best_per_mode": [c.to_dict() for c in self.best_per_mode],
            "candidates": [c.to_dict() for c in self.candidates],
        }


class Planner:
    """Evaluates candidates for one model configuration against a budget."""

    def __init__(self, config: ExperimentConfig, counts_for: Callable[[tuple[int, int, int]], NetworkCounts],
                 budget_bytes: int, machine: MachineSpeed | None = None):
        self.machine = machine or MachineSpeed.here()
        self.config = config
        self.counts_for = counts_for
        self.budget_bytes = int(budget_bytes)
        self.divisor = config.model.divisor
        self.candidates: list[Candidate] = []

    def evaluate(self, volume: int | Sequence[int], batch: int, precision: Precision, recompute: Recompute,
                 stages: Sequence[str] | None = None) -> Candidate:
        """One configuration's candidate (kept in ``candidates``); ``volume``: a cube edge or a ``(D, H, W)``."""
        shape = as_shape(volume)
        config = self.config.updated({"train": {"batch_size": batch, "precision": precision},
                                      "memory": {"recompute": recompute}})
        counts = self.counts_for(shape)
        if stages is None:
            stages = mode_stages(recompute, counts)
        result = estimate(config, counts, shape, recompute_stages=stages)
        rate = self._rate(result.calibration, precision, config.model.filters[0])
        recomputed = recomputed_share(counts.block_elements, stages)
        candidate = Candidate(max(shape), batch, precision.value, recompute.value, result.predicted_peak_bytes,
                              result.predicted_peak_bytes <= self.budget_bytes and result.runnable, list(stages),
                              components=dict(result.components),
                              partitioned_stages=list(result.partitioned_stages),
                              predicted_step_s=round(predicted_step_s(result.train_flops_per_step, recomputed, rate,
                                                                      self.machine.cores), 3),
                              step_rate_source=rate.source, spatial_shape=list(shape), estimate=result)
        self.candidates.append(candidate)
        return candidate

    def evaluate_forward(self, volume: int | Sequence[int], ensemble: int = 1) -> Candidate:
        """Segmenting one whole volume (batch 1, no gradients, no optimizer; ``Pass.FORWARD``) as a candidate, kept
        in ``candidates``, in the config's precision.

        Args:
            volume: a cube edge or a ``(D, H, W)``, each a multiple of ``2**depth``.
            ensemble: the networks whose probabilities are averaged, one after the other (default 1).

        Returns:
            The ``Candidate``: ``volume`` the largest edge, ``spatial_shape`` the shape, ``fits`` whether the
            prediction is within the budget and runnable, ``components`` the estimate's; no step time.
        """
        shape = as_shape(volume)
        result = estimate(self.config, self.counts_for(shape), shape, pass_=Pass.FORWARD, ensemble=ensemble)
        candidate = Candidate(max(shape), 1, result.precision, "none", result.predicted_peak_bytes,
                              result.predicted_peak_bytes <= self.budget_bytes and result.runnable, [],
                              components=dict(result.components), partitioned_stages=list(result.partitioned_stages),
                              spatial_shape=list(shape), estimate=result)
        self.candidates.append(candidate)
        return candidate

    def largest_forward_volume(self, ensemble: int = 1) -> Candidate | None:
        """The largest cube (a multiple of ``2**depth``) one prediction can segment within the budget."""
        return self._largest(lambda k: self.evaluate_forward(k * self.divisor, ensemble), MAX_VOLUME // self.divisor)

    def _rate(self, calibration: Calibration, precision: Precision, base_filters: int) -> StepRate:
        """This machine's calibrated step rate for the mode where it has one, else the ISA class's table."""
        if calibration.step_gflops_per_core:
            return StepRate(calibration.step_gflops_per_core,
                            f"calibrated on this machine at {calibration.fitted_on[-1]}^3 ({calibration.source}; "
                            f"bigmem profile --calibrate)")
        return (tuned_step_rate(precision.value, base_filters, self.machine.native_bf16)
                or step_rate(self.machine.isa_class, precision.value, base_filters, self.machine.native_bf16))

    def precision_note(self, candidate: Candidate) -> str | None:
        """What a bf16 candidate costs in step time here, where bf16 is slower than fp32 on this CPU.

        Returns:
            ``"bf16 needed to fit: 1.8x the fp32 step time on this CPU (...)"`` where fp32 does not
            fit the same step, ``"bf16 on this CPU: 1.8x ..."`` where it would; None for an fp32
            candidate or where bf16 is not slower.
        """
        if candidate.precision != "bf16" or not candidate.predicted_step_s:
            return None
        fp32 = self.evaluate(candidate.shape, candidate.batch_size, Precision.FP32, Recompute(candidate.recompute),
                             candidate.recompute_stages)
        self.candidates.remove(fp32)  # asked for the note, not a candidate of the search
        if not fp32.predicted_step_s or candidate.predicted_step_s <= fp32.predicted_step_s:
            return None
        ratio = candidate.predicted_step_s / fp32.predicted_step_s
        lead = "bf16 needed to fit" if not fp32.fits else "bf16 on this CPU"
        return f"{lead}: {ratio:.1f}x the fp32 step time on this CPU ({candidate.step_rate_source})"

    def _largest(self, fits: Callable[[int], Candidate], upper: int) -> Candidate | None:
        return largest_fitting(fits, upper, lambda candidate: candidate.fits)

    def largest_volume(self, precision: Precision, recompute: Recompute) -> Candidate | None:
        return self._largest(lambda k: self.evaluate(k * self.divisor, 1, precision, recompute),
                             MAX_VOLUME // self.divisor)

    def largest_batch(self, volume: int, precision: Precision, recompute: Recompute) -> Candidate | None:
        return self._largest(lambda b: self.evaluate(volume, b, precision, recompute), MAX_BATCH)

    def fewest_recomputed_stages(self, volume: int | Sequence[int], batch: int, precision: Precision) -> Candidate:
        """For --recompute auto: recompute the stages that save most, one more at a time, until it fits."""
        order = recompute_order(self.counts_for(as_shape(volume)))
        candidate = None
        for count in range(len(order) + 1):
            candidate = self.evaluate(volume, batch, precision, Recompute.AUTO, order[:count])
            if candidate.fits:
                return candidate
        return candidate


def allowed_modes(allow_bf16: bool | None = None) -> tuple[tuple[Precision, Recompute], ...]:
    """MODES, without bf16 where ``allow_bf16`` is False (None: where this CPU has no native bf16)."""
    if allow_bf16 is None:
        from bigmem.sysinfo import native_bf16

        allow_bf16 = native_bf16()
    return MODES if allow_bf16 else FP32_MODES


def make_plan(config: ExperimentConfig, counts_for, budget: Budget, *, volume: int | Sequence[int] | None = None,
              batch_size: int | None = None, allow_bf16: bool | None = None) -> Plan:
    """The largest volume (unless fixed) and then batch (unless fixed) that fit, over the allowed modes.

    The modes are precision x recompute (fp32/bf16, none/stages); the chosen candidate is the
    largest volume, then batch, ties going to the earlier (cheaper in compute) mode.

    Args:
        config: the model and optimizer to plan for.
        counts_for: ``(D, H, W) -> NetworkCounts`` of the model.
        budget: the most the predicted peak may be, and what set it (``memory.budget.resolve_budget``).
        volume: fix the cube edge, or the ``(D, H, W)`` shape, instead of searching a cube.
        batch_size: fix the batch instead of searching it.
        allow_bf16: consider bf16 modes; default: only where the CPU has native bf16.

    Returns:
        A ``Plan`` (plan.json's schema): the best candidate of each mode and the chosen one
        (None where nothing fits).

    Example:
        >>> plan = make_plan(config, counts_function(config), Budget(512 * 2**30, "--memory-budget"))
        >>> plan.chosen.volume, plan.chosen.batch_size
    """
    planner = Planner(config, counts_for, budget.budget_bytes)
    best_per_mode: list[Candidate] = []
    for precision, recompute in allowed_modes(allow_bf16):
        if volume is None:
            best = planner.largest_volume(precision, recompute)
            if best is not None and batch_size is None:
                best = planner.largest_batch(best.volume, precision, recompute) or best
            elif best is not None:
                best = planner.evaluate(best.volume, batch_size, precision, recompute)
                if not best.fits:
                    best = planner._largest(
                        lambda k, p=precision, r=recompute: planner.evaluate(k * planner.divisor, batch_size, p, r),
                        MAX_VOLUME // planner.divisor)
        elif batch_size is None:
            best = planner.largest_batch(volume, precision, recompute)
        else:
            best = planner.evaluate(volume, batch_size, precision, recompute)
            best = best if best.fits else None
        if best is not None:
            best_per_mode.append(best)
    chosen = None
    for candidate in best_per_mode:  # largest volume, then batch; on a tie the faster step, then the earlier mode
        if chosen is None or _better(candidate, chosen):
            chosen = candidate
    closest = chosen or min(planner.candidates, key=lambda c: c.predicted_peak_bytes)
    note = planner.precision_note(chosen) if chosen is not None else None
    return Plan(chosen is not None, budget, chosen, closest, tuple(planner.candidates), tuple(best_per_mode),
                calibration=candidate_calibration(config, closest), precision_note=note)


def _better(candidate: Candidate, chosen: Candidate) -> bool:
    """Whether ``candidate`` beats ``chosen``: a larger volume, then batch; at the same, a faster predicted step.

    So bf16 is chosen for speed only where this CPU runs it faster (its rate, tuned or shipped),
    and for memory only where it reaches a volume or batch fp32 does not.
    """
    size, best = (candidate.volume, candidate.batch_size), (chosen.volume, chosen.batch_size)
    if size != best:
        return size > best
    if candidate.predicted_step_s and chosen.predicted_step_s:
        return candidate.predicted_step_s < chosen.predicted_step_s
    return False


def candidate_calibration(config: ExperimentConfig, candidate: Candidate) -> Calibration:
    """The calibration the estimate of ``candidate`` used (as ``estimate`` looks it up)."""
    key = recompute_key(candidate.recompute_stages)
    return calibration_for(config.model.name, candidate.precision, key)


def cheapest_fix(config: ExperimentConfig, counts_for, budget_bytes: int, volume: int | Sequence[int], batch: int,
                 allow_bf16: bool | None = None) -> str:
    """A sentence naming the cheapest change that makes ``volume`` (an edge or a shape) at ``batch`` fit, or what does,
    with its settings as config-field placeholders (``{train.batch_size}``; ``bigmem.errors.render_fields``).

    bf16 is suggested only where the CPU has it natively, or when the configuration asks for it.
    The last resort, a smaller cube, crops whole scans: it is named as such.
    """
    planner = Planner(config, counts_for, budget_bytes)
    modes = allowed_modes(True if config.train.precision is Precision.BF16 else allow_bf16)
    for precision, recompute in modes:
        candidate = planner.evaluate(volume, batch, precision, recompute)
        if candidate.fits:
            return f"use {candidate.flags()} (est. {format_bytes(candidate.predicted_peak_bytes)})"
    precision, recompute = modes[-1]
    if batch > 1:
        smaller = planner._largest(lambda b: planner.evaluate(volume, b, precision, recompute), batch - 1)
        if smaller is not None:
            return (f"use {{train.batch_size}} {smaller.batch_size} {smaller.flags()} "
                    f"(est. {format_bytes(smaller.predicted_peak_bytes)})")
    largest = planner.largest_volume(precision, recompute)
    if largest is not None:
        return (f"the largest volume that fits is {{data.volume}} {largest.volume} {{train.batch_size}} 1 "
                f"{largest.flags()} "
                f"(est. {format_bytes(largest.predicted_peak_bytes)}; it crops larger scans)")
    return "nothing fits, not even the smallest volume; raise {memory.budget_bytes} or free memory"


def check_fits(estimated: Estimate, config: ExperimentConfig, counts_for, budget_bytes: int, budget_source: str,
               volume: int | Sequence[int], what: str = "") -> None:
    """Raise InsufficientMemoryError (exit 3) unless the estimate fits the budget.

    Args:
        estimated: the job's estimate.
        config, counts_for: the job and its counts, for the cheapest fix.
        budget_bytes, budget_source: the budget and what set it.
        volume: the job's cube edge or ``(D, H, W)``.
        what: names the shape's origin in the message, e.g. " (case 'kits_0005', 256x256x256 padded)".
    """
    required = estimated.predicted_peak_bytes
    if required <= budget_bytes:
        return
    fix = cheapest_fix(config, counts_for, budget_bytes, volume, config.train.batch_size)
    mode = config.train.precision.value + (f", recompute {config.memory.recompute.value}"
                                           if config.memory.recompute is not Recompute.NONE else "")
    text = format_shape(as_shape(volume))
    raise InsufficientMemoryError(
        f"Predicted peak {format_bytes(required)} for {config.model.name} at {text}{what} x batch "
        f"{config.train.batch_size} ({mode}) exceeds the memory budget {format_bytes(budget_bytes)} "
        f"({budget_source}): {fix}; or pass {{train.force}} to try anyway.", required, budget_bytes)


__all__ = ["Candidate", "Plan", "Planner", "available_memory_bytes", "candidate_calibration",
           "check_fits", "cheapest_fix", "machine_memory_bytes", "make_plan"]
