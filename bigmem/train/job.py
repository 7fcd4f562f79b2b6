"""A training job, prepared once: everything decided before the first step.

``prepare_job`` makes each decision of a run in one place and in the order the machine needs
them: the run directory (new, or the checkpoint to resume), the data-derived config fields, the
NUMA placement (before TensorFlow starts threads), the replicas (before TensorFlow initialises
devices), the data-parallel shape (``distribute.data_parallel``), the loader, the memory
pre-flight (``memory.preflight``: budget, recomputed stages, the ``Plan`` written as plan.json)
and the learning rate. The loop and its callbacks only read the ``Job``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from bigmem.config.options import Precision, Strategy
from bigmem.config.schema import ExperimentConfig
from bigmem.data.derived import median_shape, with_data_fields
from bigmem.data.pipeline import WholeVolumeLoader
from bigmem.errors import TrainingError, UsageError
from bigmem.memory.planner import Plan
from bigmem.rundir import RunDir
from bigmem.tfenv import import_tensorflow
from bigmem.units import format_count
from bigmem.checkpoints import CheckpointManager

# The AVX2 measurement of the `make demo` configuration: 0.016 Mvox/s in bf16 against
# 0.33 in fp32 with oneDNN on (AMD EPYC Zen 3, 2 cores, TF 2.21).
EMULATED_BF16_WARNING = ("warning: this CPU has no native bfloat16 (avx512_bf16, AMX or AVX-NE-CONVERT): --precision "
                         "bf16 is emulated, about 20x slower than fp32 here; it only saves memory")


@dataclass(frozen=True)
class Job:
    """A prepared training job.

    Attributes:
        config: the resolved config, with the data-derived fields filled (never changed later).
        run: the run directory.
        checkpoints: its checkpoint manager.
        resume_from: the newest complete checkpoint, or None for a run that starts at step 0 (the
            trainer restores it, or the newest older one that loads: ``restore_newest``).
        loader: this process's batches (whole volumes, or patches for the GPU baseline).
        placement: the NUMA placement in force (``numa.policy.Placement``), or None.
        parallel: the data-parallel decisions (``distribute.execution.DataParallel``), or None
            for single-process whole volumes.
        plan: the memory pre-flight's ``Plan`` (plan.json).
        recompute_stages: the stages whose activations backward recomputes.
        total_steps: the step the run ends at.
        learning_rate: the peak learning rate (scaled to the global batch when data-parallel).
    """

    config: ExperimentConfig
    run: RunDir
    checkpoints: CheckpointManager
    resume_from: Path | None
    loader: WholeVolumeLoader
    placement: object | None
    parallel: object | None
    plan: Plan
    recompute_stages: list[str]
    total_steps: int
    learning_rate: float

    def voxels_for_step(self, step: int) -> int:
        """Scan voxels (padding left out) this process feeds the network at ``step`` (from 0): the throughput's."""
        return self.loader.real_voxels(step)

    def close(self) -> None:
        """Release the loader's readers and the store."""
        self.loader.close()


def total_steps_for(config: ExperimentConfig, steps_per_epoch: int) -> int:
    """``train.steps``, else ``train.epochs`` (default 1) passes of ``steps_per_epoch``."""
    if config.train.steps is not None:
        return config.train.steps
    return (config.train.epochs or 1) * steps_per_epoch


class NothingToDo(Exception):
    """A resume whose run is already where it was asked to end: nothing is run, nothing written.

    Args:
        message: what to tell the user (the step reached and how to train longer).
        step: the step the run is at (its newest checkpoint's).
        total_steps: the step the resume was asked to end at.
        summary: the finished run's summary.json, if it has one.
    """

    def __init__(self, message: str, step: int, total_steps: int, summary: dict | None):
        super().__init__(message)
        self.step, self.total_steps, self.summary = step, total_steps, summary


def resume_point(run: RunDir, manager: CheckpointManager, resume: bool, console: Console | None = None
                 ) -> Path | None:
    """The newest complete checkpoint to resume from, or None to start at step 0.

    A run that stopped before its first checkpoint (a data error at step 2, a kill during
    start-up) holds nothing worth keeping: the same command starts it over, with or without
    ``resume``. So does ``resume`` of a directory where no run was started yet.

    Args:
        run: the run directory.
        manager: its checkpoints.
        resume: continue the run (``--resume``).
        console: where the line saying a run starts over goes.

    Returns:
        The newest complete checkpoint (``_run`` falls back to an older one if it does not load),
        or None: start at step 0.

    Raises:
        TrainingError: a new run into a directory that holds a checkpoint or a finished model, or
            ``resume`` of a run that has one but no checkpoint to continue from.
    """
    console = console or Console(soft_wrap=True)
    latest = manager.latest()
    if resume and latest is not None:
        return latest
    kept = _kept(run, manager)
    if kept and resume:
        raise TrainingError(f"Cannot resume {str(run.path)!r}: it has no complete checkpoint (looked in "
                            f"{run.checkpoints}) but holds {kept}. Start a new run with another --out.")
    if kept:
        raise TrainingError(f"Run directory {str(run.path)!r} already holds a run: pass --resume to continue it, "
                            "or choose another --out.")
    if run.holds_run():
        console.print(f"{run.path} holds a run that stopped before its first checkpoint: starting it over "
                      "from step 0.")
    elif resume:
        console.print(f"No run was started in {run.path} yet: starting it.")
    return None


