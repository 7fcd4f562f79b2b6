"""Measured peak memory in a child process: K real training steps, or one whole-volume prediction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from bigmem.child import run_child
from bigmem.config.schema import ExperimentConfig
from bigmem.data.synth import cached_synthetic_store
from bigmem.memory import MEASURED_STEPS
from bigmem.memory.estimate import Pass
from bigmem.units import format_shape

# The child program that runs one pass and prints its peak (``bigmem/train/probe.py``: a training
# run, or predict's whole-volume path). It is started as a separate process, never imported: the
# trainer and predict are layers above this one.
PROBE_MODULE = "bigmem.train.probe"


@dataclass
class Measurement:
    """What one ``measure`` run saw in its child process (bytes, seconds)."""

    peak_bytes: int  # VmHWM of the child: the kernel's peak resident set
    baseline_bytes: int  # RSS after importing TensorFlow and Keras, before training or building the model
    seconds: float  # training: the median step (first, tracing step excluded); forward: the path
    node_bytes: dict[str, int] = field(default_factory=dict)  # training: resident bytes per NUMA node (numa_maps)
    cores: int = 1  # training: CPUs the child's steps ran on (its affinity after the placement)
    model_bytes: int = 0  # forward: RSS the model's construction added


def measure(config: ExperimentConfig, shape: Sequence[int] | None = None, *, pass_: Pass = Pass.TRAIN,
            steps: int = MEASURED_STEPS, recompute_stages: list[str] | None = None, timeout_s: float = 3600.0,
            force: bool = False, env: dict[str, str] | None = None) -> Measurement:
    """Run one pass of ``config`` in a fresh process (``python -m bigmem.train.probe``) and read its peak.

    The child applies ``config.numa`` before TensorFlow starts, so its peak is that of a real run,
    framework included. The values of the voxels and weights do not change the footprint:

    - ``Pass.TRAIN`` trains ``steps`` steps on synthetic volumes of ``shape`` (cached phantoms)
      rather than the user's store.
    - ``Pass.FORWARD`` builds ``config.model`` with random weights in ``config.train.precision`` and
      segments one random image of ``shape`` by predict's whole-volume path (normalise, pad to the
      size contract, the forward pass and softmax, the source mapping's running argmax).

    Args:
        config: the run (model, ``train.batch_size``, precision, placement); not changed.
        shape: ``(D, H, W)``; default ``data.shape``, else the cube of ``data.reference_volume``.
            A forward pass pads it to a multiple of ``2**depth`` as predict does.
        pass_: ``Pass.TRAIN`` (default) or ``Pass.FORWARD``.
        steps: training steps (default 3; the first, which traces, is left out of ``seconds``).
        recompute_stages: training: stage names to recompute in backward (``UNet3D.stage_names``);
            default None: the trainer's own choice for ``config``.
        timeout_s: the most seconds the child may run (default 3600).
        force: training: skip the pre-flight's refusal (exit 3) when the *estimate* exceeds the free
            memory: a benchmark that checks the estimate must be able to measure where it is too high.
        env: the child's environment (default: this process's), e.g. with
            ``BIGMEM_MAX_KERNEL_ELEMENTS`` lowered to run the depth-slab paths on small volumes.

    Returns:
        A ``Measurement``.

    Raises:
        BigmemError: the child failed (including the pre-flight's refusal without ``force``);
            the message ends with its last line of stderr.
        subprocess.TimeoutExpired: the child ran past ``timeout_s``.

    Example:
        >>> measure(resolve_config("tiny"), (32, 32, 32)).peak_bytes
        >>> measure(resolve_config("tiny"), (32, 32, 32), pass_=Pass.FORWARD).seconds
    """
    shape = tuple(int(s) for s in (shape or config.data.shape or (config.data.reference_volume,) * 3))
    if pass_ is Pass.FORWARD:
        values = run_child(PROBE_MODULE, {"pass": pass_.value, "config": config.to_dict(), "shape": list(shape)},
                           what=f"Measuring inference of {config.model.name} at {'x'.join(map(str, shape))}",
                           timeout_s=timeout_s, env=env)
        return Measurement(int(values["peak_bytes"]), int(values["baseline_bytes"]), float(values["seconds"]),
                           model_bytes=int(values["model_bytes"]))
    batch = config.train.batch_size
    store = str(cached_synthetic_store(num_cases=max(2, batch), volume=shape, num_classes=config.model.num_classes))
    config = config.updated({"data": {"store": store, "shape": list(shape)}, "train": {
        "steps": steps, "epochs": None, "checkpoint_every": steps,
        "warmup_steps": min(config.train.warmup_steps, steps),
        "tune": False}})  # a probe measures the step; the tuning pass measures memory through probes itself
    request = {"pass": pass_.value, "config": config.to_dict(), "recompute_stages": recompute_stages, "force": force}
    what = f"Measuring {config.model.name} at {format_shape(shape)}, batch {batch}"
    values = run_child(PROBE_MODULE, request, what=what, timeout_s=timeout_s, env=env)
    return Measurement(int(values["peak_bytes"]), int(values["baseline_bytes"]), float(values["step_s"]),
                       {str(k): int(v) for k, v in values["node_bytes"].items()}, int(values["cores"]))
