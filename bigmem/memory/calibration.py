"""Per-machine calibration of the footprint estimate: an activation multiplier and a fixed overhead.

``bigmem profile --calibrate --model X`` measures 2-3 small sizes in child processes and fits, per
(preset, precision, recompute), ``measured - exact parts = framework_bytes + activation_scale * counted``
by least squares; the result is stored in the user's cache directory, keyed by CPU model,
ISA class, TensorFlow version, preset, precision and recompute mode. Without a stored fit the
estimate uses the shipped tables for this ISA class and preset (bigmem/measured/training_memory.json,
and inference_memory.json for a forward pass); where there are none it uses another's and adds a
stated safety margin, and says so. ``calibration_for`` is the one lookup, for both passes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from bigmem.atomic import atomic_write_json
from bigmem.config import tables
from bigmem.cpu import ISA_CLASSES
from bigmem.data.synth import default_cache_dir
from bigmem.sysinfo import NATIVE_BF16_ISA_CLASSES, cpu_description, isa_class
from bigmem.tfenv import tensorflow_version
from bigmem.units import format_bytes


def knot_tuples(table: dict) -> tuple[tuple[int, int, int], ...]:
    """A shipped table's knots as ``(volume edge, counted activation bytes, overhead bytes)``, ascending."""
    return tuple((k["volume"], k["counted_activation_bytes"], k["overhead_bytes"]) for k in table["knots"])


# The shipped knots per (ISA class, preset, precision, mode), at DEFAULTS_BATCH_SIZE: the overhead
# (VmHWM - the estimate's exact parts) at each measured count of bytes, see Calibration. The mode is
# a training step's recompute mode ("none", "stages") or "inference" (one forward pass). Data, with
# the machine, command, results files and notes on how well they hold: bigmem/measured/training_memory.json
# (benchmarks/tables/bench_memory_model.py --write-table) and bigmem/measured/inference_memory.json
# (benchmarks/tables/bench_inference_memory.py --write-table).
INFERENCE_MODE = "inference"
TRAINING_MODES = ("none", "stages")
SHIPPED: dict[tuple[str, str, str, str], tuple[tuple[int, int, int], ...]] = {}
SHIPPED_MACHINES: dict[tuple[str, str, str, str], str] = {}  # the same keys: which machine measured each table
SHIPPED_CPUS: dict[tuple[str, str, str, str], str] = {}  # the same keys: that machine's CPU model


def serving_tables(entries: dict[str, dict]) -> dict[tuple[str, str, str, str], tuple[dict, dict]]:
    """``(ISA class, preset, precision, mode) -> (entry, table)``: each training table from the latest entry that
    measured it (``tables.end_date``; at an equal date the later in the file), so that a second CPU model of a
    class adds what it measured (resenc-m on an Emerald Rapids Xeon) and keeps the first model's tables for
    the rest. Each table then names its own CPU (``SHIPPED_CPUS``)."""
    served = {}
    for entry in sorted(entries.values(), key=tables.end_date):
        for table in entry["tables"]:
            served[(entry["isa_class"], table["preset"], table["precision"], table["recompute"])] = (entry, table)
    return served


for _key, (_entry, _table) in serving_tables(tables.load("training_memory")).items():
    SHIPPED[_key], SHIPPED_MACHINES[_key] = knot_tuples(_table), _entry["summary"]
    SHIPPED_CPUS[_key] = (_entry.get("machine") or {}).get("cpu", "")
for (_isa, _), _entry in tables.serving(tables.load("inference_memory"), "isa_class", "preset").items():
    for _table in _entry["tables"]:
        _key = (_isa, _table["preset"], _table["precision"], INFERENCE_MODE)
        SHIPPED[_key], SHIPPED_MACHINES[_key] = knot_tuples(_table), _entry["summary"]
        SHIPPED_CPUS[_key] = (_entry.get("machine") or {}).get("cpu", "")
# What each sample past the first adds to a training step's peak, over what its blocks count, per preset
# (``added_sample_keeps`` of any entry; the later entry wins): the step of a larger batch than the
# curve's is its batch's peak plus this much of each added sample's count (memory/estimate.py).
ADDED_SAMPLE_KEEPS: dict[str, float] = {}
for _entry in sorted(tables.load("training_memory").values(), key=tables.end_date):
    ADDED_SAMPLE_KEEPS.update(_entry.get("added_sample_keeps", {}))
