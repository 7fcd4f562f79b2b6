"""The one place bigmem imports TensorFlow from a command.

Process-wide settings that TensorFlow reads once at start-up (log level, oneDNN, NUMA memory
policy and CPU affinity) must be in force before the import, so commands call
``import_tensorflow`` rather than importing it themselves. So is glibc's allocator threshold
(``limit_heap_fragmentation``), which must precede TensorFlow's first large allocation.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import tempfile

ONEDNN_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")
# Set by enable_onednn for sysinfo.json and `bigmem info` to say why oneDNN is on or off.
ONEDNN_REASON_VARIABLE = "BIGMEM_ONEDNN_REASON"


def enable_onednn(environ=None, machine: str | None = None) -> str:
    """Turn TensorFlow's oneDNN kernels on for x86 unless the user chose; return why it is on or off.

    Stock TensorFlow enables oneDNN by default only on CPUs with AVX-512 VNNI/BF16, AVX-VNNI or
    AMX; on AVX2 servers (AMD EPYC Zen 2/3, Skylake-era Xeons) it stays off, and training is ~7x
    slower there (DESIGN.md). Must run before TensorFlow is imported.

    Args:
        environ: the environment to read and change (default ``os.environ``).
        machine: the CPU architecture (default ``platform.machine()``).

    Returns:
        The reason, also stored in ``environ[ONEDNN_REASON_VARIABLE]``.
    """
    environ = os.environ if environ is None else environ
    machine = (machine or platform.machine()).lower()
    if ONEDNN_REASON_VARIABLE in environ and ONEDNN_VARIABLE in environ:
        return environ[ONEDNN_REASON_VARIABLE]  # decided earlier in this process (or its parent)
    if ONEDNN_VARIABLE in environ:
        reason = f"{ONEDNN_VARIABLE}={environ[ONEDNN_VARIABLE]} set by the user"
    elif machine in X86_MACHINES:
        environ[ONEDNN_VARIABLE] = "1"
        reason = (f"turned on by bigmem on x86 ({ONEDNN_VARIABLE}=1; TensorFlow's own default is on only with "
                  "AVX-512 VNNI/BF16, AVX-VNNI or AMX)")
    else:
        reason = f"TensorFlow's default on {machine} ({ONEDNN_VARIABLE} unset)"
    environ[ONEDNN_REASON_VARIABLE] = reason
    return reason


@contextlib.contextmanager
def _stderr_to_tempfile():
    """Send file descriptor 2 to a temporary file; yield the file to replay it on failure.

    TensorFlow's C++ start-up lines (oneDNN notice, CUDA probing on a CPU machine) are logged
    before absl's logging is initialised, so TF_CPP_MIN_LOG_LEVEL cannot silence them.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


# The thread-pool sizes of the placement in force, set by bigmem.numa.apply (None: TF's defaults).
_thread_pools: tuple[int, int] | None = None


def set_thread_pools(intra_op_threads: int, inter_op_threads: int) -> None:
    """Size TensorFlow's thread pools when ``import_tensorflow`` imports it.

    Stock TensorFlow ignores OMP_*/KMP_* variables; its intra-op and inter-op pool sizes are the
    levers. A placement that is put in force calls this, so that the pools match its CPUs.

    Args:
        intra_op_threads: threads that run one op (a convolution) in parallel.
        inter_op_threads: threads that run independent ops at the same time.
    """
    global _thread_pools
    _thread_pools = (intra_op_threads, inter_op_threads)


def _set_thread_pools(tf) -> None:
    if _thread_pools is not None:
        tf.config.threading.set_intra_op_parallelism_threads(_thread_pools[0])
        tf.config.threading.set_inter_op_parallelism_threads(_thread_pools[1])


# glibc mallopt parameters (malloc.h). Above M_MMAP_THRESHOLD an allocation is its own mapping,
# returned to the kernel when freed; below it comes from the heap, which a trimmed top alone shrinks.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Training at many shapes frees and reallocates tensors of every size, and glibc's heap kept
# growing from the holes: the KiTS-like store (5 shapes, small, batch 1) peaked per epoch at
# 9.75, 9.95, 9.98, 10.07, 10.09, 10.13 GiB with glibc's dynamic threshold (up to 32 MiB), and at
# 9.62, 9.82, 9.96, 10.00, 10.00, 10.01 GiB with 4 MiB, epoch times unchanged (19.2-20.2 s against
# 18.4-20.0 s; benchmarks/results/native_shapes.md).
HEAP_THRESHOLD_BYTES = 4 << 20
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def limit_heap_fragmentation(environ=None) -> bool:
    """Serve allocations past HEAP_THRESHOLD_BYTES from their own mappings (glibc only), unless the user tuned malloc.

    Args:
        environ: the environment to read (default ``os.environ``): a ``MALLOC_MMAP_THRESHOLD_`` or
            ``MALLOC_TRIM_THRESHOLD_`` there is the user's choice and left alone.

    Returns:
        True when the thresholds were set; False on another C library or where the user set one.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in MALLOC_VARIABLES):
        return False
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                  HEAP_THRESHOLD_BYTES))


def import_tensorflow(*, verbose: bool = False):
    """Import and return ``tensorflow``; its start-up logs are shown only when ``verbose``."""
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        return tf
    enable_onednn()
    limit_heap_fragmentation()
    if verbose:
        import tensorflow as tf

        _set_thread_pools(tf)
        return tf
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with _stderr_to_tempfile() as captured:
        try:
            import tensorflow as tf

            _set_thread_pools(tf)
            tf.config.list_physical_devices("GPU")  # device probing logs once, here
        except BaseException:
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors="replace"))
            raise
    return tf
