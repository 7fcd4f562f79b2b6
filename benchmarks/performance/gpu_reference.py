"""The GPU side of ``bigmem compare``, measured: the same 3D U-Nets trained and run on one CUDA GPU in PyTorch.

    python benchmarks/performance/gpu_reference.py --out DIR         # on the GPU machine: ~8 min
    python benchmarks/performance/gpu_reference.py --cpu --out DIR   # the same code at tiny sizes, ~1 min
    python benchmarks/performance/gpu_reference.py --write-plan      # here, with bigmem: the planner's side

``bigmem compare`` only ever simulated the data-parallel GPU path (logical CPU devices), and the
planner's GPU footprint (``bigmem.distribute.planning.gpu_footprint_bytes``) had never met a GPU.
The machines lent with a GPU have PyTorch but no TensorFlow (its wheel is too large to carry), so
this script measures the architectures as PyTorch builds them (benchmarks/tables/torch_unet3d.py:
the MLPerf reference 3D U-Net is itself PyTorch) and imports neither bigmem nor anything beyond
the standard library and torch: the planner's predictions travel with it, precomputed here into
``gpu_reference_plan.json`` (``--write-plan``; the test suite checks that file is current).

Per model (default kits19 and intelai-brats) and precision (``tf32``: float32 weights, TF32
convolutions and matmuls, PyTorch's default for cuDNN convolutions; ``bf16``: ``torch.autocast``
to bfloat16), each step across every pair before the next, so no pair can eat the others' time,
until the budget (``--minutes``, default 8, start-up included) says stop, what it did not reach
listed:

1. training at 128^3 batch 2 (MLPerf's patch and batch): step time (median and spread of
   ``--steps`` after ``--warmup``) and the peak (``torch.cuda.max_memory_allocated``; reserved
   too, and what the GPU holds outside the allocator once the libraries are loaded);
2. the same at the planner's largest cubic patch for this GPU's memory at batch 2;
3. the largest cubic patch that trains at batch 2: a bisection over multiples of the model's
   divisor, starting at the planner's patch, each probe two steps, out-of-memory caught;
4. whole-volume inference: the largest cube one forward pass at batch 1 holds, the same way. Its
   cubes pass 2^31 elements per feature map, where kernels are least tried: last, when the rest is
   saved. A kernel's refusal of a size counts as "does not run"; any other error fails that item
   only, and a GPU context that stops working ends the run with what it has.

Training uses SGD with Nesterov momentum 0.99 (kits19's recipe; momentum buffers count in the
peak) and the Dice + cross-entropy loss of bigmem's trainer; cuDNN's autotuner is off, as every
probe is a new shape. ``--cpu`` runs the same code on the CPU with the ``tiny`` architecture at
32^3-64^3 (what the test suite runs): there is no allocator peak there, so the peak is the rise of
the process's resident high-water mark over the step (VmHWM, reset through /proc/self/clear_refs),
and "out of memory" is a peak over ``--cpu-memory-limit``.

Writes one JSON (the GPU's name, memory, driver, CUDA and torch versions, each figure with its
median and spread, and the planner's prediction beside each) and prints a table. ``bigmem compare
--gpu-reference FILE`` reads that JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

HERE = Path(__file__).resolve().parent
PLAN = HERE / "gpu_reference_plan.json"
MIB, GIB = 2**20, 2**30
MLPERF_PATCH, MLPERF_BATCH = 128, 2
MODELS = ("kits19", "intelai-brats")
CPU_MODELS = ("tiny",)
PRECISIONS = ("tf32", "bf16")
PLAN_EDGE_LIMIT = 1024  # the largest cube the plan predicts (a 1024^3 forward pass needs > 141 GiB in every model)
CPU_EDGE_LIMIT = 64
DEFAULT_MINUTES = 8.0
SCHEMA = 1
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


class OutOfMemory(Exception):
    """A probe did not run: CUDA's out-of-memory, on the CPU a peak over the limit, or a kernel's refusal.

    A refusal is a RuntimeError from cuDNN or PyTorch, such as a kernel that indexes in 32 bits refusing a
    tensor past 2^31 elements (a 32-channel 3D feature map passes it at 407^3): the cube does not run on
    this GPU whatever its memory, which is what a largest-cube search must report.
    """

    def __init__(self, message: str, kind: str = "out_of_memory"):
        super().__init__(message)
        self.kind = kind


# --- the planner's side (here, with bigmem) ---------------------------------------------------

def write_plan(path: Path = PLAN, models: tuple[str, ...] = MODELS + CPU_MODELS) -> dict:
    """Precompute what the planner predicts for every cube this script can probe; write it to ``path``.

    Per model: the architecture (what torch_unet3d.TorchUNet3D reads) and, per precision, the
    predicted training footprint of one GPU replica at batches 1 and 2 (``gpu_footprint_bytes``,
    which includes ``GPU_RUNTIME_BYTES`` for the CUDA context) and the counted bytes of a
    whole-volume forward pass (weights, the input, the live forward activations; no calibration: the
    planner has none for GPUs), per edge, every multiple of the divisor up to PLAN_EDGE_LIMIT.
    """
    from bigmem.atomic import atomic_write_json
    from bigmem.config.presets import resolve_config
    from bigmem.distribute.planning import GPU_RUNTIME_BYTES, gpu_footprint_bytes
    from bigmem.memory.estimate import forward_live_bytes
    from bigmem.memory.profile import counts_function

    report: dict = {"schema": SCHEMA, "gpu_runtime_bytes": GPU_RUNTIME_BYTES, "edge_limit": PLAN_EDGE_LIMIT,
                    "command": "python benchmarks/performance/gpu_reference.py --write-plan", "models": {}}
    for name in models:
        base = resolve_config(name)
        model = base.model
        counts_for = counts_function(base)
        edges = range(model.divisor, PLAN_EDGE_LIMIT + 1, model.divisor)
        entry = {"architecture": _architecture(model), "divisor": model.divisor, "predicted": {}}
        for precision in PRECISIONS:
            config = base.updated({"train": {"precision": "fp32" if precision == "tf32" else precision}})
            entry["predicted"][precision] = {
                f"train_batch{batch}": {str(e): gpu_footprint_bytes(config, counts_for, e, batch) for e in edges}
                for batch in (1, 2)}
            entry["predicted"][precision]["inference_counted"] = {
                str(e): _inference_counted(config, counts_for((e,) * 3), e, forward_live_bytes) for e in edges}
        report["models"][name] = entry
    atomic_write_json(path, report)
    return report


def _architecture(model) -> dict:
    fields = ("depth", "filters", "blocks_per_level", "norm", "groups", "activation", "downsampling", "residual",
              "conv_bias", "in_channels", "num_classes")
    return {f: (str(v) if isinstance(v := getattr(model, f), str) else v) for f in fields}


def _inference_counted(config, counts, edge: int, forward_live_bytes) -> int:
    float32 = 4
    weights = counts.param_count * float32
    input_tensor = config.model.in_channels * edge**3 * (float32 + (2 if config.train.precision == "bf16" else 0))
    return weights + input_tensor + forward_live_bytes(config, counts, (edge,) * 3)


# --- the devices ------------------------------------------------------------------------------

class Cuda:
    """One CUDA GPU: its allocator's peak, its out-of-memory, its health after a failure."""

    kind = "cuda"

    def __init__(self, torch):
        self.torch = torch
        self.device = torch.device("cuda")
        # torch.cuda.OutOfMemoryError exists from torch 1.13; before it an out-of-memory is a RuntimeError
        self.oom = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
        props = torch.cuda.get_device_properties(0)
        self.name, self.total_bytes = props.name, props.total_memory
        torch.backends.cuda.matmul.allow_tf32 = True  # tf32 mode: TF32 matmuls as well as convolutions
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = False  # every probe is a new shape: autotuning would be timed
        torch.empty(1, device=self.device)  # creates the context (cuBLAS and cuDNN add to it on first use)
        self.context_bytes = self.context_now()
        self.last_reserved: int | None = None
        self.last_warnings: list[str] = []

    def context_now(self) -> int:
        """What the GPU holds outside PyTorch's allocator: the context, the libraries' handles and kernels."""
        free, total = self.torch.cuda.mem_get_info()
        return total - free - self.torch.cuda.memory_reserved()

    def describe(self) -> dict:
        return {"kind": self.kind, "name": self.name, "memory_bytes": self.total_bytes,
                "context_bytes": self.context_bytes, "driver": _nvidia_smi("driver_version"),
                "cuda": self.torch.version.cuda, "cudnn": self.torch.backends.cudnn.version(),
                "capability": ".".join(map(str, self.torch.cuda.get_device_capability(0)))}

    def healthy(self) -> bool:
        """Whether the context still runs work (an illegal access leaves every later call failing)."""
        try:
            self.torch.cuda.synchronize()
            return self.torch.ones(1, device=self.device).sum().item() == 1.0
        except Exception:  # whatever the failure, the answer is no
            return False

    def run(self, fn: Callable[[], None]) -> int:
        """Run ``fn`` (which ends synchronised); its peak allocated bytes.

        Raises:
            OutOfMemory: it did not fit, or a kernel refused the size (``REFUSALS``).
            DeviceLost: the context no longer runs anything: stop, keep what was measured.
            ProbeFailed: any other error (a bug, not a size): the item fails, the run goes on.
        """
        torch = self.torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        failed: Exception | None = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn()
                torch.cuda.synchronize()
            except self.oom as error:
                failed = (OutOfMemory(_first_line(error)) if self.oom is not RuntimeError or _refusal(error)
                          else ProbeFailed(_first_line(error)))
            except RuntimeError as error:
                failed = (OutOfMemory(_first_line(error), kind=f"refused: {type(error).__name__}")
                          if _refusal(error) else ProbeFailed(f"{type(error).__name__}: {_first_line(error)}"))
        self.last_warnings = sorted({_first_line(w.message) for w in caught})[:5]
        if failed is None:
            self.last_reserved = torch.cuda.max_memory_reserved()
            return torch.cuda.max_memory_allocated()
        # Raised here, outside the handler: the caught exception's traceback holds the frames, and with them
        # the probe's tensors, until the handler ends; raising inside it would keep them allocated.
        if not self.healthy():
            raise DeviceLost(str(failed))
        gc.collect()
        torch.cuda.empty_cache()
        raise failed

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def release(self) -> None:
        gc.collect()
        self.torch.cuda.empty_cache()


