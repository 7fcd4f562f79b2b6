"""``train(config, run_dir)``: the public entry point under ``bigmem train``.

A run is three parts: a job prepared once (``train/job.py``: config, run directory, placement,
execution, loader, memory plan), the model and optimizer built (and restored) for it, and a loop
of a few lines (``train/loop.py``) whose callbacks (``train/callbacks.py``) do everything else.
It writes the run directory (docs/rundir.md) through ``RunDir``: config.json, sysinfo.json,
plan.json, numa.json, metrics.jsonl, monitor.csv, checkpoints/, model.keras and, last,
summary.json.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from bigmem.config.options import Augment, OptimizerName, Precision
from bigmem.config.schema import ExperimentConfig
from bigmem.errors import DataError, DiskFullError, TrainingError
from bigmem.infer.modelcard import CARD_NAME, ModelCard
from bigmem.atomic import atomic_output, nearest_existing, remove_leftover_temporaries
from bigmem.sysinfo import collect_sysinfo
from bigmem.tfenv import import_tensorflow
from bigmem.train import callbacks as cb
from bigmem.train.job import Job, prepare_job
from bigmem.train.loop import LoopState, StopReason, run_loop
from bigmem.train.resume import NothingToDo, Restored, restore


@dataclass
class TrainResult:
    """What a run ended with.

    Attributes:
        run_dir: the run directory.
        start_step: the step this session started from (0, or the resumed checkpoint's).
        final_step: the last completed step.
        total_steps: the step the run was to end at.
        last_loss, last_dice: the last step's loss and foreground Dice.
        interrupted_by: the signal that stopped the run early, if any.
    """

    run_dir: Path
    start_step: int
    final_step: int
    total_steps: int
    last_loss: float
    last_dice: float
    interrupted_by: int | None = None


def make_optimizer(config: ExperimentConfig, schedule):
    """SGD with Nesterov momentum or Adam (``train.optimizer``), fused per variable (``train/optimizers.py``), with
    ``train.weight_decay`` as coupled L2 and the gradients clipped to ``train.clip_norm`` (global norm)."""
    from bigmem.train.optimizers import FusedAdam, FusedSGD

    train = config.train
    common = {"learning_rate": schedule, "l2": train.weight_decay, "global_clipnorm": train.clip_norm}
    if train.optimizer is OptimizerName.SGD:
        return FusedSGD(momentum=train.momentum, nesterov=True, **common)
    return FusedAdam(**common)


class TraceCount:
    """How many times a ``tf.function`` traced (its Python body runs only while tracing)."""

    def __init__(self):
        self.count = 0

    def __call__(self) -> int:
        return self.count


def train(config: ExperimentConfig, run_dir: str | os.PathLike, *, resume: bool = False,
          console: Console | None = None, verbose: bool = False,
          recompute_stages: list[str] | None = None, force: bool = False) -> TrainResult:
    """Train ``config`` into ``run_dir``, or continue it from its newest checkpoint.

    Before anything large is allocated the footprint is estimated and checked against the memory
    budget (``memory.budget.resolve_budget``: ``memory.budget_bytes``, else what the NUMA
    placement can use, else MemAvailable).

    Args:
        config: the resolved config (``config.presets.resolve_config``); ``data.store`` None
            trains on the embedded synthetic dataset.
        run_dir: the run directory (docs/rundir.md); created if missing.
        resume: continue ``run_dir`` from its newest complete checkpoint.
        console: where progress and messages go (default: stdout).
        verbose: show TensorFlow's own logs.
        recompute_stages: stages whose activations backward recomputes, instead of
            ``memory.recompute``'s choice (the memory probe passes them).
        force: train even if the predicted peak exceeds the budget.

    Returns:
        A ``TrainResult``; ``interrupted_by`` is set when SIGINT/SIGTERM stopped the run (a
        checkpoint was written; resume with ``resume=True``).

    Raises:
        TrainingError: the run directory is in the way, nothing to resume, a non-finite loss.
        DataError: the store or a case cannot be read.
        ConfigError: a setting bigmem cannot use (it names the config field).
        InsufficientMemoryError: (exit 3) the job does not fit its budget, unless ``force``.

    A refused run leaves no ``run_dir``: every check runs (and the tuning pass, where due, after them)
    before the directory is created, and a case refused as it is read (``DataError``) before the first
    checkpoint removes the directory again.

    Example:
        >>> result = train(resolve_config("tiny", {"train": {"steps": 4}}), "runs/tiny")
        >>> result.final_step
        4
    """
    console = console or Console(soft_wrap=True)
    check_run_dir_path(Path(run_dir))
    try:  # every check that can refuse the job, and the tuning pass where it is due: nothing written yet
        job = prepare_job(config, run_dir, resume=resume, force=force, console=console, verbose=verbose,
                          recompute_stages=recompute_stages)
    except NothingToDo as done:
        return _nothing_to_do(done, run_dir, console)
    try:
        return _run_locked(job, run_dir, resume, console, verbose)
    finally:
        job.close()


def _run_locked(job, run_dir, resume: bool, console: Console, verbose: bool) -> TrainResult:
    """The job run holding its directory, where every decision about the directory is made."""
    with exclusive_run_dir(Path(run_dir)) as created:
        try:
            job = _resume_point_under_lock(job, resume)
        except NothingToDo as done:
            return _nothing_to_do(done, run_dir, console)
        try:
            return _run(job, console, verbose)
        except DataError:
            # A case refused as it is read (its store changed after convert recorded its values, which
            # the pre-flight trusts): a directory this call made, with no checkpoint yet, goes again.
            if created and job.checkpoints.latest() is None:
                shutil.rmtree(job.run.path, ignore_errors=True)
            raise


def _nothing_to_do(done: NothingToDo, run_dir, console: Console) -> TrainResult:
    """The result of a resumed run already at its last step (nothing was run or written)."""
    console.print(str(done))
    summary = done.summary or {}
    return TrainResult(Path(run_dir), done.step, done.step, done.total_steps,
                       float(summary.get("loss", "nan")), float(summary.get("dice", "nan")))


def _resume_point_under_lock(job: Job, resume: bool) -> Job:
    """``job`` with its resume point read again now that this process holds the directory: another run may
    have written a checkpoint there while the job was prepared (its lines were said then, so not again)."""
    import dataclasses
    import io

    from bigmem.train.resume import check_something_to_do, resume_point

    latest = resume_point(job.run, job.checkpoints, resume, Console(file=io.StringIO()))
    if latest == job.resume_from:
        return job
    if latest is not None:
        check_something_to_do(job.run, latest, job.total_steps)
    return dataclasses.replace(job, resume_from=latest)


def check_run_dir_path(path: Path) -> None:
    """Refuse, before anything is read or made, a run directory that cannot be one: a file, or a place where
    no folder can be created (probed with a temporary file in its nearest existing folder, which holds for root
    and read-only mounts too).

    Raises:
        TrainingError: naming the path and why.
    """
    import tempfile

    if path.is_file():
        raise TrainingError(f"Run directory {str(path)!r} is a file, not a folder: choose another {{train.run_dir}}.")
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise TrainingError(f"Run directory {str(path)!r} cannot be created or opened ({str(existing)!r} is a "
                            "file): choose another {train.run_dir}.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".bigmem-probe-", dir=existing)
    except OSError as exc:
        raise TrainingError(f"Run directory {str(path)!r} cannot be created or opened ({exc.strerror or exc}): "
                            "choose another {train.run_dir}.") from None
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def exclusive_run_dir(path: Path):
    """Hold ``path`` for this process: a second ``train`` into it is refused while this one runs.

    The lock is ``flock`` on the directory itself (no lock file), so the kernel releases it when
    the process ends, even by SIGKILL. Folders created for it are removed again if the run wrote
    nothing (a refused pre-flight leaves nothing behind), or if the caller removed the run directory.

    Yields:
        True where this call created ``path`` (it did not exist before), else False (a directory the
        user already had, such as a run to resume: never removed).

    Raises:
        TrainingError: another process holds it, or it cannot be a run directory (a file, no permission).
    """
    import fcntl

    missing = [folder for folder in (path, *path.parents) if not folder.exists()]  # the run directory first
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        what = "is a file, not a folder" if path.is_file() else f"cannot be created or opened ({exc.strerror})"
        raise TrainingError(f"Run directory {str(path)!r} {what}: choose another {{train.run_dir}}.") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TrainingError(f"Run directory {str(path)!r} is in use by another bigmem train process: wait for "
                                "it to end, or choose another {train.run_dir}.") from None
        except OSError:  # a filesystem without locks (ENOLCK, EOPNOTSUPP): run unguarded, as before locks
            pass
        yield path in missing
    finally:
        os.close(fd)
        for folder in missing:
            if not folder.exists():  # the run directory, removed by the caller
                continue
            try:
                folder.rmdir()  # only while empty
            except OSError:
                break


def build(job: Job, verbose: bool = False):
    """The model, optimizer and learning-rate schedule of ``job``, under its execution's scope."""
    import_tensorflow(verbose=verbose)
    import keras

    from bigmem.nets.unet3d import UNet3D
    from bigmem.train.schedules import WarmupPolynomialDecay

    config = job.config
    keras.utils.set_random_seed(config.train.seed)
    policy = "mixed_bfloat16" if config.train.precision is Precision.BF16 else "float32"
    with job.execution.scope():
        model = UNet3D(config.model, dtype=policy, name="unet3d").build_for()
        model.set_recompute(job.recompute_stages)  # chosen by the memory plan
        schedule = WarmupPolynomialDecay(job.learning_rate, job.total_steps, config.train.warmup_steps,
                                         config.train.lr_decay_power, config.train.end_lr)
        optimizer = make_optimizer(config, schedule)
        optimizer.build(model.trainable_variables)
    return model, optimizer, schedule


def step_and_batches(job: Job, model, optimizer, start_step: int, traces: TraceCount | None = None):
    """The compiled step and the input iterator, from ``job.execution``.

    The loss is Dice + cross-entropy over softmax classes with the mean foreground Dice as the
    step's metric, or, for ``model.region_outputs``, BCE + Dice over sigmoid regions with their mean
    hard Dice (``train.region_loss``); either is deep-supervised where the model is.
    """
    from bigmem.train.losses import dice_ce_per_sample, dice_counts, dice_from_counts, supervised

    if job.config.model.region_outputs:
        from bigmem.train.region_loss import membership, region_counts, region_dice_from_counts, region_loss

        member = membership(job.loader.store.regions, job.config.model.num_classes)
        loss, counts, from_counts = region_loss(member), region_counts(member), region_dice_from_counts
    else:
        loss, counts, from_counts = dice_ce_per_sample, dice_counts, dice_from_counts
    step = job.execution.make_step(model, optimizer, loss_per_sample=supervised(loss), metric_counts=counts,
                                   metric_from_counts=from_counts, traces=traces)
    return step, job.execution.batches(job.loader, start_step)


def default_callbacks(job: Job, console: Console, model, optimizer, start_step: int, numa: cb.NUMAReport,
                      validation: cb.Validation | None = None, shapes: cb.ShapeStats | None = None) -> list:
    """The run's callbacks, in the order they must run after each step."""
    train = job.config.train
    # The order matters: the non-finite guard raises before anything records a NaN step; the stoppers
    # (signal, time budget) run before the NUMA report, which reads placement at the first step and at
    # the step the run stops; the checkpoint written on an early stop is Checkpoints.on_train_end's.
    callbacks = [cb.NonFiniteGuard(job.checkpoints)]
    callbacks += [shapes] if shapes else []
    callbacks += [validation] if validation else []
    callbacks += [cb.MetricsLog(job.run, train.log_every), cb.TensorBoard(job.run.tensorboard, train.log_every),
                  cb.Progress(console, job.total_steps, start_step),
                  cb.Checkpoints(job.checkpoints, train.checkpoint_every, model, optimizer), cb.StopOnSignal()]
    callbacks += [cb.TimeBudget(train.time_budget_s)] if train.time_budget_s is not None else []
    callbacks += [numa]
    callbacks += [cb.Monitor(job.run, train.monitor_interval_s, job.config.data.store)] \
        if train.monitor_interval_s > 0 else []
    return callbacks


def validation_callback(job: Job, model, console: Console) -> cb.Validation | None:
    """``--val-every``: the held-out cases, validated through the prediction path (None when off)."""
    config = job.config
    if not config.train.val_every:
        return None
    from bigmem.infer.predict import Predictor

    held_out = list(job.loader.store.held_out)
    patch = job.execution.patch  # a run on patches is validated in windows of it
    return cb.Validation(config.train.val_every, Predictor(model, config, "training", patch), config.data.store,
                         held_out, job.checkpoints, console)


def _numa_summary(report: dict) -> str:
    requested = report["requested"]
    observed = ", ".join(f"{policy} on {count}" for policy, count in sorted(report["observed"].items(),
                                                                          key=lambda kv: -kv[1]))
    cpus = requested["cpus"]
    cpu_text = f"{cpus[0]}-{cpus[-1]}" if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)) else str(cpus)
    return (f"NUMA: --numa {requested['text']} on CPUs {cpu_text}, TF threads intra {requested['intra_op_threads']} "
            f"/ inter {requested['inter_op_threads']}; observed policy per thread: {observed}")


