"""The estimator's arithmetic, component by component, on the tiny preset."""

from __future__ import annotations

import math

import pytest

from bigmem.config import resolve_config
from bigmem.memory.calibration import Calibration
from bigmem.memory.estimate import (
    ALLOCATOR_GROWTH_FRACTION, FLOAT32_BYTES, HDF5_CHUNK_CACHE_BYTES, NetworkCounts, Pass, activation_elements,
    estimate, recompute_order,
)
from bigmem.nets.unet3d import UNet3D

UNIT = Calibration(activation_scale=1.0, framework_bytes=1000, source="test", borrowed=True)  # raw counts


@pytest.fixture(scope="module")
def model():
    return UNet3D(resolve_config("tiny").model).build_for()


def _config(recompute="none", **train):
    return resolve_config("tiny", {"train": train, "memory": {"recompute": recompute}})


def test_exact_components(model):
    counts = NetworkCounts.from_model(model, (16, 16, 16))
    config = _config(batch_size=2, optimizer="adam")
    result = estimate(config, counts, (16, 16, 16), calibration=UNIT)
    c = result.components
    assert c["framework"] == 1000
    assert c["weights"] == 10_135 * FLOAT32_BYTES
    assert c["gradients"] == counts.trainable_count * FLOAT32_BYTES
    assert c["optimizer_slots"] == 2 * counts.trainable_count * FLOAT32_BYTES
    assert estimate(_config(batch_size=2, optimizer="sgd"), counts, (16,) * 3,
                    calibration=UNIT).components["optimizer_slots"] == counts.trainable_count * FLOAT32_BYTES
    # prefetch 2 + 2 batches of 2 volumes, 16^3 voxels, 1 float32 channel + a uint8 label
    assert c["input_pipeline"] == 4 * 2 * 4096 * 5
    assert c["hdf5_chunk_cache"] == 2 * HDF5_CHUNK_CACHE_BYTES
    # the widest full-resolution tensor is the decoder concat: 2 x 4 filters
    assert c["workspace"] == 8 * 4096 * 2 * (3 * FLOAT32_BYTES + FLOAT32_BYTES)
    assert c["activations"] == model.feature_map_elements((16,) * 3) * 2 * FLOAT32_BYTES
    assert result.predicted_peak_bytes == sum(c.values())


def test_allocator_growth_is_its_fraction_of_the_activations_and_workspace(model):
    c = estimate(_config(batch_size=1), NetworkCounts.from_model(model, (16,) * 3), (16,) * 3,
                 calibration=UNIT).components
    assert c["allocator_growth"] == round(ALLOCATOR_GROWTH_FRACTION * (c["activations"] + c["workspace"]))


def test_first_steps_leave_the_allocator_growth_out(model):
    result = estimate(_config(batch_size=1), NetworkCounts.from_model(model, (16,) * 3), (16,) * 3, calibration=UNIT)
    assert result.first_steps_bytes == result.predicted_peak_bytes - result.components["allocator_growth"]


def test_a_forward_pass_has_no_allocator_growth(model):
    counts = NetworkCounts.from_model(model, (16,) * 3)
    assert "allocator_growth" not in estimate(_config(), counts, (16,) * 3, pass_=Pass.FORWARD).components


def test_activations_scale_with_voxels_batch_and_calibration(model):
    config = _config(batch_size=1)
    small = estimate(config, NetworkCounts.from_model(model, (16,) * 3), (16,) * 3, calibration=UNIT)
    big = estimate(config, NetworkCounts.from_model(model, (32,) * 3), (32,) * 3, calibration=UNIT)
    assert big.components["activations"] == 8 * small.components["activations"]
    scaled = estimate(config, NetworkCounts.from_model(model, (16,) * 3), (16,) * 3,
                      calibration=Calibration(1.5, 1000, "test"))
    assert scaled.components["activations"] == pytest.approx(1.5 * small.components["activations"], abs=1)


