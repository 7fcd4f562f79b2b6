"""Option names: enums looked up with dashes and any case, and suggestions for a near miss."""

from __future__ import annotations

from bigmem.config import Norm, OptimizerName, look_up_option


def test_look_up_option_accepts_dashes_and_case():
    assert look_up_option("Instance", Norm, flag="--norm") is Norm.INSTANCE
    assert look_up_option("SGD", OptimizerName, flag="--optimizer") is OptimizerName.SGD