def _start(job: Job, model, optimizer, console: Console) -> Restored:
    """Restore the newest checkpoint that loads (if resuming) and write the run's opening files.

    Returns:
        Where the session starts (``resume.restore``): the step, and the checkpoint's loss and
        Dice (the run's last if no step is left: a run killed before its summary.json).
    """
    run = job.run
    restored = restore(run, job.checkpoints, job.resume_from, model, optimizer, job.total_steps, console)
    remove_leftover_temporaries(run.path)  # a killed run's, beside its outputs
    run.path.mkdir(parents=True, exist_ok=True)
    run.write_config({**job.config.to_dict(), "total_steps": job.total_steps, "effective_lr": job.learning_rate,
                      "augmentation": job.loader.augment.to_dict() if job.loader.augment else None})
    if job.resume_from is None or not (run.path / CARD_NAME).is_file():  # a resumed run keeps what it trained on
        ModelCard.from_store(job.config.data.store).write(run.path)  # predict needs the run directory only
    split = job.loader.store.split
    if split is not None and split.splits is not None:  # --fold K: the folds it was taken from, as nnU-Net keeps them
        run.write_splits(split.splits)
    run.write_sysinfo(collect_sysinfo())
    run.write_plan(job.plan.to_dict())
    return restored


def _run(job: Job, console: Console, verbose: bool) -> TrainResult:
    model, optimizer, schedule = build(job, verbose)
    restored = _start(job, model, optimizer, console)
    numa = _announce(job, model, console)
    loader = job.loader
    traces = TraceCount()
    step, batches = step_and_batches(job, model, optimizer, restored.step, traces)
    validation = validation_callback(job, model, console)
    shapes = cb.ShapeStats(console, traces, loader.padding_share, loader.steps_per_epoch)
    start = LoopState(restored.step, job.total_steps, loss=restored.loss, dice=restored.dice)
    callbacks = default_callbacks(job, console, model, optimizer, restored.step, numa, validation, shapes)
    state = run_loop(start, step, batches, callbacks, learning_rate=schedule, voxels_for_step=job.voxels_for_step,
                     shape_for_step=loader.batch_shape, input_error=lambda: loader.error)
    result = TrainResult(job.run.path, restored.step, state.step, job.total_steps, state.loss, state.dice,
                         state.interrupted_by)
    if state.stop is StopReason.SIGNAL:
        console.print(f"Stopped by signal {state.interrupted_by} at step {state.step}; checkpoint "
                      f"{job.checkpoints.latest().name} written. Continue with --resume.")
        return result
    if state.stop is StopReason.TIME_BUDGET:
        console.print(f"Time budget of {job.config.train.time_budget_s:g} s reached at step {state.step}.")
    try:
        numa.write()
        _finish(job, model, state, console, validation.summary() if validation else None, shapes.summary())
    except DiskFullError:  # as when the loop is stopped by a full disk: the run's own event files go too
        for events in (c.events for c in callbacks if isinstance(c, cb.TensorBoard)):
            events.remove()
        raise
    return result


