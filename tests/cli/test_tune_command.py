"""``bigmem tune``'s flags, checked before anything is timed."""

from __future__ import annotations

import pytest

from helpers import run_cli


@pytest.mark.parametrize("flags, message", [
    (["--shape", "50,50,50"], "Invalid --shape 50,50,50: axes 1, 2 and 3 (50, 50, 50) are not multiples of 4 (the "
                              "network downsamples 2 times). Try --shape 48,48,48 or 52,52,52."),
    (["--volume", "50"], "Invalid --volume 50: expected a multiple of 4 (the network downsamples 2 times). Try "
                         "--volume 48 or 52."),
])
def test_a_bad_shape_is_named_by_the_flag_given(capsys, flags, message):
    code, _, err = run_cli(["tune", "--model", "tiny", *flags], capsys)
    assert code == 2
    assert err.strip() == f"bigmem tune: error: {message}"
