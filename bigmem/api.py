"""bigmem as a library: what every subcommand does, callable from a notebook without argparse.

Every ``bigmem`` subcommand parses its flags, calls one function here and prints what it returns (``bigmem
profile``: ``profile``, ``sweep`` or ``calibrate``; ``bigmem tune``: ``tune``, or ``machine_tuning`` with
``--show``), so a script can drive the same steps. The functions never print: each returns a record (``info``: a
dict) and reports long work through optional callbacks (``say``, ``progress``)::

    from bigmem import api

    report = api.convert("Task01_BrainTumour", "brats.h5")               # MSD, nnU-Net v2 raw or KiTS
    config = api.resolve_config("small", {"data": {"store": "brats.h5"}, "train": {"steps": 1000}})
    planned = api.plan(config)                                           # does it fit? the largest step
    result = api.train(config, "runs/brats")                             # a run directory
    for case in api.predict("runs/brats", "Task01_BrainTumour/imagesTs", "predictions"):
        print(case)
    scores = api.evaluate("predictions", "Task01_BrainTumour/labelsTs")  # per-class Dice and HD95
    api.export("runs/brats", "brats-model")                              # what predict needs, portable
    api.report("runs/brats").folder                                      # plots, report.md, report.json

Importing this module imports no TensorFlow; each function imports what it needs when called.
``docs/api.md`` runs the whole chain on a small synthetic dataset.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from bigmem.errors import ConfigError, DataError, UsageError

if TYPE_CHECKING:  # only for the annotations: importing them here would import TensorFlow
    from bigmem.config.schema import ExperimentConfig
    from bigmem.memory.budget import Budget
    from bigmem.numa.layouts import Layouts
    from bigmem.memory.search import Plan
    from bigmem.memory.calibration import Calibration
    from bigmem.memory.profile import Profile, ScalingLaw
    from bigmem.infer.export import Exported
    from bigmem.nets.tuning import Tuning



def resolve_config(model: str | dict | None = None, overrides: dict | None = None, *,
                   plan: str | os.PathLike | None = None,
                   config: str | os.PathLike | None = None) -> "ExperimentConfig":
    """The typed, frozen experiment config: defaults, then the preset (or a .toml file), then ``overrides``.

    Args:
        model: a preset name (``tiny``, ``small``, ``intelai-brats``, ``kits19``, ``resenc-m``), a path to a
            .toml file, preset tables (``auto_preset``), or ``"auto"``: the network nnU-Net v2's planner rules
            configure from the cases of ``overrides``' ``data.store`` (default: ``config.presets.DEFAULT_PRESET``,
            small).
        overrides: nested ``{section: {field: value}}`` (the CLI's flags, e.g.
            ``{"train": {"batch_size": 2}, "data": {"store": "brats.h5"}}``); None values are ignored.
        plan: instead of ``model``, the experiment.toml that ``plan(..., experiment=...)`` wrote (``bigmem plan
            --data``), or the plan.json beside it.
        config: instead of everything else, a whole resolved config as written (a run's config.json).

    Returns:
        An ``ExperimentConfig``; a store's channels and classes are filled in when training starts
        (``bigmem.data.derived.with_data_fields``).

    Raises:
        ConfigError: an unknown preset, section or field, a value of the wrong type, ``plan`` with
            ``model``, or ``"auto"`` without ``data.store`` (exit 2).
        UsageError: ``config`` with a model, plan or overrides.
        DataError: the plan, config or store cannot be read.

    Example:
        >>> config = resolve_config("tiny", {"train": {"steps": 2}})
        >>> config.train.steps
        2
        >>> resolve_config("auto", {"data": {"store": "kits.h5"}}).model.name
        'auto'
    """
    from bigmem.config.presets import resolve_config as resolve

    overrides = overrides or {}
    if config is not None:
        return _whole_config(config, given=model is not None or plan is not None
                             or any(v is not None for values in overrides.values() for v in values.values()))
    return resolve(preset_for(model, plan, store=overrides.get("data", {}).get("store")), overrides)


def preset_for(model: str | dict | None = None, plan: str | os.PathLike | None = None, *,
               store: str | os.PathLike | None = None) -> "str | dict":
    """What ``resolve_config`` resolves before its overrides: a preset name or .toml path, or ``auto``'s tables.

    Args:
        model: a preset name, a .toml path or ``"auto"`` (default: ``config.presets.DEFAULT_PRESET``).
        plan: the experiment.toml (or plan.json) ``bigmem plan --data`` wrote, instead of ``model``.
        store: the store ``"auto"`` configures the network from.

    Returns:
        The preset's name or path, or (``"auto"``) ``auto_preset(configure(store))``.

    Raises:
        ConfigError: ``plan`` with ``model``; ``"auto"`` without ``store``; a plan.json made for a preset
            (it names the model to give instead).
        DataError: the plan cannot be read, or its experiment preset is missing.

    Example:
        >>> preset_for("small"), preset_for(plan="plans/plan.json")
        ('small', 'plans/experiment.toml')
    """
    from bigmem.config.presets import DEFAULT_PRESET

    if plan is not None:
        if model is not None:
            raise ConfigError("model.name", f"The plan {plan} names the network to train: leave out {{field}} {model}.")
        return planned_preset(Path(plan))
    if model == "auto":
        if store is None:
            raise ConfigError("data.store", "{model.name} auto configures the network from a store's cases: "
                              "give {field}.")
        return auto_preset(configure(store))
    return model or DEFAULT_PRESET


def auto_preset(experiment) -> dict:
    """The preset tables of a network ``configure`` made (model name ``auto``), its precision and recompute mode
    left to the job's pre-flight (or ``plan``'s search), which chooses what fits.

    Example:
        >>> resolve_config(auto_preset(configure("kits.h5"))).model.strides[1]
        (1, 2, 2)
    """
    tables = experiment.tables(batch_size=2, precision="fp32", recompute="none")
    tables["model"]["name"] = "auto"
    tables.pop("memory")
    tables["train"].pop("precision")
    return tables


def planned_preset(path: Path) -> str:
    """A plan file's preset: the experiment.toml itself, or the one a plan.json's ``experiment.preset`` names.

    Raises:
        DataError: ``path`` or its preset cannot be read.
        ConfigError: a plan.json made for a preset, not configured from a store.

    Example:
        >>> planned_preset(Path("plans/plan.json"))
        'plans/experiment.toml'
    """
    import json

    if not path.is_file():
        raise DataError(f"Cannot read the plan {path}: no such file; expected the experiment.toml (or plan.json) "
                        "bigmem plan --data wrote.")
    if path.suffix != ".json":
        return str(path)
    try:
        experiment = json.loads(path.read_text()).get("experiment")
    except (OSError, ValueError, AttributeError) as exc:
        raise DataError(f"Cannot read the plan {path}: {exc}.") from None
    if not experiment or not experiment.get("preset"):
        raise ConfigError("model.name", f"The plan {path} was planned for a preset, not configured from a store: "
                          "train it with the {field} it names (bigmem plan --data STORE without --model writes an "
                          "experiment).")
    preset = Path(experiment["preset"])
    preset = preset if preset.is_absolute() else path.parent / preset.name
    if not preset.is_file():
        raise DataError(f"Cannot read the plan {path}: its experiment preset {preset} is missing.")
    return str(preset)


def _whole_config(path: str | os.PathLike, *, given: bool) -> "ExperimentConfig":
    """A resolved config.json as written; nothing else may be given with it."""
    import json

    from bigmem.config.schema import ExperimentConfig

    if given:
        raise UsageError(f"The config {path} is a whole resolved configuration: give no model, plan or overrides "
                         "with it.")
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"Cannot read the config {path}: {exc}.") from None
    return ExperimentConfig.from_dict(values, source=str(path))


def train(config: "ExperimentConfig", run_dir: str | os.PathLike, *, resume: bool = False, force: bool = False,
          verbose: bool = False, console=None):
    """Train ``config`` into ``run_dir`` (``bigmem train``), or continue it from its newest checkpoint.

    The memory plan runs first and refuses a job that cannot fit (exit 3) unless ``force``. The
    run directory holds config.json, plan.json, checkpoints, metrics and, at the end, model.keras
    (``docs/rundir.md``).

    Args:
        config: ``resolve_config(...)``.
        run_dir: the run directory (created).
        resume: continue from the newest complete checkpoint in ``run_dir``.
        force: train past the memory budget.
        verbose: TensorFlow's logs.
        console: a ``rich`` console for the run's lines (the memory plan, notes, each step's progress, the
            result), as ``bigmem train`` prints them (default: silent; the run directory's metrics.jsonl and
            summary.json hold the figures either way).

    Returns:
        A ``TrainResult`` (``bigmem.train.trainer``): steps, final loss and Dice, the run directory.

    Example:
        >>> result = train(resolve_config("tiny", {"train": {"steps": 2}}), "runs/demo")
        >>> result.steps
        2
    """
    from rich.console import Console

    from bigmem.train.trainer import train as run

    return run(config, run_dir, resume=resume, force=force, verbose=verbose,
               console=console if console is not None else Console(quiet=True))


def train_per_node(config: "ExperimentConfig", run_dir: str | os.PathLike, *, workers_per_node: int = 1,
                   resume: bool = False, force: bool = False, verbose: bool = False, topology=None,
                   say: Callable[[str], None] | None = None, announce: Callable[[str], None] | None = None) -> int:
    """Train with one worker per NUMA node of this host (``bigmem train --strategy per-node``).

    Each worker is a ``MultiWorkerMirroredStrategy`` worker bound to its node's CPUs and memory and
    trains ``--batch-size`` samples of every global batch; worker 0 writes ``run_dir``. Before any
    starts, each node's free memory is checked against its workers' predicted peak (the job's own
    pre-flight at its batch, ``memory.plans.plan_job``).

    Args:
        config: the job (its ``distribute.strategy`` becomes multiworker in each worker).
        run_dir: the run directory.
        workers_per_node: workers on each node with CPUs, its CPUs split between them.
        resume: continue from the newest checkpoint (every worker from the chief's).
        force: start even where a node's free memory cannot hold its workers.
        verbose: TensorFlow's logs in the workers.
        topology: the machine's NUMA nodes (default: read from sysfs).
        say: called with the plan's notes (memory-only nodes, split CPUs) (default: silent).
        announce: called with the workers' line (nodes, CPUs, global batch) before they start (default: silent).

    Returns:
        0, or 128 + the signal that stopped the run.

    Raises:
        InsufficientMemoryError: (exit 3) a node cannot hold its workers, unless ``force``.
        WorkerFailed: a worker died (the others were stopped).

    Example:
        >>> train_per_node(resolve_config("small", {"train": {"batch_size": 1}}), "runs/per-node")
        0
    """
    from bigmem.distribute.pernode import check_node_memory, plan_workers, run_per_node
    from bigmem.numa.topology import NUMATopology

    topology = topology or NUMATopology.from_sysfs()
    workers = plan_workers(topology, workers_per_node=workers_per_node)
    for note in workers.notes():
        (say or (lambda line: None))(note)
    if not force:
        check_node_memory(workers, topology, _worker_peak_bytes(config))
    (announce or (lambda line: None))(workers.describe(config.train.batch_size))
    env = dict(os.environ)
    if not verbose:
        # When a worker dies, the others' TensorFlow logs the broken collective (gRPC "connection refused",
        # several lines each) before the launcher stops them; the launcher's one line names the worker and
        # what it last said. verbose keeps TensorFlow's own logs.
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    flags = ["--force"] * force + ["--verbose"] * verbose
    return run_per_node(workers, config, run_dir, resume=resume, flags=flags, env=env)


def _worker_peak_bytes(config: "ExperimentConfig") -> int:
    """One per-node worker's predicted peak: the job's own pre-flight (``train.job.plan_memory``) at its batch."""
    import io

    from rich.console import Console

    from bigmem.data.derived import with_data_fields
    from bigmem.distribute.execution import SingleProcess
    from bigmem.tfenv import import_tensorflow
    from bigmem.train.job import make_loader, plan_memory

    config = with_data_fields(config)
    import_tensorflow()  # the network's counts come from building it; the workers are fresh processes
    execution = SingleProcess(config.train.batch_size)  # what one worker holds: its own --batch-size
    loader = make_loader(config, execution)
    try:
        plan, _ = plan_memory(config, execution, None, force=True, console=Console(file=io.StringIO()),
                              loader=loader)
    finally:
        loader.close()
    return plan.predicted_peak_bytes


def predict(run_dir: str | os.PathLike | Sequence[str | os.PathLike], source: str | os.PathLike,
            out_dir: str | os.PathLike, *,
            mode: str = "auto", budget_bytes: int | None = None, budget_flag: str = "--memory-budget",
            ignore_plan: bool = False, console=None, **options) -> Iterator:
    """Segment every case of ``source`` with the model in ``run_dir`` (``bigmem predict``); one result per case.

    Args:
        run_dir: a run directory or an exported model folder (``bigmem export``); a list of them: an
            ensemble whose class probabilities are averaged (``bigmem.infer.predict.load_ensemble``).
        source: NIfTI files, a folder of them (MSD, nnU-Net v2 or KiTS layout) or an HDF5 store.
        out_dir: where ``<case id>.nii.gz`` label maps are written (atomically).
        mode: "auto" (default: per case, whole where the inference memory plan says the whole
            volume fits ``budget_bytes``, else sliding windows), "whole" (refused, exit 3, where it
            does not fit, unless ``ignore_plan``) or "sliding".
        budget_bytes: the memory budget (default: MemAvailable).
        budget_flag: how the budget was given, for messages.
        ignore_plan: run "whole" even where the plan says it does not fit.
        console: a ``rich`` console where "auto" says which it chose and why (default: silent).
        **options: ``bigmem.infer.predict.predict``'s: ``overlap``, ``window``, ``tta``,
            ``save_probabilities``, ``checkpoint``, ``cases``, ``force``, ``say``.

    Returns:
        An iterator of each case's ``CaseResult`` (or ``KeptOutput`` for an output kept as it was),
        yielded as it is written: iterate it to run the prediction.

    Example:
        >>> results = list(predict("runs/demo", "imagesTs", "predictions"))
    """
    from bigmem.infer.mode import mode_chooser
    from bigmem.infer.predict import predict as run

    choose = mode_chooser(mode, budget_bytes, flag=budget_flag, ignore_plan=ignore_plan, console=console)
    return run(run_dir, source, out_dir, mode="auto", choose_mode=choose, **options)


def evaluate(predictions: str | os.PathLike, reference: str | os.PathLike, **options) -> dict:
    """Score predicted label maps against their references (``bigmem evaluate``): per-case, per-class Dice and HD95.

    Args:
        predictions: a folder of ``<case id>.nii.gz`` (``predict``'s output).
        reference: the reference labels: a folder, an MSD / nnU-Net v2 / KiTS dataset, or a store.
        **options: ``bigmem.infer.evaluate.evaluate``'s: ``classes``, ``num_classes``, ``out`` (writes
            summary.json), ``hausdorff``, ``allow_missing``, ``run``.

    Returns:
        The summary as a dict (nnU-Net's summary.json shape: ``metric_per_case``, ``mean``, ``foreground_mean``).

    Example:
        >>> evaluate("predictions", "labelsTs")["foreground_mean"]["Dice"]
    """
    from bigmem.infer.evaluate import evaluate as run

    return run(predictions, reference, **options)


@dataclass
class PlanResult:
    """``plan``'s answer: the resolved config and budget, the plan, the layouts on several NUMA nodes, and notes
    (a budget above this machine's memory)."""

    config: "ExperimentConfig"
    budget: "Budget"
    plan: "Plan"
    layouts: "Layouts | None" = None
    notes: tuple[str, ...] = ()
    out: Path | None = None
    kept: bool = False  # a plan in which nothing fits left the plan.json already at ``out`` as it was
    counts_for: Callable | None = None

    def require(self) -> None:
        """Refuse (exit 3) a plan in which nothing fits, or a fixed inference volume that does not fit (naming
        the largest that does), saying whether ``out`` holds every candidate or was kept.

        Raises:
            InsufficientMemoryError: as ``memory.plans.require_fit``.
        """
        from bigmem.memory.plans import plan_inference, require_plan

        from bigmem.memory.estimate import Pass

        fixed = self.config.data.shape if self.plan.pass_ is Pass.FORWARD else None
        if fixed is not None:
            require_plan(self.plan, self.out, self.kept,
                         lambda: plan_inference(self.config, self.counts_for, self.budget, fixed))
        require_plan(self.plan, self.out, self.kept)


def configure(store: str | os.PathLike):
    """The network nnU-Net v2's experiment-planner rules configure for ``store``'s cases, whole.

    ``data.experiment.configure_experiment``: the target spacing, each stage's kernel and stride per axis,
    the stages and features. ``plan(config, experiment=...)`` then sizes its batch, precision and recompute mode
    and writes it as a preset; ``Experiment.tables`` is that preset's tables (``resolve_config`` takes them).

    Args:
        store: an HDF5 store (``convert``).

    Returns:
        A ``data.experiment.Experiment``.

    Raises:
        DataError: the store cannot be read, or a case has no spacing.

    Example:
        >>> experiment = configure("kits.h5")
        >>> experiment.topology.strides[1], experiment.topology.kernel_sizes[0]
        ((1, 2, 2), (1, 3, 3))
    """
    from bigmem.data.experiment import configure_experiment

    return configure_experiment(store)


def plan(config: "ExperimentConfig", *, batch_size: int | None = None, budget_bytes: int | None = None,
         budget_flag: str = "--memory-budget", numa=None, inference: bool = False,
         allow_bf16: bool | None = None, out: str | os.PathLike | None = None, topology=None,
         experiment=None) -> PlanResult:
    """What fits the memory budget (``bigmem plan``), before anything is allocated.

    Training: the largest volume (unless ``data.shape`` fixes it), then batch (unless ``batch_size``
    fixes it), that fits; with ``data.store``, the store's own cases at their own shapes, the batch capped
    by the dataset (``data.experiment.dataset_batch_cap``: a step sees at most 5% of its voxels, at least 2).
    ``inference``: the largest whole cube one prediction can segment, or whether ``data.shape`` fits.

    Args:
        config: ``resolve_config(...)``.
        batch_size: fix the batch and search the volume (default: search both).
        budget_bytes: the budget (default: what ``numa``'s placement can use, else MemAvailable; on a
            machine of several NUMA nodes, what one interleaved process can hold).
        budget_flag: how the budget was given, for messages.
        numa: a ``--numa`` policy to budget for (``"bind:1"``, ``"interleave"``), or a resolved
            ``bigmem.numa.policy.Placement``.
        inference: plan ``bigmem predict``'s whole-volume pass instead of training.
        allow_bf16: consider bf16 (default: only where the CPU has it natively).
        out: write plan.json there (a plan in which nothing fits replaces no file).
        topology: the machine's NUMA nodes (default: read from sysfs; a ``NUMATopology`` to plan for another).
        experiment: a ``data.experiment.Experiment`` ``config``'s network was configured from
            (``configure_experiment``); its preset, with the batch, precision and recompute mode chosen, is
            written beside ``out`` (``EXPERIMENT_FILE``) and plan.json's ``experiment`` says so.

    Returns:
        A ``PlanResult``; ``plan.fits`` says whether anything fits (``memory.plans.require_fit`` refuses
        it with exit code 3).

    Example:
        >>> planned = plan(resolve_config("small"), budget_bytes=20 * 2**30)
        >>> planned.plan.chosen.volume, planned.plan.chosen.batch_size
        (344, 1)
    """
    from bigmem.memory.budget import resolve_budget
    from bigmem.memory.plans import plan_inference, store_cases, write_plan
    from bigmem.memory.profile import counts_function
    from bigmem.numa.topology import NUMATopology

    topology = topology or NUMATopology.from_sysfs()
    budget = resolve_budget(budget_bytes, flag=budget_flag, placement=_placement(numa, topology), topology=topology)
    cases = []
    if config.data.store is not None and not inference:
        config, cases = store_cases(config)
    counts_for = counts_function(config)
    if inference:
        planned, layouts = plan_inference(config, counts_for, budget, config.data.shape, check=False), None
    else:
        budget, planned, layouts = _plan_training(config, counts_for, budget, cases, batch_size, allow_bf16, topology)
    notes = _budget_notes(budget, inference)
    if experiment is not None:
        planned, written = _with_experiment(experiment, planned, out)
        notes += written
    kept = not write_plan(Path(out), planned, layouts) if out is not None else False
    return PlanResult(config, budget, planned, layouts, notes, Path(out) if out is not None else None, kept, counts_for)


def _plan_training(config, counts_for, budget, cases, batch_size, allow_bf16, topology) -> tuple:
    """``plan``'s training search: (the budget it sized by, the plan, the layouts on several nodes)."""
    from bigmem.memory.plans import plan_layouts, plan_search, search_budget

    budget = search_budget(budget, topology)
    planned = plan_search(config, counts_for, budget, cases=cases, volume=config.data.shape, batch_size=batch_size,
                          allow_bf16=allow_bf16)
    if cases and batch_size is None:
        planned = _capped_by_dataset(planned, config, counts_for, budget, cases, allow_bf16)
    return budget, planned, plan_layouts(planned, topology)


def _capped_by_dataset(planned, config, counts_for, budget, cases, allow_bf16):
    """``planned`` with its batch capped by the dataset (``data.experiment.dataset_batch_cap``), searched again
    at the cap where memory alone allowed more; plan.json's ``batch_cap`` records the cap either way."""
    from bigmem.data.experiment import dataset_batch_cap
    from bigmem.memory.plans import plan_search, planned_shape
    from bigmem.memory.records import BatchCap

    sample = planned_shape([c.trained_shape for c in cases], 2)
    cap = dataset_batch_cap([c.shape for c in cases], sample)
    uncapped = planned.chosen.batch_size if planned.chosen is not None else None
    if uncapped is not None and uncapped > cap:
        planned = plan_search(config, counts_for, budget, cases=cases, volume=config.data.shape, batch_size=cap,
                              allow_bf16=allow_bf16)
    return dataclasses.replace(planned, batch_cap=BatchCap(cap, sum(math.prod(c.shape) for c in cases),
                                                           math.prod(sample), uncapped))


def _with_experiment(experiment, planned, out) -> tuple:
    """``planned`` with its ``experiment``, whose preset with ``planned``'s choice is written beside ``out``; and the
    notes."""
    from bigmem.data.experiment import EXPERIMENT_FILE, write_preset
    from bigmem.memory.records import PlannedExperiment

    chosen = planned.chosen
    notes = ()
    preset = None
    if chosen is not None and out is not None:
        tables = experiment.tables(batch_size=chosen.batch_size, precision=chosen.precision,
                                   recompute=chosen.recompute)
        preset = write_preset(tables, Path(out).parent / EXPERIMENT_FILE)
    if experiment.resampling:
        notes += (f"Resampling: {experiment.resampling}",)
    planned = dataclasses.replace(planned, experiment=PlannedExperiment(experiment, str(preset) if preset else None))
    return planned, notes


def _budget_notes(budget: "Budget", inference: bool) -> tuple[str, ...]:
    """What to tell the user about ``budget``: capped by the placement, or above this machine's memory."""
    from bigmem.memory.search import machine_memory_bytes
    from bigmem.units import format_bytes

    notes = (budget.note,) if budget.note else ()
    total = machine_memory_bytes()
    if budget.budget_bytes > total and not inference:
        notes += (f"note: {budget.source} {format_bytes(budget.budget_bytes)} is more than this machine's memory "
                  f"({format_bytes(total)}): this plans for a bigger machine (bigmem train refuses such a budget "
                  "here)",)
    return notes


def _placement(numa, topology):
    """A ``--numa`` policy text resolved on ``topology`` (a ``Placement`` or None passes through)."""
    if not isinstance(numa, str):
        return numa
    from bigmem.numa.policy import resolve_placement

    return resolve_placement(numa, None, None, topology, set(os.sched_getaffinity(0)))


def profile(config: "ExperimentConfig", shape: Sequence[int] | None = None, *, inference: bool = False,
            measure: bool = False, steps: int | None = None, budget_bytes: int | None = None, numa=None,
            topology=None, verbose: bool = False, say: Callable[[str], None] | None = None,
            progress: Callable[[str], None] | None = None) -> "Profile":
    """The predicted memory of one pass, per component (``bigmem profile``), and the measured peak if asked.

    A training step recomputes the stages ``bigmem train`` would (``memory.recompute`` auto: the fewest that
    fit the budget). A measurement trains real steps in a child process, so one whose predicted peak exceeds
    the budget, or with an explicit budget above this machine's memory, is refused before it starts.

    Args:
        config: ``resolve_config(...)``.
        shape: ``(D, H, W)`` (default: ``data.shape``, else the preset's reference cube).
        inference: one whole-volume prediction instead of a training step (no budget is asked).
        measure: also run it in a child process and read its peak (VmHWM).
        steps: training steps to measure (default ``bigmem.memory.MEASURED_STEPS``).
        budget_bytes: the budget recompute auto fits and a measurement is checked against (default:
            ``memory.budget_bytes``, else what the placement can use, else MemAvailable).
        numa: a ``numa.policy`` text or a resolved ``Placement`` (default: ``config.numa``'s).
        topology: the machine's NUMA nodes (default: read from sysfs).
        verbose: TensorFlow's start-up logs.
        say: called with each note on the budget recompute auto fits, a template whose ``{section.name}``
            settings ``bigmem.errors.render_fields`` names; progress: with a line before a measurement.

    Returns:
        A ``Profile``: ``estimate.components`` (bytes), ``.predicted_peak_bytes``, ``.recompute_stages``, with
        ``measure`` the ``measurement`` and ``error_pct``; the ``budget`` it resolved (None if none was needed).

    Raises:
        InsufficientMemoryError: (exit 3) ``measure`` past the budget, or an explicit budget above this machine's.

    Example:
        >>> profile(resolve_config("small"), (64, 64, 64)).estimate.predicted_peak_bytes
    """
    from bigmem.memory import MEASURED_STEPS
    from bigmem.memory.estimate import Pass
    from bigmem.memory.plans import recompute_stages
    from bigmem.memory.profile import profile as run
    from bigmem.memory.profile import refuse_unfit_measurement

    shape = tuple(shape or config.data.shape or (config.data.reference_volume,) * 3)
    if not inference:
        config = config.updated({"data": {"shape": list(shape)}})
    placement, topology = _profile_placement(config, numa, topology)
    counts_for = _counts_for(config, verbose)
    if inference:
        if measure:
            (progress or _silent)(f"measuring inference at {'x'.join(map(str, shape))} ...")
        return run(config, shape, counts_for, pass_=Pass.FORWARD, do_measure=measure)
    auto = config.memory.recompute.value == "auto"
    budget = _profile_budget(config, budget_bytes, placement, topology) if auto or measure else None
    if auto and budget.note:
        (say or _silent)(budget.note)
    stages = recompute_stages(config, counts_for, shape, budget.budget_bytes if auto else None)
    if measure:
        refuse_unfit_measurement(config, counts_for, shape, stages, budget, "{profile.measure}",
                                 "measure a smaller {profile.shape}")
    result = run(config, shape, counts_for, do_measure=measure, steps=steps or MEASURED_STEPS,
                 recompute_stages=stages)
    return dataclasses.replace(result, budget=budget)


@dataclass(frozen=True)
class SweepResult:
    """``sweep``'s answer: each size's ``Profile`` (measured), the scaling law fitted to them, and the budget the
    largest was checked against."""

    profiles: tuple["Profile", ...]
    scaling_law: "ScalingLaw"
    budget: "Budget"


@dataclass(frozen=True)
class CalibrationResult:
    """``calibrate``'s answer: the fitted (and saved) calibration, the measured points it was fitted to, and the
    budget the largest was checked against."""

    calibration: "Calibration"
    points: tuple[dict, ...]
    budget: "Budget"


def sweep(config: "ExperimentConfig", shapes: Sequence[Sequence[int] | int], *, steps: int | None = None,
          budget_bytes: int | None = None, numa=None, topology=None, verbose: bool = False,
          progress: Callable[[str], None] | None = None) -> SweepResult:
    """Measure and predict each of ``shapes`` and fit peak = fixed + bytes/voxel x voxels (``bigmem profile
    --sweep``).

    Args:
        config: ``resolve_config(...)`` (its ``memory.recompute`` none or stages).
        shapes: ``(D, H, W)`` shapes (an int N is N^3), each a training step's.
        steps, budget_bytes, numa, topology, verbose: as ``profile``'s.
        progress: called with a line before each size is measured (default: silent).

    Returns:
        A ``SweepResult``.

    Raises:
        InsufficientMemoryError: (exit 3) the largest size's predicted peak exceeds the budget, or an explicit
            budget above this machine's memory; nothing is measured then.

    Example:
        >>> sweep(resolve_config("tiny"), [32, 48]).scaling_law.bytes_per_voxel
    """
    from bigmem.memory import MEASURED_STEPS
    from bigmem.memory.profile import sweep as run

    shapes, counts_for, budget = _measurable(config, shapes, "{sweep.shapes}", budget_bytes, numa, topology,
                                             verbose)
    results, law = run(config, shapes, counts_for, steps=steps or MEASURED_STEPS, progress=_measuring(progress))
    return SweepResult(tuple(results), law, budget)


def calibrate(config: "ExperimentConfig", shapes: Sequence[Sequence[int] | int], *, steps: int | None = None,
              budget_bytes: int | None = None, numa=None, topology=None, verbose: bool = False,
              progress: Callable[[str], None] | None = None) -> CalibrationResult:
    """Measure ``shapes`` and fit this machine's calibration for the config's preset, precision and recompute
    (``bigmem profile --calibrate``); it is saved, and later estimates use it.

    Args:
        config: ``resolve_config(...)`` (its ``memory.recompute`` none or stages).
        shapes: ``(D, H, W)`` shapes (an int N is N^3), each a training step's.
        steps, budget_bytes, numa, topology, verbose: as ``profile``'s.
        progress: called with a line before each size is measured (default: silent).

    Returns:
        A ``CalibrationResult``.

    Raises:
        InsufficientMemoryError: (exit 3) as ``sweep``'s.
        UsageError: some sizes recompute stages and others none.

    Example:
        >>> calibrate(resolve_config("tiny"), [32, 64, 96]).calibration.activation_scale
    """
    from bigmem.memory import MEASURED_STEPS
    from bigmem.memory.profile import calibrate as run

    shapes, counts_for, budget = _measurable(config, shapes, "{calibrate.shapes}", budget_bytes, numa, topology,
                                             verbose)
    calibration, points = run(config, shapes, counts_for, steps=steps or MEASURED_STEPS,
                              progress=_measuring(progress))
    return CalibrationResult(calibration, tuple(points), budget)


def _silent(line: str) -> None:
    """A callback that says nothing."""


def _measuring(progress: Callable[[str], None] | None) -> Callable[[tuple], None]:
    """``memory.profile``'s per-shape progress as ``progress``'s line."""
    from bigmem.units import format_shape

    return lambda shape: (progress or _silent)(f"measuring {format_shape(shape)} ...")


def _measurable(config, shapes, what, budget_bytes, numa, topology, verbose) -> tuple:
    """(the shapes, the network's counts, the budget) for measuring ``shapes``, after refusing (exit 3) a largest
    shape whose predicted peak exceeds the budget; ``what`` names the setting that asked for them."""
    from bigmem.memory.profile import refuse_unfit_measurement
    from bigmem.units import as_shape

    shapes = [as_shape(shape) for shape in shapes]
    placement, topology = _profile_placement(config, numa, topology)
    counts_for = _counts_for(config, verbose)
    budget = _profile_budget(config, budget_bytes, placement, topology)
    refuse_unfit_measurement(config, counts_for, max(shapes, key=math.prod), None, budget, what,
                             f"give {what} smaller sizes")
    return shapes, counts_for, budget


def _profile_placement(config, numa, topology) -> tuple:
    """(the placement ``numa`` or else ``config.numa`` asks for, resolved and checked; the topology)."""
    from bigmem.numa.policy import resolve_placement
    from bigmem.numa.topology import NUMATopology

    topology = topology or NUMATopology.from_sysfs()
    if numa is None:
        numa = resolve_placement(config.numa.policy, config.numa.cpus, config.numa.threads, topology,
                                 set(os.sched_getaffinity(0)))
    return _placement(numa, topology), topology


def _counts_for(config, verbose: bool) -> Callable:
    """``memory.profile.counts_function(config)``, TensorFlow imported first (quietly unless ``verbose``)."""
    from bigmem.tfenv import import_tensorflow

    import_tensorflow(verbose=verbose)  # before anything imports Keras
    from bigmem.memory.profile import counts_function

    return counts_function(config)


def _profile_budget(config, budget_bytes, placement, topology) -> "Budget":
    """The budget ``profile``, ``sweep`` and ``calibrate`` fit: ``budget_bytes``, else ``memory.budget_bytes``,
    else ``memory.budget.resolve_budget``'s rule; an explicit one named as its setting."""
    from bigmem.memory.budget import EXPLICIT_FIELD, resolve_budget

    explicit = budget_bytes if budget_bytes is not None else config.memory.budget_bytes
    return resolve_budget(explicit, flag=EXPLICIT_FIELD, placement=placement, topology=topology)


def compare(request, *, progress: Callable[[str], None] | None = None, generating=None, verbose: bool = False):
    """Train the same model bigmem's way and data-parallel on patches, and score both (``bigmem compare``).

    Args:
        request: a ``bigmem.compare.setup.CompareRequest`` (every option of the subcommand, with its default).
        progress: called with a line per stage.
        generating: a context manager factory shown while the synthetic phantoms are made.
        verbose: TensorFlow's logs in each run.

    Returns:
        The ``CompareReport`` (also written as compare.json, compare.md and compare.png under ``request.out``).

    Example:
        >>> from bigmem.compare.setup import CompareRequest
        >>> compare(CompareRequest(steps=20, out="compare")).conclusion.text
    """
    from bigmem.compare.setup import run_compare

    return run_compare(request, progress=progress, generating=generating, verbose=verbose)


def convert(source, out: str | os.PathLike, *, images: Sequence[str] = (), labels: Sequence[str] = (),
            say: Callable[[str], None] | None = None, **options):
    """Convert a dataset folder (MSD, nnU-Net v2 raw, KiTS) or image/label globs to an HDF5 store (``bigmem convert``).

    Args:
        source: the dataset folder or its dataset.json (None with ``images`` and ``labels``), or a
            dataset already read (``bigmem.data.layouts.read_dataset``).
        out: the store to write (atomically), with its manifest beside it.
        images, labels: glob patterns of NIfTI files instead of ``source``.
        say: called with the line that says what was found (layout, cases, channels), then each note on it.
        **options: ``bigmem.data.convert.convert``'s: ``force``, ``append``, ``skip_bad``,
            ``compression``, ``chunk_edge``, ``shape``, ``spacing``, ``normalization``, ``progress``.

    Returns:
        The ``ConvertReport``: ``store``, ``manifest``, ``converted`` and ``skipped`` case ids, the
        normalisation chosen per channel (``preprocessing``) and ``notes``.

    Example:
        >>> convert("Task04_Hippocampus", "hippocampus.h5").converted[:2]
        ['hippocampus_001', 'hippocampus_003']
    """
    from bigmem.data.convert import convert as run
    from bigmem.data.layouts import describe_dataset, read_dataset, read_globs

    if source is None:
        dataset = read_globs(list(images), list(labels))
    elif isinstance(source, (str, os.PathLike)):
        dataset = read_dataset(source)
    else:
        dataset = source
    if say is not None:
        for line in (describe_dataset(dataset), *dataset.notes):
            say(line)
    return run(dataset, out, **options)


@dataclass(frozen=True)
class TuneResult:
    """``tune``'s answer: this machine's tuning after the last pass, the file it is in, and each pass's record
    (``Tuning.tuned``'s entries: model, shape, precision, batch, seconds, convolutions and those timed, partial)."""

    tuning: "Tuning"
    path: Path
    passes: tuple[dict, ...]


@dataclass(frozen=True)
class MachineTuning:
    """``machine_tuning``'s answer: this machine's key (described), its tuning (None: the shipped tables are in
    force) and the file it is, or would be, in."""

    key: str
    tuning: "Tuning | None"
    path: Path


def tune(config: "ExperimentConfig", shape: Sequence[int] | None = None, *, precisions: Sequence[str] | None = None,
         seconds: float | None = None, measure_memory: bool = True, say: Callable[[str], None] | None = None,
         progress: Callable[[str, float], None] | None = None) -> TuneResult:
    """Time this machine's kernel choices at ``config``'s network and shape, and measure its fixed memory
    (``bigmem tune``); each precision's pass is merged into this machine's tuning file, which later runs read.

    Args:
        config: ``resolve_config(...)`` (model, batch size, recompute mode; its precision is each pass's).
        shape: ``(D, H, W)`` of one training volume (default: ``data.shape``, else the preset's reference cube).
        precisions: the precisions to time, one pass each (default: ``bigmem.tune.default_precisions``: fp32, and
            bf16 too where the CPU has it natively).
        seconds: the most seconds each pass may take, memory step included (default
            ``bigmem.tune.DEFAULT_BUDGET_S``); convolutions left untimed keep the shipped choice.
        measure_memory: also measure the framework's fixed memory (a training step at the smallest shape).
        say: called with a line before each pass (network, shape, batch, precision, machine) and one after it
            (convolutions timed, seconds) (default: silent).
        progress: called with (what, fraction of the pass done) as each pass goes, from ``("", 0.0)`` at its start
            to ``("done", 1.0)`` (default: silent).

    Returns:
        A ``TuneResult``.

    Raises:
        UsageError: ``seconds`` not a positive, finite number.
        ConfigError: ``shape`` the network cannot take, or an unknown precision.

    Example:
        >>> tune(resolve_config("tiny"), (16, 16, 16), precisions=["fp32"], seconds=2).passes[0]["timed"]
    """
    from bigmem.config.schema import check_shape
    from bigmem.nets.tuning import key_here, tuning_path
    from bigmem.tune import DEFAULT_BUDGET_S, default_precisions
    from bigmem.tune import tune as run

    if seconds is not None and not 0 < seconds < math.inf:
        raise UsageError(f"Invalid {{tune.seconds}} {seconds:g}: expected a positive, finite number.")
    if shape is not None:
        check_shape("tune.shape", tuple(shape), config.model)
    shape = tuple(shape or config.data.shape or (config.data.reference_volume,) * 3)
    say, progress = say or _silent, progress or (lambda what, done: None)
    tuning, passes = None, []
    for precision in precisions or default_precisions():
        sized = config.updated({"train": {"precision": precision}})
        say(f"tuning {sized.model.name} at {'x'.join(map(str, shape))}, batch {sized.train.batch_size}, {precision} "
            f"on {key_here().describe()} ...")
        progress("", 0.0)
        tuning = run(sized, shape, budget_s=seconds or DEFAULT_BUDGET_S, measure_memory=measure_memory,
                     progress=progress)
        last = tuning.tuned[-1]
        passes.append(last)
        say(f"  {last['timed']} of {last['convolutions']} convolutions timed in {last['seconds']:.0f} s"
            + (" (out of time: the rest keep the shipped choice)" if last["partial"] else ""))
    return TuneResult(tuning, tuning_path(), tuple(passes))


def machine_tuning() -> MachineTuning:
    """This machine's tuning as the layers and the planner read it (``bigmem tune --show``); nothing is timed.

    Returns:
        A ``MachineTuning``: its ``tuning`` (``describe()``, ``summary()``) is None where this machine is not tuned.

    Example:
        >>> machine_tuning().tuning is None  # never tuned here: the shipped tables are in force
        True
    """
    from bigmem.nets.tuning import key_here, load_tuning, tuning_path

    return MachineTuning(key_here().describe(), load_tuning(), tuning_path())


def export(run_dir: str | os.PathLike, out: str | os.PathLike, *, checkpoint: str | None = None,
           force: bool = False) -> "Exported":
    """Copy what ``predict`` needs of a run into a model folder, to use on another machine (``bigmem export``).

    Args:
        run_dir: a finished ``train`` run (``model.keras``), or one with ``checkpoint``.
        out: the model folder to write (atomically).
        checkpoint: also copy this checkpoint: ``"best"``, ``"latest"`` or ``"ckpt-N"`` (default: model.keras only).
        force: replace an existing ``out``.

    Returns:
        The ``Exported`` record (``bigmem.infer.export``): the folder, the files in it and their bytes.

    Raises:
        DataError: not a run directory, no model.keras (and no ``checkpoint``), no such checkpoint, or ``out``
            exists without ``force`` (or is inside the run).

    Example:
        >>> export("runs/spheres", "spheres-model").files
        ['config.json', 'model.keras', 'plan.json', 'preprocessing.json']
    """
    from bigmem.infer.export import export_run

    return export_run(run_dir, out, checkpoint=checkpoint, force=force)


def info(*, tensorflow: bool = True, verbose: bool = False) -> dict:
    """The machine as bigmem sees it (``bigmem info``): CPU and ISA, memory, NUMA nodes, TensorFlow and oneDNN,
    the kernel tables in force, and where each network's fixed memory term comes from.

    Args:
        tensorflow: import TensorFlow and describe it (its version, oneDNN, GPUs); False is faster.
        verbose: TensorFlow's start-up logs.

    Returns:
        ``bigmem.sysinfo.collect_sysinfo``'s dict (``bigmem info --json``'s), with ``memory_terms``: per network
        with a shipped table, ``memory.calibration.fixed_term_status`` (measured here, this CPU's table, or
        borrowed from another CPU until its first run measures it).

    Example:
        >>> info(tensorflow=False)["cpu"]["logical_cpus"]
        2
    """
    from bigmem.sysinfo import collect_sysinfo
    from bigmem.tfenv import import_tensorflow

    if tensorflow:
        import_tensorflow(verbose=verbose)
    machine = collect_sysinfo(include_tensorflow=tensorflow)
    from bigmem.memory.calibration import fixed_term_status, shipped_presets

    machine["memory_terms"] = {preset: fixed_term_status(preset) for preset in shipped_presets()}
    return machine


@dataclass(frozen=True)
class SynthResult:
    """``synth``'s answer: the store written, its phantoms (how many, their edge and classes) and its bytes."""

    path: Path
    cases: int
    volume: int
    classes: int
    nbytes: int


def synth(out: str | os.PathLike, *, cases: int = 8, volume: int = 64, classes: int = 3, seed: int = 0,
          force: bool = False, progress: Callable[[int, int], None] | None = None) -> SynthResult:
    """Write synthetic 3D phantoms to an HDF5 store (``bigmem synth``): noisy volumes with a bias field and lumpy
    ellipsoids of ``classes - 1`` foreground classes, a store ``train`` reads as ``data.store``.

    Args:
        out: the store to write (atomically).
        cases: how many phantoms.
        volume: the edge of each cubic volume, in voxels.
        classes: classes, background included (2..255).
        seed: the phantoms' random seed.
        force: overwrite an existing ``out``.
        progress: called with (0, cases) once the arguments are checked, then (cases done, cases) after each
            phantom (default: silent).

    Returns:
        A ``SynthResult``.

    Raises:
        UsageError: ``cases`` below 1, ``volume`` below 4, or ``classes`` outside 2..255.
        DataError: ``out`` exists and not ``force``.

    Example:
        >>> synth("phantoms.h5", cases=2, volume=16).nbytes > 0
        True
    """
    from bigmem.data.synth import write_synthetic_store

    check_synth(cases, volume, classes)
    out = Path(out)
    if out.exists() and not force:
        raise DataError(f"{str(out)!r} exists: pass {{synth.force}} to overwrite it.")
    if progress is not None:
        progress(0, cases)
    write_synthetic_store(out, num_cases=cases, volume=volume, num_classes=classes, seed=seed, progress=progress)
    return SynthResult(out, cases, volume, classes, out.stat().st_size)


def check_synth(cases: int, volume: int, classes: int) -> None:
    """Refuse what ``synth`` cannot write, before anything else is done: for a caller that checks more (memory,
    disk) before ``synth`` runs, as ``bigmem synth`` does.

    Raises:
        UsageError: ``cases`` below 1, ``volume`` below 4, or ``classes`` outside 2..255.

    Example:
        >>> check_synth(0, 64, 3)
        Traceback (most recent call last):
        bigmem.errors.UsageError: Invalid synth.cases 0: expected a positive integer.
    """
    if cases < 1:
        raise UsageError(f"Invalid {{synth.cases}} {cases}: expected a positive integer.")
    if volume < 4:
        raise UsageError(f"Invalid {{synth.volume}} {volume}: expected an integer >= 4.")
    if not 2 <= classes <= 255:
        raise UsageError(f"Invalid {{synth.classes}} {classes}: expected 2..255 (background + foreground classes).")


@dataclass(frozen=True)
class ReportResult:
    """``report``'s answer: the folder written, each run's summary (report.json's ``runs``: state, steps, peak RSS,
    input stall share, ``notes`` on what was left out while reading) and the plots' file names by name."""

    folder: Path
    runs: tuple[dict, ...]
    plots: dict[str, str]


def report(run_dirs: str | os.PathLike | Sequence[str | os.PathLike],
           out: str | os.PathLike | None = None) -> ReportResult:
    """Plot and summarise a run, finished or still running, or two side by side (``bigmem report``).

    Args:
        run_dirs: one run directory, or two to draw on the same axes and summarise in adjacent columns.
        out: the folder for the PNG plots, report.md and report.json (default: the first run's report/).

    Returns:
        A ``ReportResult``.

    Raises:
        DataError: no such directory, one with neither metrics.jsonl nor monitor.csv, or not one or two of them.

    Example:
        >>> report("runs/spheres").runs[0]["steps"]
        6
    """
    from bigmem.monitor.report import make_report

    run_dirs = [run_dirs] if isinstance(run_dirs, (str, os.PathLike)) else list(run_dirs)
    folder, written = make_report(run_dirs, out)
    return ReportResult(folder, tuple(written["runs"]), dict(written["plots"]))


__all__ = ["CalibrationResult", "MachineTuning", "PlanResult", "ReportResult", "SweepResult", "SynthResult",
           "TuneResult", "auto_preset", "calibrate", "check_synth", "compare", "configure", "convert", "evaluate",
           "export", "info", "machine_tuning", "plan", "planned_preset", "predict", "preset_for", "profile", "report",
           "resolve_config", "sweep", "synth", "train", "train_per_node", "tune"]