# The class whose tables an unmeasured class starts from, before its margin: the margins below
# were sized against it (AVX2 and AVX-512 without bf16 have no AMX tiles either).
FALLBACK_ISA = "avx512_bf16"
# The batch the training tables were measured at. Their curve is followed only by calibrations at the
# same batch: at equal counted bytes, batch 2 left more overhead than batch 1 (kits19 bf16 +
# stages, 96^3 x 2 measured 2.74 GiB, 0.27 GiB (13% of the overhead) above the batch-1 curve; 2026-12-01).
DEFAULTS_BATCH_SIZE = 1
# Presets without tables of their own that use another's: tiny has small's blocks (instance
# norm, max pooling) at a quarter of its width; its test-sized runs are framework-dominated.
PRESET_FOR = {"tiny": "small"}
# Margins added to the whole prediction where the defaults were not measured for this CPU or
# model, so that a pre-flight check never under-predicts silently (measured on an AVX2 dev machine
# with oneDNN forced on, small 64^3, the avx512-fitted default): fp32 was predicted 9.6% below
# the measured peak (x1.106 needed), rounded up to 15%; bf16 without native instructions is
# emulated with float32 temporaries and was predicted 45.7% below (x1.84 needed), rounded up to 100%.
UNMEASURED_MARGIN_FRACTION = 0.15
EMULATED_BF16_MARGIN_FRACTION = 1.0
# ... plus a fixed part, for the framework's own overhead, which differs between CPUs by an offset
# that the fraction does not cover at small sizes: on an Intel Xeon with AMX (not measured for
# the defaults; TF 2.21, 2026-12-01) every preset and mode measured 10-205 MiB above the AMD
# curve at 32-96^3, and small bf16 + stages at 96^3 came out 5.2% under the prediction with the
# 15% alone (benchmarks/results/memory_model-amx-intel-xeon-20261201-101443.json); 205 MiB rounded
# up. With both, every prediction there was high, by 8.8-23.8% at the largest size of each mode.
UNMEASURED_MARGIN_BYTES = 256 * 2**20
# Once bigmem tune has measured the fixed term on this machine, what is left unmeasured is the
# slope, borrowed from the table's CPU: on an AVX2 AMD EPYC (no table of its class), the
# avx512_bf16 table moved by the measured term predicted small at 48-256^3 (fp32, none and stages)
# between 0.9% and 0.1% under the measured peak (benchmarks/results/profile_accuracy-avx2-*.json);
# 2% keeps such a prediction from coming in under. Emulated bf16 keeps its own margin.
TUNED_MARGIN_FRACTION = 0.02


@dataclass
class Calibration:
    """How the counted activation bytes become resident bytes: ``framework + scale * counted``.

    With ``knots`` (measured ``[counted_activation_bytes, overhead_bytes]`` pairs, ascending),
    the line is the segment between the two knots around the counted bytes (the first or last
    segment beyond them): the measured overhead is not one line in the counted bytes. On this
    machine (kits19, fp32) it grows by 2,340 bytes per voxel up to 96^3 and by 1,955 from 128^3
    to 192^3 (benchmarks/results/memory_model-*.json), so no single (scale, framework) pair holds
    both 32^3 and 192^3 within 5%. ``activation_scale`` and ``framework_bytes`` are then the line
    used beyond the measured sizes (``line_for`` past the last knot).
    """

    activation_scale: float
    framework_bytes: int
    source: str
    key: dict = field(default_factory=dict)
    fitted_on: list = field(default_factory=list)
    # Added to the whole prediction (a fraction of it, and fixed bytes) where the values were not measured here.
    margin_fraction: float = 0.0
    margin_bytes: int = 0
    knots: list = field(default_factory=list)
    # The training step's rate measured with the fit (GFLOP/s per core, speed.py's count)
    # at its largest volume, fitted_on[-1]; None where no step was timed (the shipped defaults).
    step_gflops_per_core: float | None = None
    # The CPU model and ISA class a shipped table was measured on ("" for a fit made here).
    table_cpu: str = ""
    table_isa: str = ""
    # The batch its knots were measured at (the shipped tables': DEFAULTS_BATCH_SIZE). A step of a larger
    # batch adds, per added sample, what the network's added samples keep (``added_sample_keeps``;
    # memory/estimate.py, the training estimate).
    batch_size: int = DEFAULTS_BATCH_SIZE
    # The curve is another network's (no table was measured for this one): the estimate then keeps every
    # counted tensor instead of following it (memory/estimate.py), and keeps only its fixed term.
    borrowed: bool = False

    @property
    def has_margin(self) -> bool:
        """Whether the table was not measured here, so a safety margin is added (``unmeasured_margin``)."""
        return bool(self.margin_fraction or self.margin_bytes)

    def safety_margin(self, predicted_bytes: int) -> int:
        """The bytes added to a prediction of ``predicted_bytes``: its fraction plus the fixed part (0 where
        measured). Training and inference estimates both add this one number."""
        return int(round(self.margin_fraction * predicted_bytes)) + self.margin_bytes if self.has_margin else 0

    def line_for(self, counted_activation_bytes: float) -> tuple[float, float]:
        """(activation_scale, framework_bytes) of the segment that holds ``counted_activation_bytes``.

        Args:
            counted_activation_bytes: the estimate's activation bytes at unit scale.

        Returns:
            The scalars when there are fewer than two knots, else the interpolating segment's
            slope and intercept: below the first knot the first segment's; beyond the last, a
            line through the last knot with the larger of the last segment's slope and the
            least-squares slope of all knots (each weighted by 1 / overhead^2).
        """
        if len(self.knots) < 2:
            return self.activation_scale, self.framework_bytes
        index = 1
        while index < len(self.knots) - 1 and counted_activation_bytes > self.knots[index][0]:
            index += 1
        (x0, y0), (x1, y1) = self.knots[index - 1], self.knots[index]
        slope = (y1 - y0) / (x1 - x0)
        if counted_activation_bytes > x1 and len(self.knots) > 2:
            # Beyond the last knot, through it, with the larger of the last segment's slope and
            # the least-squares slope of all knots: one segment between nearby sizes is noisy
            # (kits19 bf16+stages, calibrated on 32/64/96^3: the 64-96 segment predicts 288^3
            # 9.3% low, the least-squares slope 1.1% low; benchmarks/results/memory_model-*.json).
            xs, ys = [k[0] for k in self.knots], [k[1] for k in self.knots]
            slope = max(slope, fit_line(xs, ys, [1.0 / max(y, 1) ** 2 for y in ys])[0])
            return slope, int(round(y1 - slope * x1))
        return slope, int(round(y0 - slope * x0))

    def fixed_bytes(self) -> int:
        """The overhead at no counted bytes: the first segment's intercept (else ``framework_bytes``)."""
        return self.line_for(self.knots[0][0])[1] if len(self.knots) >= 2 else self.framework_bytes

    def table_digest(self) -> str:
        """Eight hex digits naming the curve (its knots, and the class a shipped one came from): an offset
        ``bigmem tune`` measured against one shipped table is never applied to another (``with_tuned_overhead``)."""
        text = json.dumps([self.table_isa, self.knots], sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:8]

    def to_dict(self) -> dict:
        return asdict(self)


