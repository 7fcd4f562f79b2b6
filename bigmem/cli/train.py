"""``bigmem train``: train a 3D U-Net on whole volumes."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bigmem.cli.common import (
    add_budget_flag, add_memory_flags, add_model_flags, add_numa_flags, budget_arguments, model_overrides,
    numa_overrides,
)
from bigmem.errors import DataError, UsageError
from bigmem.rundir import RunDir
from bigmem.units import parse_bytes

HELP = "train a 3D U-Net on whole volumes"

DESCRIPTION = """\
Train a 3D U-Net on whole volumes held in RAM. With no --data, bigmem generates a synthetic
phantom dataset once (cached under ~/.cache/bigmem) and trains the 'small' preset on it.

Settings resolve in this order: built-in defaults, then the --model preset's file, then flags.
The resolved configuration is saved as RUN_DIR/config.json. Interrupt with Ctrl-C (or SIGTERM)
to write a checkpoint and stop; continue with --resume.
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("train", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser, volume_help="train on whole volumes cropped/padded to N^3; N must be a multiple of "
                                        "2^depth (default: the preset's)")
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
    run_group.add_argument("--resume", action="store_true", help="continue RUN_DIR from its newest checkpoint")
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
    sections["data"].update(holdout=args.holdout)
    sections["distribute"] = dict(strategy=args.strategy, gpus=args.gpus, simulate_replicas=args.simulate_replicas,
                                  gpu_memory_bytes=gpu_memory, patch=args.patch)
    sections["memory"].update(budget_bytes=budget)
    sections["train"].update(steps=args.steps, epochs=args.epochs, lr=args.lr, warmup_steps=args.warmup_steps,
                             seed=args.seed, checkpoint_every=args.checkpoint_every, val_every=args.val_every,
                             reference_batch=args.reference_batch, time_budget_s=args.time_budget,
                             monitor_interval_s=args.monitor_interval)
    return {name: {k: v for k, v in values.items() if v is not None} for name, values in sections.items()}


def resolve(args):
    """The resolved ExperimentConfig and run directory for these arguments."""
    from bigmem.config.presets import preset_names, resolve_config

    overrides = _overrides(args)
    if args.data is not None and not Path(args.data).exists():
        raise DataError(f"Cannot open store {args.data!r} (--data): no such file.")
    if args.resume:
        if args.out is None:
            raise UsageError("--resume needs --out RUN_DIR: the run to continue.")
        run = RunDir(args.out)
        if not run.config.exists():
            raise DataError(f"Cannot resume {args.out!r}: no config.json there (is it a bigmem run directory?).")
        if args.model is not None:
            raise UsageError("--model cannot change when resuming; the run keeps the model in its config.json.")
        saved = run.read_config()
        # config.json also records derived figures (total_steps, effective_lr); only the sections are settings
        saved = {k: v for k, v in saved.items() if isinstance(v, dict)}
        if overrides["train"].get("steps") is not None or overrides["train"].get("epochs") is not None:
            saved["train"] = {**saved.get("train", {}), "steps": None, "epochs": None}
        # the saved sections are complete; the preset only fills settings newer than the run
        preset = saved.get("model", {}).get("name")
        return resolve_config(preset if preset in preset_names() else "small", overrides, base=saved), Path(args.out)
    preset = args.model or "small"
    config = resolve_config(preset, overrides)
    out = Path(args.out) if args.out else Path("runs") / f"{config.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return config, out


def run(args) -> int:
    from bigmem.numa.apply import place

    config, out = resolve(args)
    place(config.numa.policy, config.numa.cpus, config.numa.threads)  # before TensorFlow or numpy start threads
    from bigmem.train.trainer import train

    result = train(config, out, resume=args.resume, verbose=getattr(args, "verbose", False), force=args.force)
    if result.interrupted_by is not None:
        return 128 + result.interrupted_by
    return 0
