"""Per-machine calibration of the footprint estimate: an activation multiplier and a fixed overhead.

``bigmem profile --calibrate --model X`` measures 2-3 small sizes in child processes and fits, per
(preset, precision, recompute), ``measured - exact parts = framework_bytes + activation_scale * counted``
by least squares; the result is stored in the user's cache directory, keyed by CPU model,
ISA class, TensorFlow version, preset, precision and recompute mode. Without a stored fit the
estimate uses the shipped defaults for this ISA class and preset; where there are none it uses
another's and adds a stated safety margin, and says so.
"""

from __future__ import annotations

import functools
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Sequence

from bigmem.data.synth import default_cache_dir
from bigmem.atomic import atomic_write_json
from bigmem.sysinfo import NATIVE_BF16_ISA_CLASSES, cpu_description, isa_class
from bigmem.units import format_bytes

# Defaults per (ISA class, preset, precision, recompute): knots (volume edge, counted activation
# bytes, measured overhead bytes = VmHWM - the estimate's exact parts) at batch 1, see
# Calibration. Measured by
#   python benchmarks/bench_memory_model.py --model intelai-brats,small,kits19 --check-sizes reused
#       --checks-per-mode 9 --reuse <the results files it names in "reused_from">
# (every point trained 3 steps in a fresh child process; its printed "defaults_fit"), on the
# development machine: AMD EPYC, 2 vCPUs, avx512_bf16 without AMX, one NUMA node, 24 GiB,
# TensorFlow 2.21.0 with oneDNN on, Keras 3: up to 128^3 (and kits19 fp32 160^3, kits19 bf16 +
# stages 256^3) on 2026-11-30, the largest size of each mode on 2026-12-01 (--fresh-checks);
# results in benchmarks/results/memory_model-avx512_bf16-amd-epyc-2026113*.json and -20261201-*.json (a later file
# wins where both measured a size). The same size measured on both days differed by 0.4-6.7%
# (intelai-brats bf16 256^3: 17.73 and 16.54 GiB; kits19 fp32 192^3: 14.47 and 13.98), which
# bounds how close any knot can be.
# intelai-brats fp32 at 256^3 (none) and 288^3 (stages) were killed by the kernel at 22.80 and
# 22.76 GiB resident, against 18.10 and 18.42 GiB predicted from the knots below them: their
# knots are those lower bounds (the peak was at least that), so a plan does not start them in
# 24 GiB. Run alone, 256^3 held 18.0 GiB after its first step and grew to 23.15 GiB in its second;
# with TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1 (malloc instead of TF's oneDNN BFC pool, which never
# returns memory and fragments) it peaked at 16.4 GiB. The defaults are measured with the pool,
# as bigmem runs today. tiny uses small's (DEFAULT_PRESET_FOR).
# The amx entries: the same command on an Intel Xeon with AMX (amx_bf16, avx512_fp16), 2 vCPUs,
# one NUMA node, 24 GiB, TensorFlow 2.21.0 with oneDNN on, 2026-12-01: 32-96^3 and the largest size
# of each mode (benchmarks/results/memory_model-amx-intel-xeon-20261201-10*.json, some re-measured in -12*.json),
# 128^3 and a size between (-14*.json). Sizes measured twice there differed by 0.6-2.2%. Each
# knot left out and predicted from the others: between knots -9.6% (small bf16/none at 128^3) to
# +3.9%, 46 of 49 within 5%; the largest size from the knots below it +1.0% to +11.8% (always over:
# Calibration.line_for's rule beyond the last knot). A <= 96^3 calibration on this machine that
# followed the AMD curve instead predicted up to 12.5% low (kits19 bf16/none at 192^3), which is
# why each class has its own.
DEFAULTS_MACHINES = {
    "avx512_bf16": "AMD EPYC 2 vCPU avx512_bf16, TF 2.21.0, 2026-11-30/12-01",
    "amx": "Intel Xeon 2 vCPU amx, TF 2.21.0, 2026-12-01",
}
# The class whose defaults an unmeasured class starts from, before its margin: the margins below
# were sized against it (AVX2 and AVX-512 without bf16 have no AMX tiles either).
FALLBACK_ISA = "avx512_bf16"
# The batch the DEFAULTS were measured at. Their curve is followed only by calibrations at the
# same batch: at equal counted bytes, batch 2 left more overhead than batch 1 (kits19 bf16 +
# stages, 96^3 x 2 measured 2.74 GiB, 0.27 GiB (13% of the overhead) above the batch-1 curve; 2026-12-01).
DEFAULTS_BATCH_SIZE = 1
DEFAULTS: dict[tuple[str, str, str, str], tuple[tuple[int, int, int], ...]] = {
    ("avx512_bf16", "small", "fp32", "none"): (
        (32, 24_551_424, 695_568_720),
        (64, 196_411_392, 849_606_992),
        (96, 662_888_448, 1_265_551_696),
        (128, 1_571_291_136, 2_057_447_760),
        (304, 21_049_777_152, 17_375_328_592),
    ),
    ("avx512_bf16", "small", "bf16", "none"): (
        (32, 13_520_896, 711_051_600),
        (64, 108_167_168, 857_418_064),
        (96, 365_064_192, 1_097_779_536),
        (128, 865_337_344, 1_608_710_480),
        (344, 16_796_966_848, 14_831_989_072),
    ),
    ("avx512_bf16", "small", "fp32", "stages"): (
        (32, 19_283_968, 700_430_672),
        (64, 154_271_744, 793_753_936),
        (96, 520_667_136, 1_068_386_640),
        (128, 1_234_173_952, 1_552_689_488),
        (352, 25_666_961_408, 17_965_578_576),
    ),
    ("avx512_bf16", "small", "bf16", "stages"): (
        (32, 10_887_168, 722_626_896),
        (64, 87_097_344, 811_624_784),
        (96, 293_953_536, 986_872_144),
        (128, 696_778_752, 1_371_658_576),
        (384, 18_813_026_304, 13_151_160_656),
    ),
    ("avx512_bf16", "intelai-brats", "fp32", "none"): (
        (32, 59_478_016, 847_618_528),
        (64, 475_824_128, 1_107_259_872),
        (96, 1_605_906_432, 1_755_529_696),
        (240, 25_092_288_000, 15_734_088_160),
        (256, 30_452_744_192, 24_054_063_584),  # a lower bound: killed at 22.80 GiB resident (see above)
    ),
    ("avx512_bf16", "intelai-brats", "bf16", "none"): (
        (32, 31_967_232, 837_767_648),
        (64, 255_737_856, 1_131_295_200),
        (96, 863_115_264, 1_695_150_560),
        (256, 16_367_222_784, 17_332_761_056),
    ),
    ("avx512_bf16", "intelai-brats", "fp32", "stages"): (
        (32, 41_754_624, 842_314_208),
        (64, 334_036_992, 1_040_880_096),
        (96, 1_127_374_848, 1_525_883_360),
        (272, 25_642_558_464, 16_562_717_152),
        (288, 30_439_120_896, 23_872_979_424),  # a lower bound: killed at 22.76 GiB resident (see above)
    ),
    ("avx512_bf16", "intelai-brats", "bf16", "stages"): (
        (32, 23_105_536, 839_877_088),
        (64, 184_844_288, 1_056_006_624),
        (96, 623_849_472, 1_578_230_240),
        (272, 14_189_687_296, 15_078_142_432),
    ),
    ("avx512_bf16", "kits19", "fp32", "none"): (
        (32, 95_734_784, 885_110_108),
        (64, 765_878_272, 1_419_109_724),
        (96, 2_584_839_168, 2_863_961_436),
        (128, 6_127_026_176, 5_380_838_748),
        (160, 11_966_848_000, 9_255_101_788),
        (192, 20_678_713_344, 14_494_664_028),
    ),
    ("avx512_bf16", "kits19", "bf16", "none"): (
        (32, 52_258_304, 943_375_708),
        (64, 418_066_432, 1_229_227_356),
        (96, 1_410_974_208, 1_980_990_812),
        (128, 3_344_531_456, 3_302_958_428),
        (224, 17_924_598_272, 12_998_083_932),
    ),
    ("avx512_bf16", "kits19", "fp32", "stages"): (
        (32, 74_863_872, 925_582_684),
        (64, 598_910_976, 1_244_034_396),
        (96, 2_021_324_544, 2_160_117_084),
        (128, 4_791_287_808, 3_579_942_236),
        (224, 25_678_308_096, 15_208_211_804),
    ),
    ("avx512_bf16", "kits19", "bf16", "stages"): (
        (32, 41_822_848, 978_457_948),
        (64, 334_582_784, 1_210_717_532),
        (96, 1_129_216_896, 1_586_447_708),
        (128, 2_676_662_272, 2_488_800_604),
        (256, 21_413_298_176, 13_843_834_204),
        (288, 30_488_856_192, 17_806_493_020),
    ),
    ("amx", "intelai-brats", "fp32", "none"): (
        (32, 59_478_016, 860_574_176),
        (64, 475_824_128, 1_094_312_416),
        (96, 1_605_906_432, 1_868_693_984),
        (128, 3_806_593_024, 3_177_120_224),
        (192, 12_847_251_456, 8_625_471_968),
        (240, 25_092_288_000, 15_832_474_080),
    ),
    ("amx", "intelai-brats", "bf16", "none"): (
        (32, 31_967_232, 870_543_840),
        (64, 255_737_856, 1_129_165_280),
        (96, 863_115_264, 1_865_630_176),
        (128, 2_045_902_848, 3_026_936_288),
        (192, 6_904_922_112, 7_841_219_040),
        (256, 16_367_222_784, 16_674_554_336),
    ),
    ("amx", "intelai-brats", "fp32", "stages"): (
        (32, 41_754_624, 871_076_320),
        (64, 334_036_992, 1_057_759_712),
        (96, 1_127_374_848, 1_569_276_384),
        (128, 2_672_295_936, 2_599_211_488),
        (192, 9_018_998_784, 6_512_644_576),
        (272, 25_642_558_464, 16_699_818_464),
    ),
    ("amx", "intelai-brats", "bf16", "stages"): (
        (32, 23_105_536, 847_884_768),
        (64, 184_844_288, 1_032_446_432),
        (96, 623_849_472, 1_542_914_528),
        (128, 1_478_754_304, 2_483_618_272),
        (224, 7_925_198_848, 9_687_781_856),
        (288, 16_843_935_744, 19_484_201_440),
    ),
    ("amx", "small", "fp32", "none"): (
        (32, 24_551_424, 700_877_136),
        (64, 196_411_392, 849_992_016),
        (96, 662_888_448, 1_259_972_944),
        (128, 1_571_291_136, 2_039_249_232),
        (224, 8_421_138_432, 7_334_324_560),
        (312, 22_755_717_504, 17_803_477_328),
    ),
    ("amx", "small", "bf16", "none"): (
        (32, 13_520_896, 771_230_032),
        (64, 108_167_168, 946_379_088),
        (96, 365_064_192, 1_274_857_808),
        (128, 865_337_344, 1_898_482_000),
        (256, 6_922_698_752, 7_005_047_120),
        (352, 17_996_312_576, 16_335_911_248),
    ),
    ("amx", "small", "fp32", "stages"): (
        (32, 19_283_968, 754_002_256),
        (64, 154_271_744, 843_290_960),
        (96, 520_667_136, 1_128_659_280),
        (128, 1_234_173_952, 1_554_585_936),
        (256, 9_873_391_616, 7_541_254_480),
        (352, 25_666_961_408, 18_034_178_384),
    ),
    ("amx", "small", "bf16", "stages"): (
        (32, 10_887_168, 787_745_104),
        (64, 87_097_344, 931_731_792),
        (96, 293_953_536, 1_202_309_456),
        (128, 696_778_752, 1_456_855_376),
        (288, 7_936_745_472, 6_438_590_800),
        (400, 21_264_000_000, 14_986_606_928),
    ),
    ("amx", "kits19", "fp32", "none"): (
        (32, 95_734_784, 971_691_356),
        (64, 765_878_272, 1_406_891_356),
        (96, 2_584_839_168, 2_666_333_532),
        (128, 6_127_026_176, 5_313_164_636),
        (160, 11_966_848_000, 9_231_168_860),
        (192, 20_678_713_344, 14_434_915_676),
    ),
    ("amx", "kits19", "bf16", "none"): (
        (32, 52_258_304, 952_010_076),
        (64, 418_066_432, 1_228_784_988),
        (96, 1_410_974_208, 2_049_754_460),
        (128, 3_344_531_456, 3_504_321_884),
        (160, 6_532_288_000, 6_252_266_844),
        (192, 11_287_793_664, 9_966_175_580),
        (224, 17_924_598_272, 13_616_797_020),
    ),
    ("amx", "kits19", "fp32", "stages"): (
        (32, 74_863_872, 948_540_764),
        (64, 598_910_976, 1_289_635_164),
        (96, 2_021_324_544, 2_170_119_516),
        (128, 4_791_287_808, 3_605_460_316),
        (160, 9_357_984_000, 6_152_197_468),
        (224, 25_678_308_096, 15_280_133_468),
    ),
    ("amx", "kits19", "bf16", "stages"): (
        (32, 41_822_848, 1_032_865_116),
        (64, 334_582_784, 1_263_785_308),
        (96, 1_129_216_896, 1_783_260_508),
        (128, 2_676_662_272, 2_873_812_316),
        (192, 9_033_735_168, 6_969_189_724),
        (256, 21_413_298_176, 14_234_342_748),
    ),
}
# Presets without defaults of their own that use another's: tiny has small's blocks (instance
# norm, max pooling) at a quarter of its width; its test-sized runs are framework-dominated.
DEFAULT_PRESET_FOR = {"tiny": "small"}
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
# 15% alone (benchmarks/results/memory_model-amx-intel-xeon-20261201-101443.json); 205 MiB rounded up. With
# both, every prediction there was high, by 8.8-23.8% at the largest size of each mode.
UNMEASURED_MARGIN_BYTES = 256 * 2**20


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
    # The training step's rate measured with the fit (GFLOP/s per core, memory/speed.py's count)
    # at its largest volume, fitted_on[-1]; None where no step was timed (the shipped defaults).
    step_gflops_per_core: float | None = None

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