def knots_from(points: Sequence[dict]) -> list[list[int]]:
    """Measured points as knots: one per volume (averaged), ascending, overhead never decreasing.

    A later knot below an earlier one (measurement noise at small sizes, where the framework's
    fixed cost dominates) is raised to it, so that a segment never has a negative slope; that
    errs towards predicting more.

    Args:
        points: ``{volume, counted_activation_bytes, exact_bytes, measured_peak_bytes}`` each.

    Returns:
        ``[[counted_activation_bytes, overhead_bytes], ...]``, ascending in both.
    """
    by_volume: dict[int, list[dict]] = {}
    for p in points:
        by_volume.setdefault(p["volume"], []).append(p)
    knots = []
    for volume in sorted(by_volume, key=lambda v: by_volume[v][0]["counted_activation_bytes"]):
        group = by_volume[volume]
        x = sum(p["counted_activation_bytes"] for p in group) / len(group)
        y = sum(p["measured_peak_bytes"] - p["exact_bytes"] for p in group) / len(group)
        if knots and x <= knots[-1][0]:
            continue
        knots.append([int(round(x)), int(round(max(y, knots[-1][1] if knots else y)))])
    return knots


def added_sample_keeps(preset: str) -> float:
    """What each added sample keeps of its counted bytes (``ADDED_SAMPLE_KEEPS``); 1.0 (all of it) unmeasured."""
    return ADDED_SAMPLE_KEEPS.get(PRESET_FOR.get(preset, preset), 1.0)


def calibration_path() -> Path:
    return default_cache_dir() / "calibration.json"


@functools.lru_cache(maxsize=1)
def machine_cpu_model() -> str:
    """This CPU's model name (``bigmem.cpu.cpu_description``), read once: every calibration lookup keys on it."""
    return cpu_description()["model"]


@functools.lru_cache(maxsize=1)
def machine_isa_class() -> str:
    """This CPU's ISA class (``bigmem.cpu.isa_class`` of its /proc/cpuinfo flags)."""
    return isa_class(cpu_description()["isa"])


def machine_key(preset: str, precision: str, recompute: str) -> dict:
    """What a stored calibration is valid for: this CPU and TF version, one model and mode."""
    return {"cpu": machine_cpu_model(), "isa": machine_isa_class(), "tensorflow": tensorflow_version(),
            "preset": preset, "precision": precision, "recompute": recompute}


def _load_all(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text()).get("calibrations", [])
    except (OSError, ValueError):
        return []


