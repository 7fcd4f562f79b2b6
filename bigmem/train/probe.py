"""Child process that runs one pass of a configuration and reports its peak memory.

Run as ``python -m bigmem.train.probe REQUEST.json`` (by ``bigmem.memory.measure.measure``); prints
one JSON line. A fresh process per configuration, so one measurement's peak never leaks into the
next. The request's ``pass`` is "train" (a few training steps by the trainer) or "forward" (one
random whole volume segmented by ``bigmem predict``'s path). It lives with the trainer and above
predict, both of which it runs; the memory layer starts it as a program and never imports it.

The forward path is predict's own, not a copy of it: ``predict_probabilities`` (normalise, pad to
the size contract, ``forward_probabilities``, crop) and ``labels_to_source`` (the class channels
mapped to the source grid one at a time and reduced by a running argmax), on a case whose source
grid is the store grid. Only the reading and writing of files is left out. The network is a
``UNet3D`` of the request's config with random weights: the values of the weights and voxels do
not change the footprint.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from rich.console import Console

from bigmem.child import serve
from bigmem.config.options import Precision
from bigmem.config.schema import ExperimentConfig
from bigmem.memory.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes
from bigmem.numa.observe import node_resident_bytes
from bigmem.rundir import RunDir
from bigmem.tfenv import import_tensorflow


def probe(request: dict) -> dict:
    """Run the request's pass: ``{"pass": "train"|"forward", "config": ExperimentConfig.to_dict(), ...}``.

    Returns:
        ``peak_bytes`` (VmHWM of this process), ``baseline_bytes`` (RSS after importing TensorFlow
        and Keras) and the pass's own figures (``_train``'s or ``_forward``'s).
    """
    return _forward(request) if request.get("pass") == "forward" else _train(request)


def _train(request: dict) -> dict:
    """Train ``request["config"]`` for its steps; also ``node_bytes``, ``steps``, ``step_s`` (median, the
    first excluded) and ``cores``."""
    config = ExperimentConfig.from_dict(request["config"], source="probe request")
    from bigmem.numa.apply import place

    place(config.numa.policy, config.numa.cpus, config.numa.threads)  # before TensorFlow starts its threads
    import_tensorflow()
    import keras  # noqa: F401  (part of the framework's fixed cost, as in a real run)

    baseline_bytes = rss_bytes()
    from bigmem.train.trainer import train  # after the placement, and outside the baseline (TF and Keras only)

    with tempfile.TemporaryDirectory(prefix="bigmem-probe-") as run_dir:
        train(config, f"{run_dir}/run", console=Console(file=io.StringIO()),
              recompute_stages=request.get("recompute_stages"), force=bool(request.get("force", False)))
        rows = RunDir(f"{run_dir}/run").read_metrics()
    step_s = [r["step_s"] for r in rows[1:]] or [rows[0]["step_s"]]
    return {
        "peak_bytes": peak_rss_bytes(),
        "baseline_bytes": baseline_bytes,
        "node_bytes": {str(k): v for k, v in node_resident_bytes().items()},
        "steps": len(rows),
        "step_s": statistics.median(step_s),
        "cores": len(os.sched_getaffinity(0)),  # after the placement: what the steps ran on
    }


def _forward(request: dict) -> dict:
    """Segment a random volume of ``request["shape"]`` with a random-weight network; report the peak.

    Args:
        request: ``{"config": ExperimentConfig.to_dict(), "shape": [D, H, W]}``; the network is
            ``config.model`` in ``config.train.precision`` (bf16: Keras's ``mixed_bfloat16``), the
            image has ``config.model.in_channels`` channels. ``D, H, W`` need not be multiples of
            ``2**depth``: predict pads them.

    Returns:
        ``peak_bytes`` (VmHWM of this process: framework, model and the whole path),
        ``baseline_bytes`` (RSS after importing TensorFlow and Keras), ``model_bytes`` (RSS added
        by building the model), ``seconds`` (the path, model building excluded).
    """
    config = ExperimentConfig.from_dict(request["config"], source="inference probe request")
    shape = tuple(int(s) for s in request["shape"])
    from bigmem.numa.apply import place

    place(config.numa.policy, config.numa.cpus, config.numa.threads)  # before TensorFlow starts its threads
    import_tensorflow()
    import keras  # noqa: F401  (part of the framework's fixed cost, as in a real run)

    baseline_bytes = rss_bytes()
    from bigmem.data.preprocess import Preprocessing
    from bigmem.infer.geometry import CaseGeometry, labels_to_source
    from bigmem.infer.modelcard import ModelCard
    from bigmem.infer.predict import Mode, Predictor, predict_probabilities
    from bigmem.nets.unet3d import UNet3D

    policy = "mixed_bfloat16" if config.train.precision is Precision.BF16 else "float32"
    model = UNet3D(config.model, dtype=policy, name="unet3d").build_for()
    model_bytes = rss_bytes() - baseline_bytes
    channels = config.model.in_channels  # the default z-score: the cost of every scheme is one pass or two
    card = ModelCard(tuple(f"channel{c}" for c in range(channels)), ("background",), Preprocessing.default(channels))
    predictor = Predictor(model, config, "random weights (inference probe)", card=card)
    geometry = CaseGeometry("probe", shape, np.eye(4), shape, np.eye(4), shape, ((0, 0),) * 3, (1.0, 1.0, 1.0))
    image = np.random.default_rng(0).standard_normal((*shape, config.model.in_channels), dtype=np.float32)
    reset_peak_rss()  # the image's float32 draw is the case read from disk; nothing before it is the path's
    started = time.perf_counter()
    probabilities = predict_probabilities(predictor, image, mode=Mode.WHOLE)
    del image  # as predict_case does once the probabilities exist
    labels = labels_to_source(probabilities, geometry)
    seconds = time.perf_counter() - started
    if labels.shape != shape:  # a probe that segmented something else would measure the wrong thing
        raise RuntimeError(f"inference probe: labels of shape {labels.shape}, expected {shape}")
    return {"peak_bytes": peak_rss_bytes(), "baseline_bytes": baseline_bytes, "model_bytes": model_bytes,
            "seconds": round(seconds, 3)}


def main(argv: list[str] | None = None) -> int:
    """``python -m bigmem.train.probe REQUEST.json``: ``probe``'s result as one JSON line (``child.serve``)."""
    return serve(probe, argv)


if __name__ == "__main__":
    sys.exit(main())