# What a kernel says when a size is beyond it (cuDNN, cuBLAS, PyTorch's 32-bit indexing checks): the cube
# does not run on this GPU. Anything else is a bug and is reported as one, not counted as "does not fit".
REFUSALS = re.compile(r"out of memory|CUDNN_STATUS|CUBLAS_STATUS_ALLOC|unable to find an engine|32.?bit|"
                      r"canUse32BitIndexMath|too large|integer out of range|illegal memory access|not supported",
                      re.I)


def _refusal(error: BaseException) -> bool:
    return bool(REFUSALS.search(str(error)))


class DeviceLost(Exception):
    """The GPU's context failed for good: what was measured is written, nothing more is tried."""


class ProbeFailed(Exception):
    """A probe failed for a reason other than its size."""


class Cpu:
    """The CPU standing in (tests): the resident high-water mark's rise, and a limit as its memory."""

    kind = "cpu"

    def __init__(self, torch, limit_bytes: int):
        self.torch, self.device = torch, torch.device("cpu")
        # glibc raises its mmap threshold as large blocks are freed, after which freed tensors stay in the
        # heap and the next step's rise of VmHWM under-counts; a fixed threshold returns every large block.
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        self.name, self.total_bytes, self.context_bytes = f"CPU ({_cpu_model()})", limit_bytes, 0

    def describe(self) -> dict:
        return {"kind": self.kind, "name": self.name, "memory_bytes": self.total_bytes, "context_bytes": 0,
                "threads": self.torch.get_num_threads(),
                "peak": "rise of VmHWM over the call (no allocator statistics on the CPU)"}

    last_reserved = None
    last_warnings: list = []

    def context_now(self) -> int:
        return 0

    def healthy(self) -> bool:
        return True

    def run(self, fn: Callable[[], None]) -> int:
        before = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        fn()
        peak = _status_bytes("VmHWM") - before
        if peak > self.total_bytes:
            raise OutOfMemory(f"peak {peak / MIB:.0f} MiB over the {self.total_bytes / MIB:.0f} MiB limit")
        return peak

    def sync(self) -> None:
        pass

    def release(self) -> None:
        pass


