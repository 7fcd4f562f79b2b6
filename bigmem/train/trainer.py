"""The training loop: whole volumes, a custom ``tf.function`` step, atomic checkpoints, resume.

``train(config, run_dir)`` is the public entry point under ``bigmem train``. It writes the run
directory of DESIGN.md through ``RunDir``: config.json, sysinfo.json, plan.json, numa.json,
metrics.jsonl, monitor.csv, checkpoints/, model.keras and, last, summary.json.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from rich.console import Console

from bigmem.config.options import OptimizerName, Precision, Strategy
from bigmem.config.schema import ExperimentConfig
from bigmem.data.pipeline import WholeVolumeLoader
from bigmem.data.synth import cached_synthetic_store
from bigmem.errors import TrainingError
from bigmem.monitor.sampler import ResourceMonitor
from bigmem.rundir import RunDir
from bigmem.sysinfo import collect_sysinfo
from bigmem.tfenv import import_tensorflow
from bigmem.train.checkpoints import CheckpointManager
from bigmem.train.progress import TrainProgress


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    total_steps: int
    last_loss: float
    last_dice: float
    interrupted_by: int | None = None  # the signal that stopped the run early, if any


class StopSignals:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step (main thread only)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# DESIGN.md / the AVX2 measurement of the `make demo` configuration: 0.016 Mvox/s in bf16 against
# 0.33 in fp32 with oneDNN on (AMD EPYC Zen 3, 2 cores, TF 2.21).
EMULATED_BF16_WARNING = ("warning: this CPU has no native bfloat16 (avx512_bf16, AMX or AVX-NE-CONVERT): --precision "
                         "bf16 is emulated, about 20x slower than fp32 here; it only saves memory")


def total_steps_for(config: ExperimentConfig, steps_per_epoch: int) -> int:
    if config.train.steps is not None:
        return config.train.steps
    return (config.train.epochs or 1) * steps_per_epoch


def make_optimizer(config: ExperimentConfig, schedule):
    from bigmem.train.optimizers import FusedAdam, FusedSGD

    if config.train.optimizer is OptimizerName.SGD:
        return FusedSGD(learning_rate=schedule, momentum=config.train.momentum, nesterov=True)
    return FusedAdam(learning_rate=schedule)


def make_train_step(model, optimizer):
    """One compiled update. It returns the loss, which depends on the whole forward pass."""
    import tensorflow as tf

    from bigmem.train.losses import dice_ce_loss, foreground_dice

    @tf.function(reduce_retracing=True)
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = dice_ce_loss(labels, logits)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        return loss, foreground_dice(labels, logits)

    return train_step


def _prepare_run_dir(run: RunDir, manager: CheckpointManager, resume: bool) -> Path | None:
    if resume:
        latest = manager.latest()
        if latest is None:
            raise TrainingError(f"Cannot resume {str(run.path)!r}: it has no complete checkpoint "
                                f"(looked in {run.checkpoints}). Start a new run without --resume.")
        return latest
    if run.holds_run():
        raise TrainingError(f"Run directory {str(run.path)!r} already holds a run: pass --resume to continue it, "
                            "or choose another --out.")
    return None


def train(config: ExperimentConfig, run_dir: str | os.PathLike, *, resume: bool = False,
          console: Console | None = None, verbose: bool = False,
          recompute_stages: list[str] | None = None, force: bool = False) -> TrainResult:
    """Train ``config`` into ``run_dir`` (resuming from its newest checkpoint if ``resume``).

    Before anything large is allocated, the footprint is estimated and checked against the
    memory budget (``memory.preflight.resolve_budget``: ``train.memory_budget_bytes``, else what
    the NUMA placement can use, else MemAvailable): a job that does not fit raises
    InsufficientMemoryError (exit 3) unless ``force``.
    """
    console = console or Console(soft_wrap=True)
    run = RunDir(run_dir)
    manager = CheckpointManager(run.checkpoints, keep=config.train.keep_checkpoints)
    latest = _prepare_run_dir(run, manager, resume)

    if config.data.store is None:
        with console.status("Generating the synthetic dataset (cached for later runs) ..."):
            store_path = cached_synthetic_store(num_cases=config.data.synth_cases, volume=config.data.synth_volume,
                                                num_classes=config.data.synth_classes)
        config.data.store = str(store_path)
    loader = WholeVolumeLoader(config.data.store, volume=config.data.volume, batch_size=config.train.batch_size,
                               seed=config.train.seed, flip=config.data.flip, num_workers=config.data.num_workers,
                               prefetch=config.data.prefetch, cold_cache=config.data.cold_cache,
                               holdout=config.data.holdout)
    try:
        # The data decides the network's input channels and classes (as nnU-Net's planner does).
        config.model.in_channels = loader.num_channels
        config.model.num_classes = loader.store.num_classes
        config.validate()
        total_steps = total_steps_for(config, loader.steps_per_epoch)
        placement = current_placement(config)
        import_tensorflow(verbose=verbose)
        replicas = None
        if config.train.strategy is not Strategy.NONE:
            from bigmem.distribute.strategy import setup_replicas

            replicas = setup_replicas(config)  # before any TensorFlow operation initialises devices
        plan, recompute_stages = preflight(config, recompute_stages, force=force, console=console,
                                           placement=placement, replicas=replicas, loader=loader)
        return _run(config, run, manager, latest, loader, total_steps, console, verbose, recompute_stages, plan,
                    placement, replicas)
    finally:
        loader.close()


def current_placement(config: ExperimentConfig):
    """The NUMA placement in force: the one the CLI applied, else ``config.numa`` applied now.

    Applying fails (clearly) if TensorFlow is already imported and a policy is asked for: its
    threads would not inherit the policy.
    """
    from bigmem.numa.apply import current, place
    from bigmem.numa.policy import PolicyKind

    placement = current()
    wanted = (config.numa.policy or "none").strip().lower()
    if placement is not None and placement.text.strip().lower() == wanted:
        return placement
    if placement is not None and placement.kind is not PolicyKind.NONE:
        from bigmem.errors import UsageError

        raise UsageError(f"This process already runs under --numa {placement.text}; it cannot switch to "
                         f"{config.numa.policy!r}. Start a new process.")
    return place(config.numa.policy, config.numa.cpus, config.numa.threads)


def plan_data_parallel(config: ExperimentConfig, counts_for, replicas, loader) -> dict:
    """Choose the patch that fits one GPU (--gpu-memory) and set the loader to global batches of it."""
    from bigmem.distribute.planning import gpu_footprint_bytes, largest_edge
    from bigmem.errors import InsufficientMemoryError, UsageError
    from bigmem.units import format_bytes

    gpu_memory = config.train.gpu_memory_bytes
    if gpu_memory is None:
        raise UsageError("Give --gpu-memory SIZE (e.g. 80GiB): the patch size is chosen to fit one GPU's memory"
                         + (", and these replicas are simulated on CPU." if replicas.simulated else "."))
    per_replica = config.train.batch_size
    patch = config.data.patch or largest_edge(config, counts_for, gpu_memory, per_replica, config.data.volume)
    if patch is None:
        need = gpu_footprint_bytes(config, counts_for, config.model.divisor, per_replica)
        raise InsufficientMemoryError(
            f"Not even a {config.model.divisor}^3 patch at batch {per_replica} fits --gpu-memory "
            f"{format_bytes(gpu_memory)} (needs {format_bytes(need)}).", need, gpu_memory)
    config.data.patch = patch
    global_batch = per_replica * replicas.num_replicas
    loader.reshape(batch_size=global_batch, patch=patch)
    return {"replicas": replicas.num_replicas, "simulated": replicas.simulated, "devices": list(replicas.devices),
            "gpu_memory_bytes": gpu_memory, "patch": patch, "per_replica_batch": per_replica,
            "global_batch": global_batch,
            "per_gpu_predicted_bytes": gpu_footprint_bytes(config, counts_for, patch, per_replica)}


def preflight(config: ExperimentConfig, recompute_stages: list[str] | None, *, force: bool,
              console: Console, placement=None, replicas=None, loader=None):
    """The run's memory pre-flight (``memory.preflight``), printed; refuses a job that cannot fit.

    Returns:
        ``(plan, recompute_stages)``: the ``memory.planner.Plan`` written as plan.json (with the
        data-parallel patch and replicas when ``replicas``), and the stages to recompute.

    Raises:
        InsufficientMemoryError: (exit 3) the host's predicted peak exceeds the budget, unless
            ``force``; on real GPUs the host holds only the input and is not checked.
    """
    from bigmem.memory.preflight import job_plan, resolve_budget
    from bigmem.memory.profile import counts_function
    from bigmem.nets.limits import max_kernel_elements
    from bigmem.units import format_bytes

    counts_for = counts_function(config)
    data_parallel = None
    if replicas is not None:
        data_parallel = plan_data_parallel(config, counts_for, replicas, loader)
        config = ExperimentConfig.from_dict(config.to_dict())  # the host check: patches, global batch
        config.data.volume = data_parallel["patch"]
        config.train.batch_size = data_parallel["global_batch"]
    budget = resolve_budget(config.train.memory_budget_bytes, placement=placement)
    if budget.note:
        console.print(budget.note, style="yellow")
    host_check = replicas is None or replicas.simulated  # on real GPUs the host holds only the input
    plan = job_plan(config, counts_for, budget, stages=recompute_stages, force=force, check=host_check)
    plan.data_parallel = data_parallel
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


def _numa_summary(report: dict) -> str:
    requested = report["requested"]
    observed = ", ".join(f"{policy} on {count}" for policy, count in sorted(report["observed"].items(),
                                                                          key=lambda kv: -kv[1]))
    cpus = requested["cpus"]
    cpu_text = f"{cpus[0]}-{cpus[-1]}" if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)) else str(cpus)
    return (f"NUMA: --numa {requested['text']} on CPUs {cpu_text}, TF threads intra {requested['intra_op_threads']} "
            f"/ inter {requested['inter_op_threads']}; observed policy per thread: {observed}")


def _distributed_batches(replicas, loader, start_step: int):
    """The loader's global batches, split over the replicas (every worker takes its own slice)."""
    import tensorflow as tf

    strategy = replicas.strategy
    if config_is_multiworker(strategy):
        workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")
        index = strategy.cluster_resolver.task_id
        per_worker = loader.batch_size // workers
        local = strategy.num_replicas_in_sync // workers

        mine = slice(index * per_worker, (index + 1) * per_worker)

        def dataset_fn(context):  # the same global batches on every worker; each takes its slice
            data = loader.dataset(start_step).map(lambda x, y: (x[mine], y[mine]))
            return data.unbatch().batch(per_worker // local)

        return iter(strategy.distribute_datasets_from_function(dataset_fn))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return iter(strategy.experimental_distribute_dataset(loader.dataset(start_step).with_options(options)))


def config_is_multiworker(strategy) -> bool:
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def _run(config, run, manager, latest, loader, total_steps, console, verbose, recompute_stages, plan,
         placement=None, replicas=None) -> TrainResult:
    tf = import_tensorflow(verbose=verbose)
    import keras

    from bigmem.nets.unet3d import UNet3D
    from bigmem.train.schedules import WarmupPolynomialDecay

    keras.utils.set_random_seed(config.train.seed)
    policy = "mixed_bfloat16" if config.train.precision is Precision.BF16 else "float32"
    lr = config.train.lr
    if replicas is not None:  # the linear scaling rule, from the batch --lr was meant for
        from bigmem.distribute.strategy import scaled_learning_rate

        lr = scaled_learning_rate(lr, config.train.reference_batch or config.train.batch_size, loader.batch_size)
    scope = replicas.strategy.scope() if replicas is not None else contextlib.nullcontext()
    with scope:
        model = UNet3D(config.model, dtype=policy, name="unet3d").build_for()
        model.set_recompute(recompute_stages)  # chosen by the pre-flight
        schedule = WarmupPolynomialDecay(lr, total_steps, config.train.warmup_steps,
                                         config.train.lr_decay_power, config.train.end_lr)
        optimizer = make_optimizer(config, schedule)
        optimizer.build(model.trainable_variables)

    start_step = 0
    if latest is not None:
        state = manager.restore(latest, model, optimizer)
        start_step = int(state["step"])
        run.truncate_metrics(start_step)
        console.print(f"Resuming {run.path} from {latest.name} (step {start_step} of {total_steps}).")
    run.path.mkdir(parents=True, exist_ok=True)
    run.write_config({**config.to_dict(), "total_steps": total_steps, "effective_lr": lr})
    run.write_sysinfo(collect_sysinfo())
    if plan is not None:
        run.write_plan(plan.to_dict())
    from bigmem.numa.observe import NodePeakSampler, observed

    requested = placement.to_dict() if placement is not None else {"policy": "none", "text": "none"}
    numa_report = observed(requested)
    run.write_numa(numa_report)
    if placement is not None:
        console.print(_numa_summary(numa_report))
    if replicas is None:
        what = f"{loader.batch_size} x {loader.volume}^3 whole volumes"
        train_step = make_train_step(model, optimizer)
        batches = iter(loader.dataset(start_step))
    else:
        from bigmem.distribute.strategy import make_distributed_step
        from bigmem.train.losses import dice_ce_per_sample, dice_counts, dice_from_counts

        where = "logical CPU devices (simulated on CPU)" if replicas.simulated else "GPUs"
        what = (f"{loader.batch_size} x {loader.volume}^3 patches over {replicas.num_replicas} {where}, "
                f"lr {lr:g}")
        train_step = make_distributed_step(replicas, model, optimizer, loader.batch_size,
                                           loss_per_sample=dice_ce_per_sample, metric_counts=dice_counts,
                                           metric_from_counts=dice_from_counts)
        batches = _distributed_batches(replicas, loader, start_step)
    console.print(f"bigmem train: {config.model.name} ({model.count_params():,} parameters), {what}, "
                  f"{config.train.precision.value}, {total_steps} steps -> {run.path}")
    process = psutil.Process()
    voxels_per_step = loader.batch_size * loader.volume**3
    step, loss, dice = start_step, float("nan"), float("nan")
    pending: list[dict] = []

    def checkpoint(at_step: int) -> Path:
        run.append_metrics(pending)
        pending.clear()
        return manager.save(at_step, model, optimizer, {"total_steps": total_steps, "loss": loss, "dice": dice})

    sampler = NodePeakSampler()

    def write_numa_report() -> None:
        run.write_numa(observed(requested, sampler))  # threads seen now that TF's pools have run

    started_s = time.monotonic()
    budget_s = config.train.time_budget_s
    waited_s = stepped_s = 0.0  # input wait and whole step time of this session's steps (the stall share)
    monitor = (ResourceMonitor(run.monitor, interval_s=config.train.monitor_interval_s, store_path=config.data.store)
               if config.train.monitor_interval_s > 0 else contextlib.nullcontext())
    with StopSignals() as stop, TrainProgress(console, total_steps, start_step) as progress, sampler, monitor:
        while step < total_steps and not (budget_s is not None and time.monotonic() - started_s >= budget_s):
            started = time.perf_counter()
            try:
                images, labels = next(batches)
            except tf.errors.OpError as exc:  # a reader error surfaces through tf.data
                raise loader.error or TrainingError(f"The input pipeline failed: {exc.message}") from None
            fetched = time.perf_counter()
            loss_t, dice_t = train_step(images, labels)
            loss, dice = float(loss_t), float(dice_t)
            elapsed = time.perf_counter() - started
            if not math.isfinite(loss):
                kept = manager.latest()
                where = f"the newest good checkpoint is {kept}" if kept else "no checkpoint was written yet"
                run.append_metrics(pending)
                raise TrainingError(f"Loss is {loss} at step {step + 1}: training stopped; {where}. "
                                    "Try a lower --lr or --precision fp32.")
            step += 1
            waited_s += fetched - started
            stepped_s += elapsed
            row = {"step": step, "loss": loss, "dice": dice, "lr": float(schedule(step - 1)),
                   "voxels_per_s": voxels_per_step / elapsed, "rss_bytes": process.memory_info().rss,
                   "input_wait_s": fetched - started, "step_s": elapsed}
            if step % config.train.log_every == 0 or step == total_steps:
                pending.append(row)
                run.append_metrics(pending)
                pending.clear()
            progress.update(row)
            if step == start_step + 1:
                write_numa_report()
            if stop.signum is not None:
                write_numa_report()
                saved = checkpoint(step)
                console.print(f"Stopped by signal {stop.signum} at step {step}; checkpoint {saved.name} written. "
                              "Continue with --resume.")
                return TrainResult(run.path, start_step, step, total_steps, loss, dice, interrupted_by=stop.signum)
            if step % config.train.checkpoint_every == 0 or step == total_steps:
                checkpoint(step)

    if step < total_steps:  # the time budget ended the run
        checkpoint(step)
        console.print(f"Time budget of {budget_s:g} s reached at step {step}.")
    write_numa_report()
    from bigmem.memory.procfs import peak_rss_bytes

    stall_share = waited_s / stepped_s if stepped_s else 0.0
    run.write_summary(steps=step, train_s=time.monotonic() - started_s, peak_rss_bytes=peak_rss_bytes(), loss=loss,
                      dice=dice, input_wait_s=waited_s, step_time_s=stepped_s, input_stall_share=stall_share)
    _save_model(model, run.model)
    console.print(f"Done: step {step}, loss {loss:.4f}, Dice {dice:.3f}; input stalls {100 * stall_share:.1f}% of "
                  f"step time. Model: {run.model}")
    return TrainResult(run.path, start_step, step, total_steps, loss, dice)


def _save_model(model, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.keras")
    try:
        model.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

