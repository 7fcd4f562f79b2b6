"""The one place bigmem imports TensorFlow from a command.

Process-wide settings that TensorFlow reads once at start-up (log level now; NUMA memory
policy and CPU affinity later) must be in force before the import, so commands call
``import_tensorflow`` rather than importing it themselves.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile


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


def _set_thread_pools(tf) -> None:
    """Size TF's thread pools from the applied placement (stock TF ignores OMP_*/KMP_* variables)."""
    from bigmem.numa.apply import current

    placement = current()
    if placement is not None:
        tf.config.threading.set_intra_op_parallelism_threads(placement.intra_op_threads)
        tf.config.threading.set_inter_op_parallelism_threads(placement.inter_op_threads)


def import_tensorflow(*, verbose: bool = False):
    """Import and return ``tensorflow``; its start-up logs are shown only when ``verbose``."""
    if "tensorflow" in sys.modules:
        import tensorflow as tf

        return tf
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
