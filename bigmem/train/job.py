"""A training job, prepared once: everything decided before the first step.

``prepare_job`` makes each decision of a run in one place and in the order the machine needs
them: the run directory (new, or the checkpoint to resume: ``train/resume.py``), the data-derived
config fields, the NUMA placement (before TensorFlow starts threads), the execution (single
process, or data parallel over replicas set up before TensorFlow initialises devices:
``distribute.execution.choose_execution``), the loader, the memory plan (``plan_memory`` over
``memory.plans``: budget, recomputed stages, the ``Plan`` written as plan.json) and the
learning rate. The loop and its callbacks only read the ``Job``.

Everything that can refuse the job runs before anything is timed or measured: the tuning pass (and
its fixed-memory step) runs only for a job that will run, or whose verdict waits on what it
measures (``refuse_then_measure``). Nothing here writes the run directory; the trainer creates it
once the job is prepared.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from bigmem.checkpoints import CheckpointManager
from bigmem.config.options import Precision
from bigmem.config.schema import ExperimentConfig
from bigmem.data.derived import augmentation, pad_multiple, with_data_fields
from bigmem.data.pipeline import VolumeLoader
from bigmem.distribute.execution import Execution, choose_execution
from bigmem.errors import UsageError
from bigmem.memory.search import Plan
from bigmem.numa.policy import Placement
from bigmem.rundir import RunDir
from bigmem.tfenv import import_tensorflow
from bigmem.train.resume import check_resumed_config, check_something_to_do, resume_point
from bigmem.units import format_count

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
            trainer restores it, or the newest older one that loads: ``resume.restore``).
        loader: this process's batches (whole volumes, or patches for the GPU baseline).
        placement: the NUMA placement in force.
        execution: how the steps run: ``SingleProcess`` whole volumes, or the ``DataParallel``
            decisions (``distribute.execution``).
        plan: the memory plan (plan.json).
        recompute_stages: the stages whose activations backward recomputes.
        total_steps: the step the run ends at.
        learning_rate: the peak learning rate (scaled to the global batch when data-parallel).
    """

    config: ExperimentConfig
    run: RunDir
    checkpoints: CheckpointManager
    resume_from: Path | None
    loader: VolumeLoader
    placement: Placement
    execution: Execution
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


def data_fields_note(preset, model) -> str:
    """One line: the store's channels and classes replace the preset's (``in_channels``, ``num_classes``)."""
    return (f"The store has {format_count(model.in_channels, 'channel')} and "
            f"{format_count(model.num_classes, 'class', 'classes')}; the {preset.name!r} preset's "
            f"{preset.in_channels} and {preset.num_classes} are replaced.")