def recompute_key(recompute_stages) -> str:
    """The calibration table's recompute mode for a step: "stages" when any stage is recomputed, else "none"."""
    return "stages" if recompute_stages else "none"


def calibration_for(preset: str, precision: str, mode: str, *, path: Path | None = None,
                    isa: str | None = None) -> Calibration:
    """The one calibration lookup: this machine's stored fit for the mode, else the shipped table.

    Args:
        preset: the model preset's name (``config.model.name``).
        precision: "fp32" or "bf16".
        mode: a training step's recompute mode ("none", "stages"; ``recompute_key``) or
            ``INFERENCE_MODE`` (one forward pass).
        path: the calibration store (default: ``calibration_path()``).
        isa: the ISA class to look tables up for (default: this CPU's).

    Returns:
        A stored fit (``bigmem profile --calibrate``); else ``shipped_calibration``.

    Example:
        >>> calibration_for("small", "fp32", "none").source  # e.g. 'this machine, fitted 2026-12-01'
    """
    key = machine_key(preset, precision, mode)
    for entry in _load_all(path or calibration_path()):
        if entry.get("key") == key:
            return Calibration(**entry)
    shipped = shipped_calibration(preset, precision, mode, isa=isa or machine_isa_class(), key=key)
    if isa is not None:
        return shipped
    if mode == INFERENCE_MODE:
        return inference_moved_here(shipped, preset, precision)
    tuned = with_tuned_overhead(shipped, preset, precision, mode)
    if tuned is shipped and not shipped.has_margin and shipped.table_cpu and not is_this_cpu(shipped.table_cpu):
        # The ISA class was measured, but not known to be on this CPU: the fixed term is bounded until measured.
        what = (f"not this CPU ({machine_cpu_model()})" if shipped.table_cpu != machine_cpu_model() else
                "this CPU's name too, but one a hypervisor gives to several CPU generations")
        return dataclasses.replace(
            shipped, margin_bytes=UNMEASURED_MARGIN_BYTES,
            source=f"{shipped.source}; measured on {shipped.table_cpu}, {what}: "
                   f"+{format_bytes(UNMEASURED_MARGIN_BYTES)} for the framework's fixed term until bigmem tune "
                   "measures it")
    return tuned


def fixed_term_status(preset: str, precision: str = "fp32", mode: str = "none") -> str:
    """Where the plan's fixed term for ``preset`` comes from on this machine, in a few words (``bigmem info``).

    Returns:
        "measured here (+63 MiB)" where ``bigmem tune`` (or a first training run) measured it; "this CPU's
        table"; else "borrowed from <CPU> (<class>): +<margin> until its first run measures it".
    """
    shipped = shipped_calibration(preset, precision, mode, isa=machine_isa_class())
    moved = with_tuned_overhead(shipped, preset, precision, mode)
    if moved is not shipped:
        offset = moved.knots[0][1] - shipped.knots[0][1]
        return f"measured here ({'+' if offset >= 0 else '-'}{format_bytes(abs(offset))})"
    found = calibration_for(preset, precision, mode)
    if not found.has_margin:
        return "this CPU's table"
    margin = " + ".join(part for part in (f"{100 * found.margin_fraction:.0f}%" if found.margin_fraction else "",
                                          format_bytes(found.margin_bytes) if found.margin_bytes else "") if part)
    return (f"borrowed from {found.table_cpu or 'another CPU'} ({found.table_isa}): +{margin} until its first run "
            "measures it")


def shipped_presets() -> list[str]:
    """The presets with a shipped training table of their own (any class)."""
    return sorted({key[1] for key in SHIPPED if key[3] in TRAINING_MODES})


def is_this_cpu(table_cpu: str) -> bool:
    """Whether a table recorded as measured on ``table_cpu`` is known to come from this CPU model.

    Only where the two names agree and the name identifies a model (it has a model number:
    "AMD EPYC 9654", "Intel(R) Xeon(R) Platinum 8481C"). "AMD EPYC" and "Intel(R) Xeon(R) Processor" are
    what hypervisors show for many generations: an EPYC of family 26 (Zen 5) reads "AMD EPYC" like the
    EPYC the avx512_bf16 tables were measured on, and small's step there peaked 6.3-8.6% above their
    prediction at 32-64^3 before its fixed term was measured (benchmarks/results/memory_model.md).
    """
    return table_cpu == machine_cpu_model() and any(c.isdigit() for c in table_cpu)


