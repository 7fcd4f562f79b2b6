"""``bigmem compare``'s request: every option of the command with its default (``CompareRequest``), and
``run_compare``, which turns one into a comparison.

``run_compare`` makes the decisions the command makes before anything trains: the held-out cases
(one in ``HOLDOUT_ONE_IN`` of the store's by default), the data-parallel replicas (GPUs when there
are, else ``DEFAULT_SIMULATED_REPLICAS`` simulated on CPU), one GPU's memory (given, measured in a
``--gpu-reference`` file, or the scaled stand-in) and the resolved config; then it calls
``run.compare``. The command line parses its flags into a ``CompareRequest`` and calls it; so does
``bigmem.api.compare``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ContextManager

from bigmem.compare.run import (
    DEFAULT_PHANTOM_VOLUME, DEFAULT_VAL_EVERY, REAL_CASE, GpuMemory, Settings, compare, scaled_gpu_memory, whole_shape,
)
from bigmem.config.presets import DEFAULT_PRESET
from bigmem.errors import ConfigError, UsageError

if TYPE_CHECKING:
    from bigmem.compare.gpu_reference import GpuReference
    from bigmem.compare.report import CompareReport
    from bigmem.config.schema import ExperimentConfig

HOLDOUT_ONE_IN = 5  # default held-out cases: one in five of the store's (at least one), a 5-fold split's share
DEFAULT_SIMULATED_REPLICAS = 2  # data-parallel replicas simulated on CPU when no GPU is found: the fewest that shard
EQUAL = ("time", "flops")


@dataclasses.dataclass(frozen=True)
class CompareRequest:
    """Every option of ``bigmem compare``, each default the command's (a flag not given keeps it).

    Errors name the options as ``compare.<attribute>`` (``ConfigError``); the command line shows
    them as its flags (``compare.time_budget_s`` as ``--time-budget``).

    Attributes:
        data: the HDF5 store; None (default): synthetic phantoms of ``volume`` (default
            ``DEFAULT_PHANTOM_VOLUME``, 64) voxels per edge, generated once and cached.
        model: the preset name or .toml file (default ``DEFAULT_PRESET``, small).
        volume: with ``data``, every case cropped/padded to ``volume``^3 for the whole-volume path;
            without, the phantoms' edge (default None: each case at its own shape).
        shape: with ``data``, every case cropped/padded to this ``(D, H, W)`` instead (default None).
        batch_size: samples per replica, and per step of the whole-volume path (default None: the preset's).
        gpus: GPUs for the data-parallel path (default None: every GPU found).
        simulate_replicas: run the data-parallel path on this many logical CPU devices (default None:
            on the GPUs found, else on ``DEFAULT_SIMULATED_REPLICAS``, 2).
        gpu_memory_bytes: one GPU's memory, which sizes the patch (default None: the scaled stand-in,
            ``run.scaled_gpu_memory``, or the memory ``gpu_reference`` measured).
        gpu_reference: the JSON benchmarks/performance/gpu_reference.py wrote on a real GPU: its memory
            and the model's largest patch size the data-parallel path, and the report adds what it
            measured (default None).
        equal: what the two paths get the same of: ``"time"`` (training time, default) or ``"flops"``
            (training FLOPs).
        time_budget_s: seconds of training for the whole-volume path (default None:
            ``run.DEFAULT_TIME_BUDGET_S``, 120, unless ``steps`` is given).
        steps: steps for the whole-volume path instead of seconds (default None).
        seeds: runs per path, seeds 0..N-1 (default 1); the conclusion weighs the difference against
            their spread.
        val_every: validate the whole-volume path every this many steps, the data-parallel path at the
            same training FLOPs (default ``run.DEFAULT_VAL_EVERY``, 10).
        memory_budget_bytes: the host's memory budget for both runs and the largest-volume figure
            (default None: ``memory.budget.resolve_budget``'s, MemAvailable).
        holdout: held-out cases the Dice is scored on, the store's last (default None: one in
            ``HOLDOUT_ONE_IN`` of its cases, at least one).
        monitor_interval_s: seconds between monitor.csv rows in each run directory (default None:
            ``train.monitor_interval_s``'s default; 0: off).
        out: the output folder (default "compare").

    Example:
        >>> request = CompareRequest(simulate_replicas=2, steps=20, equal="flops")
        >>> run_compare(request).conclusion.text
    """

    data: str | None = None
    model: str = DEFAULT_PRESET
    volume: int | None = None
    shape: tuple[int, int, int] | None = None
    batch_size: int | None = None
    gpus: int | None = None
    simulate_replicas: int | None = None
    gpu_memory_bytes: int | None = None
    gpu_reference: str | None = None
    equal: str = "time"
    time_budget_s: float | None = None
    steps: int | None = None
    seeds: int = 1
    val_every: int = DEFAULT_VAL_EVERY
    memory_budget_bytes: int | None = None
    holdout: int | None = None
    monitor_interval_s: float | None = None
    out: str = "compare"

    def check(self) -> None:
        """Raise ``ConfigError`` for an option no comparison could use; reads and imports nothing.

        Raises:
            ConfigError: a count or length that is not positive (``holdout`` may be 0 here; the
                store decides), an ``equal`` other than time or flops, ``volume`` with ``shape``,
                ``shape`` without ``data``, or ``gpu_memory_bytes`` with ``gpu_reference``.
        """
        for name in ("steps", "batch_size", "volume", "gpus", "simulate_replicas", "time_budget_s", "seeds",
                     "val_every"):
            _check_positive(name, getattr(self, name))
        _check_positive("holdout", self.holdout, zero_ok=True)
        if self.monitor_interval_s is not None and not 0 <= self.monitor_interval_s < math.inf:
            raise ConfigError("compare.monitor_interval_s", f"Invalid {{field}} {self.monitor_interval_s:g}: expected "
                              "seconds >= 0 (0 turns the monitor off).")
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes < 1:
            raise ConfigError("compare.gpu_memory_bytes", f"Invalid {{field}} {self.gpu_memory_bytes}: expected a "
                              "positive size such as 80GiB.")
        if self.equal not in EQUAL:
            raise ConfigError("compare.equal", f"Invalid {{field}} {self.equal!r}: expected time or flops.")
        if self.gpu_memory_bytes is not None and self.gpu_reference is not None:
            raise ConfigError("compare.gpu_memory_bytes", "Give either {field} or {compare.gpu_reference}, not both: "
                              "the reference file measured its GPU's memory.")
        if self.shape is not None and self.volume is not None:
            raise ConfigError("compare.volume", "Give either {field} or {compare.shape}, not both.")
        if self.shape is not None and self.data is None:
            raise ConfigError("compare.shape", "{field} needs {compare.data}: the synthetic phantoms are cubes (give "
                              "{compare.volume} N for N^3 phantoms).")


def _check_positive(name: str, value: int | float | None, *, zero_ok: bool = False) -> None:
    """``ConfigError`` on ``compare.<name>`` unless ``value`` (when given) is finite and > 0 (>= 0 with ``zero_ok``)."""
    if value is None or ((value >= 0 if zero_ok else value > 0) and value < math.inf):
        return
    integer = isinstance(value, int)
    what = (("an integer >= 0" if integer else "a number >= 0") if zero_ok else
            ("a positive integer" if integer else "a positive, finite number"))
    raise ConfigError(f"compare.{name}", f"Invalid {{field}} {value:g}: expected {what}.")


def run_compare(request: CompareRequest, progress: Callable[[str], None] | None = None, *,
                generating: Callable[[], ContextManager] | None = None, verbose: bool = False) -> CompareReport:
    """Compare whole volumes in RAM with data parallel on patches as ``request`` asks (``bigmem compare``).

    Checks ``request``, reads its ``gpu_reference``, resolves the config (generating the phantoms
    without ``data``), decides the held-out cases (``held_out_count``), one GPU's memory and the
    replicas (``replica_count``), then plans, trains and scores both paths (``run.compare``), which
    writes compare.json, compare.md and compare.png (and every run directory) under ``request.out``.

    Args:
        request: the options (``CompareRequest``).
        progress: called with one line per phase, and the sentences saying how the GPU's memory was
            sized and what a ``gpu_reference`` measured (default None: nothing is said).
        generating: a context-manager factory wrapped around generating the synthetic phantoms when they
            are not cached yet (e.g. a console status line; default None).
        verbose: show TensorFlow's start-up logs (default False).

    Returns:
        The ``CompareReport``: per path the per-seed runs (throughput, peak host memory, training FLOPs,
        curves, held-out scores), their means and spread, and the conclusion.

    Raises:
        ConfigError: an option no comparison could use (``CompareRequest.check``), or a ``holdout`` that
            leaves the store no case to train on or none to score.
        UsageError: an unreadable ``gpu_reference``, or one without the measurement the phantoms need;
            an unknown preset.
        DataError: the store cannot be read.
        InsufficientMemoryError: (exit 3) a path does not fit, before anything trains.
        BigmemError: a training run failed.

    Example:
        >>> report = run_compare(CompareRequest(model="tiny", steps=20, equal="flops"), progress=print)
        >>> report.conclusion.text
    """
    from bigmem.compare.gpu_reference import load_gpu_reference

    say = progress or (lambda line: None)
    request.check()
    measured = load_gpu_reference(request.gpu_reference) if request.gpu_reference is not None else None
    config = resolve_compare_config(request, generating=generating)
    holdout = held_out_count(request.holdout, config.data.store)
    reference, patch = None, None
    if measured is not None:
        memory, patch, reference = _measured_gpu(measured, config, request)
    elif request.gpu_memory_bytes is not None:
        memory = GpuMemory(request.gpu_memory_bytes)
    else:
        from bigmem.memory.profile import counts_function

        memory = scaled_gpu_memory(config, counts_function(config))
    replicas, simulate = replica_count(request.gpus, request.simulate_replicas, verbose=verbose)
    settings = Settings(replicas=replicas, simulate=simulate, gpu_memory=memory, equal=request.equal,
                        time_budget_s=request.time_budget_s, steps=request.steps, seeds=request.seeds,
                        holdout=holdout, val_every=request.val_every, memory_budget_bytes=request.memory_budget_bytes,
                        monitor_interval_s=request.monitor_interval_s, patch=patch, gpu_reference=reference)
    if memory.stand_in:
        say(f"GPU memory: {memory.stand_in}.")
    if reference is not None:
        say(f"{reference.measured_sentence(patch)}.")
    return compare(config, Path(request.out), settings, progress=say)


def resolve_compare_config(request: CompareRequest, *,
                           generating: Callable[[], ContextManager] | None = None) -> ExperimentConfig:
    """The compared job: ``request.model`` on its store (or phantoms) at its shape and batch, with the store's fields.

    Args:
        request: the options; ``volume`` or ``shape`` with ``data`` fixes the whole-volume path's shape,
            ``volume`` without it is the phantoms' edge.
        generating: as ``run_compare``'s.

    Returns:
        The resolved config, with ``data.store`` set (``data.derived.with_data_fields``).

    Example:
        >>> resolve_compare_config(CompareRequest(model="tiny", volume=32)).data.synth_volume
        32
    """
    from bigmem.config.presets import resolve_config
    from bigmem.data.derived import with_data_fields

    data: dict = {"store": request.data}
    if request.shape is not None:
        data["shape"] = list(request.shape)
    elif request.volume is not None and request.data is not None:
        data["shape"] = [request.volume] * 3
    if request.data is None:  # phantoms of --volume, each trained whole at its own (cube) shape
        data["synth_volume"] = request.volume or DEFAULT_PHANTOM_VOLUME
    train = {"batch_size": request.batch_size} if request.batch_size is not None else {}
    return with_data_fields(resolve_config(request.model, {"data": data, "train": train}), generating=generating)


def held_out_count(holdout: int | None, store: str) -> int:
    """The held-out cases both paths are scored on: ``holdout``, or one in ``HOLDOUT_ONE_IN`` of ``store``'s cases
    (at least one).

    Args:
        holdout: the cases asked for (``CompareRequest.holdout``); None: the default.
        store: the store's path.

    Returns:
        The number of held-out cases, the store's last.

    Raises:
        ConfigError: (field ``compare.holdout``) none held out, or none left to train on.

    Example:
        >>> held_out_count(None, "brats.h5")  # 484 cases
        96
    """
    from bigmem.data.store import HDF5VolumeStore

    with HDF5VolumeStore(store) as opened:
        num_cases = len(opened)
    count = max(1, num_cases // HOLDOUT_ONE_IN) if holdout is None else holdout
    if count >= num_cases or count == 0:
        given = f"{{field}} {count}" if holdout is not None else f"the default {{field}} ({count})"
        cases = f"{num_cases} case{'s' if num_cases > 1 else ''}"
        need = ("at least one held-out case to score" if count == 0
                else "at least one besides the held-out ones to train on")
        raise ConfigError("compare.holdout", f"Invalid {given}: the store {store!r} has {cases}; compare needs {need}.")
    return count


def replica_count(gpus: int | None, simulate_replicas: int | None, *, verbose: bool = False) -> tuple[int, bool]:
    """The data-parallel path's replicas: ``(count, simulated on CPU)``.

    ``simulate_replicas`` when given; else the GPUs found (``gpus`` of them when given); else, with no
    GPU, ``DEFAULT_SIMULATED_REPLICAS`` logical CPU devices.

    Args:
        gpus: GPUs to use (None: every one found).
        simulate_replicas: logical CPU devices instead of GPUs (None: only when no GPU is found).
        verbose: show TensorFlow's start-up logs (this imports TensorFlow to count the GPUs).

    Returns:
        ``(replicas, simulate)``.

    Example:
        >>> replica_count(None, None)  # on a host without GPUs
        (2, True)
    """
    from bigmem.tfenv import import_tensorflow

    found = len(import_tensorflow(verbose=verbose).config.list_physical_devices("GPU"))
    simulate = simulate_replicas is not None or found == 0
    return simulate_replicas or (DEFAULT_SIMULATED_REPLICAS if simulate else (gpus or found)), simulate


def _measured_gpu(measured: dict, config: ExperimentConfig, request: CompareRequest
                  ) -> tuple[GpuMemory, int | None, GpuReference | None]:
    """(GpuMemory, the fixed patch edge or None, the GpuReference reported) from a ``gpu_reference`` file.

    With ``data``: the measured GPU's memory, and the compared model's measured largest patch at batch 2
    where the file has it (the planner's patch for that memory otherwise, and where the measured patch
    is not smaller than the volumes). With the phantoms: the scaled stand-in, proportioned by the
    measured kits19 patch of a 512^3 volume, which the file must have.
    """
    from bigmem.compare.gpu_reference import MEASURED_BATCH, gpu_reference_for
    from bigmem.memory.profile import counts_function

    precision = config.train.precision
    own = gpu_reference_for(measured, config.model.name, precision)
    if request.data is None:
        real = gpu_reference_for(measured, REAL_CASE["model"], precision)
        if real is None:
            raise UsageError(f"{{compare.gpu_reference}} {request.gpu_reference}: no {REAL_CASE['model']} "
                             f"measurement at {precision}, which sizes the phantoms' stand-in GPU; give "
                             "{compare.data} STORE.h5 (the measured memory then sizes the patch) or a file that "
                             "measured kits19.")
        return scaled_gpu_memory(config, counts_function(config), real), None, own or real
    patch = None
    if own is not None and own.largest_patch and config.train.batch_size == MEASURED_BATCH \
            and own.largest_patch < max(whole_shape(config)):
        patch = own.largest_patch
    reference = own or gpu_reference_for(measured, config.model.name, precision, memory_only=True)
    return GpuMemory(measured["device"]["memory_bytes"]), patch, reference