def _cpu_model() -> str:
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    return found.group(1).strip() if found else (platform.processor() or "unknown")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(match.group(1)) * 1024


def _nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


# --- the measurements -------------------------------------------------------------------------

@dataclasses.dataclass
class Clock:
    """The time budget: what is left, and whether an item estimated at ``seconds`` still fits."""

    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float) -> bool:
        # half again and 5 s more: a new shape's first step (kernel choice, lazy loading) and steps near
        # full memory (low-workspace algorithms, allocator retries) cost more than the cubic extrapolation
        return 1.5 * seconds + 5 < self.left()


class Bench:
    """One model at one precision on one device: its training step and forward pass at any cube."""

    def __init__(self, torch, device, architecture: dict, precision: str, seed: int = 0):
        from torch_unet3d import TorchUNet3D, dice_ce_loss

        self.torch, self.device, self.precision = torch, device, precision
        self.loss = dice_ce_loss
        self.classes, self.channels = architecture["num_classes"], architecture["in_channels"]
        torch.manual_seed(seed)
        self.model = TorchUNet3D(SimpleNamespace(**architecture)).to(device.device)
        self.parameters = sum(p.numel() for p in self.model.parameters())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-2, momentum=0.99, nesterov=True)
        self.step_s_per_voxel = 0.0  # the last training step's seconds per voxel: what the clock expects of the next

    def _autocast(self):
        return self.torch.autocast(self.device.device.type, dtype=self.torch.bfloat16,
                                   enabled=self.precision == "bf16")

    def _batch(self, edge: int, batch: int):
        torch, device = self.torch, self.device.device
        images = torch.randn(batch, self.channels, edge, edge, edge, device=device)
        labels = torch.randint(0, self.classes, (batch, edge, edge, edge), device=device)
        return images, labels

    def train_steps(self, edge: int, batch: int, steps: int) -> list[float]:
        """``steps`` training steps on one random batch; each one's seconds (synchronised)."""
        images, labels = self._batch(edge, batch)
        self.model.train()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            with self._autocast():
                loss = self.loss(self.model(images).float(), labels)
            loss.backward()
            self.optimizer.step()
            self.device.sync()
            times.append(time.perf_counter() - start)
        self.step_s_per_voxel = times[-1] / (batch * edge**3)
        return times

    def expected_s(self, edge: int, batch: int, steps: int) -> float:
        """What ``steps`` training steps at ``edge`` should take, from the last one measured."""
        return self.step_s_per_voxel * batch * edge**3 * steps

    def forward(self, edge: int) -> float:
        images, _ = self._batch(edge, 1)
        self.model.eval()
        start = time.perf_counter()
        with self.torch.inference_mode(), self._autocast():
            self.model(images).argmax(1)
        self.device.sync()
        return time.perf_counter() - start

    def drop_state(self) -> None:
        """Forget gradients and momentum, so an out-of-memory probe leaves the next one the same memory."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        self.device.release()


def timed_training(bench: Bench, edge: int, batch: int, warmup: int, steps: int) -> dict:
    """Step time (median, spread of ``steps`` after ``warmup``) and the peak over all of them."""
    times: list[float] = []
    peak = bench.device.run(lambda: times.extend(bench.train_steps(edge, batch, warmup + steps)))
    kept = times[warmup:]
    median = statistics.median(kept)
    return {"edge": edge, "batch": batch, "peak_bytes": peak, "step_s": {
        "median": median, "min": min(kept), "max": max(kept), "all": kept}, "steps_per_s": 1 / median,
        "voxels_per_s": batch * edge**3 / median}


def largest_fitting(fits: Callable[[int], bool], candidates: list[int], first: int) -> tuple[int | None, list]:
    """The largest of ascending ``candidates`` for which ``fits`` (monotone) holds, by bisection from ``first``.

    Returns:
        (the largest that fits or None, each probe as (candidate, fitted)).
    """
    low, high = -1, len(candidates)  # indices known to fit / not to fit
    index = min(range(len(candidates)), key=lambda i: abs(candidates[i] - first))
    probes = []
    while high - low > 1:
        fitted = fits(candidates[index])
        probes.append((candidates[index], fitted))
        low, high = (index, high) if fitted else (low, index)
        index = (low + high) // 2  # past the last fit an out-of-memory comes at the first large allocation: cheap
    return (candidates[low] if low >= 0 else None), probes


def search(bench: Bench, candidates: list[int], first: int, clock: Clock, probe: Callable[[int], float],
           expected_s: Callable[[int], float], known: dict[int, bool], label: str) -> dict:
    """The largest cube ``probe`` holds, by bisection from ``first``; each probe's peak, seconds, fit.

    ``known`` holds outcomes already measured (the timed points), which are not probed again. A
    probe the clock cannot afford ends the search with the largest fit so far, marked incomplete;
    its cost is priced at no more than 1.25 times the largest fit's edge, as a probe past the
    boundary runs out of memory at its first large allocation.
    """
    record: dict = {"probes": []}

    def fits(edge: int) -> bool:
        if edge in known:
            record["probes"].append({"edge": edge, "fits": known[edge], "from": "a timed point"})
            return known[edge]
        fitted = [p["edge"] for p in record["probes"] if p["fits"]] + [e for e, ok in known.items() if ok]
        cap = int(1.25 * max(fitted or [first]))
        if not clock.allows(expected_s(min(edge, cap))):
            raise TimeoutError
        began = time.monotonic()
        try:
            peak = bench.device.run(lambda: probe(edge))
        except OutOfMemory as error:
            bench.drop_state()
            record["probes"].append({"edge": edge, "fits": False, "kind": error.kind, "error": str(error),
                                     "s": time.monotonic() - began, "warnings": bench.device.last_warnings})
            print(f"  {label} {edge}^3: does not run ({error.kind}, {time.monotonic() - began:.1f} s)", flush=True)
            return False
        record["probes"].append({"edge": edge, "fits": True, "peak_bytes": peak,
                                 "peak_reserved_bytes": bench.device.last_reserved, "s": time.monotonic() - began,
                                 "warnings": bench.device.last_warnings})
        print(f"  {label} {edge}^3: runs ({time.monotonic() - began:.1f} s, peak {peak / GIB:.2f} GiB)", flush=True)
        return True

    try:
        record["largest_edge"], _ = largest_fitting(fits, candidates, first)
    except TimeoutError:
        known_fits = [p["edge"] for p in record["probes"] if p["fits"]]
        record["largest_edge"] = max(known_fits) if known_fits else None
        record["incomplete"] = "the time budget ran out before the bisection closed: a lower bound"
    return record


def planner_edge(predicted: dict[str, int], memory_bytes: int) -> int | None:
    """The largest edge whose predicted footprint fits ``memory_bytes`` (None: not even the smallest)."""
    fitting = [int(e) for e, b in predicted.items() if b <= memory_bytes]
    return max(fitting) if fitting else None


class Pair:
    """One model at one precision: its bench, the planner's figures for it, and its entry of the report."""

    def __init__(self, torch, device, name: str, precision: str, plan: dict, args):
        entry = plan["models"][name]
        self.name, self.precision, self.device, self.args = name, precision, device, args
        self.predicted = entry["predicted"][precision]
        limit = CPU_EDGE_LIMIT if device.kind == "cpu" else plan["edge_limit"]
        self.candidates = list(range(entry["divisor"], limit + 1, entry["divisor"]))
        # The planner allows GPU_RUNTIME_BYTES for the CUDA context; the CPU standing in has none.
        self.adjust = 0 if device.kind == "cuda" else -plan["gpu_runtime_bytes"]
        self.train_predicted = {e: b + self.adjust for e, b in self.predicted["train_batch2"].items()
                                if int(e) <= limit}
        self.inference_predicted = {e: b + plan["gpu_runtime_bytes"] + self.adjust
                                    for e, b in self.predicted["inference_counted"].items() if int(e) <= limit}
        self.bench = Bench(torch, device, entry["architecture"], precision, seed=args.seed)
        self.planned = planner_edge(self.train_predicted, device.total_bytes)
        self.result: dict = {"model": name, "precision": precision, "parameters": self.bench.parameters,
                             "skipped": [], "failed": [], "planner_patch_batch2": self.planned}

    @property
    def label(self) -> str:
        return f"{self.name} {self.precision}"

    def timed_point(self, label: str, edge: int | None, clock: Clock) -> None:
        """Time training at ``edge``^3 x 2 into ``result[label]``."""
        args, result = self.args, self.result
        if edge is None:
            result[label] = None
            return
        estimate = self.bench.expected_s(edge, MLPERF_BATCH, args.warmup + args.steps)
        if not clock.allows(estimate):
            result["skipped"].append(f"{label} {edge}^3: ~{estimate:.0f} s, {clock.left():.0f} s left")
            return
        try:
            point = timed_training(self.bench, edge, MLPERF_BATCH, args.warmup, args.steps)
        except OutOfMemory as error:
            self.bench.drop_state()
            result[label] = {"edge": edge, "batch": MLPERF_BATCH, "failed": error.kind, "error": str(error)}
            print(f"  {self.label} {label} {edge}^3 x{MLPERF_BATCH}: does not run ({error.kind})", flush=True)
            return
        self.bench.drop_state()
        point["peak_reserved_bytes"] = self.device.last_reserved
        point["context_bytes"] = self.device.context_now()  # the libraries' handles exist by now
        point["predicted_bytes"] = self.train_predicted.get(str(edge))
        result[label] = point
        print(f"  {self.label} {label} {edge}^3 x{MLPERF_BATCH}: {point['step_s']['median']:.3f} s/step, "
              f"peak {point['peak_bytes'] / GIB:.2f} GiB", flush=True)

    def known_outcomes(self) -> dict[int, bool]:
        known = {}
        for key in (k for k in self.result if k.startswith("mlperf_") or k == "planner_patch"):
            point = self.result[key]
            if isinstance(point, dict) and "edge" in point:
                known[point["edge"]] = "step_s" in point
        return known

    def training_search(self, clock: Clock) -> None:
        bench = self.bench
        self.result["largest_patch_batch2"] = self._with_predictions(search(
            bench, self.candidates, self.planned or self.args.mlperf_patch, clock,
            lambda edge: sum(bench.train_steps(edge, MLPERF_BATCH, 2)),  # two steps: the momentum buffers exist
            lambda edge: bench.expected_s(edge, MLPERF_BATCH, 2), self.known_outcomes(),
            f"{self.label} training x{MLPERF_BATCH}"), self.train_predicted)
        bench.drop_state()

    def inference_search(self, clock: Clock) -> None:
        bench = self.bench
        planned = planner_edge(self.inference_predicted, self.device.total_bytes)
        largest_training = (self.result.get("largest_patch_batch2") or {}).get("largest_edge")
        record = search(bench, self.candidates, planned or largest_training or self.args.mlperf_patch, clock,
                        bench.forward, lambda edge: bench.expected_s(edge, 1, 1) / 3,  # a third of a step
                        {}, f"{self.label} forward")
        record["planner_counted_edge"] = planned
        self.result["largest_inference_cube"] = self._with_predictions(record, self.inference_predicted)
        bench.drop_state()

    @staticmethod
    def _with_predictions(record: dict, predicted: dict[str, int]) -> dict:
        for probe in record["probes"]:
            probe["predicted_bytes"] = predicted.get(str(probe["edge"]))
        return record