def test_bf16_halves_all_but_the_float32_logits(model):
    counts = NetworkCounts.from_model(model, (16,) * 3)
    fp32 = estimate(_config(batch_size=1), counts, (16,) * 3, calibration=UNIT).components["activations"]
    bf16 = estimate(_config(batch_size=1, precision="bf16"), counts, (16,) * 3, calibration=UNIT)
    head = counts.head_elements  # conv output (bf16) + float32 logits: 3 bytes per element pair on average
    assert bf16.components["activations"] == (fp32 - head * 4) // 2 + head * 3
    # the workspace: three bf16 tensors and one float32 upcast of the widest full-resolution shape
    assert bf16.components["workspace"] == counts.largest_tensor * (3 * 2 + 4)


def test_recompute_keeps_outputs_plus_the_largest_stage(model):
    counts = NetworkCounts.from_model(model, (16,) * 3)
    every = list(counts.block_elements)
    kept = activation_elements(counts, every)
    assert kept == (sum(counts.block_outputs.values()) + max(counts.block_elements.values())
                    + counts.head_elements)
    assert kept < activation_elements(counts, [])
    full = estimate(_config(batch_size=1, recompute="stages"), counts, (16,) * 3, calibration=UNIT)
    assert full.recompute_stages == every
    assert full.components["activations"] == kept * FLOAT32_BYTES
    # The most profitable stage to recompute is the full-resolution decoder stage.
    assert recompute_order(counts)[0] == "dec0"


def test_non_cubic_shapes(model):
    counts = NetworkCounts.from_model(model, (8, 12, 20))
    result = estimate(_config(batch_size=1), counts, (8, 12, 20), calibration=UNIT)
    assert result.spatial_shape == (8, 12, 20)
    assert counts.largest_tensor == 8 * math.prod((8, 12, 20))


def test_to_dict_names_the_fields(model):
    result = estimate(_config(), NetworkCounts.from_model(model, (16,) * 3), (16,) * 3, calibration=UNIT)
    data = result.to_dict()
    assert data["predicted_peak_bytes"] == sum(data["components"].values())
    assert data["param_count"] == 10_135
    assert data["calibration"]["source"] == "test"


def test_a_margin_is_its_own_component_and_a_note(model):
    counts = NetworkCounts.from_model(model, (16,) * 3)
    plain = estimate(_config(), counts, (16,) * 3, calibration=UNIT)
    margined = Calibration(1.0, 1000, "default for small on avx512_bf16; no default for ISA class avx2",
                           margin_fraction=0.15)
    result = estimate(_config(), counts, (16,) * 3, calibration=margined)
    assert result.components["safety_margin"] == round(0.15 * plain.predicted_peak_bytes)
    assert result.predicted_peak_bytes == plain.predicted_peak_bytes + result.components["safety_margin"]
    assert "safety_margin" not in plain.components
    assert not plain.notes
    assert any("no default for ISA class avx2" in note and "--calibrate --model tiny" in note for note in result.notes)
    margined.margin_bytes = 256 * 2**20  # the fixed part (calibration.UNMEASURED_MARGIN_BYTES) adds to the fraction
    fixed = estimate(_config(), counts, (16,) * 3, calibration=margined)
    assert fixed.components["safety_margin"] == result.components["safety_margin"] + 256 * 2**20


def test_the_calibration_scales_activations_and_workspace_alike(model):
    counts = NetworkCounts.from_model(model, (16,) * 3)
    unit = estimate(_config(), counts, (16,) * 3, calibration=UNIT).components
    half = estimate(_config(), counts, (16,) * 3, calibration=Calibration(0.5, 1000, "test")).components
    assert half["workspace"] == round(0.5 * unit["workspace"])
    assert half["activations"] == round(0.5 * unit["activations"])
    assert half["weights"] == unit["weights"]
    assert half["input_pipeline"] == unit["input_pipeline"]
    # with knots, the segment around the counted bytes decides both
    counted = unit["activations"] + unit["workspace"]
    curve = Calibration(0.0, 0, "test", knots=[[0, 500], [2 * counted, 500 + 4 * counted]])
    knotted = estimate(_config(), counts, (16,) * 3, calibration=curve).components
    assert knotted["framework"] == 500
    assert knotted["workspace"] == 2 * unit["workspace"]


