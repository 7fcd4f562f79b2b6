"""``bigmem profile``'s API: predicted breakdown, measured peak, size sweeps and calibration."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from bigmem.config.schema import ExperimentConfig
from bigmem.data.pipeline import padded_shape  # the one rounding rule: training pads as predict does
from bigmem.errors import UsageError
from bigmem.memory import MEASURED_STEPS
from bigmem.memory.calibration import (
    Calibration,
    fit_calibration,
    fit_line,
    machine_isa_class,
    recompute_key,
    save_calibration,
    shipped_shape,
)
from bigmem.memory.estimate import Estimate, NetworkCounts, Pass, estimate, mode_stages
from bigmem.memory.measure import Measurement, measure
from bigmem.memory.records import Budget
from bigmem.memory.plans import recompute_stages as choose_stages
from bigmem.speed import measured_rate, recomputed_share
from bigmem.units import as_shape

TEBIBYTE = 2**40
# No multiplier and no overhead: the estimate's own parts, as a calibration fit takes them.
UNIT_CALIBRATION = Calibration(1.0, 0, "unit")


def counts_function(config: ExperimentConfig) -> Callable[[tuple[int, int, int]], NetworkCounts]:
    """Build the network once (weights only; no activation is allocated) and count any shape."""
    from bigmem.tfenv import import_tensorflow

    import_tensorflow()
    from bigmem.nets.unet3d import UNet3D

    model = UNet3D(config.model).build_for()
    return lambda shape: NetworkCounts.from_model(model, shape)


def stages_for(config: ExperimentConfig, counts: NetworkCounts) -> list[str]:
    """The stages a fixed --recompute mode recomputes (kept for the benchmarks' imports).

    bigmem's own code asks ``memory.plans.recompute_stages``, which also chooses ``auto``'s.
    """
    return mode_stages(config.memory.recompute, counts)


@dataclass(frozen=True)
class Profile:
    """``bigmem profile``'s result for one shape: the estimate, the measured peak when asked for, and the
    budget the recomputed stages were chosen for or the measurement was checked against (None when neither
    needed one)."""

    estimate: Estimate
    measurement: Measurement | None
    budget: Budget | None = None

    @property
    def error_pct(self) -> float | None:
        """(predicted - measured) / measured in percent; None without a measurement."""
        if self.measurement is None:
            return None
        measured = self.measurement.peak_bytes
        return 100.0 * (self.estimate.predicted_peak_bytes - measured) / measured

    def to_dict(self) -> dict:
        """``bigmem profile --json``'s fields: the estimate's, the measured peak and error, and with a
        measurement its node bytes and step seconds (training) or seconds (a forward pass)."""
        data = self.estimate.to_dict()
        data["measured_peak_bytes"] = self.measurement.peak_bytes if self.measurement else None
        data["error_pct"] = None if self.error_pct is None else round(self.error_pct, 2)
        if self.measurement and self.estimate.pass_ is Pass.FORWARD:
            data["measured_seconds"] = self.measurement.seconds
        elif self.measurement:
            data["measured_node_bytes"] = self.measurement.node_bytes
            data["measured_step_s"] = self.measurement.seconds
        return data


def profile(config: ExperimentConfig, shape: Sequence[int], counts_for, *, pass_: Pass = Pass.TRAIN,
            do_measure: bool = False, steps: int = MEASURED_STEPS,
            recompute_stages: list[str] | None = None) -> Profile:
    """Predict (and optionally measure) one pass of ``config`` at ``shape``.

    Args:
        config: the job (model, batch, precision, recompute, placement for the measurement).
        shape: ``(D, H, W)``. A training step runs it as given (a multiple of ``2**depth``); a
            forward pass pads the case to one as predict does.
        counts_for: ``counts_function(config)``.
        pass_: ``Pass.TRAIN`` (default) or ``Pass.FORWARD`` (``bigmem predict``'s whole volume).
        do_measure: also run it in a child process (``measure.measure``) and read its peak.
        steps: training steps to measure.
        recompute_stages: training: the stages to recompute (default: ``memory.plans.recompute_stages``).

    Returns:
        The ``Profile``.

    Raises:
        BigmemError: the measuring child failed.

    Example:
        >>> profile(config, (240, 240, 155), counts_function(config), pass_=Pass.FORWARD).estimate.spatial_shape
        (240, 240, 160)
    """
    if pass_ is Pass.FORWARD:
        padded = padded_shape(shape, config.model.divisors)
        predicted = estimate(config, counts_for(padded), padded, pass_=pass_, source_shape=tuple(shape))
        return Profile(predicted, measure(config, shape, pass_=pass_) if do_measure else None)
    counts = counts_for(tuple(shape))
    stages = recompute_stages if recompute_stages is not None else choose_stages(config, counts_for, shape)
    predicted = estimate(config, counts, shape, recompute_stages=stages)
    measured = measure(config, steps=steps, recompute_stages=stages) if do_measure else None
    return Profile(predicted, measured)


def refuse_unfit_measurement(config: ExperimentConfig, counts_for, shape: Sequence[int], stages: list[str] | None,
                             budget: Budget, what: str, advice: str) -> None:
    """Refuse (exit 3) measuring a training step at ``shape`` whose predicted peak exceeds ``budget``, or an
    explicit budget above this machine's memory: the measured run trains real steps in a child process.

    Args:
        config: the job.
        counts_for: ``counts_function(config)``.
        shape: the largest shape to be measured.
        stages: the stages it recomputes (default: ``memory.plans.recompute_stages``'s).
        budget: ``memory.budget.resolve_budget(...)``.
        what: the setting that asks for the measurement, as a ``{section.name}`` placeholder.
        advice: what to give instead, the end of the message's last sentence.

    Raises:
        InsufficientMemoryError: the predicted peak exceeds the budget, or the budget the machine.
    """
    from bigmem.errors import InsufficientMemoryError
    from bigmem.memory.budget import check_budget_within_machine
    from bigmem.units import format_bytes, format_shape

    check_budget_within_machine(budget)
    shape = tuple(shape)
    predicted = profile(_with_shape(config, shape), shape, counts_for, recompute_stages=stages).estimate
    peak = predicted.predicted_peak_bytes
    if peak > budget.budget_bytes:
        raise InsufficientMemoryError(
            f"{what} would train {config.model.name} at {format_shape(shape)} x batch {predicted.batch_size} "
            f"({predicted.precision}): predicted peak {format_bytes(peak)} exceeds the memory budget "
            f"{format_bytes(budget.budget_bytes)} ({budget.source}). Drop {what} for the estimate alone, or "
            f"{advice}.", peak, budget.budget_bytes)


def _with_shape(config: ExperimentConfig, shape: Sequence[int]) -> ExperimentConfig:
    return config.updated({"data": {"shape": [int(s) for s in shape]}})


def _cube_edge(shape: Sequence[int]) -> int:
    """The edge of the cube with ``shape``'s voxels (rounded): how the calibration's knots are keyed."""
    return int(round(math.prod(shape) ** (1 / 3)))


@dataclass
class ScalingLaw:
    """peak_bytes = fixed_bytes + bytes_per_voxel * voxels (fitted on measured points)."""

    fixed_bytes: float
    bytes_per_voxel: float

    def peak_at(self, volume: int) -> float:
        return self.fixed_bytes + self.bytes_per_voxel * volume**3

    def volume_reaching(self, peak_bytes: float) -> float:
        return ((peak_bytes - self.fixed_bytes) / self.bytes_per_voxel) ** (1 / 3)

    def to_dict(self) -> dict:
        return {"fixed_bytes": int(self.fixed_bytes), "bytes_per_voxel": self.bytes_per_voxel,
                "peak_bytes_at_512": int(self.peak_at(512)),
                "volume_reaching_1TiB": round(self.volume_reaching(TEBIBYTE), 1)}


def sweep(config: ExperimentConfig, shapes: Sequence[Sequence[int]], counts_for, *, steps: int = MEASURED_STEPS,
          progress: Callable[[tuple], None] | None = None) -> tuple[list[Profile], ScalingLaw]:
    """Measure and predict each ``(D, H, W)`` (an int N is N^3); fit the measured peaks against voxels."""
    results = []
    for shape in shapes:
        shape = as_shape(shape)
        if progress:
            progress(shape)
        results.append(profile(_with_shape(config, shape), shape, counts_for, do_measure=True, steps=steps))
    voxels = [math.prod(r.estimate.spatial_shape) for r in results]
    slope, intercept = fit_line(voxels, [r.measurement.peak_bytes for r in results])
    return results, ScalingLaw(intercept, slope)


def calibration_point(config: ExperimentConfig, counts_for, measured_peak_bytes: int,
                      measurement: Measurement | None = None) -> dict:
    """One measured point as ``fit_calibration`` takes it: the estimate's parts at unit calibration.

    Args:
        config: the measured configuration (its ``data.shape`` is the measured shape).
        counts_for: ``counts_function(config)``.
        measured_peak_bytes: the measured VmHWM of that configuration.
        measurement: the run that measured it, if its step time should calibrate the step rate
            (default None: memory only).

    Returns:
        ``{volume, shape, counted_activation_bytes, exact_bytes, measured_peak_bytes}`` (``volume``
        the edge of the cube of as many voxels, how knots are keyed); the counted bytes
        are the activations' and the workspace's (what the calibration scales), the exact ones
        the rest of the estimate. With ``measurement``, also ``step_s`` and
        ``step_gflops_per_core`` (``speed.measured_rate`` on the cores the run had).
    """
    shape = tuple(config.data.shape or (config.data.reference_volume,) * 3)
    counts = counts_for(shape)
    stages = choose_stages(config, counts_for, shape)
    raw = estimate(config, counts, shape, recompute_stages=stages, calibration=UNIT_CALIBRATION)
    counted = raw.components["activations"] + raw.components["workspace"]  # what the calibration scales
    point = {"volume": _cube_edge(shape), "counted_activation_bytes": counted,
             "exact_bytes": raw.first_steps_bytes - counted,
             "measured_peak_bytes": int(measured_peak_bytes)}
    if len(set(shape)) != 1:
        point["shape"] = list(shape)
    if measurement is not None and measurement.seconds > 0:
        rate = measured_rate(raw.train_flops_per_step, recomputed_share(counts.block_elements, stages),
                             measurement.seconds, measurement.cores)
        point.update(step_s=round(measurement.seconds, 4), step_gflops_per_core=round(rate, 2))
    return point


def calibrate(config: ExperimentConfig, shapes: Sequence[Sequence[int]], counts_for, *, steps: int = MEASURED_STEPS,
              progress: Callable[[tuple], None] | None = None, save: bool = True) -> tuple[Calibration, list]:
    """Measure ``shapes`` (an int N is N^3) and fit this machine's calibration for the config's preset, precision
    and recompute."""
    shapes = [as_shape(shape) for shape in shapes]
    stages = [choose_stages(_with_shape(config, shape), counts_for, shape) for shape in shapes]
    # The fit is stored under the key an estimate of these steps looks it up by (recompute_key): one
    # key, so every size must recompute stages, or none (auto may choose either), before any is measured.
    keys = {recompute_key(chosen) for chosen in stages}
    if len(keys) > 1:
        raise UsageError(f"{{memory.recompute}} {config.memory.recompute.value} recomputes stages at some "
                         "{calibrate.shapes} sizes and none at others, which are two calibrations: give "
                         "{memory.recompute} none or {memory.recompute} stages.")
    points = []
    for shape, chosen in zip(shapes, stages):
        if progress:
            progress(shape)
        sized = _with_shape(config, shape)
        measured = measure(sized, steps=steps, recompute_stages=chosen)
        points.append(calibration_point(sized, counts_for, measured.peak_bytes, measured))
    recompute = keys.pop()
    precision = config.train.precision.value
    shape = shipped_shape(config.model.name, precision, recompute, machine_isa_class(), config.train.batch_size)
    calibration = fit_calibration(config.model.name, precision, recompute, points, shape,
                                  batch_size=config.train.batch_size)
    if save:
        save_calibration(calibration)
    return calibration, points
