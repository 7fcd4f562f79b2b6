"""How a job's steps run: in this process, or data parallel. The one such decision the trainer asks of this package.

``choose_execution(config)`` decides it, once, and gives an ``Execution``: ``SingleProcess`` (whole
volumes in this process, the path bigmem is for) or the ``DataParallel`` decisions that
``data_parallel(config, replicas, counts_for)`` makes: whole volumes or a patch that fits one GPU,
the per-replica and global batch, each process's share of the data, what one host must hold (for
the memory pre-flight), the learning rate (linear scaling), the compiled step and the distributed
batches. The job asks its execution and never branches on which one it has.

Two shapes of data-parallel job:

- **Patches on GPUs** (``mirrored``, or ``multiworker`` with ``distribute.gpu_memory_bytes`` or
  ``distribute.patch``): the baseline bigmem compares itself with; the patch is the largest that
  fits one GPU's memory.
- **Whole volumes on several CPU hosts** (``multiworker`` without them): each worker loads only
  its slice of every global batch of whole volumes, applies its own NUMA placement and memory
  pre-flight, and the gradients are all-reduced as for GPUs. One server not being enough is
  what this path is for.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from bigmem.config.options import Strategy
from bigmem.config.schema import ExperimentConfig
from bigmem.distribute.planning import gpu_footprint_bytes, largest_patch
from bigmem.distribute.strategy import Replicas, make_distributed_step, scaled_learning_rate, setup_replicas
from bigmem.errors import ConfigError, InsufficientMemoryError
from bigmem.units import as_shape, format_bytes, format_shape


class Execution(Protocol):
    """How a job's steps run; ``SingleProcess`` and ``DataParallel`` are the two (``choose_execution`` picks).

    Each answers what the job asks of it (the loader's batch, what the memory pre-flight checks,
    the learning rate, the step, the batches, the opening line, plan.json's ``data_parallel``
    section), so nothing in the job depends on which one it holds.
    """

    @property
    def patch(self) -> tuple[int, int, int] | None:
        """The patch ``(D, H, W)`` the job trains on, or None for whole volumes."""

    @property
    def whole_volumes(self) -> bool:
        """True: whole volumes (no patch)."""

    @property
    def worker_batch(self) -> int:
        """Samples this process loads per step."""

    @property
    def host_checked(self) -> bool:
        """Whether the memory pre-flight checks this host's predicted peak (it holds the activations)."""

    def loader_settings(self) -> dict:
        """Keyword arguments for this process's ``VolumeLoader``: its batch (and patch and shard)."""

    def host_config(self, config: ExperimentConfig) -> ExperimentConfig:
        """The job this host runs, for its memory pre-flight."""

    def learning_rate(self, lr: float, reference_batch: int | None) -> float:
        """The peak learning rate the run uses, given ``train.lr`` and ``train.reference_batch``."""

    def scope(self) -> contextlib.AbstractContextManager:
        """The context the model and optimizer are built in (a strategy's scope, or none)."""

    def make_step(self, model, optimizer, *, loss_per_sample, metric_counts, metric_from_counts,
                  traces=None) -> Callable:
        """The compiled step: ``step(images, labels) -> (loss, metric)``."""

    def batches(self, loader, start_step: int):
        """The step's input iterator from ``loader`` (built with ``loader_settings``), from ``start_step``."""

    def describe(self, data: str, lr: float) -> str:
        """One line for the run's opening message (``data``: ``VolumeLoader.describe``)."""

    def to_dict(self) -> dict | None:
        """plan.json's ``data_parallel`` section (None when the job is not data parallel)."""