def measure(pairs: list[Pair], clock: Clock, save: Callable[[], None]) -> str | None:
    """Every pair's measurements, cheapest first across pairs, so that one pair cannot eat the budget.

    The 128^3 points of every pair, then the planner's patches, then the training searches, then the
    forward searches (whose cubes pass 2^31 elements per feature map, where kernels are least tried:
    last, after everything else is saved). ``save`` runs after every item.

    Returns:
        None, or why the run stopped early (the GPU's context was lost).
    """
    phases = [("mlperf point", lambda pair: pair.timed_point(f"mlperf_{pair.args.mlperf_patch}",
                                                             pair.args.mlperf_patch, clock)),
              ("planner's patch", lambda pair: pair.timed_point("planner_patch", pair.planned, clock)
               if pair.planned != pair.args.mlperf_patch else pair.result.update(planner_patch={"same_as": "mlperf"})),
              ("largest training patch", lambda pair: pair.training_search(clock)),
              ("largest forward cube", lambda pair: pair.inference_search(clock))]
    for phase, work in phases:
        for pair in pairs:
            if not clock.allows(0):
                pair.result["skipped"].append(f"{phase}: the time budget")
                save()
                continue
            print(f"{pair.label}: {phase} ({clock.left():.0f} s left)", flush=True)
            try:
                work(pair)
            except DeviceLost as error:
                pair.result["failed"].append(f"{phase}: the GPU's context failed: {error}")
                save()
                return f"the GPU's context failed during {pair.label}'s {phase}: {error}"
            except Exception as error:  # one item's failure must not cost the others' figures (one lent GPU)
                pair.result["failed"].append(f"{phase}: {type(error).__name__}: {_first_line(error)}")
                print(f"  {pair.label}: {phase} failed: {type(error).__name__}: {_first_line(error)}", flush=True)
                pair.bench.drop_state()
                if not pair.device.healthy():
                    save()
                    return f"the GPU's context failed after {pair.label}'s {phase}"
            save()
    return None


