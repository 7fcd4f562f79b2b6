"""``bigmem compare``'s report, typed: each run, each path over its seeds, and the conclusion.

``CompareReport.to_dict`` is compare.json and ``CompareReport.from_dict`` reads it back. The keys
are those of the report before it had types, so compare.json files written before read as they are;
reports from before patches took the dataset's aspect (``patch_size`` an edge) or before native
shapes (no ``shape``, ``native_shapes``) read as cubes of whole volumes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from bigmem.units import as_shape, format_count

PATHS = ("cpu_bigmem", "data_parallel")
LABELS = {"cpu_bigmem": "whole volumes in RAM (bigmem)", "data_parallel": "GPU data parallel on patches"}


@dataclasses.dataclass(frozen=True)
class ClassScore:
    """One class's held-out scores.

    Attributes:
        dice: Dice (None: no case defined it).
        hd95_mm: the 95th-percentile Hausdorff distance in mm (None: no case defined it).
    """

    dice: float | None
    hd95_mm: float | None

    def to_dict(self) -> dict[str, Any]:
        """``{"dice", "hd95_mm"}``."""
        return {"dice": self.dice, "hd95_mm": self.hd95_mm}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ClassScore:
        """The score ``to_dict`` wrote."""
        return cls(values["dice"], values["hd95_mm"])


def _scores(values: Mapping[str, Any]) -> dict[str, ClassScore]:
    return {name: ClassScore.from_dict(score) for name, score in values.items()}


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """A trained model's scores on the held-out cases, by ``bigmem predict``'s and ``bigmem evaluate``'s code.

    Attributes:
        mode: how it predicted: "whole", or "sliding 8^3, overlap 0.5".
        dice: the foreground mean Dice over cases and classes.
        hd95_mm: the foreground mean HD95 in mm (None: undefined for every case).
        per_class: ``ClassScore`` per class (its id as a string, as evaluate's summary.json has it).
        inference_s_per_case: mean seconds of prediction per case.
        inference_peak_bytes: the largest peak host memory of a case's prediction.
        predictions: the folder holding the predictions and their summary.json.
    """

    mode: str
    dice: float
    hd95_mm: float | None
    per_class: Mapping[str, ClassScore]
    inference_s_per_case: float
    inference_peak_bytes: int
    predictions: str

    def to_dict(self) -> dict[str, Any]:
        """compare.json's ``held_out`` of a run."""
        return {"mode": self.mode, "dice": self.dice, "hd95_mm": self.hd95_mm,
                "per_class": {name: score.to_dict() for name, score in self.per_class.items()},
                "inference_s_per_case": self.inference_s_per_case,
                "inference_peak_bytes": self.inference_peak_bytes, "predictions": self.predictions}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> HeldOut:
        """The scores ``to_dict`` wrote."""
        return cls(values["mode"], values["dice"], values["hd95_mm"], _scores(values["per_class"]),
                   values["inference_s_per_case"], values["inference_peak_bytes"], values["predictions"])


@dataclasses.dataclass(frozen=True)
class CurvePoint:
    """One step of a run's time-to-Dice curve.

    Attributes:
        step: the step.
        time_s: training seconds up to the end of it (validation not counted).
        train_dice: its batch's foreground Dice.
        val_dice: the held-out Dice validated after it (None: not a validation step).
    """

    step: int
    time_s: float
    train_dice: float
    val_dice: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{"step", "time_s", "train_dice"}``, and ``"val_dice"`` on a validation step."""
        point = {"step": self.step, "time_s": self.time_s, "train_dice": self.train_dice}
        return point if self.val_dice is None else {**point, "val_dice": self.val_dice}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CurvePoint:
        """The point ``to_dict`` wrote."""
        return cls(values["step"], values["time_s"], values["train_dice"], values.get("val_dice"))


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """One ``train`` run's figures, read from its run directory (what compare's child process returns).

    Attributes:
        run_dir: the run directory.
        steps: steps trained.
        train_s: training seconds (the sum of the steps' times; validation not counted).
        step_s: median seconds per step, the first (tracing) left out where there are others.
        voxels_per_s: median voxels per second, as ``step_s``.
        peak_host_bytes: the run's peak resident memory (summary.json's ``peak_rss_bytes``).
        final_train_dice: the last step's foreground Dice.
        curve: a ``CurvePoint`` per step.
    """

    run_dir: str
    steps: int
    train_s: float
    step_s: float
    voxels_per_s: float
    peak_host_bytes: int
    final_train_dice: float
    curve: tuple[CurvePoint, ...]

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON-able data (the child's result, and part of a run in compare.json)."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {**values, "curve": [point.to_dict() for point in self.curve]}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainingRun:
        """The figures ``to_dict`` wrote (other keys, such as a run's held-out scores, are left out)."""
        names = [field.name for field in dataclasses.fields(cls) if field.name != "curve"]
        return cls(**{name: values[name] for name in names},
                   curve=tuple(CurvePoint.from_dict(point) for point in values["curve"]))


@dataclasses.dataclass(frozen=True)
class SeedRun:
    """One path's run at one seed: its training, the FLOPs and samples it trained on, its held-out scores.

    Attributes:
        seed: the run's seed.
        training: the run's figures (``TrainingRun``).
        train_flops: training FLOPs (steps times the path's FLOPs per step).
        samples_per_s: samples (whole volumes or patches, over all replicas) per second of a median step.
        held_out: the final model's scores (``HeldOut``).
    """

    seed: int
    training: TrainingRun
    train_flops: float
    samples_per_s: float
    held_out: HeldOut

    def to_dict(self) -> dict[str, Any]:
        """A run in compare.json: its seed, the training figures, FLOPs, throughput and ``held_out``, flat."""
        return {"seed": self.seed, **self.training.to_dict(), "train_flops": self.train_flops,
                "samples_per_s": self.samples_per_s, "held_out": self.held_out.to_dict()}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SeedRun:
        """The run ``to_dict`` wrote."""
        return cls(values["seed"], TrainingRun.from_dict(values), values["train_flops"], values["samples_per_s"],
                   HeldOut.from_dict(values["held_out"]))


@dataclasses.dataclass(frozen=True)
class PathResult:
    """One path over its seeds: the runs, their held-out Dice's mean and spread, mean throughput and peaks.

    Attributes:
        runs: a ``SeedRun`` per seed.
        dice: mean held-out Dice.
        dice_std: its sample standard deviation (None with one seed).
        dice_range: max - min of the held-out Dice over seeds.
        per_class: mean ``ClassScore`` per class (None where no seed defined it).
        hd95_mm: mean foreground HD95 in mm (None where no seed defined it).
        steps, train_s, step_s, voxels_per_s, samples_per_s, train_flops, peak_host_bytes: means over seeds.
        inference_mode: how the path predicts (its first run's ``HeldOut.mode``).
        inference_s_per_case: mean seconds of prediction per case.
        max_whole_volume: the planner's largest whole-volume edge at batch 1 for this path (None: none fits).
        max_whole_volume_mode: its precision and recomputed stages (cpu_bigmem only; None for a GPU).
    """

    runs: tuple[SeedRun, ...]
    dice: float
    dice_std: float | None
    dice_range: float
    per_class: Mapping[str, ClassScore]
    hd95_mm: float | None
    steps: float
    train_s: float
    step_s: float
    voxels_per_s: float
    samples_per_s: float
    train_flops: float
    peak_host_bytes: float
    inference_mode: str
    inference_s_per_case: float
    max_whole_volume: int | None = None
    max_whole_volume_mode: str | None = None

    @classmethod
    def over_seeds(cls, runs: Sequence[SeedRun], *, max_whole_volume: int | None,
                   max_whole_volume_mode: str | None = None) -> PathResult:
        """The path of ``runs``: their means, and the held-out Dice's standard deviation and range.

        Args:
            runs: one ``SeedRun`` per seed, at least one.
            max_whole_volume, max_whole_volume_mode: the planner's figures for the path.

        Returns:
            The ``PathResult``; means leave out classes' scores that are None or NaN.
        """
        import numpy as np  # not at import: the CLI imports this module before a NUMA placement applies

        dice = [run.held_out.dice for run in runs]

        def mean(values) -> float:
            return float(np.mean(list(values)))

        def mean_of(values) -> float | None:  # a score some cases leave undefined (None, or NaN)
            values = [v for v in values if v is not None and v == v]
            return mean(values) if values else None

        trained = [run.training for run in runs]
        per_class = {name: ClassScore(mean_of(run.held_out.per_class[name].dice for run in runs),
                                      mean_of(run.held_out.per_class[name].hd95_mm for run in runs))
                     for name in runs[0].held_out.per_class}
        return cls(tuple(runs), mean(dice), float(np.std(dice, ddof=1)) if len(dice) > 1 else None,
                   float(max(dice) - min(dice)), per_class, mean_of(run.held_out.hd95_mm for run in runs),
                   steps=mean(t.steps for t in trained), train_s=mean(t.train_s for t in trained),
                   step_s=mean(t.step_s for t in trained), voxels_per_s=mean(t.voxels_per_s for t in trained),
                   samples_per_s=mean(run.samples_per_s for run in runs),
                   train_flops=mean(run.train_flops for run in runs),
                   peak_host_bytes=mean(t.peak_host_bytes for t in trained),
                   inference_mode=runs[0].held_out.mode,
                   inference_s_per_case=mean(run.held_out.inference_s_per_case for run in runs),
                   max_whole_volume=max_whole_volume, max_whole_volume_mode=max_whole_volume_mode)

    def to_dict(self) -> dict[str, Any]:
        """A path in compare.json (``max_whole_volume_mode`` only where there is one)."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        values.update(runs=[run.to_dict() for run in self.runs],
                      per_class={name: score.to_dict() for name, score in self.per_class.items()})
        if self.max_whole_volume_mode is None:
            del values["max_whole_volume_mode"]
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> PathResult:
        """The path ``to_dict`` wrote."""
        names = [field.name for field in dataclasses.fields(cls) if field.name not in ("runs", "per_class")]
        return cls(runs=tuple(SeedRun.from_dict(run) for run in values["runs"]),
                   per_class=_scores(values["per_class"]), **{name: values.get(name) for name in names})


@dataclasses.dataclass(frozen=True)
class Conclusion:
    """Which path reached the higher held-out Dice, by how much, and whether that exceeds the seed spread.

    Attributes:
        higher: the path ("cpu_bigmem" or "data_parallel"); "cpu_bigmem" on a tie.
        difference: the absolute difference of the paths' mean held-out Dice.
        spread: the larger of the paths' ranges (max - min) of held-out Dice over seeds; None with one seed.
        exceeds_spread: ``difference > spread``; None with one seed.
        text: the sentence that says it.
    """

    higher: str
    difference: float
    spread: float | None
    exceeds_spread: bool | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        """compare.json's ``conclusion``."""
        return dataclasses.asdict(self)


def conclude(paths: Mapping[str, PathResult], seeds: int, budget: str) -> Conclusion:
    """The conclusion from the paths' numbers: higher held-out Dice, difference, and the seed spread.

    Args:
        paths: ``PathResult`` of "cpu_bigmem" and "data_parallel".
        seeds: the runs per path; with one the spread is unknown and the text says so.
        budget: the budget sentence (``CompareReport.budget``), quoted in the text.

    Returns:
        The ``Conclusion``.

    Example:
        >>> conclude(paths, 1, "equal training time (120 s of training each)").text
        'Whole volumes in RAM (bigmem) reached the higher held-out Dice within equal training time ...'
    """
    cpu, dp = paths["cpu_bigmem"].dice, paths["data_parallel"].dice
    higher = "cpu_bigmem" if cpu >= dp else "data_parallel"
    difference = abs(cpu - dp)
    spread = max(paths[name].dice_range for name in PATHS) if seeds > 1 else None
    exceeds = None if spread is None else difference > spread
    first, second = (cpu, dp) if higher == "cpu_bigmem" else (dp, cpu)
    label = LABELS[higher]
    text = (f"{label[0].upper() + label[1:]} reached the higher held-out Dice within {budget}: "
            f"{first:.3f} against {second:.3f} ({difference:+.3f}")
    if spread is None:
        text += "); one seed, so the seed-to-seed spread is unknown (--seeds 3 measures it)."
    else:
        text += (f"), {'more' if exceeds else 'no more'} than the spread over {format_count(seeds, 'seed')} "
                 f"({spread:.3f})"
                 + ("." if exceeds else ": the difference is not established."))
    return Conclusion(higher, difference, spread, exceeds, text)


@dataclasses.dataclass(frozen=True)
class CompareReport:
    """What ``bigmem compare`` compared and found: compare.json, compare.md and compare.png are written from it.

    Attributes:
        simulated: the data-parallel replicas were logical CPU devices.
        replicas: data-parallel replicas.
        gpu_memory_bytes: one GPU's memory, which sized the patch.
        gpu_memory_stand_in: the sentence stating the scaled stand-in; None when given.
        model: the preset's name.
        volume: the largest edge of ``shape``.
        shape: the whole-volume path's largest step shape ``(D, H, W)``.
        native_shapes: the whole-volume path trained each case at its own shape.
        patch_size: the data-parallel patch ``(D, H, W)``.
        batch: ``{"cpu_bigmem": batch, "data_parallel": global batch}``.
        held_out_cases: the case ids both paths were scored on.
        budget: the sentence stating the equal budget.
        seeds: runs per path.
        paths: ``PathResult`` per path (``PATHS``).
        gpu_reference: what a real GPU measured (``GpuReference.to_dict``, ``--gpu-reference``); None
            when nothing was measured on a GPU.

    Example:
        >>> report = CompareReport.from_dict(json.loads(Path("cmp/compare.json").read_text()))
        >>> report.conclusion.higher
        'cpu_bigmem'
    """

    simulated: bool
    replicas: int
    gpu_memory_bytes: int
    gpu_memory_stand_in: str | None
    model: str
    volume: int
    shape: tuple[int, int, int]
    native_shapes: bool
    patch_size: tuple[int, int, int]
    batch: Mapping[str, int]
    held_out_cases: tuple[str, ...]
    budget: str
    seeds: int
    paths: Mapping[str, PathResult]
    gpu_reference: Mapping[str, Any] | None = None

    @property
    def conclusion(self) -> Conclusion:
        """``conclude`` over ``paths``: computed from the numbers, never stored apart from them."""
        return conclude(self.paths, self.seeds, self.budget)

    def to_dict(self) -> dict[str, Any]:
        """compare.json: the fields (``gpu_reference`` only when there is one), ``paths`` per path, ``conclusion``."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        values.update(shape=list(self.shape), patch_size=list(self.patch_size), batch=dict(self.batch),
                      held_out_cases=list(self.held_out_cases),
                      paths={name: path.to_dict() for name, path in self.paths.items()},
                      conclusion=self.conclusion.to_dict())
        if self.gpu_reference is None:  # a report without one reads as those written before the field
            del values["gpu_reference"]
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CompareReport:
        """The report of compare.json, also as written before it recorded shapes (cubes of ``volume``)."""
        shape = values.get("shape") or [values["volume"]] * 3
        return cls(values["simulated"], values["replicas"], values["gpu_memory_bytes"],
                   values["gpu_memory_stand_in"], values["model"], values["volume"], as_shape(shape),
                   bool(values.get("native_shapes", False)), as_shape(values["patch_size"]), dict(values["batch"]),
                   tuple(values["held_out_cases"]), values["budget"], values["seeds"],
                   {name: PathResult.from_dict(path) for name, path in values["paths"].items()},
                   values.get("gpu_reference"))
