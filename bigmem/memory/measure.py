"""Measured peak memory in a child process: K real training steps, or one whole-volume prediction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from bigmem.child import run_child
from bigmem.config.schema import ExperimentConfig
from bigmem.data.synth import cached_synthetic_store
from bigmem.units import format_shape

# The child program that trains and prints its peak (``bigmem/train/probe.py``). It is started as
# a separate process, never imported: the trainer is a layer above this one.
PROBE_MODULE = "bigmem.train.probe"
# The child program that segments a random volume by predict's path (``bigmem/infer/probe.py``);
# prediction is a layer above this one too.
INFERENCE_PROBE_MODULE = "bigmem.infer.probe"


@dataclass
class Measurement:
    """What one ``measure`` run saw in its child process (bytes, seconds)."""

    peak_bytes: int  # VmHWM of the child: the kernel's peak resident set
    baseline_bytes: int  # RSS after importing TensorFlow and Keras, before training
    node_bytes: dict[str, int]  # resident bytes per NUMA node after the steps (numa_maps)
    step_s: float  # median step time (first, tracing step excluded)
    cores: int = 1  # CPUs the child's training ran on (its affinity after the placement)


def measure(config: ExperimentConfig, *, steps: int = 3, recompute_stages: list[str] | None = None,
            timeout_s: float = 3600.0, force: bool = False) -> Measurement:
    """Train ``config`` for ``steps`` steps on synthetic volumes of its shape in a fresh process.

    The values of the voxels do not change the footprint, so the measurement uses phantoms of
    ``config.data.shape`` (cached) rather than the user's store. The child
    (``python -m bigmem.train.probe``) applies ``config.numa`` before TensorFlow starts, so its
    peak is that of a real run of the configuration, framework included.

    Args:
        config: the run to measure (model, ``data.shape``, ``train.batch_size``, precision,
            placement); not changed.
        steps: training steps (default 3; the first, which traces, is left out of ``step_s``).
        recompute_stages: stage names to recompute in the backward pass (``UNet3D.stage_names``);
            default None: the trainer's own choice for ``config``.
        timeout_s: the most seconds the child may run (default 3600).
        force: skip the training pre-flight's refusal (exit 3) when the *estimate* exceeds the
            free memory (default False): a benchmark that checks the estimate must be able to
            measure where it is too high.

    Returns:
        A ``Measurement``: the child's peak resident set (VmHWM) and its baseline after importing
        TensorFlow and Keras, in bytes; resident bytes per NUMA node; the median step time in s
        and the CPUs it ran on.

    Raises:
        BigmemError: the child failed (including the pre-flight's refusal without ``force``);
            the message ends with its last line of stderr.
        subprocess.TimeoutExpired: the child ran past ``timeout_s``.

    Example:
        >>> result = measure(ExperimentConfig.from_dict({"model": {"depth": 2}, "data": {"shape": [32, 64, 64]}}))
        >>> result.peak_bytes - result.baseline_bytes  # bytes the training itself added
    """
    shape = tuple(config.data.shape or (config.data.reference_volume,) * 3)
    batch = config.train.batch_size
    store = str(cached_synthetic_store(num_cases=max(2, batch), volume=shape, num_classes=config.model.num_classes))
    config = config.updated({"data": {"store": store}, "train": {
        "steps": steps, "epochs": None, "checkpoint_every": steps,
        "warmup_steps": min(config.train.warmup_steps, steps)}})
    request = {"config": config.to_dict(), "recompute_stages": recompute_stages, "force": force}
    what = f"Measuring {config.model.name} at {format_shape(shape)}, batch {batch}"
    values = run_child(PROBE_MODULE, request, what=what, timeout_s=timeout_s)
    return Measurement(int(values["peak_bytes"]), int(values["baseline_bytes"]),
                       {str(k): int(v) for k, v in values["node_bytes"].items()}, float(values["step_s"]),
                       int(values["cores"]))


@dataclass
class InferenceMeasurement:
    """What one ``measure_inference`` run saw in its child process (bytes, seconds)."""

    peak_bytes: int  # VmHWM of the child: the kernel's peak resident set
    baseline_bytes: int  # RSS after importing TensorFlow and Keras, before the model is built
    model_bytes: int  # RSS the model's construction added
    seconds: float  # the prediction path, model building excluded


def measure_inference(config: ExperimentConfig, shape: Sequence[int], *, timeout_s: float = 3600.0,
                      env: dict[str, str] | None = None) -> InferenceMeasurement:
    """Segment one random whole volume of ``shape`` by ``bigmem predict``'s path in a fresh process.

    The child (``python -m bigmem.infer.probe``) applies ``config.numa``, builds ``config.model``
    with random weights in ``config.train.precision``, and runs predict's whole-volume path
    (normalise, pad to the size contract, the forward pass and softmax, the source mapping's
    running argmax) on a random image; its peak is that of segmenting one case, framework
    included.

    Args:
        config: the network (``model``, ``train.precision``) and placement (``numa``); not changed.
        shape: the case's spatial shape ``(D, H, W)`` (padded to a multiple of ``2**depth`` as
            predict pads it).
        timeout_s: the most seconds the child may run (default 3600).
        env: the child's environment (default: this process's), e.g. with
            ``BIGMEM_MAX_KERNEL_ELEMENTS`` lowered to run the depth-slab paths on small volumes.

    Returns:
        An ``InferenceMeasurement``: the child's peak resident set (VmHWM), its RSS after importing
        TensorFlow and Keras and what building the model added, in bytes; the path's seconds.

    Raises:
        BigmemError: the child failed; the message ends with its last line of stderr.
        subprocess.TimeoutExpired: the child ran past ``timeout_s``.

    Example:
        >>> measure_inference(resolve_config("tiny"), (32, 32, 32)).peak_bytes
    """
    shape = [int(s) for s in shape]
    values = run_child(INFERENCE_PROBE_MODULE, {"config": config.to_dict(), "shape": shape},
                       what=f"Measuring inference of {config.model.name} at {'x'.join(map(str, shape))}",
                       timeout_s=timeout_s, env=env)
    return InferenceMeasurement(int(values["peak_bytes"]), int(values["baseline_bytes"]), int(values["model_bytes"]),
                                float(values["seconds"]))