# --- the report -------------------------------------------------------------------------------

def _gib(value) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def table(report: dict) -> str:
    """The measurements as a plain text table (rich may not be installed on the GPU machine)."""
    rows = [("model", "precision", "point", "edge", "step s (median, min-max)", "peak GiB", "planner GiB",
             "planner/measured")]
    for r in report["results"]:
        for label in [k for k in r if k.startswith("mlperf_") or k == "planner_patch"]:
            point = r[label]
            if isinstance(point, dict) and point.get("failed"):
                rows.append((r["model"], r["precision"], label, f"{point['edge']}^3 x{point['batch']}",
                             f"does not run: {point['failed']}", "", "", ""))
            if not point or "step_s" not in point:
                continue
            s = point["step_s"]
            # the peak allocated, and what the GPU held outside the allocator once the libraries were loaded
            measured = point["peak_bytes"] + point.get("context_bytes", report["device"]["context_bytes"])
            ratio = f"{point['predicted_bytes'] / measured:.2f}" if point.get("predicted_bytes") else "-"
            rows.append((r["model"], r["precision"], label, f"{point['edge']}^3 x{point['batch']}",
                         f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})", _gib(measured),
                         _gib(point.get("predicted_bytes")), ratio))
        for label, key in (("largest patch x2", "largest_patch_batch2"), ("largest forward", "largest_inference_cube")):
            record = r.get(key) or {}
            edge = record.get("largest_edge")
            planned = (r.get("planner_patch_batch2") if key == "largest_patch_batch2"
                       else record.get("planner_counted_edge"))
            rows.append((r["model"], r["precision"], label, f"{edge}^3" if edge else "-",
                         f"planner: {planned}^3" if planned else "planner: -",
                         "", "", "(incomplete)" if record.get("incomplete") else ""))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    notes = [f"{r['model']} {r['precision']}: failed: {item}" for r in report["results"] for item in r["failed"]]
    notes += [f"stopped early: {report['stopped']}"] if report.get("stopped") else []
    notes += [f"{r['model']} {r['precision']}: skipped {item}" for r in report["results"] for item in r["skipped"]]
    notes += [f"{r['model']} {r['precision']}: the {key} search is incomplete (the time budget)"
              for r in report["results"] for key in ("largest_patch_batch2", "largest_inference_cube")
              if (r.get(key) or {}).get("incomplete")]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], *notes])


