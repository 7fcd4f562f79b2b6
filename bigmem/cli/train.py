"""``bigmem train``: train a 3D U-Net on whole volumes."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bigmem.errors import DataError, UsageError

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
    data = parser.add_argument_group("data")
    data.add_argument("--data", metavar="STORE.h5", help="HDF5 store to train on (default: synthetic phantoms)")
    data.add_argument("--volume", type=int, metavar="N",
                      help="train on whole volumes cropped/padded to N^3; N must be a multiple of 2^depth "
                           "(default: the preset's)")
    data.add_argument("--num-workers", type=int, metavar="N",
                      help="reader processes (0: read in the training process; default 0)")
    data.add_argument("--prefetch", type=int, metavar="N", help="batches prepared ahead of the step (default 2)")
    model = parser.add_argument_group("model")
    model.add_argument("--model", metavar="PRESET", default=None,
                       help="preset name (tiny, small, intelai-brats, kits19) or a .toml file (default: small)")
    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--batch-size", type=int, metavar="B", help="volumes per step")
    length = opt.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, metavar="K", help="number of training steps")
    length.add_argument("--epochs", type=int, metavar="E", help="number of passes over the cases")
    opt.add_argument("--lr", type=float, metavar="X", help="peak learning rate (after linear warmup)")
    opt.add_argument("--warmup-steps", type=int, metavar="K", help="linear warmup length in steps")
    opt.add_argument("--optimizer", choices=["sgd", "adam"], help="SGD with Nesterov momentum, or Adam")
    opt.add_argument("--precision", choices=["fp32", "bf16"], help="fp32, or bf16 mixed precision (mixed_bfloat16)")
    opt.add_argument("--seed", type=int, metavar="S", help="seed for weights, case order and augmentation")
    run_group = parser.add_argument_group("run directory")
    run_group.add_argument("--out", metavar="RUN_DIR",
                           help="where config.json, metrics.jsonl, checkpoints/ and model.keras go "
                                "(default: runs/<preset>-<date>-<time>)")
    run_group.add_argument("--resume", action="store_true", help="continue RUN_DIR from its newest checkpoint")
    run_group.add_argument("--checkpoint-every", type=int, metavar="K", help="steps between checkpoints")
    parser.set_defaults(run=run)


def _overrides(args) -> dict:
    """Only the flags the user gave (argparse defaults are None), as config sections."""
    sections = {
        "data": {"store": args.data, "volume": args.volume, "num_workers": args.num_workers,
                 "prefetch": args.prefetch},
        "train": {"batch_size": args.batch_size, "steps": args.steps, "epochs": args.epochs, "lr": args.lr,
                  "warmup_steps": args.warmup_steps, "optimizer": args.optimizer, "precision": args.precision,
                  "seed": args.seed, "checkpoint_every": args.checkpoint_every},
    }
    return {name: {k: v for k, v in values.items() if v is not None} for name, values in sections.items()}


def resolve(args):
    """The resolved ExperimentConfig and run directory for these arguments."""
    from bigmem.config.presets import resolve_config
    from bigmem.config.schema import ExperimentConfig, update

    overrides = _overrides(args)
    if args.data is not None and not Path(args.data).exists():
        raise DataError(f"Cannot open store {args.data!r} (--data): no such file.")
    if args.resume:
        if args.out is None:
            raise UsageError("--resume needs --out RUN_DIR: the run to continue.")
        saved_path = Path(args.out) / "config.json"
        if not saved_path.exists():
            raise DataError(f"Cannot resume {args.out!r}: no config.json there (is it a bigmem run directory?).")
        if args.model is not None:
            raise UsageError("--model cannot change when resuming; the run keeps the model in its config.json.")
        saved = json.loads(saved_path.read_text())
        saved.pop("total_steps", None)
        if overrides["train"].get("steps") is not None or overrides["train"].get("epochs") is not None:
            saved["train"]["steps"] = saved["train"]["epochs"] = None
        config = ExperimentConfig.from_dict(saved, source=str(saved_path))
        update(config, {k: v for k, v in overrides.items() if v}, source="flags")
        config.validate()
        return config, Path(args.out)
    preset = args.model or "small"
    config = resolve_config(preset, overrides)
    out = Path(args.out) if args.out else Path("runs") / f"{config.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return config, out


def run(args) -> int:
    from bigmem.train.trainer import train

    config, out = resolve(args)
    result = train(config, out, resume=args.resume, verbose=getattr(args, "verbose", False))
    if result.interrupted_by is not None:
        return 128 + result.interrupted_by
    return 0
