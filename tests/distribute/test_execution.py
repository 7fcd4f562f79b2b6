"""distribute.data_parallel: the one data-parallel decision, on fake strategies (no devices needed)."""

from __future__ import annotations

import pytest

from bigmem.config import resolve_config
from bigmem.distribute.execution import data_parallel
from bigmem.distribute.planning import gpu_footprint_bytes
from bigmem.distribute.strategy import Replicas
from bigmem.errors import ConfigError, InsufficientMemoryError
from bigmem.memory.profile import counts_function

GIB = 2**30


class FakeResolver:
    def __init__(self, workers: int, index: int):
        self.workers, self.task_id = workers, index

    def cluster_spec(self):
        workers = self.workers

        class Spec:
            def as_dict(self):
                return {"worker": [f"host{i}:1" for i in range(workers)]}

            def num_tasks(self, kind):
                return workers

        return Spec()


class FakeStrategy:
    def __init__(self, resolver=None):
        self.cluster_resolver = resolver


def _replicas(count: int, *, simulated=True, workers=None, index=0) -> Replicas:
    strategy = FakeStrategy(FakeResolver(workers, index) if workers else None)
    return Replicas(strategy, count, simulated, tuple(f"/cpu:{i}" for i in range(count)))


def _config(**distribute):
    return resolve_config("tiny", {"data": {"volume": 64}, "train": {"batch_size": 2}, "distribute": distribute})


@pytest.fixture(scope="module")
def counts_for():
    return counts_function(_config())


def test_multiworker_without_a_gpu_size_trains_whole_volumes_each_worker_its_slice(counts_for):
    config = _config(strategy="multiworker")
    parallel = data_parallel(config, _replicas(2, workers=2, index=1), counts_for)
    assert parallel.whole_volumes and parallel.patch is None
    assert (parallel.global_batch, parallel.num_workers, parallel.worker_index, parallel.worker_batch) == (4, 2, 1, 2)
    assert parallel.loader_settings() == {"batch_size": 2, "patch": None, "shard": (1, 2)}
    host = parallel.host_config(config)  # one worker's pre-flight: its own batch of whole volumes
    assert (host.data.shape, host.train.batch_size) == ((64, 64, 64), 2)
    assert parallel.host_checked
    assert config.data.shape == (64, 64, 64) and config.train.batch_size == 2  # the config is not changed
    assert parallel.to_dict()["whole_volumes"] is True


def test_mirrored_picks_the_largest_patch_that_fits_one_gpu(counts_for):
    config = _config(strategy="mirrored", gpu_memory_bytes=GIB + 300 * 2**20)
    parallel = data_parallel(config, _replicas(2), counts_for)
    patch = parallel.patch
    divisor = config.model.divisor
    assert patch is not None and patch % divisor == 0 and patch <= 64
    assert gpu_footprint_bytes(config, counts_for, patch, 2) <= config.distribute.gpu_memory_bytes
    if patch < 64:
        assert gpu_footprint_bytes(config, counts_for, patch + divisor, 2) > config.distribute.gpu_memory_bytes
    assert parallel.loader_settings() == {"batch_size": 4, "patch": patch, "shard": (0, 1)}
    host = parallel.host_config(config)  # the simulated replicas all live on this host
    assert (host.data.shape, host.train.batch_size) == ((patch,) * 3, 4)
    real = data_parallel(config, _replicas(2, simulated=False), counts_for)
    assert not real.host_checked  # real GPUs: the host holds only the input


def test_a_given_patch_needs_no_gpu_size(counts_for):
    parallel = data_parallel(_config(strategy="mirrored", patch=32), _replicas(2), counts_for)
    assert (parallel.patch, parallel.gpu_memory_bytes) == (32, None)


def test_learning_rate_scales_with_the_global_batch(counts_for):
    parallel = data_parallel(_config(strategy="mirrored", patch=16), _replicas(4), counts_for)
    assert parallel.global_batch == 8
    assert parallel.learning_rate(1e-3, None) == pytest.approx(4e-3)  # from one replica's batch
    assert parallel.learning_rate(1e-3, 8) == pytest.approx(1e-3)


def test_refusals_name_the_fields(counts_for):
    with pytest.raises(ConfigError) as info:
        data_parallel(_config(strategy="mirrored"), _replicas(2), counts_for)
    assert info.value.field == "distribute.gpu_memory_bytes"
    assert str(info.value).startswith("Give distribute.gpu_memory_bytes SIZE (e.g. 80GiB) or distribute.patch N")
    with pytest.raises(InsufficientMemoryError, match=r"^Not even a 4\^3 patch at batch 2 fits one GPU's 1.00 MiB"):
        data_parallel(_config(strategy="mirrored", gpu_memory_bytes=2**20), _replicas(2), counts_for)