def _write_json(path: Path, report: dict) -> None:
    # bigmem.atomic is not importable on the GPU machine: the same temporary name and rename, by hand.
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(report, indent=1))
    os.replace(temporary, path)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-") or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE.parent / "results",
                        help="folder of the JSON (default benchmarks/results)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU at tiny sizes (what the tests run)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated presets (default {','.join(MODELS)}; with --cpu {','.join(CPU_MODELS)})")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="tf32, bf16 or both (default both)")
    parser.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                        help=f"the whole run's budget, start-up included (default {DEFAULT_MINUTES:g})")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per point (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    parser.add_argument("--mlperf-patch", type=int, default=None,
                        help=f"the first point's cube (default {MLPERF_PATCH}; with --cpu 32)")
    parser.add_argument("--cpu-memory-limit", type=float, default=256,
                        help="with --cpu: MiB a probe may add to the resident set (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write-plan", action="store_true",
                        help=f"(with bigmem installed) write the planner's predictions to {PLAN.name} and stop")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if args.write_plan:
        write_plan()
        print(f"wrote {PLAN}")
        return 0
    models = tuple((args.models or ",".join(CPU_MODELS if args.cpu else MODELS)).split(","))
    precisions = tuple(args.precisions.split(","))
    args.mlperf_patch = args.mlperf_patch or (32 if args.cpu else MLPERF_PATCH)
    plan = json.loads(PLAN.read_text())
    unknown = [m for m in models if m not in plan["models"]] + [p for p in precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"not in {PLAN.name}: {', '.join(unknown)} (models: {', '.join(plan['models'])}; "
                     f"precisions: {', '.join(PRECISIONS)})")
    print(f"gpu_reference: {', '.join(models)} x {', '.join(precisions)}, within {args.minutes:g} min "
          f"(start-up included): for every pair, training at {args.mlperf_patch}^3 x{MLPERF_BATCH}, then at the "
          f"planner's patch ({args.warmup} + {args.steps} steps each), then the largest patch at batch "
          f"{MLPERF_BATCH}, then the largest forward cube, by bisection; what the budget does not reach is "
          "skipped and listed; the JSON is rewritten after every item.", flush=True)
    sys.path.insert(0, str(HERE.parent / "tables"))
    import torch

    if args.cpu:
        device = Cpu(torch, int(args.cpu_memory_limit * MIB))
    elif not torch.cuda.is_available():
        print("gpu_reference: error: no CUDA device (torch.cuda.is_available() is False); "
              "--cpu runs the same code on the CPU at tiny sizes", file=sys.stderr)
        return 1
    else:
        device = Cuda(torch)
    clock = Clock(started + args.minutes * 60)
    print(f"device: {device.name}, {device.total_bytes / GIB:.1f} GiB; torch {torch.__version__}", flush=True)
    report = {"schema": SCHEMA, "device": device.describe(), "torch": torch.__version__,
              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(["python", "benchmarks/performance/gpu_reference.py", *(argv or sys.argv[1:])]),
              "settings": {"models": models, "precisions": precisions, "minutes": args.minutes,
                           "steps": args.steps, "warmup": args.warmup, "mlperf_patch": args.mlperf_patch,
                           "batch": MLPERF_BATCH, "optimizer": "SGD nesterov momentum 0.99",
                           "cudnn_benchmark": False},
              "plan": {"file": PLAN.name, "gpu_runtime_bytes": plan["gpu_runtime_bytes"]}, "results": []}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_reference-{device.kind}-{_slug(device.name)}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    report["elapsed_s"] = time.monotonic() - started

    def save() -> None:  # after every item: a run stopped from outside keeps what it measured
        report["elapsed_s"] = time.monotonic() - started
        _write_json(path, report)

    pairs = []
    for name in models:
        for precision in precisions:
            pair = Pair(torch, device, name, precision, plan, args)
            pairs.append(pair)
            report["results"].append(pair.result)
    save()
    stopped = measure(pairs, clock, save)
    if stopped:
        report["stopped"] = stopped
        save()
    print(table(report))
    print(f"wrote {path} ({report['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
