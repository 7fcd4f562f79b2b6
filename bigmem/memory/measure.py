"""Measured peak memory: K real training steps of a configuration in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from bigmem.config.schema import ExperimentConfig
from bigmem.data.synth import cached_synthetic_store
from bigmem.errors import BigmemError

# The child program that trains and prints its peak (``bigmem/train/probe.py``). It is started as
# a separate process, never imported: the trainer is a layer above this one.
PROBE_MODULE = "bigmem.train.probe"


@dataclass
class Measurement:
    """What one ``measure`` run saw in its child process (bytes, seconds)."""

    peak_bytes: int  # VmHWM of the child: the kernel's peak resident set
    baseline_bytes: int  # RSS after importing TensorFlow and Keras, before training
    node_bytes: dict[str, int]  # resident bytes per NUMA node after the steps (numa_maps)
    step_s: float  # median step time (first, tracing step excluded)


def measure(config: ExperimentConfig, *, steps: int = 3, recompute_stages: list[str] | None = None,
            timeout_s: float = 3600.0, force: bool = False) -> Measurement:
    """Train ``config`` for ``steps`` steps on synthetic volumes of its shape in a fresh process.

    The values of the voxels do not change the footprint, so the measurement uses phantoms of
    ``config.data.volume`` (cached) rather than the user's store. The child
    (``python -m bigmem.train.probe``) applies ``config.numa`` before TensorFlow starts, so its
    peak is that of a real run of the configuration, framework included.

    Args:
        config: the run to measure (model, ``data.volume``, ``train.batch_size``, precision,
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
        TensorFlow and Keras, in bytes; resident bytes per NUMA node; the median step time in s.

    Raises:
        BigmemError: the child failed (including the pre-flight's refusal without ``force``);
            the message ends with its last line of stderr.
        subprocess.TimeoutExpired: the child ran past ``timeout_s``.

    Example:
        >>> result = measure(ExperimentConfig.from_dict({"model": {"depth": 2}, "data": {"volume": 32}}))
        >>> result.peak_bytes - result.baseline_bytes  # bytes the training itself added
    """
    volume, batch = config.data.volume, config.train.batch_size
    store = str(cached_synthetic_store(num_cases=max(2, batch), volume=volume, num_classes=config.model.num_classes))
    config = config.updated({"data": {"store": store}, "train": {
        "steps": steps, "epochs": None, "checkpoint_every": steps,
        "warmup_steps": min(config.train.warmup_steps, steps)}})
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bigmem-probe-") as request:
        json.dump({"config": config.to_dict(), "recompute_stages": recompute_stages, "force": force}, request)
        request.flush()
        result = subprocess.run([sys.executable, "-m", PROBE_MODULE, request.name],
                                capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BigmemError(f"Measuring {config.model.name} at {volume}^3, batch {batch} failed in the child process "
                          f"(exit {result.returncode}): {tail}")
    values = json.loads(result.stdout.strip().splitlines()[-1])
    return Measurement(int(values["peak_bytes"]), int(values["baseline_bytes"]),
                       {str(k): int(v) for k, v in values["node_bytes"].items()}, float(values["step_s"]))
