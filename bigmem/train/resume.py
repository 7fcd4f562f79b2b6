"""Resuming a run: every decision ``--resume`` (and ``train(..., resume=True)``) makes, in one place.

In the order a resume meets them:

1. the settings: the saved config.json is the run's; only ``CHANGEABLE_ON_RESUME`` may differ
   (``check_settings``; the command line checks the flags it was given before TensorFlow starts,
   ``prepare_job`` checks a Python caller's whole config the same way, with the same message);
2. the checkpoint to continue from, or starting over, or refusing (``resume_point``);
3. whether anything is left to do (``check_something_to_do``, ``NothingToDo``);
4. the step to start at: the newest checkpoint that loads, restored into the model and optimizer
   (``restore``), from what the checkpoint callback recorded (``checkpoint_state``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from rich.console import Console

from bigmem.config.schema import ExperimentConfig, to_dict
from bigmem.errors import ConfigError, DataError, TrainingError
from bigmem.rundir import RunDir
from bigmem.units import format_bytes

if TYPE_CHECKING:
    from bigmem.checkpoints import CheckpointManager
    from bigmem.train.loop import LoopState

# Settings that may differ from the saved run on resume: they change neither the model nor a
# step's samples and update (the run's length, where and how it runs, what it records); any
# other setting must repeat the saved value.
CHANGEABLE_ON_RESUME = ("train.steps", "train.epochs", "train.time_budget_s", "train.monitor_interval_s",
                        "train.checkpoint_every", "train.val_every", "data.num_workers", "data.prefetch",
                        "data.cold_cache", "memory.budget_bytes", "numa.policy", "numa.cpus", "numa.threads")

# Fields the store decides (``data.derived.with_data_fields``), not the caller: the same store
# gives the same ones, so comparing ``data.store`` covers them.
DECIDED_BY_THE_STORE = ("model.in_channels", "model.num_classes")


class NothingToDo(Exception):
    """A resume whose run is already where it was asked to end: nothing is run, nothing written.

    Args:
        message: what to tell the user (the step reached and how to train longer).
        step: the step the run is at (its newest checkpoint's).
        total_steps: the step the resume was asked to end at.
        summary: the finished run's summary.json, if it has one.
    """

    def __init__(self, message: str, step: int, total_steps: int, summary: dict | None):
        super().__init__(message)
        self.step, self.total_steps, self.summary = step, total_steps, summary


def saved_settings(run: RunDir, *, starting: bool) -> dict | None:
    """The sections of the run's saved config.json; None where no run was started yet and ``starting``.

    Args:
        run: the run directory to resume.
        starting: the caller can start the run itself (it has a whole config: a Python caller, or
            a command that names a --model), so a directory without config.json is not an error.

    Returns:
        config.json's sections (``{"model": {...}, "data": {...}, ...}``), or None.

    Raises:
        DataError: config.json is missing (and not ``starting``), unreadable or not a JSON object.
    """
    out = str(run.path)
    if not run.config.exists():
        if starting:
            return None
        raise DataError(f"Cannot resume {out!r}: no config.json there (is it a bigmem run directory?). To start a "
                        "run there, give its flags ({model.name} ...) or leave out {train.resume}.")
    try:
        saved = run.read_config()
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"Cannot resume {out!r}: its config.json cannot be read ({exc}).") from None
    if not isinstance(saved, dict):
        raise DataError(f"Cannot resume {out!r}: its config.json is not a JSON object of settings.")
    # config.json also records derived figures (total_steps, effective_lr); only the sections are settings
    return ExperimentConfig.sections_of(saved)


def saved_config(saved: dict, overrides: dict | None = None) -> ExperimentConfig:
    """The saved run's settings as a config, with ``overrides`` (config sections) laid over them.

    The saved sections are complete; the preset they name only fills settings newer than the run.
    A new length (``train.steps`` or ``train.epochs`` in ``overrides``) replaces both saved ones.

    Args:
        saved: ``saved_settings``'s sections (not changed).
        overrides: the settings asked for, by section (only those given); None for none.

    Returns:
        The resolved config.
    """
    from bigmem.config.presets import DEFAULT_PRESET, preset_names, resolve_config

    preset = saved.get("model", {}).get("name")
    preset = preset if preset in preset_names() else DEFAULT_PRESET
    overrides = overrides or {}
    if "steps" in overrides.get("train", {}) or "epochs" in overrides.get("train", {}):
        saved = {**saved, "train": {**saved.get("train", {}), "steps": None, "epochs": None}}
    return resolve_config(preset, overrides, base=saved)


def check_settings(run: RunDir, before: ExperimentConfig, wanted: ExperimentConfig,
                   fields: Iterable[str] | None = None, *, model: str | None = None) -> None:
    """Refuse a resume whose settings differ from the saved run's, except ``CHANGEABLE_ON_RESUME``.

    Args:
        run: the run being resumed (the message names it).
        before: the saved run's settings (``saved_config``).
        wanted: the settings asked for.
        fields: the dotted fields to compare, in the order the message names them (the command
            line: the flags given); default None: every field but those the store decides.
        model: a ``--model`` given (a preset name or a .toml path), compared with the saved model's name.

    Returns:
        None: the settings agree.

    Raises:
        ConfigError: (exit 2) naming each field whose value differs, the saved value beside it.
    """
    differ = []
    if model is not None:
        name = Path(model).stem if model.endswith(".toml") else model
        if name != before.model.name:
            differ.append(("model.name", name, before.model.name))
    for field in _every_field(wanted) if fields is None else fields:
        section, key = field.split(".")
        old, new = getattr(getattr(before, section), key), getattr(getattr(wanted, section), key)
        if field in CHANGEABLE_ON_RESUME or _same(field, old, new):
            continue
        differ.append((field, to_dict(new), to_dict(old)))
    if differ:
        changes = "; ".join(f"{{{field}}} {_text(field, new)} (saved: {_text(field, old)})"
                            for field, new, old in differ)
        allowed = ", ".join(f"{{{field}}}" for field in CHANGEABLE_ON_RESUME)
        raise ConfigError(differ[0][0], f"Cannot resume {str(run.path)!r} with settings that differ from the saved "
                                        f"run: {changes}. Only {allowed} may change when resuming: repeat the saved "
                                        "values (or leave those flags out), or start a new run with another "
                                        "{train.run_dir}.")


def check_resumed_config(run: RunDir, config: ExperimentConfig) -> ExperimentConfig:
    """``check_settings`` for a caller with a whole config (``train(config, run, resume=True)``).

    A run directory without config.json has no saved settings: the run starts from ``config``.
    ``data.store`` None (the synthetic dataset) is compared as the store it stands for. A setting
    the store resolves (``RESOLVED_BY_THE_STORE``) asked for as its default takes the saved run's
    value: the run goes on as it was resolved when it started.

    Args:
        run: the run being resumed.
        config: the config asked for.

    Returns:
        ``config``, with the saved values of the store-resolved settings it leaves at their default.

    Raises:
        ConfigError: (exit 2) a setting differs from the saved run's, as on the command line.
        DataError: the saved config.json cannot be read.
    """
    saved = saved_settings(run, starting=True)
    if saved is None:
        return config
    compared = config
    if config.data.store is None:
        from bigmem.data.derived import synthetic_store_path

        compared = config.updated({"data": {"store": synthetic_store_path(config)}})
    previous = saved_config(saved)
    check_settings(run, previous, compared)
    kept: dict = {}
    for dotted, default in RESOLVED_BY_THE_STORE.items():
        section, key = dotted.split(".")
        if getattr(getattr(config, section), key) == default:
            value = getattr(getattr(previous, section), key)
            kept.setdefault(section, {})[key] = value.value if hasattr(value, "value") else value
    return config.updated(kept) if kept else config


def _every_field(config: ExperimentConfig) -> list[str]:
    """Every setting's dotted name, section by section, less those the store decides."""
    names = [f"{section.name}.{field.name}" for section in dataclasses.fields(config)
             for field in dataclasses.fields(getattr(config, section.name))]
    return [name for name in names if name not in DECIDED_BY_THE_STORE]


# Settings whose default the store resolves (``data.derived.with_data_fields``): asked for as the default,
# they agree with whatever the saved run resolved them to.
RESOLVED_BY_THE_STORE = {"data.augment": "auto", "model.region_outputs": None}


def _same(field: str, old, new) -> bool:
    if field == "data.store" and old is not None and new is not None:  # the same file, however it is spelled
        return Path(old).resolve() == Path(new).resolve()
    if field in RESOLVED_BY_THE_STORE and new == RESOLVED_BY_THE_STORE[field]:
        return True
    return old == new


def _text(field: str, value) -> str:
    if field == "data.shape":
        return "each case at its own shape" if value is None else ",".join(map(str, value))
    if value is None:
        return "none"
    if field.endswith("_bytes"):
        return format_bytes(value)
    return str(value)


def resume_point(run: RunDir, manager: CheckpointManager, resume: bool, console: Console | None = None
                 ) -> Path | None:
    """The newest complete checkpoint to resume from, or None to start at step 0.

    A run that stopped before its first checkpoint (a data error at step 2, a kill during
    start-up) holds nothing worth keeping: the same command starts it over, with or without
    ``resume``. So does ``resume`` of a directory where no run was started yet.

    Args:
        run: the run directory.
        manager: its checkpoints.
        resume: continue the run (``--resume``).
        console: where the line saying a run starts over goes.

    Returns:
        The newest complete checkpoint (``restore`` falls back to an older one if it does not load),
        or None: start at step 0.

    Raises:
        TrainingError: a new run into a directory that holds a checkpoint or a finished model, or
            ``resume`` of a run that has one but no checkpoint to continue from.
    """
    console = console or Console(soft_wrap=True)
    latest = manager.latest()
    if resume and latest is not None:
        return latest
    kept = _kept(run, manager)
    if kept and resume:
        raise TrainingError(f"Cannot resume {str(run.path)!r}: it has no complete checkpoint (looked in "
                            f"{run.checkpoints}) but holds {kept}. Start a new run with another {{train.run_dir}}.")
    if kept:
        raise TrainingError(f"Run directory {str(run.path)!r} already holds a run: pass {{train.resume}} to continue "
                            "it, or choose another {train.run_dir}.")
    if run.holds_run():
        console.print(f"{run.path} holds a run that stopped before its first checkpoint: starting it over "
                      "from step 0.")
    elif resume:
        console.print(f"No run was started in {run.path} yet: starting it.")
    return None


def _kept(run: RunDir, manager: CheckpointManager) -> str:
    """What a run directory holds that starting it over would lose ('' when nothing)."""
    kept = [p.name for p in manager.all()] or [f"checkpoints/{p.name}" for p in manager.damaged()]
    kept += [p.name for p in (run.model, run.summary) if p.exists()]
    return ", ".join(kept)


def check_something_to_do(run: RunDir, checkpoint: Path, total_steps: int) -> None:
    """Raise ``NothingToDo`` when resuming from ``checkpoint`` would train nothing and change nothing.

    That is a checkpoint past ``total_steps``, or at it in a run that finished there (its
    summary.json, the last file a run writes, says that step). A run that reached its last
    checkpoint but was killed before summary.json is not finished: resuming it writes model.keras
    and summary.json.

    Args:
        run: the run directory.
        checkpoint: the checkpoint the run would resume from (``resume_point``).
        total_steps: the step the resume is asked to end at.

    Returns:
        None: there is something to do.

    Raises:
        NothingToDo: with the line to print.
    """
    step = int(checkpoint.name.split("-")[-1])
    if step < total_steps:
        return
    try:
        summary = run.read_summary()
    except (OSError, ValueError):
        summary = None
    summary = summary if isinstance(summary, dict) else None
    finished = summary is not None and summary.get("steps") == step and run.model.exists()
    if step == total_steps and not finished:
        return
    where = (f"finished at step {step} of {total_steps}" if step == total_steps
             else f"is at step {step} ({checkpoint.name}), past the {total_steps} steps asked for")
    raise NothingToDo(f"Nothing to do: {run.path} {where}; nothing was changed. To train longer, resume asking "
                      f"for more than {step} steps.", step, total_steps, summary if finished else None)


def checkpoint_state(state: LoopState) -> dict:
    """What a checkpoint records beside the weights, for ``restore`` to carry on from (the step is the manager's).

    Args:
        state: the loop's state at the step saved.

    Returns:
        ``{"total_steps", "loss", "dice"}``: the last loss and Dice are the run's if a resume has no step left.
    """
    return {"total_steps": state.total_steps, "loss": state.loss, "dice": state.dice}


@dataclasses.dataclass(frozen=True)
class Restored:
    """Where a session starts: the step, and the last loss and Dice before it (NaN at step 0).

    Args:
        step: the step the session starts from (0, or the restored checkpoint's).
        loss: the loss at ``step`` (a run killed before its summary.json ends with it).
        dice: the foreground Dice at ``step``.

    Example:
        >>> Restored.from_state({"step": 4, "loss": 0.5, "dice": 0.25})
        Restored(step=4, loss=0.5, dice=0.25)
    """

    step: int = 0
    loss: float = math.nan
    dice: float = math.nan

    @classmethod
    def from_state(cls, state: dict) -> "Restored":
        """From a checkpoint's state.json (``checkpoint_state`` plus the step)."""
        return cls(int(state["step"]), float(state.get("loss", "nan")), float(state.get("dice", "nan")))


def restore(run: RunDir, manager: CheckpointManager, resume_from: Path | None, model, optimizer,
            total_steps: int, console: Console) -> Restored:
    """Restore the newest checkpoint that loads into ``model`` and ``optimizer``, and redo the metrics past it.

    A damaged checkpoint is skipped (and kept aside, with a line saying why) for the next older
    one. metrics.jsonl keeps the rows up to the start step: the rows after it (or, starting over,
    every row) are written again by this session.

    Args:
        run: the run directory.
        manager: its checkpoints.
        resume_from: ``resume_point``'s checkpoint, or None to start at step 0.
        model, optimizer: built, to restore into.
        total_steps: the step the run ends at (for the message).
        console: where the lines go.

    Returns:
        The ``Restored`` start: step 0 when ``resume_from`` is None.

    Raises:
        TrainingError: no checkpoint loads (``CheckpointManager.restore_newest``).
    """
    restored = Restored()
    if resume_from is not None:
        path, state, skipped = manager.restore_newest(model, optimizer)
        for passed in skipped:
            console.print(f"Skipped checkpoint {passed.name}: {passed.reason}; kept aside as "
                          f"{passed.kept_as}.", style="yellow", highlight=False)
        restored = Restored.from_state(state)
        console.print(f"Resuming {run.path} from {path.name} (step {restored.step} of {total_steps}).")
    if run.metrics.exists():
        run.truncate_metrics(restored.step)
    return restored
