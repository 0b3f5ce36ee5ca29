"""The dry run's way in (``pretrain_gpt.py --dry-run``, tools/show_layout.py): the training flags turned into the same
validated RunConfig as training, for a world the flags name instead of the launcher's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron.arguments.configs import build_run_config
from megatron.arguments.checkpoint_args import take_checkpoint_args
from megatron.arguments.parser import given_dests, layout_flags, parse_args
from megatron.config import DataConfig, OptimizerConfig, RunConfig, TrainingConfig, named_model
from megatron.errors import ConfigError

GPT2_VOCAB = 50257
"""The dry run's vocabulary without --vocab-size or --model-size: GPT-2's, upstream's default tokenizer."""


@dataclass(frozen=True)
class DryRun:
    run: RunConfig
    ignored: tuple[str, ...]
    """Flags of the command line the layout does not depend on (learning rate, checkpoints, logs...)."""
    data: str = ""
    """What was checked of the data files (--data-path, or the per-split paths), one line; empty without them."""


def configure_dry_run(argv: list[str], ranks_per_node: int) -> DryRun:
    """The RunConfig of ``argv`` on --world-size ranks, or --nodes x ``ranks_per_node``. What only training needs may
    be left out and is not checked: the learning rate and the length of training (their defaults stand in), the
    data (the vocabulary is --vocab-size, else the named size's, else GPT-2's). Everything else is training's own
    path: flag classes and ranges, the DeepSpeed JSON merged in, RunConfig's validation. The data files given are
    opened and checked as training's preflight opens them."""
    args = parse_args(argv)
    if args.use_checkpoint_args:  # the model of --load's checkpoint, as training takes it
        take_checkpoint_args(args, given_dests(argv))
    world = _world_size(args, ranks_per_node)
    vocab = args.vocab_size or (named_model(args.model_size).vocab_size if args.model_size else GPT2_VOCAB)
    stand_ins = argparse.Namespace(**vars(args))
    if stand_ins.lr is None:
        stand_ins.lr = OptimizerConfig.lr
    if stand_ins.train_iters is None and stand_ins.train_samples is None:
        stand_ins.train_iters = TrainingConfig.train_iters
    run = build_run_config(stand_ins, world, vocab, DataConfig())
    known = layout_flags() | set(_DATA_FLAGS)
    ignored = sorted({a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in known})
    return DryRun(run, tuple(ignored), _check_data(args))


_DATA_FLAGS = {"--data-path": "data_path", "--train-data-path": "train_data_path",
               "--valid-data-path": "valid_data_path", "--test-data-path": "test_data_path"}


def _check_data(args: argparse.Namespace) -> str:
    """The data files training would open, checked as its preflight opens them; one line saying what was checked.
    The dry run builds no tokenizer: token ids are checked only where the flags alone give the vocabulary
    (--tokenizer-type NullTokenizer: --vocab-size ids and its end-of-document id)."""
    paths = {dest: tuple(getattr(args, dest)) for dest in _DATA_FLAGS.values() if getattr(args, dest)}
    if not paths:
        return ""
    from megatron.data.gpt_builder import check_data_files  # numpy and the index reader: only with data flags

    vocab = args.vocab_size + 1 if args.tokenizer_type == "NullTokenizer" and args.vocab_size else None
    n = check_data_files(DataConfig(**paths).validate(), vocab)
    ids = f", token ids < {vocab}" if vocab else ""
    return f"data: {n} file(s) checked (.bin/.idx header and sizes{ids})"


def _world_size(args: argparse.Namespace, ranks_per_node: int) -> int:
    if args.world_size is None and args.nodes is None:
        raise ConfigError("pass --world-size N (ranks) or --nodes N (8 GCDs each)")
    if args.world_size is not None and args.nodes is not None:
        raise ConfigError("--world-size and --nodes are both given: pick one")
    world = args.world_size if args.world_size is not None else args.nodes * ranks_per_node
    if world < 1:
        raise ConfigError(f"--world-size / --nodes must be positive, got {world}")
    return world