def test_planewise_copies_count_where_this_cpu_takes_the_path_and_the_tables_did_not(monkeypatch):
    """kits19's strided conv from 32 channels: planewise here, 3-D on the table's class: its input is added."""
    from bigmem.memory.estimate import planewise_copy_bytes
    from bigmem.nets import choices

    here = choices.KernelChoices(planewise={("fp32", 2): (32, 32)}, source="test")
    monkeypatch.setattr(choices, "kernel_choices", lambda: ("test", here))
    monkeypatch.setitem(choices.CHOICES, "table", choices.KernelChoices(planewise={("fp32", 2): (64, 64)}))
    config = resolve_config("kits19", {"train": {"batch_size": 2}})
    assert planewise_copy_bytes(config, (64, 64, 64), "table") == 2 * 64**3 * 32 * 4
    assert planewise_copy_bytes(config, (64, 64, 64), "") == 0  # a fit made here holds its own copies
    monkeypatch.setitem(choices.CHOICES, "table", here)
    assert planewise_copy_bytes(config, (64, 64, 64), "table") == 0


def test_max_pooling_networks_have_no_planewise_copies():
    from bigmem.memory.estimate import planewise_copy_bytes

    assert planewise_copy_bytes(resolve_config("small"), (64, 64, 64), "avx512_bf16") == 0


def test_each_added_sample_keeps_what_its_network_was_measured_to_keep(model):
    """The curve was measured at batch 1; each sample past it adds its counted bytes times the network's
    measured ``added_sample_keeps`` (benchmarks/results/memory_model.md, "What an added sample keeps")."""
    from bigmem.memory.calibration import added_sample_keeps

    counts = NetworkCounts.from_model(model, (16,) * 3)
    half = Calibration(0.5, 1000, "test")
    config = _config(batch_size=3)
    keeps = added_sample_keeps(config.model.name)
    three = estimate(config, counts, (16,) * 3, calibration=half).components
    unit_three = estimate(config, counts, (16,) * 3, calibration=UNIT).components
    assert three["activations"] == round(unit_three["activations"] * (0.5 + 2 * keeps) / 3)
    assert three["workspace"] == round(unit_three["workspace"] * (0.5 + 2 * keeps) / 3)


@pytest.mark.parametrize("preset, keeps", [("intelai-brats", 0.6), ("small", 1.107), ("tiny", 1.107),
                                           ("a-network-of-mine", 1.0)])
def test_what_an_added_sample_keeps_is_measured_per_network(preset, keeps):
    from bigmem.memory.calibration import added_sample_keeps

    assert added_sample_keeps(preset) == keeps


def test_a_borrowed_curve_keeps_every_counted_tensor(model):
    counts = NetworkCounts.from_model(model, (16,) * 3)
    borrowed = Calibration(0.5, 1000, "test", borrowed=True)
    for batch in (1, 2):
        found = estimate(_config(batch_size=batch), counts, (16,) * 3, calibration=borrowed).components
        unit = estimate(_config(batch_size=batch), counts, (16,) * 3, calibration=UNIT).components
        assert found["activations"] == unit["activations"]


def test_a_calibration_measured_at_the_batch_keeps_its_curve(model):
    counts = NetworkCounts.from_model(model, (16,) * 3)
    at_two = Calibration(0.5, 1000, "test", batch_size=2)
    unit_two = estimate(_config(batch_size=2), counts, (16,) * 3, calibration=UNIT).components
    assert estimate(_config(batch_size=2), counts, (16,) * 3,
                    calibration=at_two).components["activations"] == round(0.5 * unit_two["activations"])


def test_a_batch_of_several_holds_the_plane_copies_in_its_count(monkeypatch):
    from bigmem.nets import choices

    here = choices.KernelChoices(planewise={("fp32", 2): (32, 32)}, source="test")
    monkeypatch.setattr(choices, "kernel_choices", lambda: ("test", here))
    monkeypatch.setitem(choices.CHOICES, "table", choices.KernelChoices(planewise={("fp32", 2): (64, 64)}))
    table = Calibration(0.7, 1000, "test", table_isa="table")
    kits = resolve_config("kits19")
    counts = NetworkCounts.from_model(UNet3D(kits.model).build_for(), (64,) * 3)
    one = estimate(kits.updated({"train": {"batch_size": 1}}), counts, (64,) * 3, calibration=table).components
    two = estimate(kits.updated({"train": {"batch_size": 2}}), counts, (64,) * 3, calibration=table).components
    assert one["planewise_copies"] == 64**3 * 32 * 4
    assert "planewise_copies" not in two
