"""Data-parallel training with tf.distribute (the GPU baseline bigmem compares itself with).

On a machine without GPUs the same code runs on N logical CPU devices
(``tf.config.set_logical_device_configuration``); anything produced that way is simulated and
must be reported so. The loss of a step is the mean over the *global* batch: each replica sums
its samples' losses and divides by the global batch size, and the optimizer sums gradients
across replicas (Keras 3's TF optimizer all-reduces them in a replica context).
"""

from __future__ import annotations

from dataclasses import dataclass

from bigmem.errors import BigmemError, UsageError


@dataclass(frozen=True)
class Replicas:
    strategy: object  # tf.distribute.Strategy
    num_replicas: int
    simulated: bool  # True: logical CPU devices standing in for GPUs
    devices: tuple[str, ...]


def simulate_cpu_replicas(count: int) -> list[str]:
    """Split the CPU into ``count`` logical devices. Must run before TensorFlow initialises devices."""
    import tensorflow as tf

    if count < 1:
        raise UsageError(f"Invalid {{distribute.simulate_replicas}} {count}: expected a positive integer.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:
        raise BigmemError("Cannot simulate replicas: TensorFlow's devices are already initialised in this "
                          "process; simulate before running any TensorFlow operation.") from None
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def mirrored(simulate_replicas: int | None = None, gpus: int | None = None) -> Replicas:
    """MirroredStrategy over ``gpus`` GPUs, or over ``simulate_replicas`` logical CPU devices."""
    import tensorflow as tf

    if simulate_replicas:
        devices = simulate_cpu_replicas(simulate_replicas)
        return Replicas(tf.distribute.MirroredStrategy(devices), len(devices), True, tuple(devices))
    found = [d.name for d in tf.config.list_logical_devices("GPU")]
    if not found:
        raise BigmemError("No GPU found for {distribute.strategy} mirrored; use {distribute.simulate_replicas} N to "
                          "run the same path on N logical CPU devices.")
    devices = found[:gpus] if gpus else found
    return Replicas(tf.distribute.MirroredStrategy(devices), len(devices), False, tuple(devices))


def multiworker() -> Replicas:
    """MultiWorkerMirroredStrategy configured by TF_CONFIG (every worker runs the same command)."""
    import json
    import os

    import tensorflow as tf

    if "TF_CONFIG" not in os.environ:
        raise UsageError("{distribute.strategy} multiworker needs TF_CONFIG (cluster and task); see docs/guide.md, "
                         "'Several hosts'. A run trained with {distribute.strategy} per-node (whose workers are "
                         "multiworker) resumes with {train.resume} {distribute.strategy} per-node.")
    try:
        json.loads(os.environ["TF_CONFIG"])
    except ValueError:
        raise UsageError("TF_CONFIG is not valid JSON.") from None
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    devices = tuple(d.name for d in tf.config.list_logical_devices("GPU")) or ("/cpu:0",)
    simulated = not tf.config.list_logical_devices("GPU")
    return Replicas(strategy, strategy.num_replicas_in_sync, simulated, devices)


def setup_replicas(config) -> Replicas:
    """The strategy ``config.train`` asks for (call right after importing TensorFlow)."""
    from bigmem.config.options import Strategy

    if config.distribute.strategy is Strategy.MULTIWORKER:
        return multiworker()
    if config.distribute.strategy is Strategy.PER_NODE:  # a launcher of processes, not a strategy of this one
        raise UsageError("distribute.strategy per_node starts one process per NUMA node: run `bigmem train "
                         "--strategy per-node`, or bigmem.distribute.pernode.run_per_node; each worker "
                         "trains with strategy multiworker.")
    return mirrored(simulate_replicas=config.distribute.simulate_replicas, gpus=config.distribute.gpus)


def scaled_learning_rate(reference_lr: float, reference_batch: int, global_batch: int) -> float:
    """The linear scaling rule (Goyal et al. 2017): lr grows with the global batch."""
    return reference_lr * global_batch / reference_batch


def make_distributed_step(replicas: Replicas, model, optimizer, global_batch_size: int, *, loss_per_sample,
                          metric_counts, metric_from_counts, traces=None):
    """One compiled data-parallel update; returns the global-batch mean loss and the metric.

    The loss and metric come in as functions, so this layer needs nothing from ``bigmem.train``.

    Args:
        replicas: the strategy and its replicas (``setup_replicas``).
        model: a Keras model built under ``replicas.strategy.scope()``.
        optimizer: a built Keras optimizer, also from that scope.
        global_batch_size: samples per step over all replicas; each replica's summed loss is
            divided by it, so the step's loss is the mean over the global batch.
        loss_per_sample: ``(labels, logits) -> (batch,)`` losses of a replica's samples.
        metric_counts: ``(labels, logits) -> (intersection, total)`` per-class counts, summed
            across replicas.
        metric_from_counts: ``(intersection, total) -> scalar``, the metric of the summed counts.
        traces: an object whose ``count`` is raised each time the step traces (one trace per batch
            shape; the trainer reports them), or None.

    Returns:
        A ``tf.function`` ``step(images, labels) -> (loss, metric)`` over distributed batches.

    Example:
        >>> step = make_distributed_step(replicas, model, optimizer, 4, loss_per_sample=dice_ce_per_sample,
        ...                              metric_counts=dice_counts, metric_from_counts=dice_from_counts)
    """
    import tensorflow as tf

    strategy = replicas.strategy
    total = tf.distribute.ReduceOp.SUM

    per_replica = global_batch_size // replicas.num_replicas

    def replica_step(images, labels):
        # MultiWorkerMirroredStrategy's input rebatching leaves the batch axis unknown in the trace; the
        # depth-slab paths and the slab loss need every size static, so the batch is stated here.
        images = tf.ensure_shape(images, (per_replica, *images.shape[1:]))
        labels = tf.ensure_shape(labels, (per_replica, *labels.shape[1:]))
        with tf.GradientTape() as tape:
            outputs = model(images, training=True)  # the logits, or a deep-supervision list of them
            loss = tf.reduce_sum(loss_per_sample(labels, outputs)) / global_batch_size
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(gradients, model.trainable_variables)
        intersection, union = metric_counts(labels, outputs[0] if isinstance(outputs, (list, tuple)) else outputs)
        return loss, intersection, union

    @tf.function(reduce_retracing=False)  # one trace per batch shape: the slab paths plan from static shapes
    def step(distributed_images, distributed_labels):
        if traces is not None:
            traces.count += 1
        loss, intersection, union = strategy.run(replica_step, args=(distributed_images, distributed_labels))
        return (strategy.reduce(total, loss, axis=None),
                metric_from_counts(strategy.reduce(total, intersection, axis=None),
                                   strategy.reduce(total, union, axis=None)))

    return step
