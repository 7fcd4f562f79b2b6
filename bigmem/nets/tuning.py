"""This machine's tuning (``bigmem tune``): its kernel choices and rates, read before the shipped tables.

The shipped tables (bigmem/measured/kernel_choices.json, step_rates.json) were measured on a few
CPUs and serve others by ISA class alone; on another CPU of the same class both can be wrong (a
bf16 step slower than fp32, a planewise gradient that loses). The tuning pass (``bigmem.tune``)
times the alternatives at a run's own shapes on this machine and writes one file per machine
key under ``~/.cache/bigmem/tuning/``: the CPU model, the ISA class oneDNN runs at, the
TensorFlow version (its wheel bundles oneDNN, so that fixes oneDNN's), whether oneDNN is on,
and the intra-op thread count. A process reads the file of its own key; with none, the shipped
tables stay in force. TensorFlow-free: the planner and ``bigmem info`` read it.

The file holds, per (precision, stride, input channels) timed, whether the planewise weight
gradient won there, the rate of the network's
convolutions per precision, and the framework's fixed memory measured in a small training step
(against the shipped memory table's).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from bigmem.atomic import atomic_write_json
from bigmem.cache import cache_dir
from bigmem.tfenv import ONEDNN_VARIABLE, intra_op_threads, tensorflow_version

TUNING_VERSION = 2  # bumped when what a tuning file means changes; older files are ignored
TUNING_DIR_ENV = "BIGMEM_TUNING_DIR"  # tests point it at a temporary folder


@dataclass(frozen=True)
class TuningKey:
    """What a tuning is valid for: one CPU model, ISA class, TensorFlow (and so oneDNN), oneDNN state, threads."""

    cpu: str
    isa_class: str
    tensorflow: str
    onednn: str
    threads: int

    def slug(self) -> str:
        """A file name for this key: the ISA class, the thread count and a digest of the rest."""
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.isa_class}-t{self.threads}-{digest}"

    def describe(self) -> str:
        """``AMD EPYC, avx2, TF 2.21.0, oneDNN on, 2 threads``."""
        return (f"{self.cpu}, {self.isa_class}, TF {self.tensorflow}, oneDNN {self.onednn}, "
                f"{self.threads} thread{'s' * (self.threads != 1)}")


def onednn_state(environ=None) -> str:
    """"on" or "off": TF_ENABLE_ONEDNN_OPTS as bigmem sets it (``tfenv.enable_onednn``), "on" where unset on x86."""
    environ = os.environ if environ is None else environ
    return "off" if str(environ.get(ONEDNN_VARIABLE, "1")).strip() in ("0", "false", "False") else "on"


def key_here(threads: int | None = None) -> TuningKey:
    """This process's key: its CPU, the ISA class oneDNN runs at (``ONEDNN_MAX_CPU_ISA`` caps it), its threads."""
    from bigmem.cpu import cpu_description, isa_class
    from bigmem.nets.choices import effective_isa_class

    cpu = cpu_description()
    return TuningKey(cpu["model"], effective_isa_class(isa_class(cpu["isa"])), tensorflow_version(), onednn_state(),
                     threads or intra_op_threads())


def overhead_key(preset: str, precision: str, mode: str, table: str) -> str:
    """``Tuning.overhead_offset_bytes``'s key: ``"kits19/fp32/none@1a2b3c4d"``, the last part the digest of the
    shipped table it was measured against (``Calibration.table_digest``)."""
    return f"{preset}/{precision}/{mode}@{table}"


def tuning_dir() -> Path:
    """``$BIGMEM_TUNING_DIR``, else the cache folder's ``tuning/``."""
    return Path(os.environ.get(TUNING_DIR_ENV) or cache_dir() / "tuning")


def tuning_path(key: TuningKey | None = None) -> Path:
    """The tuning file of ``key`` (default: this process's)."""
    return tuning_dir() / f"{(key or key_here()).slug()}.json"


