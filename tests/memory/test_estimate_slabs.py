"""The estimate past the kernel limit: which stages run in depth slabs, and their per-slab workspace."""

from __future__ import annotations

import pytest

from bigmem.config import resolve_config
from bigmem.memory.calibration import Calibration
from bigmem.memory.estimate import (
    FLOAT32_BYTES,
    WORKSPACE_FLOAT32_TENSORS,
    WORKSPACE_TENSORS,
    NetworkCounts,
    estimate,
    partitioned_stages,
)
from bigmem.memory.records import Budget
from bigmem.nets.limits import kernel_element_limit
from bigmem.nets.unet3d import UNet3D

UNIT = Calibration(activation_scale=1.0, framework_bytes=1000, source="test", borrowed=True)  # raw counts


@pytest.fixture(scope="module")
def counts():
    return NetworkCounts.from_model(UNet3D(resolve_config("tiny").model).build_for(), (32, 32, 32))


def test_stage_largest_tensors(counts):
    # tiny: 4/8/16 filters, max pooling; 32^3 input with 1 channel; what each stage reports
    assert counts.stage_largest_tensor["enc0"] == 4 * 32**3
    assert counts.stage_largest_tensor["enc1"] == 4 * 32**3  # its input, before pooling
    assert counts.stage_largest_tensor["enc2"] == 8 * 16**3
    assert counts.stage_largest_tensor["dec0"] == 8 * 32**3  # the 16-filter level upsampled to 8 filters at 32^3


def test_stages_past_the_limit_and_their_workspace(counts):
    config = resolve_config("tiny", {"train": {"batch_size": 2}})
    whole = estimate(config, counts, (32, 32, 32), calibration=UNIT)
    assert whole.partitioned_stages == []
    assert partitioned_stages(counts, 2) == []
    limit = 4 * 32**3 * 2 - 1  # the batch of level-0 tensors is one element past it
    with kernel_element_limit(limit):
        assert partitioned_stages(counts, 2) == ["enc0", "enc1", "dec0"]
        assert partitioned_stages(counts, 1) == ["dec0"]
        sliced = estimate(config, counts, (32, 32, 32), calibration=UNIT)
    assert sliced.partitioned_stages == ["enc0", "enc1", "dec0"]
    assert sliced.to_dict()["partitioned_stages"] == ["enc0", "enc1", "dec0"]
    assert any("run in depth slabs" in note and "enc0, enc1, dec0" in note for note in sliced.notes)
    # the workspace keeps the widest tensor's (2 x 8 x 32^3 per batch): measured, slabs do not lower the peak
    per_element = WORKSPACE_TENSORS * FLOAT32_BYTES + WORKSPACE_FLOAT32_TENSORS * FLOAT32_BYTES
    assert whole.components["workspace"] == 2 * 2 * 4 * 32**3 * per_element
    assert sliced.components == whole.components


def test_a_plane_too_wide_for_any_slab_is_not_runnable(counts):
    from bigmem.memory.search import make_plan

    config = resolve_config("tiny")
    plane = counts.largest_tensor // 32  # the widest tensor's depth plane at 32^3
    with kernel_element_limit(6 * plane):
        assert estimate(config, counts, (32,) * 3, calibration=UNIT).runnable
    with kernel_element_limit(6 * plane - 1):
        result = estimate(config, counts, (32,) * 3, calibration=UNIT)
        assert not result.runnable
        assert result.to_dict()["runnable"] is False
        assert any(note.startswith("not runnable: a depth plane of") and note.endswith("(needs 6 planes)")
                   for note in result.notes)
        model = UNet3D(config.model).build_for()
        plan = make_plan(config, lambda shape: NetworkCounts.from_model(model, shape), Budget(2**40, "test"),
                         batch_size=1)
    # 1 TiB is plenty, yet no volume whose planes are this wide is chosen
    assert plan.fits
    assert plan.chosen.volume < 32


@pytest.mark.parametrize("planes, runnable", [(5.5, False), (6, True)])
def test_the_estimates_verdict_is_the_planners(counts, planes, runnable):
    """A plane between limit/6 and limit/5 was called runnable, yet a stride-2 3x3x3 conv on it was refused."""
    from bigmem.memory.estimate import Pass, estimate
    from bigmem.nets.slabplan import SlabTooLargeError, plan_conv

    config = resolve_config("tiny")
    plane = counts.largest_tensor // 32  # (1, 32, 32, 32, 8): dec0's skip and upsampled maps
    limit = int(planes * plane)
    with kernel_element_limit(limit):
        verdicts = {estimate(config, counts, (32,) * 3, calibration=UNIT).runnable,
                    estimate(config, counts, (32,) * 3, calibration=UNIT, pass_=Pass.FORWARD).runnable}
    try:
        plan_conv((1, 32, 32, 32, plane // 32**2), (3, 3, 3, 8, 8), 2, limit=limit)
        planned = True
    except SlabTooLargeError:
        planned = False
    assert verdicts == {planned} == {runnable}
