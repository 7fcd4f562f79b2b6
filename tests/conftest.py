"""Shared fixtures: tiny synthetic stores, a private cache dir, quiet TensorFlow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

# Keep the developer's ~/.cache/bigmem out of tests, and TensorFlow's start-up logs quiet.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


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


def copy_store(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


@pytest.fixture
def corrupt_store(tiny_store, tmp_path):
    """A function (mutate) -> path of a copy of tiny_store changed by ``mutate(h5py.File)``."""

    def make(mutate, name="bad.h5") -> Path:
        path = copy_store(tiny_store, tmp_path / name)
        with h5py.File(path, "r+") as handle:
            mutate(handle)
        return path

    return make


def run_cli(argv, capsys):
    """Run ``bigmem argv`` in-process; return (exit code, stdout, stderr)."""
    from bigmem.cli.main import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def bigmem_subprocess_cmd() -> list[str]:
    return [sys.executable, "-m", "bigmem"]


__all__ = ["copy_store", "run_cli", "bigmem_subprocess_cmd", "np"]
