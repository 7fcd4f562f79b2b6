"""Fake sysfs trees describing 2- and 4-socket machines."""

from __future__ import annotations

import pytest

from helpers import make_sysfs


@pytest.fixture
def two_socket(tmp_path):
    """2 x 24 cores with SMT siblings (0-23,48-71 | 24-47,72-95), 768 GiB each; node 1 half full."""
    return make_sysfs(tmp_path, [("0-23,48-71", 768, 700), ("24-47,72-95", 768, 384)], [[10, 21], [21, 10]])


@pytest.fixture
def four_socket(tmp_path):
    """4 x 20 cores (80 cores, as the 2020 paper's server), 384 GiB each; node 3 nearly full."""
    return make_sysfs(tmp_path, [("0-19", 384, 370), ("20-39", 384, 370), ("40-59", 384, 370), ("60-79", 384, 40)],
                      [[10, 21, 21, 21], [21, 10, 21, 21], [21, 21, 10, 21], [21, 21, 21, 10]])
