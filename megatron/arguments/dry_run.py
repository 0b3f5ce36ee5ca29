"""The dry run's way in (``pretrain_gpt.py --dry-run``, tools/show_layout.py): the training flags turned into the same
validated RunConfig as training, for a world the flags name instead of the launcher's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron.arguments.configs import build_run_config
from megatron.arguments.parser import layout_flags, parse_args
from megatron.config import DataConfig, OptimizerConfig, RunConfig, TrainingConfig, named_model
from megatron.errors import ConfigError

GPT2_VOCAB = 50257
"""The dry run's vocabulary without --vocab-size or --model-size: GPT-2's, upstream's default tokenizer."""


@dataclass(frozen=True)
class DryRun:
    run: RunConfig
    ignored: tuple[str, ...]
    """Flags of the command line the layout does not depend on (learning rate, data, checkpoints, logs...)."""


def configure_dry_run(argv: list[str], ranks_per_node: int) -> DryRun:
    """The RunConfig of ``argv`` on --world-size ranks, or --nodes x ``ranks_per_node``. What only training needs may
    be left out and is not checked: the learning rate and the length of training (their defaults stand in), the
    data (the vocabulary is --vocab-size, else the named size's, else GPT-2's). Everything else is training's own
    path: flag classes and ranges, the DeepSpeed JSON merged in, RunConfig's validation."""
    args = parse_args(argv)
    world = _world_size(args, ranks_per_node)
    vocab = args.vocab_size or (named_model(args.model_size).vocab_size if args.model_size else GPT2_VOCAB)
    stand_ins = argparse.Namespace(**vars(args))
    if stand_ins.lr is None:
        stand_ins.lr = OptimizerConfig.lr
    if stand_ins.train_iters is None and stand_ins.train_samples is None:
        stand_ins.train_iters = TrainingConfig.train_iters
    run = build_run_config(stand_ins, world, vocab, DataConfig())
    known = layout_flags()
    ignored = sorted({a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in known})
    return DryRun(run, tuple(ignored))


def _world_size(args: argparse.Namespace, ranks_per_node: int) -> int:
    if args.world_size is None and args.nodes is None:
        raise ConfigError("pass --world-size N (ranks) or --nodes N (8 GCDs each)")
    if args.world_size is not None and args.nodes is not None:
        raise ConfigError("--world-size and --nodes are both given: pick one")
    world = args.world_size if args.world_size is not None else args.nodes * ranks_per_node
    if world < 1:
        raise ConfigError(f"--world-size / --nodes must be positive, got {world}")
    return world