def _announce(job: Job, model, console: Console) -> cb.NUMAReport:
    """numa.json as the run opens, then the opening lines: the placement, and what trains on what."""
    numa = cb.NUMAReport(job.run, job.placement.to_dict())
    console.print(_numa_summary(numa.write()))
    what = job.execution.describe(job.loader.describe(), job.learning_rate)
    console.print(f"bigmem train: {job.config.model.name} ({model.count_params():,} parameters), {what}, "
                  f"{job.config.train.precision.value}, {job.total_steps} step{'' if job.total_steps == 1 else 's'} -> "
                  f"{job.run.path}")
    console.print(_recipe_line(job.config))
    note = short_run_note(job.config, job.total_steps)
    if note:
        console.print(note, style="yellow")
    split = job.loader.store.split
    if split is not None:
        console.print(_fold_line(split))
    return numa


def _recipe_line(config) -> str:
    """The opening line naming the training recipe and its parts, as resolved (``train.recipe``)."""
    train, model = config.train, config.model
    update = (f"SGD (Nesterov, momentum {train.momentum:g})" if train.optimizer is OptimizerName.SGD else "Adam")
    extras = [f"weight decay {train.weight_decay:g}" if train.weight_decay else "",
              f"gradients clipped to {train.clip_norm:g}" if train.clip_norm else "",
              f"{train.warmup_steps}-step warm-up" if train.warmup_steps else ""]
    return (f"Recipe {train.recipe.value}: {update} at lr {train.lr:g}, poly decay {train.lr_decay_power:g}"
            + "".join(f", {e}" for e in extras if e) + f"; augmentation {config.data.augment.value}; deep supervision "
            + ("on" if model.deep_supervision else "off"))


