"""EventWriters: TensorBoard event files made on first use, and none of this run's left after a full-disk stop."""

from __future__ import annotations

import errno

import pytest

from bigmem.errors import DiskFullError, TrainingError
from bigmem.monitor.events import EventWriters


def _log(events: EventWriters, name: str, step: int) -> None:
    import tensorflow as tf

    with events.writing(name, step):
        tf.summary.scalar("loss", 0.5)


def test_writers_are_made_on_first_use_and_closed_on_leaving(tmp_path):
    events = EventWriters(tmp_path / "tensorboard")
    with events:
        assert not (tmp_path / "tensorboard").exists()  # nothing made before the first write
        _log(events, "train", 1)
        _log(events, "train", 2)
        _log(events, "validation", 2)
    assert [p.parent.name for p in events.files] == ["train", "validation"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in events.files)


@pytest.mark.parametrize("stop", [DiskFullError("No space left on device writing 'x'", "x", 10, 0),
                                  OSError(errno.ENOSPC, "No space left on device")], ids=["DiskFullError", "ENOSPC"])
def test_a_full_disk_stop_removes_this_run_s_event_files_and_folders(tmp_path, stop):
    earlier = tmp_path / "tensorboard" / "train" / "events.out.tfevents.1.host.99999.0.v2"  # a resumed run's
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"earlier")
    events = EventWriters(tmp_path / "tensorboard")
    with pytest.raises(type(stop)):
        with events:
            _log(events, "train", 3)
            _log(events, "validation", 3)
            assert len(events.files) == 2
            raise stop
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "tensorboard", "tensorboard/train", f"tensorboard/train/{earlier.name}"]  # validation/ was made: removed
    assert earlier.read_bytes() == b"earlier"


def test_another_failure_keeps_the_event_files(tmp_path):
    events = EventWriters(tmp_path / "tensorboard")
    with pytest.raises(TrainingError):
        with events:
            _log(events, "train", 1)
            raise TrainingError("Loss is nan at step 1")  # the curve up to it is what explains it
    assert len(events.files) == 1
    assert events.files[0].is_file()
