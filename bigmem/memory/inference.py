"""Predicted peak resident memory of segmenting one whole volume, per component, before anything is allocated.

Inference keeps no activations for backward, no gradients and no optimizer state: a forward pass
frees each tensor after its last use, so its footprint is the largest set of tensors alive at
once, not their sum. Each block reports that set (``inference_live_elements`` in nets/blocks.py:
its temporaries, its output and one depth slab where its ops run in slabs) and
``NetworkCounts.stage_inference_live`` adds what the network holds beside it (the stage's
inputs, the encoder outputs kept as skips). ``bigmem predict``'s whole-volume path
(infer/predict.py) adds host arrays around the forward pass: the case's image, its normalised
(or padded) copy, the probabilities copied out of TensorFlow, the source mapping's arrays.

What TensorFlow adds is calibrated, not guessed. Its CPU allocator (with oneDNN on, a caching
best-fit allocator) keeps the buffers it has held and reuses freed ones: the resident set never
shrank during a pass (kits19, fp32, 128^3-256^3, RSS read after every stage), and the buffers
left free at a stage are not always where the next stage's tensors fit (at 256^3 the last
decoder stage grew the resident set by one full-resolution tensor more than its new tensors
needed), so the peak is the live set plus fragmentation, which varies with the size. So the
counted bytes (the live set inside TensorFlow) become resident bytes through measured knots per
(ISA class, preset, precision), ``INFERENCE_DEFAULTS``, interpolated between the measured sizes
as the training estimate's calibration is (memory/calibration.py). Host arrays are numpy's,
allocated and returned to the kernel outside that allocator, and are added on top of its peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from bigmem.config import tables
from bigmem.config.options import Precision
from bigmem.config.schema import ExperimentConfig
from bigmem.data.pipeline import padded_shape  # the one rounding rule: training pads as predict does
from bigmem.memory.calibration import (
    FALLBACK_ISA, Calibration, knot_tuples, last_slope, machine_isa_class, unmeasured_margin,
)
from bigmem.memory.estimate import (
    BFLOAT16_BYTES, FLOAT32_BYTES, Estimate, NetworkCounts, slab_verdict,
)
from bigmem.memory.measure import InferenceMeasurement, measure_inference
from bigmem.nets.limits import exceeds_limit, max_kernel_elements, slab_elements
from bigmem.units import format_bytes

LABEL_BYTES = 1  # predict's labels are uint8
BOOL_BYTES = 1  # numpy's bool: the running argmax's "better" mask
# Knots per (ISA class, preset, precision), as the training calibration's DEFAULTS: the overhead
# (VmHWM - the estimate's exact parts) at each measured count of live bytes. Data, one entry per
# machine and model with its command, results files and notes on how well the knots hold:
# bigmem/measured/inference_memory.json (benchmarks/tables/bench_inference_memory.py --write-table).
_INFERENCE = tables.serving(tables.load("inference_memory"), "isa_class", "preset")
INFERENCE_DEFAULTS_MACHINES = {key: entry["summary"] for key, entry in _INFERENCE.items()}  # by (ISA class, preset)
INFERENCE_DEFAULTS: dict[tuple[str, str, str], tuple[tuple[int, int, int], ...]] = {
    (isa, table["preset"], table["precision"]): knot_tuples(table)
    for (isa, _), entry in _INFERENCE.items() for table in entry["tables"]
}
# Presets without knots of their own that use another's (tiny has small's blocks at a quarter of its width).
INFERENCE_PRESET_FOR = {"tiny": "small"}


@dataclass
class InferenceEstimate(Estimate):
    """A whole-volume inference prediction: ``Estimate`` (batch 1, no recomputation) plus its phases.

    ``components`` are the bytes live at the peak; ``host_phases`` the numpy arrays of each phase
    after the forward pass (the peak is TensorFlow's peak plus the largest of them).
    """

    host_phases: dict[str, int] = field(default_factory=dict)
    forward_flops: int = 0  # 2 per multiply-add of one forward pass
    source_shape: tuple[int, int, int] | None = None

    def to_dict(self) -> dict:
        """``Estimate.to_dict`` plus ``kind`` ("inference"), ``host_phases``, ``forward_flops``, ``source_shape``."""
        data = super().to_dict()
        data.update(kind="inference", host_phases=dict(self.host_phases), forward_flops=self.forward_flops,
                    source_shape=list(self.source_shape or self.spatial_shape))
        return data


def inference_calibration(preset: str, precision: str, *, isa: str | None = None) -> Calibration:
    """The shipped inference calibration for ``preset`` and ``precision`` on ISA class ``isa``.

    Args:
        preset: the model preset's name (``config.model.name``).
        precision: "fp32" or "bf16".
        isa: an ISA class (``bigmem.sysinfo.isa_class``; default: this CPU's).

    Returns:
        A ``Calibration`` whose knots are ``INFERENCE_DEFAULTS``'s; where they were not measured
        for this ISA class, preset or precision, another's with ``margin_fraction`` set (15%, or
        100% for bf16 emulated on this ISA) and its ``source`` saying why.

    Example:
        >>> inference_calibration("kits19", "fp32", isa="avx512_bf16").margin_fraction
        0.0
    """
    isa = isa or machine_isa_class()
    key = {"isa": isa, "preset": preset, "precision": precision, "mode": "inference"}
    measured_isas = sorted({k[0] for k in INFERENCE_DEFAULTS})
    reasons = []
    source_isa = isa if isa in measured_isas else FALLBACK_ISA
    if source_isa != isa:
        reasons.append(f"no inference default for ISA class {isa} (measured: {', '.join(measured_isas)})")
    base = INFERENCE_PRESET_FOR.get(preset, preset)
    for wanted_precision in (precision, "fp32", "bf16"):
        available = {k[1] for k in INFERENCE_DEFAULTS if (k[0], k[2]) == (source_isa, wanted_precision)}
        if available:
            break
    if wanted_precision != precision:
        reasons.append(f"no inference default in {precision}; using {wanted_precision}'s")
    if base not in available:
        # The measured preset with the largest overhead per counted byte beyond its knots: errs high.
        fallback = max(sorted(available), key=lambda name: last_slope(
            INFERENCE_DEFAULTS[(source_isa, name, wanted_precision)]))
        reasons.append(f"no inference default for model {preset!r}; using {fallback}'s")
        base = fallback
    knots = [[x, y] for _, x, y in INFERENCE_DEFAULTS[(source_isa, base, wanted_precision)]]
    margin, margin_bytes = unmeasured_margin(reasons, precision, isa)
    scale, framework = Calibration(0.0, 0, "", knots=knots).line_for(knots[-1][0] + 1)
    machine = INFERENCE_DEFAULTS_MACHINES[(source_isa, base)]
    source = f"inference default for {base} {wanted_precision} on {source_isa} ({machine})"
    if reasons:
        source += f"; {'; '.join(reasons)}: +{100 * margin:.0f}% + {format_bytes(margin_bytes)} safety margin"
    volumes = [v for v, _, _ in INFERENCE_DEFAULTS[(source_isa, base, wanted_precision)]]
    return Calibration(round(scale, 4), framework, source, key, volumes, margin_fraction=margin,
                       margin_bytes=margin_bytes, knots=knots)


def forward_live_bytes(config: ExperimentConfig, counts: NetworkCounts, spatial_shape: Sequence[int]) -> int:
    """TensorFlow's live bytes at the forward pass's peak, the network's input excepted.

    The largest of: each stage's live elements (``counts.stage_inference_live``) in the compute
    dtype; the head (the last decoder stage's output, the head's logits, and under bf16 their
    float32 cast, plus one depth slab where the head runs in slabs); the softmax (float32 logits
    and probabilities).

    Args:
        config: the network (``model``) and its precision (``train.precision``).
        counts: ``NetworkCounts.from_model`` for ``spatial_shape``.
        spatial_shape: the network's input ``(D, H, W)``.

    Returns:
        Bytes.
    """
    compute_bytes = BFLOAT16_BYTES if config.train.precision is Precision.BF16 else FLOAT32_BYTES
    voxels = math.prod(spatial_shape)
    classes = config.model.num_outputs  # the probabilities: per class, or per region
    stages = max(counts.stage_inference_live.values()) * compute_bytes
    last_output = list(counts.block_outputs.values())[-1]  # the last decoder stage's (the head's input)
    head_in = (1, *spatial_shape, last_output // voxels)
    slab = slab_elements(math.prod(head_in[2:])) if exceeds_limit(head_in) else 0
    head = (last_output + classes * voxels + slab) * compute_bytes
    if compute_bytes != FLOAT32_BYTES:
        head += classes * voxels * FLOAT32_BYTES  # the logits leave the network in float32
    softmax = 2 * classes * voxels * FLOAT32_BYTES
    return max(stages, head, softmax)


def estimate_inference(config: ExperimentConfig, counts: NetworkCounts, spatial_shape: Sequence[int], *,
                       calibration: Calibration | None = None, source_shape: Sequence[int] | None = None,
                       save_probabilities: bool = False) -> InferenceEstimate:
    """The predicted peak of segmenting one whole volume of ``spatial_shape`` (batch 1), per component.

    Components (bytes live at the peak; their sum is the prediction):

    - ``framework``: TensorFlow, Keras and what building the model adds beside its weights (calibrated).
    - ``weights``: every parameter in float32 (Keras 3 keeps no bfloat16 copy under mixed precision:
      each layer casts its kernel when it runs, a temporary of one layer's size).
    - ``input_tensor``: TensorFlow's float32 copy of the network's input (and its bfloat16 cast under bf16).
    - ``forward_activations``: the live set at the forward pass's peak (``forward_live_bytes``).
    - ``allocator_slack``: what TensorFlow's allocator holds beyond those two at its peak (calibrated).
    - ``input_image``, ``network_input``: the case's float32 image and the copy that goes through the
      network (its normalised copy, or that copy padded to the size contract).
    - ``probabilities``: the float32 probabilities copied out of TensorFlow (and their cropped copy).
    - ``output_mapping``: the source mapping's arrays (a float32 running maximum, the uint8 labels,
      a bool mask; with ``save_probabilities`` the float32 and float16 source-grid probabilities).
    - ``safety_margin``: only where the calibration was not measured for this machine and model.

    The host arrays (the last four) are numpy's, outside TensorFlow's allocator, whose peak stays
    resident: the prediction is TensorFlow's peak plus the host arrays of the largest phase after
    it (``host_phases``), which is why some of them may be 0.

    Args:
        config: the network (``model``) and its precision (``train.precision``: bf16 runs Keras's
            ``mixed_bfloat16``, as predict loads a bf16 run).
        counts: ``NetworkCounts.from_model`` for ``spatial_shape``.
        spatial_shape: the network's input ``(D, H, W)``, each a multiple of ``2**depth``.
        calibration: how counted bytes become resident ones (default: ``inference_calibration``).
        source_shape: the case's own shape before padding (default: ``spatial_shape``).
        save_probabilities: predict writes the probabilities too (``--save-probabilities``).

    Returns:
        An ``InferenceEstimate`` (``batch_size`` 1, no recomputed stages).

    Example:
        >>> counts = NetworkCounts.from_model(UNet3D(config.model), (256, 256, 256))
        >>> estimate_inference(config, counts, (256, 256, 256)).predicted_peak_bytes
    """
    precision = config.train.precision
    calibration = calibration or inference_calibration(config.model.name, precision.value)
    voxels = math.prod(spatial_shape)
    source_shape = tuple(source_shape) if source_shape is not None else tuple(spatial_shape)
    source_voxels = math.prod(source_shape)
    channels, classes = config.model.in_channels, config.model.num_outputs
    padded = source_voxels != voxels

    input_tensor = channels * voxels * (FLOAT32_BYTES + (BFLOAT16_BYTES if precision is Precision.BF16 else 0))
    forward = forward_live_bytes(config, counts, spatial_shape)
    counted = input_tensor + forward
    scale, intercept = calibration.line_for(counted)
    framework = calibration.fixed_bytes()
    slack = int(round(intercept + scale * counted)) - framework - counted

    image = channels * source_voxels * FLOAT32_BYTES
    network_input = channels * voxels * FLOAT32_BYTES
    probabilities = classes * voxels * FLOAT32_BYTES
    cropped = classes * source_voxels * FLOAT32_BYTES if padded else 0
    mapping = source_voxels * (FLOAT32_BYTES + LABEL_BYTES + BOOL_BYTES)
    saved = classes * source_voxels * (FLOAT32_BYTES + 2) if save_probabilities else 0  # float32, then float16
    phases = {
        # predict_probabilities: the image, the network's input and the probabilities' copy (and its crop)
        "probabilities": image + network_input + probabilities + cropped,
        # labels_to_source after the image is dropped: the (cropped) probabilities and the running argmax
        "mapping": (cropped or probabilities) + mapping,
    }
    if save_probabilities:
        phases["saved_probabilities"] = (cropped or probabilities) + saved
    peak_phase = max(phases, key=phases.get)
    host = {
        "probabilities": {"input_image": image, "network_input": network_input,
                          "probabilities": probabilities + cropped, "output_mapping": 0},
        "mapping": {"input_image": 0, "network_input": 0, "probabilities": cropped or probabilities,
                    "output_mapping": mapping},
        "saved_probabilities": {"input_image": 0, "network_input": 0, "probabilities": cropped or probabilities,
                                "output_mapping": saved},
    }[peak_phase]
    components = {"framework": framework, "weights": counts.param_count * FLOAT32_BYTES, "input_tensor": input_tensor,
                  "forward_activations": forward, "allocator_slack": slack, **host}
    notes = [f"host arrays peak in the {peak_phase.replace('_', ' ')} phase, after the forward pass "
             f"(phases: {', '.join(f'{k} {v:,} B' for k, v in phases.items())})"]
    if calibration.has_margin:
        components["safety_margin"] = calibration.safety_margin(sum(components.values()))
        notes.append(f"calibration: {calibration.source}")
    sliced = [name for name, n in counts.stage_largest_tensor.items() if n > max_kernel_elements()]  # batch 1
    widest_plane = max(counts.stage_largest_tensor.values(), default=counts.largest_tensor) // spatial_shape[0]
    runnable, unrunnable = slab_verdict(widest_plane)
    notes += unrunnable
    if sliced:
        notes.append(f"{len(sliced)} stages hold tensors past {max_kernel_elements():,} elements, the limit bigmem "
                     f"keeps TF's CPU kernels under, and run in depth slabs of at most "
                     f"{slab_elements(widest_plane):,} elements: {', '.join(sliced)}")
    return InferenceEstimate(components, counts.param_count, tuple(spatial_shape), 1, precision.value, [],
                             calibration, 0, notes, partitioned_stages=sliced, runnable=runnable,
                             host_phases=phases, forward_flops=2 * counts.forward_macs, source_shape=source_shape)


@dataclass
class InferenceProfile:
    """``bigmem profile --inference``'s result: the estimate, and the measured peak when asked for."""

    estimate: InferenceEstimate
    measurement: InferenceMeasurement | None

    @property
    def error_pct(self) -> float | None:
        """(predicted - measured) / measured in percent; None without a measurement."""
        if self.measurement is None:
            return None
        measured = self.measurement.peak_bytes
        return 100.0 * (self.estimate.predicted_peak_bytes - measured) / measured

    def to_dict(self) -> dict:
        """``bigmem profile --json``'s fields (``kind`` "inference"), ``measured_seconds`` with a measurement."""
        data = self.estimate.to_dict()
        data["measured_peak_bytes"] = self.measurement.peak_bytes if self.measurement else None
        data["error_pct"] = None if self.error_pct is None else round(self.error_pct, 2)
        if self.measurement:
            data["measured_seconds"] = self.measurement.seconds
        return data


def profile_inference(config: ExperimentConfig, shape: Sequence[int], counts_for, *,
                      do_measure: bool = False) -> InferenceProfile:
    """Predict (and optionally measure) segmenting one whole case of ``shape`` by ``bigmem predict``'s path.

    Args:
        config: the network and its precision (``train.precision``) and placement (``numa``, for
            the measurement).
        shape: the case's ``(D, H, W)``; padded to a multiple of ``2**depth`` as predict pads it.
        counts_for: ``memory.profile.counts_function(config)``.
        do_measure: also segment a random volume of ``shape`` in a child process
            (``measure.measure_inference``) and read its peak.

    Returns:
        The ``InferenceProfile``.

    Raises:
        BigmemError: the measuring child failed.

    Example:
        >>> profile_inference(config, (240, 240, 155), counts_function(config)).estimate.spatial_shape
        (240, 240, 160)
    """
    padded = padded_shape(shape, config.model.divisor)
    predicted = estimate_inference(config, counts_for(padded), padded, source_shape=tuple(shape))
    measured = measure_inference(config, shape) if do_measure else None
    return InferenceProfile(predicted, measured)


__all__ = ["INFERENCE_DEFAULTS", "InferenceEstimate", "InferenceProfile", "estimate_inference", "forward_live_bytes",
           "inference_calibration", "padded_shape", "profile_inference"]
