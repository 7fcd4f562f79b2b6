"""oneDNN is turned on for x86 before TensorFlow starts, unless the user chose; thread pools follow the placement."""

import os
import subprocess
import sys

from bigmem.tfenv import ONEDNN_REASON_VARIABLE, enable_onednn


def test_x86_gets_onednn_on():
    environ = {}
    reason = enable_onednn(environ, machine="x86_64")
    assert environ["TF_ENABLE_ONEDNN_OPTS"] == "1"
    assert reason.startswith("turned on by bigmem on x86")
    assert environ[ONEDNN_REASON_VARIABLE] == reason
    assert enable_onednn(environ, machine="x86_64") == reason  # a second call (or a child process) keeps it


def test_the_users_setting_wins():
    environ = {"TF_ENABLE_ONEDNN_OPTS": "0"}
    assert enable_onednn(environ, machine="x86_64") == "TF_ENABLE_ONEDNN_OPTS=0 set by the user"
    assert environ["TF_ENABLE_ONEDNN_OPTS"] == "0"


def test_other_architectures_keep_tensorflows_default():
    environ = {}
    assert enable_onednn(environ, machine="aarch64") == "TensorFlow's default on aarch64 (TF_ENABLE_ONEDNN_OPTS unset)"
    assert "TF_ENABLE_ONEDNN_OPTS" not in environ


def test_an_applied_placement_sizes_tensorflows_thread_pools():
    code = ("from bigmem.numa.apply import apply_placement\nfrom bigmem.numa.policy import Placement, PolicyKind\n"
            "from bigmem.tfenv import import_tensorflow\n"
            "apply_placement(Placement(PolicyKind.NONE, (), (), intra_op_threads=3, inter_op_threads=2))\n"
            "tf = import_tensorflow()\n"
            "print(tf.config.threading.get_intra_op_parallelism_threads(), "
            "tf.config.threading.get_inter_op_parallelism_threads())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.stdout.split() == ["3", "2"]
