"""Transforms are registered by name, say what memory they take, and a chain round-trips through config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest

from bigmem.data.transforms import CHAINS, TRANSFORMS, Compose, Transform, chain


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_every_named_chain_round_trips_through_json(name):
    built = chain(name, planned_shape=(20, 128, 96), spacing=(5.0, 1.0, 1.0))
    assert Compose.from_dict(json.loads(json.dumps(built.to_dict()))) == built


def test_a_round_trip_keeps_changed_parameters():
    built = chain("light", flip=False, intensity=(0.2, 0.0))
    again = Compose.from_dict(json.loads(json.dumps(built.to_dict())))
    assert again.transforms[0].scale == 0.2


def test_every_registered_transform_says_its_extra_memory():
    for name, kind in TRANSFORMS.items():
        assert kind().extra_volumes(4) >= 0.0, name


def test_a_transform_that_does_not_say_its_extra_memory_cannot_be_made():
    try:
        @dataclass(repr=False)
        class Silent(Transform):
            name: ClassVar[str] = "silent_test"

            def apply(self, sample, rng):
                return sample

        with pytest.raises(TypeError):
            Silent()
    finally:
        TRANSFORMS.pop("silent_test", None)


def test_two_transforms_of_one_name_are_refused():
    with pytest.raises(TypeError, match="two transforms are named 'noise'"):
        @dataclass(repr=False)
        class Other(Transform):
            name: ClassVar[str] = "noise"

            def apply(self, sample, rng):
                return sample

            def extra_volumes(self, channels):
                return 0.0


def test_an_unknown_transform_name_is_refused():
    with pytest.raises(ValueError, match="no transform is named 'warp'"):
        Transform.from_dict({"name": "warp"})