def current_placement(config: ExperimentConfig) -> Placement:
    """The NUMA placement in force: the one the CLI applied, else ``config.numa`` applied now.

    Args:
        config: the job (its ``numa`` section).

    Returns:
        The ``Placement``.

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
        raise UsageError(f"This process already runs under {{numa.policy}} {placement.text}; it cannot switch to "
                         f"{config.numa.policy!r}. Start a new process.")
    return place(config.numa.policy, config.numa.cpus, config.numa.threads)


def prepare_job(config: ExperimentConfig, run_dir, *, resume: bool = False, force: bool = False,
                console: Console | None = None, verbose: bool = False,
                recompute_stages: list[str] | None = None) -> Job:
    """Make every decision of a training run, in the order the machine needs them.

    Args:
        config: the resolved config (``config.presets.resolve_config``).
        run_dir: the run directory (created when the run starts).
        resume: continue ``run_dir`` from its newest checkpoint; ``config`` must agree with the
            saved settings but for ``resume.CHANGEABLE_ON_RESUME``.
        force: run even if the predicted peak exceeds the memory budget.
        console: where the memory plan's lines go.
        verbose: show TensorFlow's logs.
        recompute_stages: the stages to recompute, overriding ``memory.recompute`` (the probe).

    Returns:
        The ``Job``; call ``job.close()`` when done with it (it holds the loader's readers).

    Raises:
        NothingToDo: ``resume`` of a run already at (or past) its last step; nothing was written.
        TrainingError: the run directory is in the way, or there is nothing to resume.
        DataError: the store (or, resuming, the saved config.json) cannot be read.
        ConfigError: a setting bigmem cannot use, or, resuming, one that differs from the saved run's.
        InsufficientMemoryError: (exit 3) the job does not fit its memory budget, unless ``force``.
    """
    console = console or Console(soft_wrap=True)
    run = RunDir(run_dir)
    manager = CheckpointManager(run.checkpoints, keep=config.train.keep_checkpoints)
    if resume:
        config = check_resumed_config(run, config)  # what the command line checks of its flags, for every caller
    resume_from = resume_point(run, manager, resume, console)
    if resume_from is not None and config.train.steps is not None:  # known before the data is read
        check_something_to_do(run, resume_from, config.train.steps)
    config = _with_data_fields(config, console)
    placement = current_placement(config)
    import_tensorflow(verbose=verbose)
    execution = choose_execution(config)
    loader = make_loader(config, execution)
    try:
        total_steps = total_steps_for(config, loader.steps_per_epoch)
        if resume_from is not None:
            check_something_to_do(run, resume_from, total_steps)
        plan, stages = refuse_then_measure(config, execution, recompute_stages, force=force, console=console,
                                           placement=placement, loader=loader, run=run)
        lr = execution.learning_rate(config.train.lr, config.train.reference_batch)
        return Job(config, run, manager, resume_from, loader, placement, execution, plan, stages, total_steps, lr)
    except BaseException:
        loader.close()
        raise


NO_TUNE_VARIABLE = "BIGMEM_NO_TUNE"  # =1: as --no-tune, for scripts and test suites that train many short runs


def refuse_then_measure(config: ExperimentConfig, execution: Execution, recompute_stages: list[str] | None, *,
                        force: bool, console: Console, placement: Placement | None = None,
                        loader: VolumeLoader | None = None, run: RunDir | None = None) -> tuple[Plan, list[str]]:
    """The memory plan, decided before anything is timed or measured where it can be (``plan_memory``).

    Where this job would tune (``tuning_due``), it is first planned on what is known: the shipped
    tables with their margin for the terms this machine has not measured. A job over its budget by
    more than that margin is refused at once (what the pass measures cannot bring it in); one within
    the margin is said to be, measured, then decided; one that fits runs the pass. Either way the plan
    that is kept is made after the pass, on what it measured.

    Args:
        as ``plan_memory``'s, and ``run``: the run directory, whose disk must hold a checkpoint
            (``check_checkpoint_space``, before the pass; default None: not checked).

    Returns:
        ``plan_memory``'s ``(plan, recompute_stages)``.

    Raises:
        InsufficientMemoryError: (exit 3) as ``plan_memory``, before the pass where the verdict
            cannot depend on it.
        DiskFullError: the run directory's disk cannot hold one checkpoint.
    """
    from bigmem.memory.budget import check_budget_within_machine, resolve_budget
    from bigmem.units import format_bytes

    due = tuning_due(config, execution)
    if due is None:
        planned = plan_memory(config, execution, recompute_stages, force=force, console=console, placement=placement,
                              loader=loader)
        if run is not None:
            check_checkpoint_space(run, planned[0])
        return planned
    budget = resolve_budget(config.memory.budget_bytes, placement=placement)
    check_budget_within_machine(budget, force=force)
    first = _plan(config, execution, recompute_stages, budget, force=True, loader=loader)
    if run is not None:
        check_checkpoint_space(run, first)
    if not first.fits and not force:
        unmeasured = unmeasured_bytes(first)
        if first.predicted_peak_bytes - unmeasured > budget.budget_bytes:  # refused on what is known: its own error
            plan_memory(config, execution, recompute_stages, force=False, console=console, placement=placement,
                        loader=loader)
        console.print(f"The predicted peak, {format_bytes(first.predicted_peak_bytes)}, is over the "
                      f"{format_bytes(budget.budget_bytes)} budget by less than its margin for terms not measured "
                      f"on this machine ({format_bytes(unmeasured)}): measuring them before deciding.")
    auto_tune(config, execution, loader, console)
    return plan_memory(config, execution, recompute_stages, force=force, console=console, placement=placement,
                       loader=loader)


def check_checkpoint_space(run: RunDir, plan: Plan) -> None:
    """Refuse, before anything is timed or trained, a run whose disk cannot hold one checkpoint: the model's
    weights and the optimizer's slots (the plan's ``weights`` and ``optimizer_slots``, float32 in every
    precision). A disk that fills later is still refused where the checkpoint is written.

    Raises:
        DiskFullError: naming the checkpoints folder, the bytes one checkpoint needs and those free.
    """
    from bigmem.atomic import disk_full_error, free_bytes

    needed = int(plan.chosen.components.get("weights", 0)) + int(plan.chosen.components.get("optimizer_slots", 0))
    if needed > free_bytes(run.path):
        raise disk_full_error(run.checkpoints, needed)


def unmeasured_bytes(plan: Plan) -> int:
    """What a plan adds for terms this machine has not measured: its chosen step's safety margin (0 where none)."""
    return int(plan.chosen.components.get("safety_margin", 0))


