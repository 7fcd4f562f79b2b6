"""The one place bigmem imports TensorFlow from a command.

Process-wide settings that TensorFlow reads once at start-up (log level, oneDNN, NUMA memory
policy and CPU affinity) must be in force before the import, so commands call
``import_tensorflow`` rather than importing it themselves.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import tempfile
from importlib import metadata

ONEDNN_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
X86_MACHINES = ("x86_64", "amd64", "i686", "i386")
# Set by enable_onednn for sysinfo.json and `bigmem info` to say why oneDNN is on or off.
ONEDNN_REASON_VARIABLE = "BIGMEM_ONEDNN_REASON"


def tensorflow_version() -> str:
    """The installed TensorFlow's version, without importing it ("unknown" where none is installed).

    TensorFlow's wheel bundles its oneDNN, so this version also fixes oneDNN's.
    """
    for dist in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def intra_op_threads() -> int:
    """Threads one op runs on in this process: the placement's intra-op pool, else the CPUs it may use."""
    if _thread_pools is not None:
        return _thread_pools[0]
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def enable_onednn(environ=None, machine: str | None = None) -> str:
    """Turn TensorFlow's oneDNN kernels on for x86 unless the user chose; return why it is on or off.

    Stock TensorFlow enables oneDNN by default only on CPUs with AVX-512 VNNI/BF16, AVX-VNNI or
    AMX; on AVX2 servers (AMD EPYC Zen 2/3, Skylake-era Xeons) it stays off, and training is ~7x
    slower there (benchmarks/results/speed.md, "oneDNN and bf16"). Must run before TensorFlow is imported.

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


def import_tensorflow(*, verbose: bool = False):
    """Import and return ``tensorflow``; its start-up logs are shown only when ``verbose``."""
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        return tf
    enable_onednn()
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
