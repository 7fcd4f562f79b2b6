"""The fields and shapes the data decides: the planners and the loader train each case at the same shape."""

from __future__ import annotations

import pytest

from bigmem.config.presets import resolve_config
from bigmem.data.derived import pad_multiple, trained_shapes, with_data_fields
from bigmem.data.synth import write_synthetic_store

ODD_SHAPES = [(33, 34, 35), (17, 9, 40), (20, 16, 13)]


@pytest.fixture(scope="module")
def odd_store(tmp_path_factory):
    return write_synthetic_store(tmp_path_factory.mktemp("odd") / "odd.h5", num_cases=len(ODD_SHAPES), volume=0,
                                 shapes=ODD_SHAPES)


@pytest.mark.parametrize("preset, data, multiple, first", [
    ("tiny", {}, 4, (36, 36, 36)),  # depth 2
    ("small", {}, 8, (40, 40, 40)),  # depth 3
    ("small", {"pad_multiple": 16}, 16, (48, 48, 48)),
    ("small", {"shape": [24, 16, 32]}, 8, (24, 16, 32)),
])
def test_the_loader_trains_each_case_at_the_shape_the_planners_see(odd_store, preset, data, multiple, first):
    from bigmem.distribute.execution import SingleProcess
    from bigmem.train.job import make_loader

    config = with_data_fields(resolve_config(preset, {"data": {"store": str(odd_store), **data}}))
    assert pad_multiple(config) == multiple
    planned = trained_shapes(config)
    assert [(case_id, own) for case_id, own, _ in planned] == [(f"synth_{i:04d}", s) for i, s in enumerate(ODD_SHAPES)]
    assert planned[0][2] == first
    with make_loader(config, SingleProcess(batch_size=1)) as loader:
        assert loader.shapes == [trained for _, _, trained in planned]
