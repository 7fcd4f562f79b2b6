"""Atomic checkpoints: round trip, newest complete wins, temporaries ignored, pruning, the best kept apart."""

from __future__ import annotations


import keras
import numpy as np
import pytest

from bigmem.config import resolve_config
from bigmem.errors import DataError, DiskFullError
from bigmem.nets.unet3d import UNet3D
from bigmem.checkpoints import CheckpointManager


def _model_and_optimizer(seed: int, **model_overrides):
    keras.utils.set_random_seed(seed)
    model = UNet3D(resolve_config("tiny", {"model": model_overrides}).model).build_for()
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def test_round_trip_restores_weights_and_optimizer(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    optimizer.iterations.assign(17)
    for var in optimizer.variables[1:]:
        var.assign(np.full(var.shape, 0.5, var.dtype))
    manager = CheckpointManager(tmp_path, keep=2)
    saved = manager.save(17, model, optimizer, {"loss": 1.25})
    assert saved.name == "ckpt-00000017"
    other, other_opt = _model_and_optimizer(1)
    state = manager.restore(saved, other, other_opt)
    assert state == {"loss": 1.25, "step": 17}
    for a, b in zip(model.weights, other.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(other_opt.iterations.numpy()) == 17
    for a, b in zip(optimizer.variables, other_opt.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_newest_complete_checkpoint_wins_and_temporaries_are_ignored(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (2, 4, 6, 8):
        manager.save(step, model, optimizer, {})
    assert [p.name for p in manager.all()] == ["ckpt-00000004", "ckpt-00000006", "ckpt-00000008"]
    # A crash mid-write leaves a temporary directory (atomic_output's name, or an older bigmem's), a
    # replaced checkpoint moved aside, or a directory without its state file.
    for stale in (".ckpt-00000010.tmp-99999-0", ".tmp-ckpt-00000011-99999", ".ckpt-00000008.tmp-99999-1"):
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "variables.h5").write_bytes(b"half")
    (tmp_path / "ckpt-00000012").mkdir()
    assert manager.latest().name == "ckpt-00000008"
    manager.save(9, model, optimizer, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000006", "ckpt-00000008", "ckpt-00000009",
                                                          "ckpt-00000012"]  # no temporary left


def test_checkpoint_from_another_model_is_refused(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    saved = CheckpointManager(tmp_path).save(1, model, optimizer, {})
    bigger, bigger_opt = _model_and_optimizer(0, base_filters=6)  # same layers (skips joined below 16), wider
    with pytest.raises(DataError, match=r"^Checkpoint '.*ckpt-00000001': variable .* has shape"):
        CheckpointManager(tmp_path).restore(saved, bigger, bigger_opt)
    residual, residual_opt = _model_and_optimizer(0, residual=True)
    with pytest.raises(DataError, match=r"^Checkpoint '.*' holds \d+ model variables; this run has \d+\. "
                                        r"Was it written by another model\?$"):
        CheckpointManager(tmp_path).restore(saved, residual, residual_opt)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    saved = CheckpointManager(tmp_path).save(1, model, optimizer, {})
    (saved / "state.json").write_text("{not json")
    with pytest.raises(DataError, match=r"^Cannot read checkpoint '.*ckpt-00000001'"):
        CheckpointManager(tmp_path).restore(saved, model, optimizer)


def test_best_is_kept_apart_and_found_by_name(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    manager = CheckpointManager(tmp_path, keep=1)
    assert manager.best is None
    manager.save(2, model, optimizer, {})
    best = manager.save_best(2, model, {"val_dice": 0.5})
    other, _ = _model_and_optimizer(1)
    manager.save(4, other, optimizer, {})
    manager.save(6, other, optimizer, {})  # pruning keeps one periodic checkpoint, never best
    assert [p.name for p in manager.all()] == ["ckpt-00000006"]
    assert manager.best == best
    assert manager.find("best") == best
    assert manager.find("latest").name == "ckpt-00000006"
    assert manager.find("ckpt-6") == manager.find("6") == manager.find("ckpt-00000006")
    restored, _ = _model_and_optimizer(2)
    assert manager.restore(best, restored) == {"val_dice": 0.5, "step": 2}  # the weights only
    for a, b in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(DataError, match=r"^No checkpoint 'ckpt-4' in .*: expected latest or one of "
                                        r"ckpt-00000006, best\.$"):
        manager.find("ckpt-4")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_restore_newest_skips_damaged_checkpoints_and_keeps_them_aside(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    manager = CheckpointManager(tmp_path, keep=5)
    for step in (1, 2, 3, 4):
        manager.save(step, model, optimizer, {"loss": float(step)})
    (tmp_path / "ckpt-00000004" / "state.json").write_text('{"loss": 4.0}')  # parses, but no step
    (tmp_path / "ckpt-00000003" / "variables.h5").write_bytes(b"\0" * 4096)  # zeroed
    (tmp_path / "ckpt-00000002" / "state.json").unlink()  # half removed
    (tmp_path / ".damaged-ckpt-00000003").mkdir()  # kept aside by an earlier resume
    other, other_opt = _model_and_optimizer(1)
    path, state, skipped = manager.restore_newest(other, other_opt)
    assert path.name == "ckpt-00000001"
    assert state == {"loss": 1.0, "step": 1}
    assert [(s.name, s.reason, s.kept_as.name) for s in skipped] == [
        ("ckpt-00000004", "state.json: expected a JSON object with an integer 'step'", ".damaged-ckpt-00000004"),
        ("ckpt-00000003", "variables.h5: Unable to synchronously open file (file signature not found)",
         ".damaged-ckpt-00000003.1"),
        ("ckpt-00000002", "state.json missing", ".damaged-ckpt-00000002")]
    assert [p.name for p in manager.all()] == ["ckpt-00000001"]
    assert [p.name for p in manager.damaged()] == [".damaged-ckpt-00000002", ".damaged-ckpt-00000003",
                                                   ".damaged-ckpt-00000003.1", ".damaged-ckpt-00000004"]
    for a, b in zip(model.weights, other.weights):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    manager.save(5, model, optimizer, {})  # pruning never touches what was kept aside
    assert len(manager.damaged()) == 4


def test_a_flipped_byte_fails_the_crc_check(tmp_path):
    import h5py

    model, optimizer = _model_and_optimizer(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, model, optimizer, {})
    saved = manager.save(2, model, optimizer, {})
    with h5py.File(saved / "variables.h5", "r+") as handle:  # silent corruption: the file still opens
        data = handle["model/00000"]
        value = data[...]
        value.reshape(-1)[0] += 1.0
        data[...] = value
        path = data.attrs["path"]
    with pytest.raises(DataError, match=rf"^Cannot read checkpoint '.*ckpt-00000002': variables.h5: model variable "
                                        rf"{path} fails its CRC-32 check$"):
        manager.restore(saved, model, optimizer)
    path, _, skipped = manager.restore_newest(model, optimizer)
    assert path.name == "ckpt-00000001"
    assert [s.name for s in skipped] == ["ckpt-00000002"]


def test_a_checkpoint_of_another_model_is_refused_not_kept_aside(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, model, optimizer, {})
    residual, residual_opt = _model_and_optimizer(0, residual=True)
    with pytest.raises(DataError, match=r"Was it written by another model\?$"):
        manager.restore_newest(residual, residual_opt)
    assert [p.name for p in manager.all()] == ["ckpt-00000001"]
    assert manager.damaged() == []


def test_none_loads(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    manager = CheckpointManager(tmp_path)
    (manager.save(1, model, optimizer, {}) / "state.json").write_text("[]")
    with pytest.raises(DataError, match=r"^No checkpoint in .* loads: ckpt-00000001: state.json: expected a JSON "
                                        r"object with an integer 'step' \(kept aside as \.damaged-ckpt-00000001\)\. "
                                        r"Start a new run with another train\.run_dir\.$"):
        manager.restore_newest(model, optimizer)
    with pytest.raises(DataError, match=r"loads: there is none\."):
        CheckpointManager(tmp_path / "missing").restore_newest(model, optimizer)


def test_a_checkpoint_its_directory_and_their_parents_are_fsynced(tmp_path, monkeypatch):
    import os

    from bigmem import atomic

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    model, optimizer = _model_and_optimizer(0)
    run = tmp_path / "run"
    run.mkdir()
    manager = CheckpointManager(run / "checkpoints")
    saved = manager.save(3, model, optimizer, {})
    tmp = synced[2]
    assert atomic.temporary_of(os.path.basename(tmp)) == ("ckpt-00000003", os.getpid())
    assert synced == [f"{tmp}/state.json", f"{tmp}/variables.h5", tmp,  # contents, then names
                      str(run / "checkpoints"), str(run)]  # the rename into place, and checkpoints/ itself
    assert saved == run / "checkpoints" / "ckpt-00000003"
    synced.clear()
    manager.save(4, model, optimizer, {})
    assert synced[3:] == [str(run / "checkpoints")]  # checkpoints/ was there: run/ has no new name to sync


def test_a_failed_first_checkpoint_leaves_no_checkpoints_folder(tmp_path, monkeypatch):
    import errno

    import bigmem.checkpoints as checkpoints

    def full(array):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints, "_crc32", full)
    model, optimizer = _model_and_optimizer(0)
    with pytest.raises(DiskFullError, match=r"^No space left on device writing '.*/checkpoints/ckpt-00000001' "
                                            r"\(needed .* free\)\. Free space or choose another output\.path\.$"):
        CheckpointManager(tmp_path / "run" / "checkpoints").save(1, model, optimizer, {})
    assert list(tmp_path.iterdir()) == []  # neither run/ nor checkpoints/: made by the write, removed on failure


def test_a_re_save_of_the_same_step_replaces_it_whole(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, model, optimizer, {"loss": 1.0})
    manager.save(1, model, optimizer, {"loss": 0.5})
    assert manager.read_state(manager.latest()) == {"loss": 0.5, "step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001"]


def test_a_failed_write_leaves_nothing_behind_and_the_last_checkpoint_whole(tmp_path, monkeypatch):
    import errno

    import bigmem.checkpoints as checkpoints

    model, optimizer = _model_and_optimizer(0)
    manager = CheckpointManager(tmp_path)
    manager.save(1, model, optimizer, {"loss": 1.0})
    manager.save_best(1, model, {"val_dice": 0.5})

    def full(array):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints, "_crc32", full)
    for write in (lambda: manager.save(2, model, optimizer, {}), lambda: manager.save_best(2, model, {})):
        with pytest.raises(DiskFullError, match=r"^No space left on device writing '.*/(ckpt-00000002|best)' "):
            write()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "ckpt-00000001"]
    assert manager.read_state(manager.latest()) == {"loss": 1.0, "step": 1}
    assert manager.read_state(manager.best) == {"val_dice": 0.5, "step": 1}
