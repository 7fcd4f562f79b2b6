"""The experiment a store configures (data/experiment.py) and the dataset's cap on the batch."""

from __future__ import annotations

import numpy as np
import pytest

from bigmem.config.presets import resolve_config, tomllib
from bigmem.data.store import StoreWriter
from bigmem.data.experiment import (
    EXPERIMENT_FILE,
    configure_experiment,
    dataset_batch_cap,
    toml_text,
    write_preset,
)


def kits_like(path, depths=(10, 12, 15), spacings=None, size=32):
    """A KiTS-like store: a few CT cases of varied depth at 3 x 0.8 x 0.8 mm (or ``spacings`` per case)."""
    rng = np.random.default_rng(0)
    with StoreWriter(path, num_classes=3, channel_names=["CT"]) as writer:
        for i, depth in enumerate(depths):
            label = np.zeros((depth, size, size), np.uint8)
            label[depth // 4:depth // 2, 8:20, 8:20] = 1
            label[depth // 3:depth // 2, 10:14, 10:14] = 2
            image = (rng.normal(size=label.shape) + 2 * label).astype(np.float32)
            writer.add_case(f"case_{i:05d}", image, label,
                            spacing=spacings[i] if spacings else (3.0, 0.8, 0.8))
        writer.commit()
    return path


@pytest.fixture
def kits_store(tmp_path):
    return kits_like(tmp_path / "kits.h5")


def test_a_kits_like_store_configures_an_anisotropic_network(kits_store):
    # The median case is 12 x 32 x 32 at 3 x 0.8 x 0.8 mm: the 3 mm axis keeps a 1-deep kernel and waits one
    # stage, until halving the fine axes has brought their spacing within 2x of it (config/topology.py).
    topology = configure_experiment(kits_store).topology
    assert topology.spacing == (3.0, 0.8, 0.8)
    assert topology.median_shape == (12.0, 32.0, 32.0)
    assert topology.strides == ((1, 1, 1), (1, 2, 2), (2, 2, 2), (1, 2, 2))
    assert topology.kernel_sizes == ((1, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3))
    assert topology.features == (32, 64, 128, 256)


def test_the_configured_preset_resolves_to_that_network(kits_store):
    tables = configure_experiment(kits_store).tables(batch_size=2, precision="fp32", recompute="none")
    model = resolve_config(tables).model
    assert model.divisors == (2, 8, 8)
    assert model.stage_kernels[0] == (1, 3, 3)
    assert (model.norm.value, model.activation.value, model.downsampling.value) == (
        "instance", "leaky_relu", "strided")  # nnU-Net's PlainConvUNet as its planner configures it
    assert model.conv_bias and model.deep_supervision


def test_a_store_at_the_target_spacing_needs_no_resampling(kits_store):
    assert configure_experiment(kits_store).resampling is None


def test_a_case_off_the_target_spacing_is_named_with_the_spacing_to_convert_to(tmp_path):
    spacings = [(3.0, 0.8, 0.8), (3.0, 0.8, 0.8), (3.0, 1.0, 1.0)]
    store = kits_like(tmp_path / "mixed.h5", spacings=spacings)
    resampling = configure_experiment(store).resampling
    assert resampling.startswith("case 'case_00002' is at 3x1x1 mm, not the target 3x0.8x0.8 mm: ")
    assert "--spacing 3,0.8,0.8" in resampling


def test_the_batch_is_capped_at_five_percent_of_the_dataset():
    # nnU-Net's rule: round(dataset voxels x 0.05 / sample voxels), at least 2.
    assert dataset_batch_cap([(33, 96, 96), (40, 96, 96), (57, 96, 96)], (64, 96, 96)) == 2
    assert dataset_batch_cap([(64, 64, 64)] * 200, (64, 64, 64)) == 10
    assert dataset_batch_cap([(64, 64, 64)] * 50, (64, 64, 64)) == 2  # round(2.5) is 2 (half to even)


def test_the_preset_is_written_one_stage_per_line_and_reads_back(tmp_path, kits_store):
    tables = configure_experiment(kits_store).tables(batch_size=3, precision="fp32", recompute="stages")
    path = write_preset(tables, tmp_path / EXPERIMENT_FILE)
    text = path.read_text()
    assert "strides = [[1, 1, 1], [1, 2, 2], [2, 2, 2], [1, 2, 2]]\n" in text
    assert tomllib.loads(text)["train"]["batch_size"] == 3
    assert resolve_config(str(path)).memory.recompute.value == "stages"


def test_toml_text_writes_each_kind_of_value():
    text = toml_text({"t": {"s": 'a "b"', "i": 3, "f": 0.01, "b": False, "l": [[1, 2], [3]]}})
    assert tomllib.loads(text) == {"t": {"s": 'a "b"', "i": 3, "f": 0.01, "b": False, "l": [[1, 2], [3]]}}