def _kept(run: RunDir, manager: CheckpointManager) -> str:
    """What a run directory holds that starting it over would lose ('' when nothing)."""
    kept = [p.name for p in manager.all()] or [f"checkpoints/{p.name}" for p in manager.damaged()]
    kept += [p.name for p in (run.model, run.summary) if p.exists()]
    return ", ".join(kept)


def check_something_to_do(run: RunDir, checkpoint: Path, total_steps: int) -> None:
    """Raise ``NothingToDo`` when resuming from ``checkpoint`` would train nothing and change nothing.

    That is a checkpoint past ``total_steps``, or at it in a run that finished there (its
    summary.json, the last file a run writes, says that step). A run that reached its last
    checkpoint but was killed before summary.json is not finished: resuming it writes model.keras
    and summary.json.

    Raises:
        NothingToDo: with the line to print.
    """
    step = int(checkpoint.name.split("-")[-1])
    if step < total_steps:
        return
    try:
        summary = run.read_summary()
    except (OSError, ValueError):
        summary = None
    summary = summary if isinstance(summary, dict) else None
    finished = summary is not None and summary.get("steps") == step and run.model.exists()
    if step == total_steps and not finished:
        return
    where = (f"finished at step {step} of {total_steps}" if step == total_steps
             else f"is at step {step} ({checkpoint.name}), past the {total_steps} steps asked for")
    raise NothingToDo(f"Nothing to do: {run.path} {where}; nothing was changed. To train longer, resume with "
                      f"--steps N, N > {step}.", step, total_steps, summary if finished else None)


def data_fields_note(preset, model) -> str:
    """One line: the store's channels and classes replace the preset's (``in_channels``, ``num_classes``)."""
    return (f"The store has {format_count(model.in_channels, 'channel')} and "
            f"{format_count(model.num_classes, 'class', 'classes')}; the {preset.name!r} preset's "
            f"{preset.in_channels} and {preset.num_classes} are replaced.")


def current_placement(config: ExperimentConfig):
    """The NUMA placement in force: the one the CLI applied, else ``config.numa`` applied now.

    Raises:
        UsageError: this process already runs under another policy (threads would not follow a
            new one), or the policy cannot be applied.
    """
    from bigmem.numa.apply import current, place
    from bigmem.numa.policy import PolicyKind

    placement = current()
    wanted = (config.numa.policy or "none").strip().lower()
    if placement is not None and placement.text.strip().lower() == wanted:
        return placement
    if placement is not None and placement.kind is not PolicyKind.NONE:
        raise UsageError(f"This process already runs under --numa {placement.text}; it cannot switch to "
                         f"{config.numa.policy!r}. Start a new process.")
    return place(config.numa.policy, config.numa.cpus, config.numa.threads)


def prepare_job(config: ExperimentConfig, run_dir, *, resume: bool = False, force: bool = False,
                console: Console | None = None, verbose: bool = False,
                recompute_stages: list[str] | None = None) -> Job:
    """Make every decision of a training run, in the order the machine needs them.

    Args:
        config: the resolved config (``config.presets.resolve_config``).
        run_dir: the run directory (created when the run starts).
        resume: continue ``run_dir`` from its newest checkpoint.
        force: run even if the predicted peak exceeds the memory budget.
        console: where the pre-flight's lines go.
        verbose: show TensorFlow's logs.
        recompute_stages: the stages to recompute, overriding ``memory.recompute`` (the probe).

    Returns:
        The ``Job``; call ``job.close()`` when done with it (it holds the loader's readers).

    Raises:
        NothingToDo: ``resume`` of a run already at (or past) its last step; nothing was written.
        TrainingError: the run directory is in the way, or there is nothing to resume.
        DataError: the store cannot be read.
        ConfigError: a setting bigmem cannot use.
        InsufficientMemoryError: (exit 3) the job does not fit its memory budget, unless ``force``.
    """
    console = console or Console(soft_wrap=True)
    run = RunDir(run_dir)
    manager = CheckpointManager(run.checkpoints, keep=config.train.keep_checkpoints)
    resume_from = resume_point(run, manager, resume, console)
    if resume_from is not None and config.train.steps is not None:  # known before the data is read
        check_something_to_do(run, resume_from, config.train.steps)
    preset = config.model
    config = with_data_fields(config, generating=lambda: console.status(
        "Generating the synthetic dataset (cached for later runs) ..."))
    if config.data.store and (preset.in_channels, preset.num_classes) != (config.model.in_channels,
                                                                          config.model.num_classes):
        console.print(data_fields_note(preset, config.model))
    placement = current_placement(config)
    import_tensorflow(verbose=verbose)
    from bigmem.memory.profile import counts_function

    parallel = None
    if config.distribute.strategy is not Strategy.NONE:
        from bigmem.distribute.execution import data_parallel
        from bigmem.distribute.strategy import setup_replicas

        replicas = setup_replicas(config)  # before any TensorFlow operation initialises devices
        parallel = data_parallel(config, replicas, counts_function(config), aspect=median_shape(config))
    settings = parallel.loader_settings() if parallel else {"batch_size": config.train.batch_size}
    data = config.data
    loader = WholeVolumeLoader(data.store, shape=data.shape, pad_multiple=data.pad_multiple or config.model.divisor,
                               seed=config.train.seed, flip=data.flip,
                               intensity=(data.intensity_scale, data.intensity_shift), num_workers=data.num_workers,
                               prefetch=data.prefetch, cold_cache=data.cold_cache, holdout=data.holdout, **settings)
    try:
        total_steps = total_steps_for(config, loader.steps_per_epoch)
        if resume_from is not None:
            check_something_to_do(run, resume_from, total_steps)
        plan, stages = preflight(config, parallel, recompute_stages, force=force, console=console,
                                 placement=placement, loader=loader)
        lr = parallel.learning_rate(config.train.lr, config.train.reference_batch) if parallel else config.train.lr
        return Job(config, run, manager, resume_from, loader, placement, parallel, plan, stages, total_steps, lr)
    except BaseException:
        loader.close()
        raise