@dataclass
class Tuning:
    """One machine key's tuning file.

    Attributes:
        key: the ``TuningKey`` it is valid for.
        planewise: ``"precision/stride/input channels"`` -> whether the planewise weight gradient won
            there, its time and oneDNN's summed over every shape timed (all passes). Only what was
            timed is present; other channel counts keep the shipped choice.
        conv_gflops_per_core: ``"precision/base_filters"`` -> the rate of the network's convolutions at
            their fastest kernels (forward + both gradients), per core: the whole-network ceiling's rate.
        overhead_offset_bytes: ``"preset/precision/mode@table"`` (``overhead_key``) -> the measured overhead
            at the network's smallest shape minus that shipped table's there: the framework's fixed term on
            this machine against the CPU the table came from (memory/calibration.py adds it to that table,
            never to another shipped later).
        tuned: what each pass timed (model, shape, precision, seconds, whether it ran out of budget).
        rows: the timings (one per distinct convolution: its shape and each kernel's seconds).
    """

    key: dict
    planewise: dict
    conv_gflops_per_core: dict
    overhead_offset_bytes: dict
    tuned: list
    rows: list
    version: int = TUNING_VERSION

    def planewise_counts(self) -> dict[tuple[str, int, int], bool]:
        """``(precision, stride, input channels) -> planewise or not``, for the convolutions that were timed."""
        out = {}
        for name, won in self.planewise.items():
            precision, stride, channels = name.split("/")
            out[(precision, int(stride), int(channels))] = bool(won)
        return out

    def summary(self) -> str:
        """What the layers and the planner now take from it, in one line."""
        by_pair: dict[str, list[str]] = {}
        for (precision, stride, channels), won in sorted(self.planewise_counts().items()):
            by_pair.setdefault(f"{precision} stride {stride}", []).append(f"{channels}{'' if won else ' no'}")
        planewise = "; ".join(f"{pair}: {', '.join(counts)}" for pair, counts in by_pair.items()) or "none timed"
        rates = ", ".join(f"{p} {rate:g}" for p, rate in sorted(self.conv_gflops_per_core.items()))
        offsets = ", ".join(f"{name.split('@')[0]} {value / 2**20:+.0f} MiB"
                            for name, value in sorted(self.overhead_offset_bytes.items())) or "not measured"
        return (f"planewise weight gradient by input channels ({planewise}); convolutions at "
                f"{rates or '-'} GFLOP/s per core; fixed memory against the shipped table {offsets}")

    def conv_rates(self, precision: str) -> dict[int, float]:
        """``base filters -> GFLOP/s per core`` of the convolutions tuned in ``precision``."""
        out = {}
        for name, rate in self.conv_gflops_per_core.items():
            tuned_precision, width = name.split("/")
            if tuned_precision == precision:
                out[int(width)] = float(rate)
        return out

    def describe(self) -> str:
        """One line: what was tuned, when, how long it took."""
        passes = ", ".join(f"{t['model']} {'x'.join(map(str, t['shape']))} {t['precision']}"
                           + (" (partial)" if t.get("partial") else "") for t in self.tuned)
        seconds = sum(t.get("seconds", 0.0) for t in self.tuned)
        return f"tuned on this machine ({passes}; {seconds:.0f} s)"


def load_tuning(path: Path | None = None) -> Tuning | None:
    """This process's tuning file, or None where there is none (or it is unreadable or of another version)."""
    path = path or tuning_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("version") != TUNING_VERSION:
        return None
    try:
        return Tuning(**data)
    except TypeError:
        return None


def save_tuning(tuning: Tuning, path: Path | None = None) -> Path:
    """Write ``tuning`` (atomically) under its key's name; the choices are read afresh after it."""
    from bigmem.nets.choices import kernel_choices

    path = path or tuning_dir() / f"{TuningKey(**tuning.key).slug()}.json"
    atomic_write_json(path, asdict(tuning))
    kernel_choices.cache_clear()
    return path
