"""compare's request: the command's options and defaults in one place, the cheap refusals, and the decisions
``run_compare`` makes before anything trains (held-out cases, replicas, the compared config)."""

from __future__ import annotations

import dataclasses
import types

import pytest

from bigmem.cli.common import flag_for
from bigmem.compare.run import DEFAULT_PHANTOM_VOLUME, DEFAULT_VAL_EVERY
from bigmem.compare.setup import (
    DEFAULT_SIMULATED_REPLICAS, CompareRequest, held_out_count, replica_count, resolve_compare_config,
)
from bigmem.config.presets import DEFAULT_PRESET
from bigmem.errors import ConfigError


def _parsed(*flags: str):
    from bigmem.cli.compare import request_from
    from bigmem.cli.main import build_parser

    return request_from(build_parser().parse_args(["compare", *flags]))


def test_a_flag_not_given_keeps_the_request_s_default():
    request = _parsed()
    assert request == CompareRequest()
    assert (request.model, request.equal, request.seeds, request.val_every, request.out) == (
        DEFAULT_PRESET, "time", 1, DEFAULT_VAL_EVERY, "compare")


def test_every_flag_sets_its_option():
    request = _parsed("--data", "s.h5", "--model", "tiny", "--shape", "8,16,24", "--batch-size", "3", "--gpus", "2",
                      "--simulate-replicas", "4", "--gpu-memory", "8GiB", "--equal", "flops", "--steps", "7",
                      "--seeds", "2", "--val-every", "5", "--memory-budget", "3GiB", "--holdout", "1",
                      "--monitor-interval", "0.5", "--out", "cmp")
    assert request == CompareRequest(data="s.h5", model="tiny", shape=(8, 16, 24), batch_size=3, gpus=2,
                                     simulate_replicas=4, gpu_memory_bytes=8 * 2**30, equal="flops", steps=7, seeds=2,
                                     val_every=5, memory_budget_bytes=3 * 2**30, holdout=1, monitor_interval_s=0.5,
                                     out="cmp")
    assert _parsed("--volume", "32", "--time-budget", "30", "--gpu-reference", "ref.json") == CompareRequest(
        volume=32, time_budget_s=30.0, gpu_reference="ref.json")


@pytest.mark.parametrize("options, message", [
    ({"steps": 0}, "Invalid {compare.steps} 0: expected a positive integer."),
    ({"time_budget_s": -5.0}, "Invalid {compare.time_budget_s} -5: expected a positive, finite number."),
    ({"simulate_replicas": 0}, "Invalid {compare.simulate_replicas} 0: expected a positive integer."),
    ({"holdout": -1}, "Invalid {compare.holdout} -1: expected an integer >= 0."),
    ({"monitor_interval_s": -1.0}, "Invalid {compare.monitor_interval_s} -1: expected seconds >= 0 (0 turns the "
                                   "monitor off)."),
    ({"gpu_memory_bytes": 0}, "Invalid {compare.gpu_memory_bytes} 0: expected a positive size such as 80GiB."),
    ({"equal": "energy"}, "Invalid {compare.equal} 'energy': expected time or flops."),
    ({"gpu_memory_bytes": 2**30, "gpu_reference": "ref.json"}, "Give either {compare.gpu_memory_bytes} or "
     "{compare.gpu_reference}, not both: the reference file measured its GPU's memory."),
    ({"volume": 16, "shape": (16, 16, 16), "data": "s.h5"}, "Give either {compare.volume} or {compare.shape}, not "
     "both."),
    ({"shape": (16, 16, 16)}, "{compare.shape} needs {compare.data}: the synthetic phantoms are cubes (give "
     "{compare.volume} N for N^3 phantoms)."),
])
def test_check_names_options_as_fields_and_the_command_line_as_flags(options, message):
    with pytest.raises(ConfigError) as raised:
        CompareRequest(**options).check()
    fields = {name: f"compare.{name}" for name in (f.name for f in dataclasses.fields(CompareRequest))}
    assert str(raised.value) == message.format(compare=types.SimpleNamespace(**fields))
    flags = {name: flag_for(field) for name, field in fields.items()}
    assert raised.value.render(flag_for) == message.format(compare=types.SimpleNamespace(**flags))