# The shortest runs the recipe study measured nnU-Net's spatial augmentation at (benchmarks/results/recipe_budget.md,
# "What each part of the default is worth"): 300 steps of `small`, one seed per stand-in.
SHORT_RUN_STEPS = 300


def short_run_note(config, total_steps: int) -> str | None:
    """What the recipe study measured, for a run on a store at most ``SHORT_RUN_STEPS`` long whose augmentation
    rotates and scales; None otherwise."""
    if config.data.store is None or total_steps > SHORT_RUN_STEPS or config.data.augment not in (
            Augment.NNUNET, Augment.SPATIAL):
        return None
    return (f"note: at {SHORT_RUN_STEPS} steps the recipe study measured nnU-Net's rotation and scaling costing "
            "unseen-subject Dice on an anisotropic CT-like stand-in (0.836 with them, 0.882 without) and changing "
            "nothing on a brain MRI one (one seed each; benchmarks/results/recipe_budget.md); --augment intensity "
            "trains without them.")


def _fold_line(split) -> str:
    """``--fold``'s opening line: the fold, where its folds came from, its cases."""
    source = (f" of the splits in {split.source}" if split.source else " of nnU-Net's 5-fold split" if split.splits
              else " (every case trains and validates)")
    return f"Fold {split.fold}{source}: {len(split.train)} training, {len(split.val)} validation cases"


def _finish(job: Job, model, state: LoopState, console: Console, validation: dict | None,
            shapes: dict | None = None) -> None:
    """model.keras, then summary.json: a run is complete when its summary.json names its last step."""
    import time

    from bigmem.memory.procfs import peak_rss_bytes

    stall_share = state.waited_s / state.stepped_s if state.stepped_s else 0.0
    _save_model(model, job.run.model)
    job.run.write_summary(steps=state.step, train_s=time.monotonic() - state.started_s,
                          peak_rss_bytes=peak_rss_bytes(), loss=state.loss, dice=state.dice,
                          input_wait_s=state.waited_s, step_time_s=state.stepped_s, input_stall_share=stall_share,
                          validation=validation, shapes=shapes)
    console.print(f"Done: step {state.step}, loss {state.loss:.4f}, Dice {state.dice:.3f}; input stalls "
                  f"{100 * stall_share:.1f}% of step time. Model: {job.run.model}")


def _save_model(model, path: Path) -> None:
    """model.keras through the one atomic writer: synced, renamed into place, a full disk one line."""
    with atomic_output(path, needed_bytes=lambda: sum(int(w.numpy().nbytes) for w in model.weights)) as tmp:
        model.save(tmp)
