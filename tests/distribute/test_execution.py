"""distribute.execution: single process or data parallel, decided once; fake strategies (no devices needed)."""

from __future__ import annotations

import contextlib
import json

import pytest

from bigmem.config import resolve_config
from bigmem.distribute.execution import Execution, SingleProcess, choose_execution, data_parallel
from bigmem.distribute.planning import gpu_footprint_bytes, patch_shape
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
        self.scopes_entered = 0

    @contextlib.contextmanager
    def scope(self):
        self.scopes_entered += 1
        yield


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
    assert parallel.whole_volumes
    assert parallel.patch is None
    assert (parallel.global_batch, parallel.num_workers, parallel.worker_index, parallel.worker_batch) == (4, 2, 1, 2)
    assert parallel.loader_settings() == {"batch_size": 2, "patch": None, "shard": (1, 2)}
    host = parallel.host_config(config)  # one worker's pre-flight: its own batch of whole volumes
    assert (host.data.shape, host.train.batch_size) == ((64, 64, 64), 2)
    assert parallel.host_checked
    assert config.data.shape == (64, 64, 64)
    assert config.train.batch_size == 2  # the config is not changed
    assert parallel.to_dict()["whole_volumes"] is True


def test_mirrored_picks_the_largest_patch_that_fits_one_gpu(counts_for):
    config = _config(strategy="mirrored", gpu_memory_bytes=GIB + 300 * 2**20)
    parallel = data_parallel(config, _replicas(2), counts_for)
    patch = parallel.patch
    divisor = config.model.divisor
    assert patch is not None
    assert len(set(patch)) == 1  # a cube for cubes (data.shape 64^3)
    edge = patch[0]
    assert edge % divisor == 0
    assert edge <= 64
    assert gpu_footprint_bytes(config, counts_for, patch, 2) <= config.distribute.gpu_memory_bytes
    if edge < 64:
        assert gpu_footprint_bytes(config, counts_for, edge + divisor, 2) > config.distribute.gpu_memory_bytes
    assert parallel.loader_settings() == {"batch_size": 4, "patch": patch, "shard": (0, 1)}
    host = parallel.host_config(config)  # the simulated replicas all live on this host
    assert (host.data.shape, host.train.batch_size) == (patch, 4)
    assert parallel.to_dict()["patch"] == list(patch)
    real = data_parallel(config, _replicas(2, simulated=False), counts_for)
    assert not real.host_checked  # real GPUs: the host holds only the input


def test_the_patch_takes_the_datasets_median_aspect(counts_for):
    """As nnU-Net's planner: a flat dataset gets a flat patch, the largest of its proportions that fits."""
    config = _config(strategy="mirrored", gpu_memory_bytes=GIB + 300 * 2**20)
    flat = data_parallel(config, _replicas(2), counts_for, aspect=(64, 64, 16))
    cube = data_parallel(config, _replicas(2), counts_for).patch
    assert flat.patch[2] < flat.patch[0] == flat.patch[1]
    assert flat.patch[2] % config.model.divisor == 0
    assert flat.patch[0] >= cube[0]  # fewer voxels per unit of edge: a longer edge fits
    assert patch_shape((64, 64, 16), flat.patch[0], config.model.divisor) == flat.patch
    bigger = patch_shape((64, 64, 16), flat.patch[0] + config.model.divisor, config.model.divisor)
    assert bigger == flat.patch or gpu_footprint_bytes(config, counts_for, bigger, 2) > GIB + 300 * 2**20
    assert patch_shape((240, 240, 155), 128, 16) == (128, 128, 80)
    assert patch_shape((512, 512, 29), 256, 16) == (256, 256, 16)  # never thinner than 2^depth
    assert patch_shape((100, 30, 30), 96, 16) == (96, 32, 32)  # nor longer than the median, rounded up
    divisor = config.model.divisor  # a median thinner than 2^depth still gets the smallest patch
    assert data_parallel(config, _replicas(2), counts_for, aspect=(2, 3, 2)).patch == (divisor,) * 3


