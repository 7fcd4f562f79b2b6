"""``bigmem train``'s argument handling that runs before TensorFlow: the per-node workers' argv."""

from __future__ import annotations

import pytest

from bigmem.cli.main import build_parser
from bigmem.cli.train import worker_argv


def _argv_of(*flags: str) -> list[str]:
    args = build_parser().parse_args(["train", *flags])
    return worker_argv(args, args.train_parser)


@pytest.mark.parametrize(("given", "passed"), [("--deep-supervision", "--deep-supervision"),
                                               ("--no-deep-supervision", "--no-deep-supervision")])
def test_workers_get_a_boolean_flag_as_it_was_given(given, passed):
    argv = _argv_of("--model", "tiny", given)
    assert passed in argv
    assert len([a for a in argv if a.endswith("deep-supervision")]) == 1


def test_workers_get_no_boolean_flag_that_was_not_given():
    assert not [a for a in _argv_of("--model", "tiny") if a.endswith("deep-supervision")]


def test_workers_get_the_augmentation_chain():
    argv = _argv_of("--model", "tiny", "--augment", "light")
    assert argv[argv.index("--augment") + 1] == "light"
