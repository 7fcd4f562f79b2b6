"""The data-parallel step: N simulated replicas train exactly as 1 replica with the same global batch."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from bigmem.distribute.strategy import mirrored, scaled_learning_rate, simulate_cpu_replicas
from bigmem.errors import BigmemError

CHILD = """
import json, sys
from bigmem.distribute.strategy import make_distributed_step, mirrored
replicas = mirrored(simulate_replicas=int(sys.argv[1]))
import keras, numpy as np, tensorflow as tf
from bigmem.config import resolve_config
from bigmem.nets.unet3d import UNet3D
from bigmem.train.losses import dice_ce_per_sample, dice_counts, dice_from_counts
from bigmem.train.optimizers import FusedSGD
keras.utils.set_random_seed(0)
with replicas.strategy.scope():
    model = UNet3D(resolve_config("tiny").model).build_for()
    optimizer = FusedSGD(0.05, momentum=0.9)  # bigmem's optimizer; Keras's ops under a strategy
    optimizer.build(model.trainable_variables)
rng = np.random.default_rng(0)
images = rng.normal(size=(4, 16, 16, 16, 1)).astype(np.float32)
labels = rng.integers(0, 3, (4, 16, 16, 16)).astype(np.uint8)
dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()
batches = iter(replicas.strategy.experimental_distribute_dataset(dataset))
step = make_distributed_step(replicas, model, optimizer, global_batch_size=4, loss_per_sample=dice_ce_per_sample,
                             metric_counts=dice_counts, metric_from_counts=dice_from_counts)
losses = [float(step(*next(batches))[0]) for _ in range(3)]
print(json.dumps({"replicas": replicas.num_replicas, "simulated": replicas.simulated, "losses": losses,
                  "weights": [np.asarray(w).ravel()[:50].tolist() for w in model.trainable_weights[:3]]}), flush=True)
import os
os._exit(0)  # the answer is out: skip TensorFlow's teardown (seconds)
"""


def _start(replicas: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(replicas)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})


def _result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def _side_by_side(*processes: subprocess.Popen):
    """Independent processes run at once; any still running when the test fails are killed."""
    try:
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()


@pytest.mark.slow
def test_two_replicas_train_exactly_as_one():
    with _side_by_side(_start(1), _start(2)) as started:  # each process splits its CPU before TensorFlow starts
        one, two = (_result(process) for process in started)
    assert (one["replicas"], two["replicas"]) == (1, 2)
    assert two["simulated"] is True
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert one["losses"][2] < one["losses"][0]  # it is training
    for a, b in zip(one["weights"], two["weights"]):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)


def test_linear_scaling_rule():
    # Goyal et al. 2017: 0.1 per 256 images -> 3.2 at a global batch of 8192.
    assert scaled_learning_rate(0.1, 256, 8192) == pytest.approx(3.2)
    assert scaled_learning_rate(1e-3, 2, 2) == pytest.approx(1e-3)


def test_no_gpu_is_a_clear_error():
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    with pytest.raises(BigmemError, match=r"^No GPU found for distribute\.strategy mirrored; use "
                                         r"distribute\.simulate_replicas N"):
        mirrored()


def test_simulating_after_initialisation_is_refused():
    import tensorflow as tf

    float(tf.constant(1.0) + 1.0)  # make sure this process's devices are initialised
    with pytest.raises(BigmemError, match=r"^Cannot simulate replicas: TensorFlow's devices are already"):
        simulate_cpu_replicas(2)


def test_replica_count_must_be_positive():
    from bigmem.errors import UsageError

    with pytest.raises(UsageError, match=r"^Invalid distribute\.simulate_replicas 0: expected a positive "
                                        r"integer\.$"):
        simulate_cpu_replicas(0)


def _start_train(tmp_path, tiny_store, name: str, replicas: int, batch: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "bigmem", "train", "--model", "tiny", "--data", str(tiny_store), "--volume", "16",
         "--steps", "4", "--seed", "2", "--strategy", "mirrored", "--simulate-replicas", str(replicas),
         "--batch-size", str(batch), "--reference-batch", "4", "--gpu-memory", "2GiB", "--optimizer", "sgd",
         "--out", str(tmp_path / name)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _trained(tmp_path, name: str, process: subprocess.Popen) -> list[dict]:
    from bigmem.rundir import read_jsonl

    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert "simulated on CPU" in out
    return read_jsonl(tmp_path / name / "metrics.jsonl")


@pytest.mark.slow
def test_bigmem_train_on_n_replicas_matches_one(tmp_path, tiny_store):
    with _side_by_side(_start_train(tmp_path, tiny_store, "one", replicas=1, batch=4),
                       _start_train(tmp_path, tiny_store, "two", replicas=2, batch=2)) as (first, second):
        one, two = _trained(tmp_path, "one", first), _trained(tmp_path, "two", second)
    assert [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["lr"] == pytest.approx(a["lr"])
        assert b["dice"] == pytest.approx(a["dice"], abs=1e-6)
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())["data_parallel"]
    assert plan["replicas"] == 2
    assert plan["simulated"]
    assert plan["global_batch"] == 4
    assert plan["patch"] == [16, 16, 16]


def test_simulated_replicas_need_gpu_memory(tmp_path, tiny_store):
    result = subprocess.run([sys.executable, "-m", "bigmem", "train", "--model", "tiny", "--data", str(tiny_store),
                             "--strategy", "mirrored", "--simulate-replicas", "2", "--out", str(tmp_path / "r")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == ("bigmem train: error: Give --gpu-memory SIZE (e.g. 80GiB) or --patch N: the patch "
                                     "size is chosen to fit one GPU's memory, and these replicas are simulated on CPU.")


def test_multiworker_without_tf_config_says_how_a_per_node_run_resumes(monkeypatch):
    from bigmem.distribute.strategy import multiworker
    from bigmem.errors import UsageError

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(UsageError, match=r"needs TF_CONFIG .* resumes with train\.resume distribute\.strategy "
                                        r"per-node\.$"):
        multiworker()