@dataclass(frozen=True)
class SingleProcess:
    """Whole volumes in this process: no replicas, no patch, the learning rate as given.

    Args:
        batch_size: samples per step (``train.batch_size``).

    Example:
        >>> execution = SingleProcess(batch_size=2)
        >>> execution.loader_settings(), execution.to_dict()
        ({'batch_size': 2}, None)
    """

    batch_size: int

    @property
    def patch(self) -> None:
        """None: each case trains whole."""
        return None

    @property
    def whole_volumes(self) -> bool:
        """True: whole volumes."""
        return True

    @property
    def worker_batch(self) -> int:
        """Samples per step: the whole batch, all loaded here."""
        return self.batch_size

    @property
    def host_checked(self) -> bool:
        """True: this host holds the activations, so its predicted peak is checked against the budget."""
        return True

    def loader_settings(self) -> dict:
        """The loader's batch (the loader's defaults: no patch, no shard)."""
        return {"batch_size": self.batch_size}

    def host_config(self, config: ExperimentConfig) -> ExperimentConfig:
        """``config`` itself: this host runs the whole job."""
        return config

    def learning_rate(self, lr: float, reference_batch: int | None) -> float:
        """``lr`` unchanged: linear scaling is for a global batch over replicas."""
        return lr

    def scope(self) -> contextlib.AbstractContextManager:
        """No strategy scope."""
        return contextlib.nullcontext()

    def make_step(self, model, optimizer, *, loss_per_sample, metric_counts, metric_from_counts,
                  traces=None) -> Callable:
        """One compiled update: ``step(images, labels) -> (mean loss over the batch, metric of its counts)``.

        One trace per distinct batch shape, never a shape-generic one (``reduce_retracing`` off):
        the depth-slab paths and the loss plan their slabs from static shapes.

        Args:
            model: the built Keras model.
            optimizer: its built optimizer.
            loss_per_sample: ``(labels, logits) -> (batch,)`` losses; the step's loss is their mean.
            metric_counts: ``(labels, logits) -> (intersection, total)`` per-class counts of the batch.
            metric_from_counts: ``(intersection, total) -> scalar``, the step's metric.
            traces: an object whose ``count`` is raised each time the step traces, or None.

        Returns:
            A ``tf.function`` ``step(images, labels) -> (loss, metric)``.
        """
        import tensorflow as tf

        @tf.function(reduce_retracing=False)
        def step(images, labels):
            if traces is not None:
                traces.count += 1
            with tf.GradientTape() as tape:
                outputs = model(images, training=True)  # the logits, or a deep-supervision list of them
                loss = tf.reduce_mean(loss_per_sample(labels, outputs))
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(gradients, model.trainable_variables)
            logits = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
            return loss, metric_from_counts(*metric_counts(labels, logits))

        return step

    def batches(self, loader, start_step: int):
        """``loader``'s batches from ``start_step``, as they come."""
        return iter(loader.dataset(start_step))

    def describe(self, data: str, lr: float) -> str:
        """``batches of B: <data>`` (``lr`` is not shown: it is the one given)."""
        return f"batches of {self.batch_size}: {data}"

    def to_dict(self) -> None:
        """None: plan.json's ``data_parallel`` is null for a single-process job."""
        return None


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel decisions of one job (``data_parallel`` makes them).

    Attributes:
        replicas: the strategy and its devices.
        patch: the patch ``(D, H, W)``, or None for whole volumes (each case's own shape, or ``config.data.shape``).
        per_replica_batch: samples per replica per step (``train.batch_size``).
        global_batch: samples per step over every replica of every worker.
        num_workers: processes (hosts) taking part; 1 for ``mirrored``.
        worker_index: this process's index among them.
        gpu_memory_bytes: the per-GPU memory the patch was sized for (None: not sized).
        per_gpu_predicted_bytes: the predicted footprint of one replica (patches only).
    """

    replicas: Replicas
    patch: tuple[int, int, int] | None
    per_replica_batch: int
    global_batch: int
    num_workers: int = 1
    worker_index: int = 0
    gpu_memory_bytes: int | None = None
    per_gpu_predicted_bytes: int | None = None

    @property
    def whole_volumes(self) -> bool:
        """True: whole volumes (no patch)."""
        return self.patch is None

    @property
    def worker_batch(self) -> int:
        """Samples this process loads per step: its slice of the global batch."""
        return self.global_batch // self.num_workers

    def loader_settings(self) -> dict:
        """Keyword arguments for this process's ``VolumeLoader``: its batch, patch and shard."""
        return {"batch_size": self.worker_batch, "patch": self.patch, "shard": (self.worker_index, self.num_workers)}

    def host_config(self, config: ExperimentConfig) -> ExperimentConfig:
        """The job one host runs, for its memory pre-flight: its samples per step at the input shape."""
        data = {"shape": list(self.patch)} if self.patch else {}
        return config.updated({"data": data, "train": {"batch_size": self.worker_batch}})

    @property
    def host_checked(self) -> bool:
        """Whether the host holds the model's activations: not on real GPUs, where it holds the input."""
        return self.replicas.simulated or self.whole_volumes

    def learning_rate(self, lr: float, reference_batch: int | None) -> float:
        """``lr`` scaled linearly from the batch it was meant for (default: one replica's) to the global batch."""
        return scaled_learning_rate(lr, reference_batch or self.per_replica_batch, self.global_batch)

    def scope(self) -> contextlib.AbstractContextManager:
        """The strategy's scope, where the model and optimizer are built (their variables mirrored)."""
        return self.replicas.strategy.scope()

    def make_step(self, model, optimizer, *, loss_per_sample, metric_counts, metric_from_counts,
                  traces=None) -> Callable:
        """The compiled data-parallel step: ``step(images, labels) -> (loss, metric)`` (``make_distributed_step``)."""
        return make_distributed_step(self.replicas, model, optimizer, self.global_batch, traces=traces,
                                     loss_per_sample=loss_per_sample, metric_counts=metric_counts,
                                     metric_from_counts=metric_from_counts)

    def batches(self, loader, start_step: int):
        """This process's batches from ``loader`` (built with ``loader_settings``), split over its replicas."""
        import tensorflow as tf

        strategy = self.replicas.strategy
        if self.num_workers > 1 or isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            local = max(1, strategy.num_replicas_in_sync // self.num_workers)

            def dataset_fn(context):  # each worker already holds only its slice of the global batch
                return loader.dataset(start_step).unbatch().batch(self.worker_batch // local)

            return iter(strategy.distribute_datasets_from_function(dataset_fn))
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return iter(strategy.experimental_distribute_dataset(loader.dataset(start_step).with_options(options)))

    def describe(self, data: str, lr: float) -> str:
        """One line for the run's opening message: what trains on what, at which lr.

        Args:
            data: what happens to each scan (``VolumeLoader.describe``).
            lr: the learning rate after scaling.
        """
        where = "logical CPU devices (simulated on CPU)" if self.replicas.simulated else (
            "CPU hosts" if self.whole_volumes and self.num_workers > 1 else "GPUs")
        what = f"whole volumes ({data})" if self.whole_volumes else f"{format_shape(self.patch)} patches"
        hosts = f" on {self.num_workers} workers" if self.num_workers > 1 else ""
        return (f"{self.global_batch} x {what} over {self.replicas.num_replicas} {where}{hosts}, lr {lr:g}")

    def to_dict(self) -> dict:
        """plan.json's ``data_parallel`` section."""
        return {"replicas": self.replicas.num_replicas, "simulated": self.replicas.simulated,
                "devices": list(self.replicas.devices), "workers": self.num_workers, "worker_index": self.worker_index,
                "whole_volumes": self.whole_volumes, "gpu_memory_bytes": self.gpu_memory_bytes,
                "patch": list(self.patch) if self.patch else None,
                "per_replica_batch": self.per_replica_batch, "global_batch": self.global_batch,
                "per_gpu_predicted_bytes": self.per_gpu_predicted_bytes}


def data_parallel(config: ExperimentConfig, replicas: Replicas, counts_for,
                  aspect: Sequence[int] | None = None) -> DataParallel:
    """Decide how ``config`` runs over ``replicas``: whole volumes or the patch that fits one GPU.

    Args:
        config: the resolved job (``distribute`` section; ``train.batch_size`` is per replica).
        replicas: the strategy and devices (``strategy.setup_replicas``).
        counts_for: ``(D, H, W) -> NetworkCounts`` of the model, for the per-GPU footprint.
        aspect: the shape the patch is proportioned after, as nnU-Net shapes its patch after the
            dataset's median shape (``largest_patch``; its longest axis bounds the patch's); default:
            ``data.shape``, else the ``data.reference_volume`` cube. ``distribute.patch`` N is a cube.

    Returns:
        The ``DataParallel`` decisions; ``config`` is not changed.

    Raises:
        ConfigError: ``mirrored`` without ``distribute.gpu_memory_bytes`` or ``distribute.patch``
            (a GPU cannot hold whole volumes; ``multiworker`` without them trains whole volumes).
        InsufficientMemoryError: not even the smallest patch fits ``distribute.gpu_memory_bytes``.

    Example:
        >>> parallel = data_parallel(config, mirrored(simulate_replicas=2), counts_function(config))
        >>> parallel.global_batch == 2 * config.train.batch_size
        True
    """
    settings = config.distribute
    per_replica = config.train.batch_size
    workers, index = _workers(replicas)
    global_batch = per_replica * replicas.num_replicas
    whole = settings.strategy is Strategy.MULTIWORKER and settings.gpu_memory_bytes is None and settings.patch is None
    if whole:
        return DataParallel(replicas, None, per_replica, global_batch, workers, index)
    gpu_memory = settings.gpu_memory_bytes
    if gpu_memory is None and settings.patch is None:
        raise ConfigError("distribute.gpu_memory_bytes", "Give {field} SIZE (e.g. 80GiB) or {distribute.patch} N: "
                          "the patch size is chosen to fit one GPU's memory"
                          + (", and these replicas are simulated on CPU." if replicas.simulated else "."))
    aspect = tuple(aspect or config.data.shape or (config.data.reference_volume,) * 3)
    patch = as_shape(settings.patch) if settings.patch else largest_patch(config, counts_for, gpu_memory, per_replica,
                                                                           aspect)
    if patch is None:
        need = gpu_footprint_bytes(config, counts_for, config.model.divisor, per_replica)
        raise InsufficientMemoryError(
            f"Not even a {config.model.divisor}^3 patch at batch {per_replica} fits one GPU's "
            f"{format_bytes(gpu_memory)} (needs {format_bytes(need)}): give a larger {{distribute.gpu_memory_bytes}} "
            "(distribute.gpu_memory_bytes) or a smaller {train.batch_size}.", need, gpu_memory)
    return DataParallel(replicas, patch, per_replica, global_batch, workers, index, gpu_memory,
                        gpu_footprint_bytes(config, counts_for, patch, per_replica))


def choose_execution(config: ExperimentConfig) -> Execution:
    """How ``config`` runs: ``SingleProcess``, or ``DataParallel`` over the replicas ``distribute.strategy`` asks for.

    Call it after importing TensorFlow and before any TensorFlow operation: a data-parallel job
    sets its devices up here (``strategy.setup_replicas``), and its patch is proportioned after
    the dataset's median shape (``data.derived.median_shape``).

    Args:
        config: the resolved job, with its data fields (``data.derived.with_data_fields``).

    Returns:
        The job's ``Execution``.

    Raises:
        ConfigError, InsufficientMemoryError: as ``data_parallel``; UsageError: as ``setup_replicas``.
    """
    if config.distribute.strategy is Strategy.NONE:
        return SingleProcess(config.train.batch_size)
    from bigmem.data.derived import median_shape
    from bigmem.memory.profile import counts_function  # builds the network: TensorFlow

    replicas = setup_replicas(config)  # before any TensorFlow operation initialises devices
    return data_parallel(config, replicas, counts_function(config), aspect=median_shape(config))


def _workers(replicas: Replicas) -> tuple[int, int]:
    """(number of workers, this worker's index) of a multi-worker strategy; (1, 0) otherwise."""
    resolver = getattr(replicas.strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return 1, 0
    return resolver.cluster_spec().num_tasks("worker"), int(resolver.task_id or 0)