def tuning_due(config: ExperimentConfig, execution: Execution) -> str | None:
    """What ``auto_tune`` would run for this job: ``"pass"`` (the tuning pass), ``"fixed memory"`` (its memory
    step alone) or None (nothing).

    Nothing with ``train.tune`` off or ``BIGMEM_NO_TUNE=1``, for the workers of a multi-worker run (each
    would time the same kernels), and for bf16 on a CPU that emulates it; the pass on this machine's
    first run in this precision (a pass of any model or shape counts: ``bigmem tune`` tunes others);
    the memory step where a tuned machine has no fixed term for this network, mode or shipped table.
    """
    import os

    from bigmem.distribute.execution import SingleProcess
    from bigmem.nets.tuning import load_tuning
    from bigmem.sysinfo import native_bf16

    precision = config.train.precision
    if (not config.train.tune or os.environ.get(NO_TUNE_VARIABLE) == "1" or not isinstance(execution, SingleProcess)
            or (precision is Precision.BF16 and not native_bf16())):
        return None
    tuning = load_tuning()
    if tuning is None or not any(t["precision"] == precision.value for t in tuning.tuned):
        return "pass"
    from bigmem.tune import fixed_memory_key

    return None if fixed_memory_key(config) in tuning.overhead_offset_bytes else "fixed memory"


def auto_tune(config: ExperimentConfig, execution: Execution, loader: VolumeLoader | None, console: Console) -> None:
    """Whatever ``tuning_due`` says is due: the tuning pass (``bigmem tune``) at the step's shape, or the
    framework's fixed memory (runs at the network's smallest shape, ``tune.measure_fixed_memory``).

    The pass writes its file once, when it ends (``nets.tuning.save_tuning``, atomic): a pass stopped by
    Ctrl-C or a kill leaves nothing, and the next run tunes again.
    """
    due = tuning_due(config, execution)
    if due == "fixed memory":
        from bigmem.tune import measure_fixed_memory

        with console.status(f"Measuring the framework's fixed memory for {config.model.name} on this machine "
                            "(once; a training step at its smallest shape) ..."):
            measure_fixed_memory(config)
    elif due == "pass":
        from bigmem.tune import run_with_progress

        shape = _planned_shapes(config, loader)[0] or config.data.shape or (config.data.reference_volume,) * 3
        tuning = run_with_progress(config, shape, console)
        console.print(f"tuned this machine once ({NO_TUNE_VARIABLE}=1 or --no-tune to skip): {tuning.summary()}")


def _with_data_fields(config: ExperimentConfig, console: Console) -> ExperimentConfig:
    """``data.derived.with_data_fields``, saying so when the store's channels and classes replace the preset's."""
    preset = config.model
    config = with_data_fields(config, generating=lambda: console.status(
        "Generating the synthetic dataset (cached for later runs) ..."))
    if config.data.store and (preset.in_channels, preset.num_classes) != (config.model.in_channels,
                                                                          config.model.num_classes):
        console.print(data_fields_note(preset, config.model))
    return config


def make_loader(config: ExperimentConfig, execution: Execution) -> VolumeLoader:
    """This process's loader: ``config.data``, with the batch (and patch and shard) ``execution`` gives it.

    Args:
        config: the job, with its data fields (``data.derived.with_data_fields``).
        execution: how the steps run (``Execution.loader_settings``).

    Returns:
        The ``VolumeLoader``; close it when done.
    """
    data = config.data
    return VolumeLoader(data.store, shape=data.shape, pad_multiple=pad_multiple(config), seed=config.train.seed,
                        augment=augmentation(config), num_workers=data.num_workers, prefetch=data.prefetch,
                        cold_cache=data.cold_cache, holdout=data.holdout, fold=data.fold, splits=data.splits,
                        **execution.loader_settings())