def with_tuned_overhead(calibration: Calibration, preset: str, precision: str, mode: str) -> Calibration:
    """The shipped table moved by this machine's measured fixed term (``bigmem tune``), where there is one.

    The table's overhead at small sizes is the framework's on the CPU it was measured on; this
    machine's can differ by hundreds of MiB (an AMX Xeon: 10-205 MiB above the AMD curve). The
    tuning pass measures it at the network's smallest shape; the knots move by the difference, and
    the fixed part of the safety margin, which stood in for it, is dropped. The offset is kept under the
    digest of the table it was measured against: a table shipped later is not moved by it until tune
    measures again.
    """
    from bigmem.nets.tuning import load_tuning, overhead_key

    tuning = load_tuning()
    name = overhead_key(preset, precision, mode, calibration.table_digest())
    if tuning is None or name not in tuning.overhead_offset_bytes or not calibration.knots:
        return calibration
    offset = int(tuning.overhead_offset_bytes[name])
    knots = [[x, y + offset] for x, y in calibration.knots]
    scale, framework = Calibration(0.0, 0, "", knots=knots).line_for(knots[-1][0] + 1)
    fraction = calibration.margin_fraction
    if fraction and not (precision == "bf16" and machine_isa_class() not in NATIVE_BF16_ISA_CLASSES):
        fraction = min(fraction, TUNED_MARGIN_FRACTION)
    elif not fraction and calibration.table_cpu and not is_this_cpu(calibration.table_cpu):
        # This class's own table, but not known to be this CPU's: its slope is borrowed as another class's is.
        fraction = TUNED_MARGIN_FRACTION
    source = (f"{calibration.source.split('; ')[0]}; this machine's fixed term measured by bigmem tune "
              f"({'+' if offset >= 0 else '-'}{format_bytes(abs(offset))})"
              + (f": +{100 * fraction:.0f}% safety margin" if fraction else ""))
    return dataclasses.replace(calibration, knots=knots, activation_scale=round(scale, 4), framework_bytes=framework,
                               margin_fraction=fraction, margin_bytes=0, source=source)


def overhead_at(calibration: Calibration, counted_bytes: float) -> float:
    """The calibration's overhead (resident bytes beyond the exact parts) at ``counted_bytes``, without its margin."""
    scale, framework = calibration.line_for(counted_bytes)
    return framework + scale * counted_bytes


def inference_moved_here(calibration: Calibration, preset: str, precision: str) -> Calibration:
    """An inference table measured on another CPU, moved by what is known of this machine's framework instead of
    a blanket margin.

    The inference tables come from fewer machines than the training tables. Where this one's is another
    CPU's, the difference between the two CPUs' fixed terms is read from training, where it is measured:
    this machine's training curve (its class's shipped table, moved by the fixed term ``bigmem tune``
    measured here where there is one) against the training curve of the CPU the inference table came
    from, both at the smallest size measured. The inference knots move by that difference, and the margin
    is what the training curve carries (what is not measured here), and at least ``TUNED_MARGIN_FRACTION``
    for the inference curve's shape, which is the other CPU's. So a forward pass is planned from the same
    measurement as the training step of the same network, and never above it for want of a measurement
    (an AMX Xeon, tuned: small at 96^3 planned 1.30 GB for inference against 1.29 GB for training, with the
    blanket 15% + 256 MiB).

    Args:
        calibration: ``shipped_calibration(..., INFERENCE_MODE)`` for this machine's class.
        preset, precision: the network and its precision.

    Returns:
        ``calibration`` unchanged where it was measured on this CPU model and ``bigmem tune`` measured no other
        fixed term here; else moved (on the same CPU model by the tuned term alone, with training's margin;
        emulated bf16 keeps the margin its training curve has for that).
    """
    if not calibration.knots:
        return calibration
    same_cpu = calibration.table_isa == machine_isa_class() and is_this_cpu(calibration.table_cpu)
    here = calibration_for(preset, precision, "none")  # this machine's training curve, with its own margin
    there = shipped_calibration(preset, precision, "none", isa=calibration.table_isa)
    smallest = min(here.knots[0][0] if here.knots else 0, there.knots[0][0] if there.knots else 0) or 1
    offset = int(round(overhead_at(here, smallest) - overhead_at(there, smallest)))
    if same_cpu and offset == 0:  # measured on this CPU model, and nothing measured here says otherwise
        return calibration
    knots = [[x, y + offset] for x, y in calibration.knots]
    scale, framework = Calibration(0.0, 0, "", knots=knots).line_for(knots[-1][0] + 1)
    fraction = here.margin_fraction if same_cpu else max(here.margin_fraction, TUNED_MARGIN_FRACTION)
    source = (f"{calibration.source.split('; ')[0]}; moved {'+' if offset >= 0 else '-'}{format_bytes(abs(offset))} "
              f"by this machine's training curve against {calibration.table_isa}'s: +{100 * fraction:.0f}%"
              + (f" + {format_bytes(here.margin_bytes)}" if here.margin_bytes else "") + " safety margin")
    return dataclasses.replace(calibration, knots=knots, activation_scale=round(scale, 4), framework_bytes=framework,
                               margin_fraction=fraction, margin_bytes=here.margin_bytes, source=source)