def calibration_path() -> Path:
    return default_cache_dir() / "calibration.json"


def tensorflow_version() -> str:
    for dist in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@functools.lru_cache(maxsize=1)
def machine_isa_class() -> str:
    """This CPU's ISA class (``bigmem.sysinfo.isa_class`` of its /proc/cpuinfo flags)."""
    return isa_class(cpu_description()["isa"])


def machine_key(preset: str, precision: str, recompute: str) -> dict:
    """What a stored calibration is valid for: this CPU and TF version, one model and mode."""
    return {"cpu": cpu_model(), "isa": machine_isa_class(), "tensorflow": tensorflow_version(),
            "preset": preset, "precision": precision, "recompute": recompute}


def _load_all(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text()).get("calibrations", [])
    except (OSError, ValueError):
        return []


def recompute_key(recompute_stages) -> str:
    """The calibration table's recompute mode for a step: "stages" when any stage is recomputed, else "none"."""
    return "stages" if recompute_stages else "none"


def lookup_calibration(preset: str, precision: str, recompute: str, *, path: Path | None = None,
                       isa: str | None = None) -> Calibration:
    """This machine's stored calibration for ``preset`` and the mode, else the shipped default.

    Args:
        preset: the model preset's name (``config.model.name``).
        precision: "fp32" or "bf16".
        recompute: "none" or "stages".
        path: the calibration store (default: ``calibration_path()``).
        isa: the ISA class to look defaults up for (default: this CPU's).

    Returns:
        A stored fit; else the default for this ISA class and preset (no margin); else a default
        measured elsewhere with ``margin_fraction`` set and its ``source`` saying why.
    """
    key = machine_key(preset, precision, recompute)
    for entry in _load_all(path or calibration_path()):
        if entry.get("key") == key:
            return Calibration(**entry)
    return default_calibration(preset, precision, recompute, isa=isa or machine_isa_class(), key=key)


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


