"""Pretrain a GPT (GPT-2 or Llama variant) with TP x PP x ZeRO-DP: Megatron-DeepSpeed's entry point.

    python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 100 --lr 1e-3 --mock-data --vocab-size 512

Data: --data-path (Megatron .bin/.idx, blended by weight) with a --tokenizer-type (default GPT2BPETokenizer, as
upstream), or --mock-data, or
--demo-corpus (the embedded default corpus, byte tokens). --dry-run prints the layout and exits.
"""

import sys

from megatron.errors import ConfigError, run_cli


def model_provider(run, pstate):
    """GPTModelPipe (DeepSpeed's pipeline engine) when PP > 1, else the plain GPTModel (see gpt_model_pipe.py)."""
    if run.parallel.pp > 1:
        from megatron.model.gpt_model_pipe import GPTModelPipe

        return GPTModelPipe(run.model, pstate, sequence_parallel=run.parallel.sequence_parallel,
                            init_seed=run.training.seed)
    from megatron.model.gpt_model import GPTModel

    return GPTModel(run.model, tp=pstate.tp, sequence_parallel=run.parallel.sequence_parallel,
                    init_seed=run.training.seed, sp=pstate.sp)


def _tokenizer(args):
    from megatron.tokenizer import DEFAULT_TOKENIZER_TYPE, build_tokenizer

    if args.tokenizer_type is None:
        # Upstream's pretrain_gpt.py defaults to GPT-2 BPE; recorded in args so checkpoints name it too.
        missing = [flag for flag, v in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)) if not v]
        if missing:
            raise ConfigError(f"--data-path without --tokenizer-type uses {DEFAULT_TOKENIZER_TYPE} (upstream's "
                              f"default), which needs {' and '.join(missing)} (GPT-2's vocab.json / merges.txt); "
                              "or pass --tokenizer-type with its files")
        args.tokenizer_type = DEFAULT_TOKENIZER_TYPE
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)


def vocab_size(args) -> int:
    sources = [name for name, on in (("--data-path", args.data_path), ("--mock-data", args.mock_data),
                                     ("--demo-corpus", args.demo_corpus)) if on]
    if len(sources) > 1:
        raise ConfigError(f"{' and '.join(sources)} are all set: pick one data source")
    if args.data_path:
        return _tokenizer(args).vocab_size
    if args.demo_corpus:
        from megatron.data.demo_corpus import BYTE_VOCAB

        return BYTE_VOCAB
    if args.mock_data:
        if args.vocab_size is None:
            raise ConfigError("--mock-data needs --vocab-size (the null tokenizer's vocabulary)")
        return args.vocab_size
    raise ConfigError("no data source: pass --data-path PREFIX (with --vocab-file/--merge-file, or --tokenizer-type "
                      "and its files), --mock-data --vocab-size N, or --demo-corpus")


def eod_token(args) -> int | None:
    """The data's end-of-document token (--eod-mask-loss): the tokenizer's, or the demo corpus's byte EOD."""
    if args.data_path:
        return _tokenizer(args).eod
    if args.demo_corpus:
        from megatron.data.demo_corpus import BYTE_EOD

        return BYTE_EOD
    return None  # --mock-data: uniform random tokens, no documents


def datasets_provider(args, run, num_samples):
    """(train, valid, test) datasets for --split's three parts; every item is {"text": int64 array of
    seq_length + 1 tokens}. ``num_samples``: (train, valid, test) samples wanted; a split given none is None."""
    seq, seed = run.model.seq_length, run.training.seed
    if args.data_path:
        import deepspeed.comm as dist

        from megatron.data.gpt_builder import build_train_valid_test_datasets

        rank = dist.get_rank() if dist.is_initialized() else 0
        return build_train_valid_test_datasets(
            args.data_path, args.split, seq, seed, tuple(num_samples), args.data_cache_path,
            _tokenizer(args).vocab_size, barrier=dist.barrier if dist.is_initialized() else None,
            build_on_this_rank=rank == 0, log=lambda m: print(m, flush=True) if rank == 0 else None,
            per_epoch_order=args.per_epoch_doc_shuffle)
    if args.demo_corpus:
        from megatron.data.demo_corpus import ByteWindowDataset

        return ByteWindowDataset.splits(seq, seed, tuple(num_samples[1:]))
    from megatron.data.mock_dataset import MockGPTDataset

    vocab = run.model.vocab_size
    test = MockGPTDataset(num_samples[2], seq, vocab, seed + 2) if num_samples[2] > 0 else None
    return (MockGPTDataset(num_samples[0], seq, vocab, seed), MockGPTDataset(max(1, num_samples[1]), seq, vocab,
                                                                             seed + 1), test)


def forward_step(model, batch):
    from megatron.training.step import gpt_forward_step

    return gpt_forward_step(model, batch)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--dry-run" in argv:
        from tools.show_layout import main as show_layout

        return show_layout([a for a in argv if a != "--dry-run"])
    from megatron.training.pretrain import Providers, pretrain

    pretrain(argv, Providers(model_provider, datasets_provider, forward_step, vocab_size, eod_token))


if __name__ == "__main__":
    sys.exit(run_cli(main))