def last_slope(knots: Sequence[tuple[int, int, int]]) -> float:
    """The bytes per counted byte of a table's last segment: how steeply it extrapolates (0 for one knot).
    An unmeasured model takes the steepest measured one's table, so that its prediction errs high."""
    if len(knots) < 2:
        return 0.0
    (_, x0, y0), (_, x1, y1) = knots[-2], knots[-1]
    return (y1 - y0) / (x1 - x0)


def unmeasured_margin(reasons: list[str], precision: str, isa: str) -> tuple[float, int]:
    """The one margin rule, for training and inference tables alike: ``(fraction, bytes)`` added to a
    prediction whose table was not measured for this machine, model or mode (``reasons`` says why;
    none: no margin). 15% and 256 MiB; 100% for bf16 emulated on this ISA (its float32
    temporaries), which is then appended to ``reasons``."""
    if not reasons:
        return 0.0, 0
    if precision == "bf16" and isa not in NATIVE_BF16_ISA_CLASSES:
        reasons.append("bf16 is emulated on this ISA (float32 temporaries)")
        return EMULATED_BF16_MARGIN_FRACTION, UNMEASURED_MARGIN_BYTES
    return UNMEASURED_MARGIN_FRACTION, UNMEASURED_MARGIN_BYTES


def shipped_calibration(preset: str, precision: str, mode: str, *, isa: str, key: dict | None = None) -> Calibration:
    """The shipped table for ``isa``, ``preset``, ``precision`` and ``mode``, with a margin where it stands in.

    The fallback chain, each step said in ``source``: the ISA class (else ``FALLBACK_ISA``'s), the
    precision (else fp32's, then bf16's), the mode (a training mode without tables: the other
    one's), the preset (``PRESET_FOR``, else the measured preset that extrapolates most steeply,
    so that the prediction errs high). Any step taken adds ``unmeasured_margin``.

    Args:
        preset, precision, mode: as for ``calibration_for``.
        isa: an ISA class (``bigmem.cpu.isa_class``).
        key: recorded in the result (default: this machine's key).

    Returns:
        A Calibration; ``margin_fraction`` is 0 only where ``SHIPPED`` has this ISA class, preset (or
        the preset that stands in for it, ``PRESET_FOR``), precision and mode.

    Example:
        >>> shipped_calibration("small", "bf16", "none", isa="avx2").margin_fraction
        1.0
    """
    key = key or machine_key(preset, precision, mode)
    inference = mode == INFERENCE_MODE
    label = "inference default" if inference else "default"
    kind = {k for k in SHIPPED if (k[3] == INFERENCE_MODE) == inference}
    base = PRESET_FOR.get(preset, preset)
    source_isa, measured_on = _source_isa(kind, base, isa)
    reasons = []
    if source_isa != isa:
        reasons.append(f"no {label} for ISA class {isa} (measured: {', '.join(measured_on)})")
    wanted_precision, wanted_mode, available = _measured_presets(kind, source_isa, precision, mode)
    if wanted_precision != precision:
        reasons.append(f"no {label} in {precision}; using {wanted_precision}'s")
    if wanted_mode != mode:
        reasons.append(f"no {label} for recompute {mode}; using {wanted_mode}'s")
    if base not in available:
        lenders = available & _lenders(kind)
        fallback = max(sorted(lenders), key=lambda name: last_slope(
            SHIPPED[(source_isa, name, wanted_precision, wanted_mode)]))
        scope = "" if inference else f" in {precision}/{mode}"
        reasons.append(f"no {label} for model {preset!r}{scope}; using {fallback}'s")
        base = fallback
    table = (source_isa, base, wanted_precision, wanted_mode)
    margin, margin_bytes = unmeasured_margin(reasons, precision, isa)
    knots = [[x, y] for _, x, y in SHIPPED[table]]
    scale, framework = Calibration(0.0, 0, "", knots=knots).line_for(knots[-1][0] + 1)
    what = f"{base} {wanted_precision}" if inference else base
    source = f"{label} for {what} on {source_isa} ({SHIPPED_MACHINES[table]})"
    if reasons:
        source += f"; {'; '.join(reasons)}: +{100 * margin:.0f}% + {format_bytes(margin_bytes)} safety margin"
    return Calibration(round(scale, 4), framework, source, key, [v for v, _, _ in SHIPPED[table]],
                       margin_fraction=margin, margin_bytes=margin_bytes, knots=knots, table_cpu=SHIPPED_CPUS[table],
                       table_isa=source_isa, borrowed=base != PRESET_FOR.get(preset, preset))


