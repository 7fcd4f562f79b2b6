"""``bigmem train``: train a 3D U-Net on whole volumes."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bigmem.cli.common import (
    PRESET_HELP, add_budget_flag, add_memory_flags, add_model_flags, add_numa_flags, budget_arguments, model_overrides,
    numa_overrides, resolve_with_shape,
)
from bigmem.config.schema import DataConfig
from bigmem.errors import DataError, UsageError
from bigmem.rundir import RunDir
from bigmem.units import parse_bytes

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
                    model_help=PRESET_HELP.replace("(default:", "or auto: the network bigmem plan --data configures "
                                                   "from --data's cases, at batch 2 unless --batch-size (default:"),
                    shape_help="crop (random offset) or pad every case to D,H,W, each a multiple of 2^depth "
                               "(default: each case whole at its own shape, padded to a multiple of 2^depth)")
    parser.add_argument("--plan", metavar="FILE",
                        help="train the experiment bigmem plan --data configured: its experiment.toml, or the "
                             "plan.json beside it (instead of --model); flags still override its settings")
    add_memory_flags(parser)
    add_numa_flags(parser)
    _add_data_parallel_flags(parser)
    _add_data_flags(parser)
    _add_optimisation_flags(parser)
    _add_run_flags(parser)
    parser.set_defaults(run=run)


def _add_data_parallel_flags(parser) -> None:
    """--strategy and what the data-parallel paths take; --memory-budget and --force (the pre-flight)."""
    dp = parser.add_argument_group("data parallel (the GPU baseline bigmem compares itself with)")
    dp.add_argument("--strategy", choices=["none", "mirrored", "multiworker", "per-node"],
                    help="none (default): whole volumes in this process; mirrored: tf.distribute.MirroredStrategy "
                         "on this host's GPUs; multiworker: MultiWorkerMirroredStrategy across hosts (TF_CONFIG); "
                         "per-node: one multiworker worker per NUMA node of this host, each bound to its node's "
                         "CPUs and memory and pre-flighted against its free memory; each takes --batch-size, so "
                         "the global batch is workers x --batch-size; worker 0 writes RUN_DIR")
    dp.add_argument("--workers-per-node", type=int, metavar="N",
                    help="with --strategy per-node: N workers on each node, its CPUs split between them (default 1)")
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


def _add_data_flags(parser) -> None:
    data = parser.add_argument_group("data")
    data.add_argument("--data", metavar="STORE.h5", help="HDF5 store to train on (default: synthetic phantoms)")
    data.add_argument("--holdout", type=int, metavar="N", help="keep the last N cases out of training")
    data.add_argument("--fold", metavar="K",
                      help="train nnU-Net v2's cross-validation fold K (0..4): its train cases train and its val "
                           "cases are held out (--val-every validates on them); 'all' trains on every case and "
                           "validates on every case, as nnU-Net does. The folds are those of --splits, else of a "
                           "splits_final.json beside the store, else nnU-Net's own 5-fold split of the sorted case "
                           "ids (KFold, seed 12345): the same cases land in the same folds. RUN_DIR/splits_final.json "
                           "keeps the folds used")
    data.add_argument("--splits", metavar="FILE",
                      help="with --fold: nnU-Net's splits_final.json to take the folds from (a list of "
                           '{"train": [case ids], "val": [case ids]}), used as it is')
    data.add_argument("--pad-multiple", type=int, metavar="N",
                      help="pad each case's axes up to a multiple of N (a multiple of 2^depth; default 2^depth): a "
                           "store of many shapes then compiles the step for fewer of them, for a little more padding")
    data.add_argument("--augment", choices=["nnunet", "spatial", "intensity", "light", "none"],
                      help="training augmentation: nnunet (nnU-Net v2's default: rotation and scaling in one "
                           "resampling, noise, blur, brightness, contrast, low resolution, gamma, mirroring), spatial "
                           "or intensity (its spatial or its intensity transforms alone), light (mirroring and an "
                           "intensity scale/shift) or none (default: the recipe's: nnunet with --data, light on the "
                           "synthetic set); validation and predict apply none")
    data.add_argument("--num-workers", type=int, metavar="N",
                      help="reader processes (0: read in the training process; default 0)")
    data.add_argument("--prefetch", type=int, metavar="N",
                      help=f"batches prepared ahead of the step (default {DataConfig.prefetch})")
    data.add_argument("--cold-cache", action="store_true", default=None,
                      help="drop the store's pages from the page cache after every read (posix_fadvise DONTNEED), "
                           "so training reads from disk as it would for a dataset larger than RAM")


def _add_optimisation_flags(parser) -> None:
    opt = parser.add_argument_group("optimisation")
    length = opt.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, metavar="K", help="number of training steps")
    length.add_argument("--epochs", type=int, metavar="E", help="number of passes over the cases")
    opt.add_argument("--time-budget", type=float, metavar="S", help="stop after S seconds of training (a checkpoint "
                                                                     "and model.keras are written)")
    opt.add_argument("--lr", type=float, metavar="X", help="peak learning rate (after linear warmup)")
    opt.add_argument("--warmup-steps", type=int, metavar="K", help="linear warmup length in steps")
    opt.add_argument("--weight-decay", type=float, metavar="X",
                     help="L2 weight decay added to the gradients, as PyTorch's SGD applies it (0: off; default: the "
                          "recipe's, 3e-5 under nnunet)")
    opt.add_argument("--clip-norm", type=float, metavar="X",
                     help="clip the gradients to this global norm (default: the recipe's, 12 under nnunet)")
    opt.add_argument("--seed", type=int, metavar="S", help="seed for weights, case order and augmentation")


def _add_run_flags(parser) -> None:
    run_group = parser.add_argument_group("run directory")
    run_group.add_argument("--out", metavar="RUN_DIR",
                           help="where config.json, metrics.jsonl, checkpoints/ and model.keras go "
                                "(default: runs/<preset>-<date>-<time>)")
    run_group.add_argument("--config", metavar="CONFIG.json",
                           help="train exactly this resolved configuration (a run's config.json) instead of a "
                                "preset and flags; no other setting may be given with it (the per-node launcher "
                                "starts its workers this way)")
    run_group.add_argument("--resume", action="store_true",
                           help="continue RUN_DIR from its newest checkpoint that loads (a damaged one is skipped "
                                "and kept aside); a finished run is left as it is")
    run_group.add_argument("--checkpoint-every", type=int, metavar="K", help="steps between checkpoints")
    run_group.add_argument("--val-every", type=int, metavar="K",
                           help="every K steps and at the end, segment the --holdout (or --fold) cases whole (as "
                                "bigmem predict does) and log their Dice (val_dice, per class) to metrics.jsonl, "
                                "summary.json and TensorBoard; the best model is kept as checkpoints/best (bigmem "
                                "predict --checkpoint best)")
    run_group.add_argument("--monitor-interval", type=float, metavar="S",
                           help="seconds between rows of RUN_DIR/monitor.csv (CPU, memory, page cache, disk, NUMA "
                                "nodes, GPUs; default 1; 0 turns the monitor off)")
    run_group.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                           help="on this machine's first run in a precision, time the network's kernel choices "
                                "and measure the framework's fixed memory at the run's shape (bigmem tune, about a "
                                "minute, cached in ~/.cache/bigmem/tuning) before planning; --no-tune (or "
                                "BIGMEM_NO_TUNE=1) keeps the shipped tables (default: on)")


def _overrides(args) -> dict:
    """Only the flags the user gave (argparse defaults are None), as config sections."""
    budget = budget_arguments(args)[0]
    sections = model_overrides(args)
    sections["data"].update(store=args.data, num_workers=args.num_workers, prefetch=args.prefetch,
                            cold_cache=args.cold_cache, augment=args.augment)
    sections["numa"] = numa_overrides(args)
    gpu_memory = parse_bytes(args.gpu_memory, flag="--gpu-memory") if args.gpu_memory else None
    sections["data"].update(holdout=args.holdout, pad_multiple=args.pad_multiple, fold=args.fold, splits=args.splits)
    sections["distribute"] = dict(strategy=args.strategy, gpus=args.gpus, simulate_replicas=args.simulate_replicas,
                                  gpu_memory_bytes=gpu_memory, patch=args.patch)
    sections["memory"].update(budget_bytes=budget)
    sections["train"].update(steps=args.steps, epochs=args.epochs, lr=args.lr, warmup_steps=args.warmup_steps,
                             weight_decay=args.weight_decay, clip_norm=args.clip_norm,
                             seed=args.seed, checkpoint_every=args.checkpoint_every, val_every=args.val_every,
                             reference_batch=args.reference_batch, time_budget_s=args.time_budget,
                             monitor_interval_s=args.monitor_interval, tune=args.tune)
    given = {name: {k: v for k, v in values.items() if v is not None} for name, values in sections.items()}
    if args.steps is not None or args.epochs is not None:  # a length given replaces the preset's other one
        given["train"]["epochs" if args.steps is not None else "steps"] = None
    return given


def resolve(args):
    """The resolved ExperimentConfig and run directory for these arguments.

    With ``--resume`` the run's saved config.json is the base and the flags given must agree with
    it, except those in ``train.resume.CHANGEABLE_ON_RESUME`` (checked here, before TensorFlow
    starts, by ``train.resume.check_settings``); a directory where no run was started yet is
    started from the flags when they name a --model (the same command, plus --resume, works
    after a kill at any moment).

    Raises:
        UsageError: ``--resume`` without ``--out``; ``ConfigError`` naming every flag whose value
            differs from the saved run's.
        DataError: the store or the saved config.json cannot be read.
    """
    overrides = _overrides(args)
    if getattr(args, "config", None) is not None:
        return _given_config(args, overrides)
    if args.data is not None and not Path(args.data).exists():
        raise DataError(f"Cannot open store {args.data!r} (--data): no such file.")
    if args.splits is not None and not Path(args.splits).is_file():
        raise DataError(f"Cannot read splits file {args.splits!r} (--splits): no such file; expected nnU-Net's "
                        "splits_final.json.")
    if args.resume:
        if args.out is None:
            raise UsageError("--resume needs --out RUN_DIR: the run to continue.")
        from bigmem.train.resume import check_settings, saved_config, saved_settings

        run = RunDir(args.out)
        named = args.model if args.plan is None else args.plan
        saved = saved_settings(run, starting=named is not None)
        if saved is not None:
            before, after = saved_config(saved), saved_config(saved, overrides)
            given = [f"{section}.{key}" for section, values in overrides.items() for key in values]
            check_settings(run, before, after, given, model=named)
            return after, Path(args.out)
    config = resolve_with_shape(args, _preset(args), overrides)
    out = Path(args.out) if args.out else Path("runs") / f"{config.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return config, out


def _preset(args):
    """The preset to resolve (``bigmem.api.preset_for``): ``--plan``'s experiment.toml, ``--model auto``'s tables,
    ``--model``, or the default."""
    from bigmem.api import preset_for

    return preset_for(args.model, args.plan, store=args.data)


def _given_config(args, overrides: dict):
    """``--config CONFIG.json``: the resolved config as written (a run's config.json), and the run directory."""
    given = sorted(f"{section}.{key}" for section, values in overrides.items() for key, value in values.items()
                   if value is not None)
    if given or args.model is not None or args.plan is not None:
        from bigmem.cli.common import flag_for

        flags = ", ".join(["--model"] * (args.model is not None) + ["--plan"] * (args.plan is not None)
                          + [flag_for(field) for field in given])
        raise UsageError(f"--config {args.config} is a whole resolved configuration: leave out {flags}.")
    from bigmem.api import resolve_config

    config = resolve_config(config=args.config)
    out = Path(args.out) if args.out else Path("runs") / f"{config.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return config, out


def run(args) -> int:
    from bigmem.numa.apply import place

    if getattr(args, "strategy", None) == "per-node":
        return run_per_node(args)
    if getattr(args, "workers_per_node", None) is not None:
        raise UsageError("--workers-per-node is for --strategy per-node.")
    config, out = resolve(args)
    placement = place(config.numa.policy, config.numa.cpus, config.numa.threads)  # before TF or numpy start threads
    if placement.note:
        print(f"bigmem train: note: {placement.note}", file=sys.stderr)
    from rich.console import Console

    from bigmem import api

    result = api.train(config, out, resume=args.resume, verbose=getattr(args, "verbose", False), force=args.force,
                       console=Console(soft_wrap=True))
    if result.interrupted_by is not None:
        return 128 + result.interrupted_by
    return 0


def run_per_node(args, topology=None) -> int:
    """``--strategy per-node``: plan a worker per NUMA node, check each node's free memory, launch and supervise.

    Args:
        args: the parsed flags.
        topology: the machine's nodes (default: read from sysfs).

    Returns:
        0, or 128 + the signal that stopped the run.

    Raises:
        UsageError: ``--numa``/``--cpus`` given (each worker is placed on its node).
        InsufficientMemoryError: (exit 3) a node's free memory cannot hold its workers, unless ``--force``.
        WorkerFailed: a worker died (the others were stopped).
    """
    if args.numa is not None or args.cpus is not None:
        raise UsageError("--strategy per-node binds each worker to its own node's CPUs and memory: leave out "
                         "--numa and --cpus (--workers-per-node N splits each node's CPUs).")
    as_worker = argparse.Namespace(**{**vars(args), "strategy": "multiworker"})  # what each worker resolves
    config, out = resolve(as_worker)
    from bigmem import api

    return api.train_per_node(config, out, workers_per_node=args.workers_per_node or 1, resume=args.resume,
                              force=args.force, verbose=getattr(args, "verbose", False), topology=topology,
                              say=lambda line: print(f"bigmem train: {line}", file=sys.stderr),
                              announce=lambda line: print(line, flush=True))
