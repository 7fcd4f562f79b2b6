"""``bigmem train``: train a 3D U-Net on whole volumes."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bigmem.cli.common import (
    add_budget_flag, add_memory_flags, add_model_flags, add_numa_flags, budget_arguments, model_overrides,
    numa_overrides,
)
from bigmem.errors import ConfigError, DataError, UsageError
from bigmem.rundir import RunDir
from bigmem.units import format_bytes, parse_bytes

HELP = "train a 3D U-Net on whole volumes"

DESCRIPTION = """\
Train a 3D U-Net on whole volumes held in RAM. With no --data, bigmem generates a synthetic
phantom dataset once (cached under ~/.cache/bigmem) and trains the 'small' preset on it.

Each case is used whole at its own shape (D,H,W), padded (never cropped) up to a multiple of
2^depth; padded voxels take the background value and count in no loss, metric or throughput.
--shape D,H,W (or --volume N) crops/pads every case to one shape instead, and says how much it
crops. The step compiles once per distinct batch shape (--pad-multiple makes fewer of them).

Settings resolve in this order: built-in defaults, then the --model preset's file, then flags.
The resolved configuration is saved as RUN_DIR/config.json. Interrupt with Ctrl-C (or SIGTERM)
to write a checkpoint and stop. To continue a run (stopped, killed or finished), run the same
command plus --resume, or just --out RUN_DIR --resume: the saved settings apply, and a flag that
differs from them is refused, except the run's length and how it runs (--steps, --epochs,
--time-budget, --monitor-interval, --checkpoint-every, --val-every, --num-workers, --prefetch,
--cold-cache, --memory-budget, --numa, --cpus, --threads). A run that failed before its first
checkpoint starts over with the same command.
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("train", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser, volume_help="crop/pad every case to N^3, N a multiple of 2^depth",
                    shape_help="crop (random offset) or pad every case to D,H,W, each a multiple of 2^depth "
                               "(default: each case whole at its own shape, padded to a multiple of 2^depth)")
    add_memory_flags(parser)
    add_numa_flags(parser)
    dp = parser.add_argument_group("data parallel (the GPU baseline bigmem compares itself with)")
    dp.add_argument("--strategy", choices=["none", "mirrored", "multiworker"],
                    help="none (default): whole volumes in this process; mirrored: tf.distribute.MirroredStrategy "
                         "on this host's GPUs; multiworker: MultiWorkerMirroredStrategy across hosts (TF_CONFIG)")
    dp.add_argument("--gpus", type=int, metavar="N", help="GPUs to use with --strategy mirrored (default: all)")
    dp.add_argument("--simulate-replicas", type=int, metavar="N",
                    help="run the data-parallel path on N logical CPU devices instead of GPUs (results are "
                         "labelled 'simulated on CPU')")
    dp.add_argument("--gpu-memory", metavar="SIZE", help="memory of one GPU, e.g. 80GiB: the patch is the largest "
                                                         "that fits it at --batch-size per replica")
    dp.add_argument("--patch", type=int, metavar="N", help="use N^3 patches instead of the planner's choice")
    dp.add_argument("--reference-batch", type=int, metavar="B",
                    help="the global batch --lr is meant for; lr scales linearly to the real global batch "
                         "(default: --batch-size, i.e. one replica)")
    memory = parser.add_argument_group("memory pre-flight")
    add_budget_flag(memory, help_text="refuse (exit 3) when the predicted peak exceeds SIZE, e.g. 1.5TiB (default: "
                                      "what the --numa placement can use, else MemAvailable; a SIZE above what "
                                      "a bind or interleave placement can use is capped to it)")
    memory.add_argument("--force", action="store_true", help="train even when the predicted peak exceeds the budget")
    data = parser.add_argument_group("data")
    data.add_argument("--data", metavar="STORE.h5", help="HDF5 store to train on (default: synthetic phantoms)")
    data.add_argument("--holdout", type=int, metavar="N", help="keep the last N cases out of training")
    data.add_argument("--pad-multiple", type=int, metavar="N",
                      help="pad each case's axes up to a multiple of N (a multiple of 2^depth; default 2^depth): a "
                           "store of many shapes then compiles the step for fewer of them, for a little more padding")
    data.add_argument("--num-workers", type=int, metavar="N",
                      help="reader processes (0: read in the training process; default 0)")
    data.add_argument("--prefetch", type=int, metavar="N", help="batches prepared ahead of the step (default 2)")
    data.add_argument("--cold-cache", action="store_true", default=None,
                      help="drop the store's pages from the page cache after every read (posix_fadvise DONTNEED), "
                           "so training reads from disk as it would for a dataset larger than RAM")
    opt = parser.add_argument_group("optimisation")
    length = opt.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, metavar="K", help="number of training steps")
    length.add_argument("--epochs", type=int, metavar="E", help="number of passes over the cases")
    opt.add_argument("--time-budget", type=float, metavar="S", help="stop after S seconds of training (a checkpoint "
                                                                     "and model.keras are written)")
    opt.add_argument("--lr", type=float, metavar="X", help="peak learning rate (after linear warmup)")
    opt.add_argument("--warmup-steps", type=int, metavar="K", help="linear warmup length in steps")
    opt.add_argument("--seed", type=int, metavar="S", help="seed for weights, case order and augmentation")
    run_group = parser.add_argument_group("run directory")
    run_group.add_argument("--out", metavar="RUN_DIR",
                           help="where config.json, metrics.jsonl, checkpoints/ and model.keras go "
                                "(default: runs/<preset>-<date>-<time>)")
    run_group.add_argument("--resume", action="store_true",
                           help="continue RUN_DIR from its newest checkpoint that loads (a damaged one is skipped "
                                "and kept aside); a finished run is left as it is")
    run_group.add_argument("--checkpoint-every", type=int, metavar="K", help="steps between checkpoints")
    run_group.add_argument("--val-every", type=int, metavar="K",
                           help="every K steps and at the end, segment the --holdout cases whole (as bigmem predict "
                                "does) and log their Dice (val_dice, per class) to metrics.jsonl, summary.json and "
                                "TensorBoard; the best model is kept as checkpoints/best (bigmem predict --checkpoint "
                                "best)")
    run_group.add_argument("--monitor-interval", type=float, metavar="S",
                           help="seconds between rows of RUN_DIR/monitor.csv (CPU, memory, page cache, disk, NUMA "
                                "nodes, GPUs; default 1; 0 turns the monitor off)")
    parser.set_defaults(run=run)


