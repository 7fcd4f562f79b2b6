"""``bigmem compare``'s API: whole volumes in host RAM against the usual GPU recipe, on the same task.

The question a user brings: what does training on whole volumes in RAM buy over data parallel
on patches that fit one GPU, and at what cost? Both paths train the same model on the same
data, each run through ``bigmem.train``'s Python API in a process of its own (``compare/runner.py``:
its own peak memory; simulated devices stay in that process):

- ``cpu_bigmem``: whole volumes; evaluated with one whole-volume pass per case;
- ``data_parallel``: ``tf.distribute.MirroredStrategy`` on the largest patch that fits one GPU,
  proportioned after the dataset's median shape as nnU-Net's (``distribute.planning.largest_patch``)
  (the planner's choice for ``gpu_memory_bytes``); evaluated as nnU-Net and MLPerf evaluate a
  patch-trained network: Gaussian sliding windows of its patch, at nnU-Net's overlap
  (``bigmem.infer.DEFAULT_OVERLAP``).

Both paths' memory plans are made before either trains (``plan_both_paths``), so a path that does
not fit is refused in seconds. The two paths train for equal time (validation is not counted) or
equal FLOPs (``Settings.equal``). Both are scored on the same held-out cases by
``bigmem predict``'s and ``bigmem evaluate``'s code, over one or more seeds, and the conclusion
(which path reached the higher held-out Dice, by how much, and whether that exceeds the
seed-to-seed spread) is computed from those numbers.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bigmem.atomic import atomic_write_json, atomic_write_text
from bigmem.child import run_child
from bigmem.compare.report import PATHS, ClassScore, CompareReport, HeldOut, PathResult, SeedRun, TrainingRun
from bigmem.config.schema import ExperimentConfig
from bigmem.errors import UsageError
from bigmem.infer import DEFAULT_OVERLAP
from bigmem.units import as_shape, format_bytes, format_count, format_shape

if TYPE_CHECKING:
    from bigmem.compare.gpu_reference import GpuReference
    from bigmem.distribute.execution import DataParallel

# The proportion the default GPU memory keeps: the headline case, a 512^3 kits19 volume against
# one 80 GiB GPU. The planner's patch there (about half the edge at batch 2) sets the fraction.
REAL_CASE = {"model": "kits19", "volume": 512, "gpu_memory_bytes": 80 * 2**30}
DEFAULT_PHANTOM_VOLUME = 64  # the default dataset: synthetic phantoms of this edge (a 32^3 patch)
DEFAULT_TIME_BUDGET_S = 120.0
DEFAULT_VAL_EVERY = 10


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """One GPU's memory for the data-parallel path, and, for the scaled stand-in, how it was derived.

    Attributes:
        bytes: the memory the patch is sized for.
        stand_in: None when given (``--gpu-memory``); else the sentence that states the scaling.
    """

    bytes: int
    stand_in: str | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """How ``compare`` runs: replicas, GPU memory, what the two paths get equal, seeds, validation cadence.

    Attributes:
        replicas: data-parallel replicas (GPUs, or logical CPU devices when ``simulate``).
        simulate: the replicas are logical CPU devices standing in for GPUs.
        gpu_memory: one GPU's memory (``GpuMemory``).
        equal: what the two paths get the same of: "time" (equal training time, default) or "flops"
            (equal training FLOPs).
        time_budget_s: the cpu_bigmem path's training seconds (default 120 without ``steps``).
        steps: the cpu_bigmem path's steps instead of a time budget.
        seeds: runs per path (seeds 0..N-1); the conclusion compares the difference with their spread.
        holdout: the held-out cases (the store's last ``holdout``).
        val_every: the cpu_bigmem path validates every this many steps; the data-parallel path
            at the same training FLOPs (its steps scaled by the FLOPs per step).
        memory_budget_bytes: the host's budget (default: ``memory.budget.resolve_budget``'s).
        monitor_interval_s: each run's monitor.csv interval (None: train's default).
        patch: the data-parallel patch edge, fixed (a measured GPU's largest, ``--gpu-reference``);
            None: the planner's largest for ``gpu_memory``.
        gpu_reference: what a real GPU measured (``compare.gpu_reference``), reported beside the run.
    """

    replicas: int
    simulate: bool
    gpu_memory: GpuMemory
    equal: str = "time"
    time_budget_s: float | None = None
    steps: int | None = None
    seeds: int = 1
    holdout: int = 1
    val_every: int = DEFAULT_VAL_EVERY
    memory_budget_bytes: int | None = None
    monitor_interval_s: float | None = None
    patch: int | None = None
    gpu_reference: GpuReference | None = None

    def check(self) -> None:
        """Raise ``UsageError`` for a setting no run could use."""
        if self.replicas < 1:
            raise UsageError(f"Invalid replicas {self.replicas}: expected at least 1 data-parallel replica.")
        if self.equal not in ("time", "flops"):
            raise UsageError(f"Invalid equal {self.equal!r}: expected time or flops.")
        if self.time_budget_s is not None and not 0 < self.time_budget_s < math.inf:
            raise UsageError(f"Invalid time_budget_s {self.time_budget_s:g}: expected a positive, finite number.")
        if self.steps is not None and self.steps < 1:
            raise UsageError(f"Invalid steps {self.steps}: expected a positive number of steps.")
        for name in ("seeds", "holdout", "val_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"Invalid {name} {getattr(self, name)}: expected a positive integer.")

    @property
    def cpu_time_budget_s(self) -> float | None:
        """The cpu_bigmem path's time budget: given, or the default when no steps are."""
        if self.steps is not None:
            return self.time_budget_s
        return self.time_budget_s or DEFAULT_TIME_BUDGET_S


def whole_shape(config: ExperimentConfig) -> tuple[int, int, int]:
    """The whole-volume path's largest step shape: ``data.shape``, else the store's largest case padded.

    The whole-volume path trains as ``bigmem train`` does: each case at its own shape (padded to
    the size contract) unless ``data.shape`` fixes one.
    """
    if config.data.shape is not None:
        return tuple(config.data.shape)  # type: ignore[return-value]
    from bigmem.data.derived import trained_shapes
    from bigmem.memory.plans import planned_shape

    return planned_shape([trained for _, _, trained in trained_shapes(config)], config.train.batch_size)


def scaled_gpu_memory(config: ExperimentConfig, counts_for, measured: GpuReference | None = None) -> GpuMemory:
    """One GPU's memory in the proportion of the real case, for ``config``'s volumes.

    The patch for a 512^3 kits19 volume on one GPU (at ``config``'s batch) is a fraction of its edge:
    the planner's for an 80 GiB GPU, or with ``measured`` (kits19 on a real GPU) the largest patch
    that GPU trained at batch 2 (at another batch, the planner's for its measured memory). The
    stand-in is the memory in which the planner's patch for the largest edge of
    ``whole_shape(config)`` is the same fraction (rounded down to the size contract).

    Returns:
        ``GpuMemory`` with the sentence that states the scaling.
    """
    from bigmem.compare.gpu_reference import MEASURED_BATCH
    from bigmem.config.presets import resolve_config
    from bigmem.distribute.planning import gpu_footprint_bytes, largest_edge
    from bigmem.memory.profile import counts_function

    batch = config.train.batch_size
    real = resolve_config(REAL_CASE["model"], {"train": {"batch_size": batch}})
    if measured is not None and measured.largest_patch and batch == MEASURED_BATCH:
        real_patch = min(measured.largest_patch, REAL_CASE["volume"])
        source = (f"as the measured {measured.gpu} ({format_bytes(measured.memory_bytes)}) trains a {real_patch}^3 "
                  f"patch of a {REAL_CASE['volume']}^3 {REAL_CASE['model']} volume (batch {batch})")
    else:
        gpu_memory = measured.memory_bytes if measured is not None else REAL_CASE["gpu_memory_bytes"]
        real_patch = largest_edge(real, counts_function(real), gpu_memory, batch, REAL_CASE["volume"])
        where = f"the measured {measured.gpu}'s " if measured is not None else ""
        source = (f"as {where}{format_bytes(gpu_memory)} holds {real_patch}^3 of a {REAL_CASE['volume']}^3 "
                  f"{REAL_CASE['model']} volume (batch {batch})")
    fraction = (real_patch or real.model.divisor) / REAL_CASE["volume"]
    divisor, volume = config.model.divisor, max(whole_shape(config))
    edge = max(divisor, int(fraction * volume) // divisor * divisor)
    memory = gpu_footprint_bytes(config, counts_for, edge, batch)
    return GpuMemory(memory, f"a scaled stand-in: {format_bytes(memory)}, in which the planner's patch is {edge}^3 "
                             f"of volumes of edge {volume}, {source}")


def plan_both_paths(config: ExperimentConfig, counts_for, settings: Settings):
    """Both paths' memory plans, made before either trains: (cpu_bigmem's Plan, the data-parallel decisions).

    A path that does not fit is refused here, so a refusal comes in seconds, not after the other path trained.

    Raises:
        InsufficientMemoryError: (exit 3) the whole volumes do not fit the host's budget, or not
            even the smallest patch fits one GPU, or the data-parallel host's batch does not fit.
    """
    from bigmem.data.derived import median_shape
    from bigmem.distribute.execution import data_parallel
    from bigmem.distribute.strategy import Replicas
    from bigmem.memory.budget import resolve_budget
    from bigmem.memory.plans import plan_job

    budget = resolve_budget(settings.memory_budget_bytes)
    cpu_plan = plan_job(config, counts_for, budget, shape=whole_shape(config))
    parallel = data_parallel(_dp_config(config, settings), Replicas(None, settings.replicas, settings.simulate, ()),
                             counts_for, aspect=median_shape(config))
    if parallel.host_checked:
        plan_job(parallel.host_config(config), counts_for, budget)
    return cpu_plan, parallel


def _dp_config(config: ExperimentConfig, settings: Settings) -> ExperimentConfig:
    distribute = {"strategy": "mirrored", "gpu_memory_bytes": settings.gpu_memory.bytes}
    if settings.patch is not None:
        distribute["patch"] = settings.patch
    return config.updated({"distribute": distribute})


def train_flops(config: ExperimentConfig, edge, samples: int) -> int:
    """FLOPs of one training step on ``samples`` cubes of ``edge`` (or of a ``(D, H, W)``) (``UNet3D.train_flops``)."""
    from bigmem.nets.unet3d import UNet3D

    return UNet3D(config.model).train_flops(as_shape(edge), samples)


def mean_step_flops(config: ExperimentConfig) -> float:
    """FLOPs of the whole-volume path's mean step: each training case at the shape it trains at, times the batch.

    With native shapes the cases differ (a batch pads to its bounding shape, which this leaves out); with a
    fixed ``data.shape`` every step is that shape.
    """
    if config.data.shape is not None:
        return train_flops(config, tuple(config.data.shape), config.train.batch_size)
    from bigmem.data.derived import trained_shapes

    shapes = [trained for _, _, trained in trained_shapes(config)]
    return sum(train_flops(config, shape, 1) for shape in shapes) / len(shapes) * config.train.batch_size


def _run_config(config: ExperimentConfig, settings: Settings, seed: int, val_every: int, *,
                data_parallel: bool) -> ExperimentConfig:
    """The job a path's run trains: ``config`` at ``seed`` with compare's held-out cases, validation and budgets."""
    values: dict = {"data": {"holdout": settings.holdout}, "train": {"seed": seed, "val_every": val_every}}
    if settings.memory_budget_bytes is not None:
        values["memory"] = {"budget_bytes": settings.memory_budget_bytes}
    if settings.monitor_interval_s is not None:
        values["train"]["monitor_interval_s"] = settings.monitor_interval_s
    run = config.updated(values)
    if not data_parallel:
        return run
    replicas = {"simulate_replicas" if settings.simulate else "gpus": settings.replicas}
    return _dp_config(run, settings).updated({"distribute": replicas})


def _train(config: ExperimentConfig, run_dir: Path, steps: int | None, time_budget_s: float | None) -> TrainingRun:
    """Train ``config`` into ``run_dir`` in a process of its own (``compare/runner.py``); the run's figures."""
    # Imported here: ``python -m bigmem.compare.runner`` imports this package first, and runpy warns
    # when the module it is to run was imported before it.
    from bigmem.compare.runner import MODULE, RunRequest

    request = RunRequest(config, str(run_dir), steps, time_budget_s)  # never resumed: no periodic checkpoints
    return TrainingRun.from_dict(run_child(MODULE, request.to_dict(),
                                           what=f"Training {run_dir.parent.name}/{run_dir.name}"))


def score_run(run_dir: str, store: str, held_out: list[str], *, sliding_window: tuple | None,
              out: Path) -> HeldOut:
    """``bigmem predict`` (whole, or sliding windows of ``sliding_window``) then ``bigmem evaluate`` on ``held_out``.

    Args:
        run_dir: the trained run directory.
        store: the store the held-out cases are read from.
        held_out: their case ids.
        sliding_window: the patch ``(D, H, W)`` the run trained on; None: one whole-volume pass per case.
        out: the predictions' folder (evaluate's summary.json is written there too).

    Returns:
        The run's ``HeldOut`` scores, and its inference time and peak.
    """
    import numpy as np  # not at import: the CLI imports this module before a NUMA placement applies

    from bigmem.infer.evaluate import evaluate
    from bigmem.infer.predict import predict

    mode = "sliding" if sliding_window else "whole"
    # force: timed and scored, so every case is predicted now, none kept from before
    results = list(predict(run_dir, store, out, cases=held_out, mode=mode, window=sliding_window,
                           overlap=DEFAULT_OVERLAP, force=True))
    summary = evaluate(out, store, allow_missing=True, out=out / "summary.json")
    per_class = {str(c): ClassScore(summary["mean"][str(c)]["Dice"], summary["mean"][str(c)]["HD95_mm"])
                 for c in summary["classes"]}
    how = mode if not sliding_window else f"sliding {format_shape(sliding_window)}, overlap {DEFAULT_OVERLAP:g}"
    foreground = summary["foreground_mean_defined"]
    return HeldOut(how, foreground["Dice"], foreground["HD95_mm"], per_class,
                   float(np.mean([r.seconds for r in results])), max(r.peak_rss_bytes for r in results), str(out))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Both paths as planned before either trains: the data-parallel decisions, each path's FLOPs per step,
    and the held-out cases both are scored on."""

    parallel: DataParallel
    cpu_step_flops: float
    dp_step_flops: float
    held_out: tuple[str, ...]


def compare(config: ExperimentConfig, out: Path, settings: Settings, *,
            progress: Callable[[str], None] = print) -> CompareReport:
    """Check both paths fit, train each for the same budget over ``settings.seeds`` seeds, score both.

    Each run trains under ``out/<path>/seed-<k>``, in its own process; its predictions and their
    ``summary.json`` are in ``out/<path>/seed-<k>-predictions``. Writes ``compare.json``,
    ``compare.md`` and ``compare.png`` to ``out``.

    Args:
        config: the compared job: model, data (``data.store`` set, ``with_data_fields``), whole
            volume edge and per-replica batch.
        out: the output folder (created).
        settings: replicas, GPU memory, what is equal, seeds, validation cadence (``Settings``).
        progress: called with one line per phase (default ``print``).

    Returns:
        The ``CompareReport`` (compare.json is its ``to_dict``): what was compared, per path the
        per-seed runs (throughput, peak host memory, training FLOPs, curves, held-out scores), their
        means and spread and the planner's largest whole volume, and the conclusion.

    Raises:
        UsageError: a setting no run could use.
        InsufficientMemoryError: (exit 3) a path does not fit (``plan_both_paths``), before anything trains.
        BigmemError: a training run failed (the message ends with its last line of stderr).

    Example:
        >>> settings = Settings(replicas=2, simulate=True, gpu_memory=scaled_gpu_memory(config, counts_for),
        ...                     steps=20, equal="flops", holdout=2)
        >>> compare(config, Path("cmp"), settings).conclusion.text
    """
    from bigmem.compare.render import markdown, plot
    from bigmem.memory.profile import counts_function

    settings.check()
    progress("planning both paths' memory ...")
    _, parallel = plan_both_paths(config, counts_function(config), settings)
    plan = _Plan(parallel, mean_step_flops(config), train_flops(config, parallel.patch, parallel.global_batch),
                 _held_out(str(config.data.store), settings.holdout))
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[SeedRun]] = {name: [] for name in PATHS}
    for seed in range(settings.seeds):
        for name, run in zip(PATHS, _train_and_score(config, settings, plan, seed, out, progress)):
            runs[name].append(run)
    report = _report(config, settings, plan, runs)
    atomic_write_json(out / "compare.json", report.to_dict())
    atomic_write_text(out / "compare.md", markdown(report))
    plot(report, out / "compare.png")
    return report


def _train_and_score(config: ExperimentConfig, settings: Settings, plan: _Plan, seed: int, out: Path,
                     progress: Callable[[str], None]) -> tuple[SeedRun, SeedRun]:
    """One seed: the whole-volume run, the data-parallel run for the same budget, then both scored."""
    parallel = plan.parallel
    progress(f"seed {seed}: training on whole volumes (up to {format_shape(whole_shape(config))}) ...")
    cpu = _train(_run_config(config, settings, seed, settings.val_every, data_parallel=False),
                 out / "cpu_bigmem" / f"seed-{seed}", settings.steps, settings.cpu_time_budget_s)
    if settings.equal == "flops":  # the steps of patches that train as many FLOPs
        steps, time_budget_s = max(1, round(cpu.steps * plan.cpu_step_flops / plan.dp_step_flops)), None
    else:
        steps, time_budget_s = None, settings.cpu_time_budget_s or cpu.train_s
    where = f"{settings.replicas} {'simulated replicas' if settings.simulate else 'GPUs'}"
    progress(f"seed {seed}: training data parallel on {format_shape(parallel.patch)} patches ({where}) ...")
    val_every = max(1, round(settings.val_every * plan.cpu_step_flops / plan.dp_step_flops))  # at equal FLOPs
    dp = _train(_run_config(config, settings, seed, val_every, data_parallel=True),
                out / "data_parallel" / f"seed-{seed}", steps, time_budget_s)
    progress(f"seed {seed}: predicting and scoring {len(plan.held_out)} held-out cases ...")
    scored = []
    for training, step_flops, batch, window in ((cpu, plan.cpu_step_flops, config.train.batch_size, None),
                                                (dp, plan.dp_step_flops, parallel.global_batch, parallel.patch)):
        held_out = score_run(training.run_dir, str(config.data.store), list(plan.held_out), sliding_window=window,
                             out=Path(training.run_dir).with_name(f"seed-{seed}-predictions"))
        scored.append(SeedRun(seed, training, training.steps * step_flops, batch / training.step_s, held_out))
    return scored[0], scored[1]


def _report(config: ExperimentConfig, settings: Settings, plan: _Plan,
            runs: dict[str, list[SeedRun]]) -> CompareReport:
    volumes = largest_whole_volumes(config, settings.gpu_memory.bytes, settings.memory_budget_bytes)
    shape, parallel = whole_shape(config), plan.parallel
    return CompareReport(
        simulated=settings.simulate, replicas=settings.replicas, gpu_memory_bytes=settings.gpu_memory.bytes,
        gpu_memory_stand_in=settings.gpu_memory.stand_in, model=config.model.name, volume=max(shape),
        shape=tuple(shape), native_shapes=config.data.shape is None, patch_size=tuple(parallel.patch),
        batch={"cpu_bigmem": config.train.batch_size, "data_parallel": parallel.global_batch},
        held_out_cases=plan.held_out, budget=_budget_text(settings), seeds=settings.seeds,
        paths={"cpu_bigmem": PathResult.over_seeds(runs["cpu_bigmem"], max_whole_volume=volumes.host,
                                                   max_whole_volume_mode=volumes.host_mode),
               "data_parallel": PathResult.over_seeds(runs["data_parallel"], max_whole_volume=volumes.gpu)},
        gpu_reference=settings.gpu_reference.to_dict() if settings.gpu_reference else None)


def _budget_text(settings: Settings) -> str:
    length = (f"{settings.cpu_time_budget_s:g} s" if settings.cpu_time_budget_s is not None
              else format_count(settings.steps, "step"))
    if settings.equal == "flops":
        return f"equal training FLOPs ({length} on whole volumes, the same FLOPs on patches)"
    if settings.cpu_time_budget_s is None:
        return f"equal training time ({length} on whole volumes, the same seconds on patches)"
    return f"equal training time ({length} of training each)"


def _held_out(store_path: str, holdout: int) -> tuple[str, ...]:
    from bigmem.data.store import HDF5VolumeStore

    with HDF5VolumeStore(store_path, holdout=holdout) as store:
        return tuple(store.held_out)


@dataclasses.dataclass(frozen=True)
class WholeVolumes:
    """The planner's largest whole volume (batch 1) on one GPU and in this host's RAM.

    Attributes:
        gpu: the largest edge on one GPU (None: none fits).
        host: the largest edge in the host's budget (None: none fits).
        host_mode: the host's precision and recomputed stages for it ("bf16, recompute stages"; None: none fits).
        host_budget_bytes: the host's budget it was searched in.
    """

    gpu: int | None
    host: int | None
    host_mode: str | None
    host_budget_bytes: int


def largest_whole_volumes(config: ExperimentConfig, gpu_memory_bytes: int,
                          memory_budget_bytes: int | None = None) -> WholeVolumes:
    """From the planner: the largest whole volume (batch 1) on one GPU and in this host's RAM.

    Args:
        config: the compared model.
        gpu_memory_bytes: one GPU's memory.
        memory_budget_bytes: the host's budget (``--memory-budget``); default as
            ``memory.budget.resolve_budget`` decides without one (this process runs no placement:
            MemAvailable).

    Returns:
        ``WholeVolumes``: edges (None when none fits) and the host's mode.
    """
    from bigmem.distribute.planning import largest_edge
    from bigmem.memory.budget import resolve_budget
    from bigmem.memory.search import MAX_VOLUME
    from bigmem.memory.plans import plan_search
    from bigmem.memory.profile import counts_function

    counts_for = counts_function(config)
    host = plan_search(config, counts_for, resolve_budget(memory_budget_bytes), batch_size=1)
    gpu = largest_edge(config, counts_for, gpu_memory_bytes, 1, MAX_VOLUME)
    chosen = host.chosen
    return WholeVolumes(gpu, chosen.volume if chosen else None,
                        f"{chosen.precision}, recompute {chosen.recompute}" if chosen else None, host.budget_bytes)
