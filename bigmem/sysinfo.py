"""The machine as bigmem sees it: CPU, ISA, memory, NUMA nodes, TensorFlow and oneDNN."""

from __future__ import annotations

import os
import platform
import socket
import sys
from typing import Any

import psutil

import bigmem
from bigmem.cpu import (  # noqa: F401  (re-exported: sysinfo.json and its readers name them here)
    ISA_CLASSES, NATIVE_BF16_ISA_CLASSES, NATIVE_BF16_VARIABLE, TRAINING_ISA_FLAGS, cpu_description, isa_class,
    native_bf16,
)
from bigmem.numa.topology import NUMATopology


def tensorflow_description() -> dict[str, Any]:
    """TF/Keras versions, oneDNN, and devices. Imports TensorFlow."""
    import keras
    import tensorflow as tf

    from bigmem.tfenv import ONEDNN_REASON_VARIABLE, X86_MACHINES

    # IsMklEnabled says whether oneDNN is on in this process (TF_ENABLE_ONEDNN_OPTS, else TF's
    # per-CPU default); every x86 build since TF 2.9 contains it, on or off.
    try:
        from tensorflow.python.util import _pywrap_util_port

        onednn_enabled = bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        onednn_enabled = None
    onednn_built = platform.machine().lower() in X86_MACHINES or bool(onednn_enabled)
    env = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "onednn_built": onednn_built,
        "onednn_enabled": onednn_enabled,
        "onednn_reason": os.environ.get(ONEDNN_REASON_VARIABLE, "TensorFlow imported outside bigmem"),
        "TF_ENABLE_ONEDNN_OPTS": env,
        "gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
    }


def libnuma_status() -> str:
    """'available', or why --numa policies other than none cannot be used here."""
    try:
        import numa  # py-libnuma: loads the system's libnuma.so.1

        return "available" if numa.info.numa_available() else "kernel without NUMA support"
    except (ImportError, OSError) as exc:
        return f"missing ({exc})"


def collect_sysinfo(*, include_tensorflow: bool = True, sysfs_root: str = "/") -> dict[str, Any]:
    memory = psutil.virtual_memory()
    info: dict[str, Any] = {
        "bigmem": bigmem.__version__,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu_description(),
        "memory": {"total_bytes": memory.total, "available_bytes": memory.available},
        "numa": {**NUMATopology.from_sysfs(sysfs_root).to_dict(), "libnuma": libnuma_status()},
    }
    if include_tensorflow:
        info["tensorflow"] = tensorflow_description()
    info["tuning"] = tuning_description()
    return info


def tuning_description() -> dict[str, Any]:
    """Which kernel table is in force in this process: this machine's tuning (``bigmem tune``) or the shipped one.

    Returns:
        ``{"key", "file", "tuned", "kernel_choices"}``: the machine key, its tuning file (None where
        there is none), what that file tuned, and the kernel choices' source line.
    """
    from bigmem.nets.choices import kernel_choices
    from bigmem.nets.tuning import key_here, load_tuning, tuning_path

    tuning = load_tuning()
    return {"key": key_here().describe(), "file": str(tuning_path()) if tuning else None,
            "tuned": tuning.describe() if tuning else None, "kernel_choices": kernel_choices()[1].source}