def plan_memory(config: ExperimentConfig, execution: Execution, recompute_stages: list[str] | None, *, force: bool,
                console: Console, placement: Placement | None = None, loader: VolumeLoader | None = None
                ) -> tuple[Plan, list[str]]:
    """The run's memory plan (``memory.plans.plan_job``), printed; refuses a job that cannot fit.

    The step planned is the largest the loader can feed (``memory.plans.planned_shape`` of
    its cases' shapes), with a per-case table in plan.json; a run that validates (``--val-every``)
    also plans the whole-volume pass over its largest held-out case.

    Args:
        config: the job.
        execution: how its steps run: the host is checked for what it holds (``host_config``: one
            worker's batch at the input shape), unless it holds only the input (``host_checked``:
            real GPUs).
        recompute_stages: stages to recompute instead of ``memory.recompute``'s choice.
        force: keep a job that does not fit (plan.json says so).
        console: where the one-line summary (and any note or warning) goes.
        placement: the NUMA placement, whose nodes may set the budget.
        loader: the run's loader, whose cases and shapes are planned (default None: the fixed
            ``data.shape``, else the reference cube).

    Returns:
        ``(plan, recompute_stages)``: the ``Plan`` the trainer writes as plan.json (its
        ``data_parallel`` section is ``execution.to_dict()``), and the stages to recompute.

    Raises:
        InsufficientMemoryError: (exit 3) the predicted peak exceeds the budget, or an explicit
            budget exceeds the machine's memory, unless ``force``.
    """
    from bigmem.memory.budget import check_budget_within_machine, resolve_budget

    budget = resolve_budget(config.memory.budget_bytes, placement=placement)
    if budget.note:
        console.print(budget.note, style="yellow")
    check_budget_within_machine(budget, force=force)
    plan = _plan(config, execution, recompute_stages, budget, force=force, loader=loader)
    if config.train.precision is Precision.BF16:
        from bigmem.sysinfo import native_bf16

        if not native_bf16():
            console.print(EMULATED_BF16_WARNING, style="yellow")
    console.print(_memory_line(plan))
    if plan.precision_note:
        console.print(plan.precision_note, style="yellow")
    return plan, list(plan.chosen.recompute_stages)


def _plan(config: ExperimentConfig, execution: Execution, recompute_stages: list[str] | None, budget, *,
          force: bool, loader: VolumeLoader | None) -> Plan:
    """``memory.plans.plan_job`` of this job's largest step against ``budget``, with the execution's section."""
    from bigmem.memory.plans import plan_job
    from bigmem.memory.profile import counts_function

    shape, cases, validation, validation_case = _planned_shapes(config, loader)
    plan = plan_job(execution.host_config(config), counts_function(config), budget, shape=shape,
                    stages=recompute_stages, force=force, check=execution.host_checked, cases=cases,
                    validation_shape=validation, validation_case=validation_case)
    return dataclasses.replace(plan, data_parallel=execution)


def _planned_shapes(config: ExperimentConfig, loader: VolumeLoader | None) -> tuple:
    """``(step shape, per-case shapes, validation shape, its case id)`` for ``memory.plans.plan_job``
    (None, (), None, '': none)."""
    from bigmem.data.pipeline import padded_shape
    from bigmem.memory.plans import CaseShape, planned_shape

    shape, cases, validation, validation_case = None, (), None, ""
    if loader is not None and loader.native:  # each case its own shape (a fixed shape or a patch: one for all)
        cases = [CaseShape(info.case_id, info.shape, loader.case_shape(i)) for i, info in enumerate(loader.store.cases)]
        shape = planned_shape([c.trained_shape for c in cases], loader.batch_size)
    if loader is not None:
        held_out = loader.store.held_out_cases
        if config.train.val_every and held_out and loader.patch is None:  # a patch run validates in windows
            largest = max(held_out, key=lambda c: math.prod(padded_shape(c.shape, config.model.divisors)))
            validation, validation_case = padded_shape(largest.shape, config.model.divisors), largest.case_id
    return shape, cases, validation, validation_case


def _memory_line(plan: Plan) -> str:
    """The plan in one line: predicted peak of the budget, and what runs recomputed or in depth slabs."""
    from bigmem.nets.limits import max_kernel_elements
    from bigmem.units import format_bytes

    chosen = plan.chosen
    return (f"Memory: predicted peak {format_bytes(plan.predicted_peak_bytes)} of a "
            f"{format_bytes(plan.budget_bytes)} budget ({plan.budget_source})"
            + ("" if plan.fits else " - over budget, forced")
            + (f"; recomputing {len(chosen.recompute_stages)} stages" if chosen.recompute_stages else "")
            + (f"; {len(chosen.partitioned_stages)} stages run in depth slabs (tensors past "
               f"{max_kernel_elements():,} elements)" if chosen.partitioned_stages else ""))
