"""Child process that segments one random whole volume by ``bigmem predict``'s path and reports its peak memory.

Run as ``python -m bigmem.infer.probe REQUEST.json`` (by ``bigmem.memory.measure.measure_inference``);
prints one JSON line: ``peak_bytes``, ``baseline_bytes``, ``model_bytes``, ``seconds``. A fresh
process per configuration, so one measurement's peak never leaks into the next (README.md, "Memory").

The path is predict's own, not a copy of it: ``predict_probabilities`` (normalise, pad to the
size contract, ``forward_probabilities``, crop) and ``labels_to_source`` (the class channels
mapped to the source grid one at a time and reduced by a running argmax), on a case whose source
grid is the store grid. Only the reading and writing of files is left out. The network is a
``UNet3D`` of the request's config with random weights: the values of the weights and voxels do
not change the footprint.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from bigmem.config.options import Precision
from bigmem.child import serve
from bigmem.config.schema import ExperimentConfig
from bigmem.memory.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes
from bigmem.tfenv import import_tensorflow


def probe(request: dict) -> dict:
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
    from bigmem.infer.geometry import CaseGeometry, labels_to_source
    from bigmem.data.preprocess import Preprocessing
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
    """``python -m bigmem.infer.probe REQUEST.json``: ``probe``'s result as one JSON line (``child.serve``)."""
    return serve(probe, argv)


if __name__ == "__main__":
    sys.exit(main())
