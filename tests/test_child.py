"""bigmem.child: the request/result protocol of the processes bigmem measures in."""

from __future__ import annotations

import os
import sys

import pytest

from bigmem.child import run_child
from bigmem.errors import BigmemError

CHILD = """
import sys
from bigmem.child import serve

def handle(request):
    if request.get("fail"):
        print("first line", file=sys.stderr)
        raise SystemExit("the child's last word")
    if request.get("silent"):
        print("not json")
        sys.exit(0)
    return {"twice": 2 * request["x"]}

sys.exit(serve(handle))
"""


@pytest.fixture
def env(tmp_path):
    (tmp_path / "fake_child.py").write_text(CHILD)
    paths = [str(tmp_path), *[p for p in sys.path if p]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def test_a_child_answers_with_its_last_json_line(env):
    assert run_child("fake_child", {"x": 21}, what="Doubling", env=env) == {"twice": 42}


def test_a_failing_child_is_one_line_with_its_last_stderr_line(env):
    with pytest.raises(BigmemError, match=r"^Doubling failed in the child process \(exit 1\): the child's last word$"):
        run_child("fake_child", {"fail": True}, what="Doubling", env=env)
    with pytest.raises(BigmemError, match=r"^Doubling: the child process printed no result \(its last line: "
                                          r"'not json'\)\.$"):
        run_child("fake_child", {"silent": True}, what="Doubling", env=env)