def _lenders(keys) -> set[str]:
    """The presets whose tables a network without its own may borrow: those ``FALLBACK_ISA`` measured (the
    reference set every measured class has; a class that measured one more network does not lend it)."""
    return {k[1] for k in keys if k[0] == FALLBACK_ISA}


def _source_isa(keys, preset: str, isa: str) -> tuple[str, list[str]]:
    """The ISA class whose tables serve ``preset`` on ``isa``, and the classes that could have (for the note).

    This class where it measured the preset; else another class that did (``FALLBACK_ISA`` first): a
    network's own curve from another CPU is nearer than another network's from this one. resenc-m
    (102 M weights, 409 MB in float32) peaks where a plain U-Net's curve does not put it: at 32^3 its final
    model save holds a copy of the weights above the step's peak, and from 96^3 to 128^3 its peak grew by 0.75
    of what its blocks count; with intelai-brats's curve it was 12-13% over at 64^3 on an AVX2 EPYC
    (benchmarks/results/memory_model.md, "resenc-m's own curve"). A network no class measured borrows
    (``_lenders``) from this class where it has the lenders' tables, else from ``FALLBACK_ISA``.
    """
    own = sorted({k[0] for k in keys if k[1] == preset})
    if own:
        return (isa if isa in own else FALLBACK_ISA if FALLBACK_ISA in own else nearest_class(isa, own)), own
    lending = sorted({k[0] for k in keys if k[1] in _lenders(keys)})
    return (isa if isa in lending else FALLBACK_ISA), lending


def nearest_class(isa: str, measured: Sequence[str]) -> str:
    """The class of ``measured`` nearest to ``isa`` in capability (``bigmem.cpu.ISA_CLASSES``' order; a tie goes
    to the more capable): resenc-m, measured on amx and avx2, serves avx512_bf16 from amx's table (both
    AVX-512 with bf16 instructions) and avx512 from avx2's.

    Example:
        >>> nearest_class("avx512_bf16", ["amx", "avx2"])
        'amx'
    """
    order = [name for name, _ in ISA_CLASSES] + ["baseline"]
    rank = {name: index for index, name in enumerate(order)}
    return min(measured, key=lambda name: (abs(rank.get(name, len(order)) - rank.get(isa, len(order))),
                                           rank.get(name, len(order))))


def _measured_presets(keys, isa: str, precision: str, mode: str) -> tuple[str, str, set[str]]:
    """(precision, mode, presets) of the first tables ``keys`` has for ``isa``: ``precision`` else fp32's, then
    bf16's; a training ``mode`` else the other training mode's."""
    modes = (mode,) if mode == INFERENCE_MODE else (mode, *(m for m in TRAINING_MODES if m != mode))
    for wanted_mode in modes:
        for wanted_precision in (precision, "fp32", "bf16"):
            available = {k[1] for k in keys if (k[0], k[2], k[3]) == (isa, wanted_precision, wanted_mode)}
            if available:
                return wanted_precision, wanted_mode, available
    raise ValueError(f"no shipped memory table for ISA class {isa} in mode {mode}")


def fit_line(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None) -> tuple[float, float]:
    """Weighted least-squares (slope, intercept) of ys against xs (at least two distinct xs).

    Args:
        xs, ys: the points.
        weights: one per point (default: all 1).

    Returns:
        (slope, intercept).

    Raises:
        ValueError: fewer than two distinct xs.
    """
    n = len(xs)
    weights = list(weights) if weights is not None else [1.0] * n
    total = sum(weights)
    if n < 2 or total <= 0:
        raise ValueError("calibration needs at least two different sizes")
    mean_x = sum(w * x for w, x in zip(weights, xs)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys)) / total
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs))
    if sxx == 0:
        raise ValueError("calibration needs at least two different sizes")
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys)) / sxx
    return slope, mean_y - slope * mean_x


def shipped_shape(preset: str, precision: str, recompute: str, isa: str, batch_size: int) -> list[list[int]]:
    """The shipped knots of ``preset`` in this mode, for ``isa`` or else the measured ISA class; [] if none.

    A calibration measured on small volumes follows these beyond its own sizes (``follow_shape``).
    Another preset's knots are never used: the curve belongs to one network's tensors; nor are
    they at another batch than DEFAULTS_BATCH_SIZE.
    """
    if batch_size != DEFAULTS_BATCH_SIZE:
        return []
    base = PRESET_FOR.get(preset, preset)
    for source_isa in (isa, FALLBACK_ISA, *sorted({k[0] for k in SHIPPED})):
        knots = SHIPPED.get((source_isa, base, precision, recompute))
        if knots:
            return [[x, y] for _, x, y in knots]
    return []