def _overrides(args) -> dict:
    """Only the flags the user gave (argparse defaults are None), as config sections."""
    budget = budget_arguments(args)[0]
    sections = model_overrides(args)
    sections["data"].update(store=args.data, num_workers=args.num_workers, prefetch=args.prefetch,
                            cold_cache=args.cold_cache)
    sections["numa"] = numa_overrides(args)
    gpu_memory = parse_bytes(args.gpu_memory, flag="--gpu-memory") if args.gpu_memory else None
    sections["data"].update(holdout=args.holdout, pad_multiple=args.pad_multiple)
    sections["distribute"] = dict(strategy=args.strategy, gpus=args.gpus, simulate_replicas=args.simulate_replicas,
                                  gpu_memory_bytes=gpu_memory, patch=args.patch)
    sections["memory"].update(budget_bytes=budget)
    sections["train"].update(steps=args.steps, epochs=args.epochs, lr=args.lr, warmup_steps=args.warmup_steps,
                             seed=args.seed, checkpoint_every=args.checkpoint_every, val_every=args.val_every,
                             reference_batch=args.reference_batch, time_budget_s=args.time_budget,
                             monitor_interval_s=args.monitor_interval)
    given = {name: {k: v for k, v in values.items() if v is not None} for name, values in sections.items()}
    if args.steps is not None or args.epochs is not None:  # a length given replaces the preset's other one
        given["train"]["epochs" if args.steps is not None else "steps"] = None
    return given


# Settings that may differ from the saved run on --resume: they change neither the model nor a
# step's samples and update (the run's length, where and how it runs, what it records); any
# other flag must repeat the saved value.
CHANGEABLE_ON_RESUME = ("train.steps", "train.epochs", "train.time_budget_s", "train.monitor_interval_s",
                        "train.checkpoint_every", "train.val_every", "data.num_workers", "data.prefetch",
                        "data.cold_cache", "memory.budget_bytes", "numa.policy", "numa.cpus", "numa.threads")