def test_the_default_holdout_is_one_case_in_five_at_least_one(tmp_path, tiny_store):
    from bigmem.data.synth import write_synthetic_store

    ten = write_synthetic_store(tmp_path / "ten.h5", num_cases=10, volume=8, seed=0)
    assert held_out_count(None, str(ten)) == 2
    assert held_out_count(None, str(tiny_store)) == 1  # 4 cases
    assert held_out_count(3, str(tiny_store)) == 3


@pytest.mark.parametrize("holdout, message", [
    (4, "Invalid {field} 4: the store {store!r} has 4 cases; compare needs at least one besides the held-out ones "
        "to train on."),
    (0, "Invalid {field} 0: the store {store!r} has 4 cases; compare needs at least one held-out case to score."),
])
def test_a_holdout_that_leaves_nothing_to_train_or_score_is_refused(tiny_store, holdout, message):
    with pytest.raises(ConfigError) as raised:
        held_out_count(holdout, str(tiny_store))
    assert raised.value.render(flag_for) == message.format(field="--holdout", store=str(tiny_store))


def test_the_default_holdout_that_leaves_nothing_to_train_says_it_was_the_default(tmp_path):
    from bigmem.data.synth import write_synthetic_store

    one = write_synthetic_store(tmp_path / "one.h5", num_cases=1, volume=8, seed=0)
    with pytest.raises(ConfigError) as raised:
        held_out_count(None, str(one))
    assert raised.value.render(flag_for) == (f"Invalid the default --holdout (1): the store {str(one)!r} has 1 case; "
                                             "compare needs at least one besides the held-out ones to train on.")


@pytest.mark.parametrize("gpus, simulate_replicas, found, expected", [
    (None, None, 0, (DEFAULT_SIMULATED_REPLICAS, True)),
    (None, None, 4, (4, False)),
    (2, None, 4, (2, False)),
    (2, 3, 4, (3, True)),
    (None, 3, 0, (3, True)),
])
def test_replicas_are_the_gpus_found_else_simulated(monkeypatch, gpus, simulate_replicas, found, expected):
    fake = types.SimpleNamespace(config=types.SimpleNamespace(list_physical_devices=lambda kind: ["GPU"] * found))
    monkeypatch.setattr("bigmem.tfenv.import_tensorflow", lambda verbose=False: fake)
    assert replica_count(gpus, simulate_replicas) == expected


def test_the_compared_config_is_the_store_s_at_the_shape_asked_for(tiny_store):
    whole = resolve_compare_config(CompareRequest(data=str(tiny_store), model="tiny"))
    assert whole.data.shape is None  # each case at its own shape
    assert whole.model.name == "tiny"
    cube = resolve_compare_config(CompareRequest(data=str(tiny_store), model="tiny", volume=8, batch_size=3))
    assert cube.data.shape == (8, 8, 8)
    assert cube.train.batch_size == 3
    shaped = resolve_compare_config(CompareRequest(data=str(tiny_store), model="tiny", shape=(8, 8, 16)))
    assert shaped.data.shape == (8, 8, 16)


@pytest.mark.parametrize("volume, edge", [(None, DEFAULT_PHANTOM_VOLUME), (32, 32)])
def test_without_data_the_phantoms_are_cubes_of_the_volume_each_trained_whole(monkeypatch, volume, edge):
    monkeypatch.setattr("bigmem.data.derived.with_data_fields", lambda config, generating=None: config)
    config = resolve_compare_config(CompareRequest(model="tiny", volume=volume))
    assert config.data.synth_volume == edge
    assert config.data.shape is None
    assert config.data.store is None
