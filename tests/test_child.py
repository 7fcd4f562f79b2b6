"""bigmem.child: the request/result protocol of the processes bigmem measures in."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


SLEEPER = """
import sys, time
from bigmem.child import serve

def handle(request):
    print("started", file=open(request["mark"], "w"), flush=True)
    time.sleep(request["sleep_s"])
    return {}

sys.exit(serve(handle))
"""

PARENT = """
import sys
from bigmem.child import run_child
run_child("sleeper", {"sleep_s": 60, "mark": sys.argv[1]}, what="Sleeping")
"""


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (Z: a zombie, ended but not reaped), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_ends_when_its_parent_is_killed(tmp_path):
    """SIGKILL the parent while its child measures: the child is gone too, not left holding its memory."""
    import signal
    import subprocess
    import time

    (tmp_path / "sleeper.py").write_text(SLEEPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *[p for p in sys.path if p]])}
    mark = tmp_path / "started"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(mark)], env=env)
    deadline = time.monotonic() + 60
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mark.exists()
    children = _children(parent.pid)
    assert len(children) == 1
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    while _state(children[0]) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(children[0]) in (None, "Z")  # killed (a zombie until whoever adopted it reaps it)