def resolve(args):
    """The resolved ExperimentConfig and run directory for these arguments.

    With ``--resume`` the run's saved config.json is the base and the flags given must agree with
    it, except those in ``CHANGEABLE_ON_RESUME``; a directory where no run was started yet is
    started from the flags when they name a --model (the same command, plus --resume, works
    after a kill at any moment).

    Raises:
        UsageError: ``--resume`` without ``--out``; ``ConfigError`` naming every flag whose value
            differs from the saved run's.
        DataError: the store or the saved config.json cannot be read.
    """
    from bigmem.config.presets import preset_names, resolve_config

    overrides = _overrides(args)
    if args.data is not None and not Path(args.data).exists():
        raise DataError(f"Cannot open store {args.data!r} (--data): no such file.")
    if args.resume:
        if args.out is None:
            raise UsageError("--resume needs --out RUN_DIR: the run to continue.")
        saved = _saved_settings(RunDir(args.out), args.out, starting=args.model is not None)
        if saved is not None:
            preset = saved.get("model", {}).get("name")
            # the saved sections are complete; the preset only fills settings newer than the run
            preset = preset if preset in preset_names() else "small"
            before = resolve_config(preset, base=saved)
            if "steps" in overrides["train"] or "epochs" in overrides["train"]:  # a new length replaces the old
                saved["train"] = {**saved.get("train", {}), "steps": None, "epochs": None}
            after = resolve_config(preset, overrides, base=saved)
            _refuse_changes(args, before, after, overrides)
            return after, Path(args.out)
    preset = args.model or "small"
    config = resolve_config(preset, overrides)
    out = Path(args.out) if args.out else Path("runs") / f"{config.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return config, out


def _saved_settings(run: RunDir, out: str, *, starting: bool) -> dict | None:
    """The saved config.json's sections; None where no run was started yet and ``starting``.

    Raises:
        DataError: config.json is missing (and not ``starting``) or is not a JSON object.
    """
    if not run.config.exists():
        if starting:
            return None
        raise DataError(f"Cannot resume {out!r}: no config.json there (is it a bigmem run directory?). To start a "
                        "run there, give its flags (--model ...) or leave out --resume.")
    try:
        saved = run.read_config()
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataError(f"Cannot resume {out!r}: its config.json cannot be read ({exc}).") from None
    if not isinstance(saved, dict):
        raise DataError(f"Cannot resume {out!r}: its config.json is not a JSON object of settings.")
    # config.json also records derived figures (total_steps, effective_lr); only the sections are settings
    return {k: v for k, v in saved.items() if isinstance(v, dict)}


def _refuse_changes(args, before, after, overrides: dict) -> None:
    """Raise ``ConfigError`` naming each flag given whose resolved value differs from the saved run's."""
    from bigmem.config.schema import to_dict

    differ = []
    if args.model is not None:
        name = Path(args.model).stem if args.model.endswith(".toml") else args.model
        if name != before.model.name:
            differ.append(("model.name", name, before.model.name))
    for section, values in overrides.items():
        for key in values:
            field = f"{section}.{key}"
            old, new = getattr(getattr(before, section), key), getattr(getattr(after, section), key)
            if field in CHANGEABLE_ON_RESUME or _same(field, old, new):
                continue
            differ.append((field, to_dict(new), to_dict(old)))
    if differ:
        changes = "; ".join(f"{{{field}}} {_text(field, new)} (saved: {_text(field, old)})"
                            for field, new, old in differ)
        allowed = ", ".join(f"{{{field}}}" for field in CHANGEABLE_ON_RESUME)
        raise ConfigError(differ[0][0], f"Cannot resume {args.out!r} with settings that differ from the saved run: "
                                        f"{changes}. Only {allowed} may change when resuming: repeat the saved "
                                        "values (or leave those flags out), or start a new run with another --out.")


def _same(field: str, old, new) -> bool:
    if field == "data.store" and old is not None and new is not None:  # the same file, however it is spelled
        return Path(old).resolve() == Path(new).resolve()
    return old == new


def _text(field: str, value) -> str:
    if field == "data.shape":
        return "each case at its own shape" if value is None else ",".join(map(str, value))
    if value is None:
        return "none"
    if field.endswith("_bytes"):
        return format_bytes(value)
    return str(value)


def run(args) -> int:
    from bigmem.numa.apply import place

    config, out = resolve(args)
    place(config.numa.policy, config.numa.cpus, config.numa.threads)  # before TensorFlow or numpy start threads
    from bigmem.train.trainer import train

    result = train(config, out, resume=args.resume, verbose=getattr(args, "verbose", False), force=args.force)
    if result.interrupted_by is not None:
        return 128 + result.interrupted_by
    return 0