def preflight(config: ExperimentConfig, parallel, recompute_stages: list[str] | None, *, force: bool,
              console: Console, placement=None, loader: WholeVolumeLoader | None = None) -> tuple[Plan, list[str]]:
    """The run's memory pre-flight (``memory.preflight``), printed; refuses a job that cannot fit.

    The step planned is the largest the loader can feed (``memory.preflight.planned_shape`` of
    its cases' shapes), with a per-case table in plan.json; a run that validates (``--val-every``)
    also plans the whole-volume pass over its largest held-out case.

    Args:
        config: the job.
        parallel: its ``DataParallel`` decisions, or None: the host is checked for what it holds
            (one worker's batch at the input shape; on real GPUs only the input, not checked).
        recompute_stages: stages to recompute instead of ``memory.recompute``'s choice.
        force: keep a job that does not fit (plan.json says so).
        console: where the one-line summary (and any note or warning) goes.
        placement: the NUMA placement, whose nodes may set the budget.
        loader: the run's loader, whose cases and shapes are planned (default None: the fixed
            ``data.shape``, else the reference cube).

    Returns:
        ``(plan, recompute_stages)``: the ``Plan`` written as plan.json (with the data-parallel
        section when ``parallel``), and the stages to recompute.

    Raises:
        InsufficientMemoryError: (exit 3) the predicted peak exceeds the budget, or an explicit
            budget exceeds the machine's memory, unless ``force``.
    """
    from bigmem.data.pipeline import padded_shape
    from bigmem.memory.preflight import (
        CaseShape, check_budget_within_machine, job_plan, planned_shape, resolve_budget,
    )
    from bigmem.memory.profile import counts_function
    from bigmem.nets.limits import max_kernel_elements
    from bigmem.units import format_bytes

    counts_for = counts_function(config)
    host = parallel.host_config(config) if parallel else config
    budget = resolve_budget(config.memory.budget_bytes, placement=placement)
    if budget.note:
        console.print(budget.note, style="yellow")
    check_budget_within_machine(budget, force=force)
    shape, cases, validation, validation_case = None, (), None, ""
    if loader is not None and loader.native:  # each case its own shape (a fixed shape or a patch: one for all)
        cases = [CaseShape(info.case_id, info.shape, loader.case_shape(i)) for i, info in enumerate(loader.store.cases)]
        shape = planned_shape([c.trained_shape for c in cases], loader.batch_size)
    if loader is not None:
        held_out = loader.store.held_out_cases
        if config.train.val_every and held_out and loader.patch is None:  # a patch run validates in windows
            largest = max(held_out, key=lambda c: math.prod(padded_shape(c.shape, config.model.divisor)))
            validation, validation_case = padded_shape(largest.shape, config.model.divisor), largest.case_id
    plan = job_plan(host, counts_for, budget, shape=shape, stages=recompute_stages, force=force,
                    check=parallel is None or parallel.host_checked, cases=cases, validation_shape=validation,
                    validation_case=validation_case)
    plan.data_parallel = parallel.to_dict() if parallel else None
    chosen = plan.chosen
    if config.train.precision is Precision.BF16:
        from bigmem.sysinfo import native_bf16

        if not native_bf16():
            console.print(EMULATED_BF16_WARNING, style="yellow")
    console.print(f"Memory: predicted peak {format_bytes(plan.predicted_peak_bytes)} of a "
                  f"{format_bytes(plan.budget_bytes)} budget ({plan.budget_source})"
                  + ("" if plan.fits else " - over budget, forced")
                  + (f"; recomputing {len(chosen.recompute_stages)} stages" if chosen.recompute_stages else "")
                  + (f"; {len(chosen.partitioned_stages)} stages run in depth slabs (tensors past "
                     f"{max_kernel_elements():,} elements)" if chosen.partitioned_stages else ""))
    return plan, list(chosen.recompute_stages)