def follow_shape(knots: list[list[int]], shape: Sequence[Sequence[int]]) -> list[list[int]]:
    """``knots`` (measured on small volumes) continued past their last one along the shipped ``shape``.

    The overhead per counted byte is not constant (kits19, fp32: 0.79 up to 96^3, 0.66 from 160^3,
    benchmarks/results/memory_model-*.json), so a line through small volumes over-predicts large
    ones (+14% at 192^3). Beyond the last measured knot the shipped curve is used instead, shifted
    by the bytes this machine measured above or below it there: within one ISA class, what
    differs between machines is taken to be an offset that does not grow with the volume. On the
    development machine kits19 fp32 measured 112 MB under the shipped knot at 96^3 and within
    22 MB of it at 128^3 and 160^3 (2026-12-01). Across classes it is more than an offset: on an
    Intel Xeon with AMX (TF 2.21, 2026-12-01) the AMD curve shifted this way was -12.5% at kits19
    bf16 192^3 and -11.3% at 160^3, though within -1.1..+0.8 GiB at the largest size of each mode
    (scaling the curve instead of shifting it put five of those 7.7-19.3% high;
    benchmarks/results/memory_model-amx-intel-xeon-20261201-101443.json, -143623.json); so each
    measured ISA class ships its own curve (SHIPPED).

    Args:
        knots: ``[[counted, overhead], ...]`` ascending, from this machine.
        shape: the shipped ``[[counted, overhead], ...]`` for the same preset and mode.

    Returns:
        ``knots`` plus the shifted shipped knots past the last of them.
    """
    if not knots or len(shape) < 2 or shape[-1][0] <= knots[-1][0]:
        return knots
    x_last, y_last = knots[-1]
    slope, intercept = Calibration(0.0, 0, "", knots=[list(k) for k in shape]).line_for(x_last)
    offset = y_last - (intercept + slope * x_last)
    return [list(k) for k in knots] + [[x, int(round(y + offset))] for x, y in shape if x > x_last]


def fit_calibration(preset: str, precision: str, recompute: str, points: Sequence[dict],
                    shape: Sequence[Sequence[int]] = (), *, batch_size: int = DEFAULTS_BATCH_SIZE) -> Calibration:
    """Fit ``measured - exact = framework_bytes + activation_scale * counted`` to measured points.

    With three or more volumes the result interpolates between them (``knots``; its scalars are
    the line beyond them); with two it is the least-squares line, each point weighted by
    1 / measured^2 so that it minimises the squared *relative* error (a pre-flight check is
    judged by it; unweighted, the largest size would decide the fit alone).

    Args:
        preset, precision, recompute: what the points measured (the stored key).
        points: ``{volume, counted_activation_bytes, exact_bytes, measured_peak_bytes}`` each,
            at least two different volumes (``bigmem.memory.profile.calibration_point``), and
            optionally ``step_gflops_per_core``, the rate its timed steps reached.
        shape: the shipped knots to follow past the measured volumes (``shipped_shape``; default
            none: the line through the measured knots continues).
        batch_size: the batch the points were measured at (recorded: ``Calibration.batch_size``).

    Returns:
        The Calibration, keyed by this machine, ``fitted_on`` the volumes; its step rate is the
        largest timed volume's (the one closest to the sizes a plan chooses).
    """
    timed = [p for p in points if p.get("step_gflops_per_core")]
    rate = max(timed, key=lambda p: p["volume"])["step_gflops_per_core"] if timed else None
    xs = [p["counted_activation_bytes"] for p in points]
    ys = [p["measured_peak_bytes"] - p["exact_bytes"] for p in points]
    weights = [1.0 / p["measured_peak_bytes"] ** 2 for p in points]
    scale, framework = fit_line(xs, ys, weights)
    knots = follow_shape(knots_from(points), shape) if len({p["volume"] for p in points}) > 2 else []
    calibration = Calibration(round(scale, 4), int(framework), f"this machine, fitted {time.strftime('%Y-%m-%d')}",
                              machine_key(preset, precision, recompute), sorted(p["volume"] for p in points),
                              knots=knots, step_gflops_per_core=rate, batch_size=int(batch_size))
    if knots:
        calibration.activation_scale, calibration.framework_bytes = calibration.line_for(knots[-1][0] + 1)
        calibration.activation_scale = round(calibration.activation_scale, 4)
    return calibration


def save_calibration(calibration: Calibration, *, path: Path | None = None) -> Path:
    path = path or calibration_path()
    entries = [e for e in _load_all(path) if e.get("key") != calibration.key]
    entries.append(calibration.to_dict())
    return atomic_write_json(path, {"calibrations": entries})