def test_a_given_patch_needs_no_gpu_size(counts_for):
    parallel = data_parallel(_config(strategy="mirrored", patch=32), _replicas(2), counts_for)
    assert (parallel.patch, parallel.gpu_memory_bytes) == ((32, 32, 32), None)


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
    with pytest.raises(InsufficientMemoryError, match=r"^Not even a 4\^3 patch at batch 2 fits one GPU's 1.00 MiB "
                                                      r"\(needs .*\): give a larger distribute\.gpu_memory_bytes "
                                                      r"\(distribute.gpu_memory_bytes\) or a smaller "
                                                      r"train\.batch_size\.$"):
        data_parallel(_config(strategy="mirrored", gpu_memory_bytes=2**20), _replicas(2), counts_for)


def test_a_job_without_a_strategy_runs_in_this_process_its_batch_as_given():
    config = _config()
    single = choose_execution(config)  # strategy none: no replicas set up, no TensorFlow devices touched
    assert single == SingleProcess(batch_size=2)
    assert (single.patch, single.whole_volumes, single.worker_batch, single.host_checked) == (None, True, 2, True)
    assert single.loader_settings() == {"batch_size": 2}
    assert single.host_config(config) is config
    assert single.learning_rate(1e-3, 8) == 1e-3  # no global batch over replicas to scale to
    assert single.to_dict() is None  # plan.json's data_parallel stays null
    assert single.describe("4 cases whole", 1e-3) == "batches of 2: 4 cases whole"


def _executions(counts_for) -> dict:
    return {
        "single process": SingleProcess(2),
        "whole volumes on two workers": data_parallel(_config(strategy="multiworker"),
                                                      _replicas(2, workers=2, index=1), counts_for),
        "patches on simulated replicas": data_parallel(_config(strategy="mirrored", patch=16), _replicas(2),
                                                       counts_for),
    }


@pytest.mark.parametrize("name", ["single process", "whole volumes on two workers", "patches on simulated replicas"])
def test_every_execution_answers_what_the_job_asks_consistently(counts_for, name):
    execution = _executions(counts_for)[name]
    members = [member for member in vars(Execution) if not member.startswith("_")]
    assert [member for member in members if not hasattr(execution, member)] == []
    config = _config()
    settings = execution.loader_settings()
    assert settings["batch_size"] == execution.worker_batch
    assert settings.get("patch") == execution.patch
    assert execution.whole_volumes == (execution.patch is None)
    host = execution.host_config(config)  # the memory plan checks what this host loads per step
    assert host.train.batch_size == execution.worker_batch
    assert host.data.shape == (execution.patch or config.data.shape)
    section = execution.to_dict()
    assert section is None or json.loads(json.dumps(section)) == section  # plan.json's data_parallel
    assert execution.learning_rate(1e-3, None) >= 1e-3
    with execution.scope():
        pass
    strategy = getattr(getattr(execution, "replicas", None), "strategy", None)
    assert strategy is None or strategy.scopes_entered == 1  # the model is built under the strategy's scope


def test_the_single_process_step_is_the_mean_loss_and_the_metric_of_the_batch():
    import keras
    import numpy as np
    import tensorflow as tf

    from bigmem.nets.unet3d import UNet3D
    from bigmem.train.losses import dice_ce_loss, dice_ce_per_sample, dice_counts, dice_from_counts, foreground_dice
    from bigmem.train.optimizers import FusedAdam

    config = resolve_config("tiny", {"model": {"depth": 1}})  # one level: the step traces twice, in half the time
    keras.utils.set_random_seed(0)
    model = UNet3D(config.model, name="unet3d").build_for()
    optimizer = FusedAdam(learning_rate=1e-3)
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    images = tf.constant(rng.normal(size=(2, 16, 16, 12, 1)), tf.float32)
    labels = tf.constant(rng.integers(0, 3, size=(2, 16, 16, 12)), tf.int32)
    logits = model(images, training=True)
    expected = float(dice_ce_loss(labels, logits)), float(foreground_dice(labels, logits))
    before = [w.numpy().copy() for w in model.trainable_variables]

    class Traces:
        count = 0

    traces = Traces()
    step = SingleProcess(2).make_step(model, optimizer, loss_per_sample=dice_ce_per_sample, metric_counts=dice_counts,
                                      metric_from_counts=dice_from_counts, traces=traces)
    loss, dice = step(images, labels)
    assert (float(loss), float(dice)) == pytest.approx(expected, rel=1e-5)
    assert any(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_variables))  # it updated
    step(images, labels)
    step(images[:1], labels[:1])
    assert traces.count == 2  # one trace per batch shape
