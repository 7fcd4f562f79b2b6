"""Two workers on 127.0.0.1 (MultiWorkerMirroredStrategy, TF_CONFIG) train as one with the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest

from bigmem.rundir import read_jsonl

COMMON = ["--model", "tiny", "--volume", "16", "--steps", "3", "--seed", "2", "--optimizer", "sgd",
          "--gpu-memory", "2GiB", "--reference-batch", "2"]
# TensorFlow's gRPC client polls 64 completion queues by default, a thread each (108 threads in a
# worker, 48 with 4). Each of the four numa.json writes of a run reads every thread's numa_maps
# (numa/observe.thread_policies): seconds per write here. Two loopback workers need few pollers;
# what they train and write is the same.
FEW_GRPC_THREADS = {"TF_GRPC_WORKER_CACHE_QUEUES": "4"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(run_dir) -> list[np.ndarray]:
    import bigmem.nets.unet3d  # noqa: F401  (registers UNet3D)

    return [np.asarray(w) for w in keras.models.load_model(run_dir / "model.keras").weights]


def _two_workers(tmp_path, store, extra) -> None:
    ports = [_free_port(), _free_port()]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    workers = []
    for index in range(2):
        env = {**os.environ, **FEW_GRPC_THREADS,
               "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})}
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "bigmem", "train", *extra, "--data", str(store), "--strategy", "multiworker",
             "--batch-size", "1", "--out", str(tmp_path / f"w{index}")], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    for process in workers:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err


def _same_training(tmp_path, reference: str) -> None:
    losses = {name: [r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")]
              for name in ("w0", "w1", reference)}
    assert len(losses[reference]) == 3
    assert losses["w0"] == losses["w1"]
    assert losses["w0"] == pytest.approx(losses[reference], rel=1e-5)
    w0, w1, one = (_weights(tmp_path / name) for name in ("w0", "w1", reference))
    for a, b, c in zip(w0, w1, one):
        np.testing.assert_array_equal(a, b)  # the workers hold identical weights
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_workers_match_one(tmp_path, tiny_store):
    """Patches for GPUs (--gpu-memory): two workers of batch 1 = one process of batch 2."""
    _two_workers(tmp_path, tiny_store, COMMON)
    single = subprocess.run([sys.executable, "-m", "bigmem", "train", *COMMON, "--data", str(tiny_store),
                             "--strategy", "mirrored", "--simulate-replicas", "1", "--batch-size", "2",
                             "--out", str(tmp_path / "one")], capture_output=True, text=True)
    assert single.returncode == 0, single.stderr
    _same_training(tmp_path, "one")
    plan = json.loads((tmp_path / "w0" / "plan.json").read_text())["data_parallel"]
    assert plan["replicas"] == 2
    assert plan["global_batch"] == 2


@pytest.mark.slow
def test_two_hosts_train_whole_volumes_as_one(tmp_path, tiny_store):
    """No --gpu-memory: whole volumes on two CPU workers = bigmem's own whole-volume training at batch 2."""
    whole = ["--model", "tiny", "--volume", "16", "--steps", "3", "--seed", "2", "--optimizer", "sgd",
             "--reference-batch", "2"]
    _two_workers(tmp_path, tiny_store, whole)
    single = subprocess.run([sys.executable, "-m", "bigmem", "train", *whole, "--data", str(tiny_store),
                             "--batch-size", "2", "--out", str(tmp_path / "one")], capture_output=True, text=True)
    assert single.returncode == 0, single.stderr
    _same_training(tmp_path, "one")
    for index in range(2):  # each worker planned and checked its own share: one whole volume per step
        plan = json.loads((tmp_path / f"w{index}" / "plan.json").read_text())
        assert plan["data_parallel"]["whole_volumes"]
        assert plan["data_parallel"]["worker_index"] == index
        assert (plan["data_parallel"]["workers"], plan["data_parallel"]["global_batch"]) == (2, 2)
        assert (plan["chosen"]["volume"], plan["chosen"]["batch_size"]) == (16, 1)
        assert json.loads((tmp_path / f"w{index}" / "numa.json").read_text())["requested"]