def default_calibration(preset: str, precision: str, recompute: str, *, isa: str,
                        key: dict | None = None) -> Calibration:
    """The shipped default for ``isa`` and ``preset``, with a margin where none was measured for them.

    Args:
        preset, precision, recompute: as for ``lookup_calibration``.
        isa: an ISA class (``bigmem.sysinfo.isa_class``).
        key: recorded in the result (default: this machine's key).

    Returns:
        A Calibration; ``margin_fraction`` is 0 only where DEFAULTS has this ISA class and preset
        (or the preset that stands in for it, DEFAULT_PRESET_FOR).

    Example:
        >>> default_calibration("small", "bf16", "none", isa="avx2").margin_fraction
        1.0
    """
    key = key or machine_key(preset, precision, recompute)
    measured_isas = sorted({k[0] for k in DEFAULTS})
    base = DEFAULT_PRESET_FOR.get(preset, preset)
    reasons = []
    source_isa = isa if isa in measured_isas else FALLBACK_ISA
    if source_isa != isa:
        reasons.append(f"no default for ISA class {isa} (measured: {', '.join(measured_isas)})")
    mode_defaults = {k[1]: v for k, v in DEFAULTS.items() if (k[0], k[2], k[3]) == (source_isa, precision, recompute)}
    if base not in mode_defaults:
        # An unmeasured model or mode: the shipped preset with the largest multiplier beyond its knots.
        fallback = max(mode_defaults, key=lambda name: last_slope(mode_defaults[name]))
        reasons.append(f"no default for model {preset!r} in {precision}/{recompute}; using {fallback}'s")
        base = fallback
    margin, margin_bytes = unmeasured_margin(reasons, precision, isa)
    knots = [[x, y] for _, x, y in mode_defaults[base]]
    scale, framework = Calibration(0.0, 0, "", knots=knots).line_for(knots[-1][0] + 1)
    source = f"default for {base} on {source_isa} ({DEFAULTS_MACHINES[source_isa]})"
    if reasons:
        source += f"; {'; '.join(reasons)}: +{100 * margin:.0f}% + {format_bytes(margin_bytes)} safety margin"
    return Calibration(round(scale, 4), framework, source, key, [v for v, _, _ in mode_defaults[base]],
                       margin_fraction=margin, margin_bytes=margin_bytes, knots=knots)


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
    base = DEFAULT_PRESET_FOR.get(preset, preset)
    for source_isa in (isa, FALLBACK_ISA):
        knots = DEFAULTS.get((source_isa, base, precision, recompute))
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
    benchmarks/results/memory_model-amx-intel-xeon-20261201-101443.json, -143623.json); so each measured ISA
    class ships its own curve (DEFAULTS).

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
                    shape: Sequence[Sequence[int]] = ()) -> Calibration:
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
                              knots=knots, step_gflops_per_core=rate)
    if knots:
        calibration.activation_scale, calibration.framework_bytes = calibration.line_for(knots[-1][0] + 1)
        calibration.activation_scale = round(calibration.activation_scale, 4)
    return calibration


def save_calibration(calibration: Calibration, *, path: Path | None = None) -> Path:
    path = path or calibration_path()
    entries = [e for e in _load_all(path) if e.get("key") != calibration.key]
    entries.append(calibration.to_dict())
    return atomic_write_json(path, {"calibrations": entries})
