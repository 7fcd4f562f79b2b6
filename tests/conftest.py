"""Shared fixtures: tiny synthetic stores, a private cache dir, quiet TensorFlow."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import pytest

from helpers import copy_store

# Keep the developer's ~/.cache/bigmem out of tests, and TensorFlow's start-up logs quiet.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The planner's choices depend on whether the CPU has native bf16; the suite runs on CPUs with and
# without it, so it fixes the answer (tests of the other case set it themselves).
os.environ["BIGMEM_NATIVE_BF16"] = "1"
# The tuning pass takes about a minute on a run's first use; the suite's short runs keep the shipped
# tables (tests/nets/test_tuning.py and tests/train/test_auto_tune.py run the pass themselves).
os.environ["BIGMEM_NO_TUNE"] = "1"


def pytest_collection_modifyitems(config, items):
    """Skip the ``numa`` tests on a kernel with one NUMA node: they prove placement on real nodes."""
    numa_items = [item for item in items if item.get_closest_marker("numa") is not None]
    if not numa_items:
        return
    from bigmem.numa.topology import NUMATopology

    num_nodes = NUMATopology.from_sysfs().num_nodes
    if num_nodes < 2:
        skip = pytest.mark.skip(reason=f"needs a kernel with several NUMA nodes (this one has {num_nodes}); "
                                       "`make test-numa` boots one (tools/numa-vm)")
        for item in numa_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("bigmem-cache")
    previous = os.environ.get("BIGMEM_CACHE_DIR")
    os.environ["BIGMEM_CACHE_DIR"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("BIGMEM_CACHE_DIR", None)
    else:
        os.environ["BIGMEM_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    """Four 16^3 phantoms with 3 classes."""
    from bigmem.data.synth import write_synthetic_store

    return write_synthetic_store(tmp_path_factory.mktemp("stores") / "tiny.h5", num_cases=4, volume=16,
                                 num_classes=3, seed=0)


@pytest.fixture
def corrupt_store(tiny_store, tmp_path):
    """A function (mutate) -> path of a copy of tiny_store changed by ``mutate(h5py.File)``."""

    def make(mutate, name="bad.h5") -> Path:
        path = copy_store(tiny_store, tmp_path / name)
        with h5py.File(path, "r+") as handle:
            mutate(handle)
        return path

    return make
