"""Pretrain a GPT (GPT-2 or Llama variant) with TP x PP x ZeRO-DP: Megatron-DeepSpeed's entry point.

    python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --micro-batch-size 2 --global-batch-size 8 --train-iters 100 --lr 1e-3 --mock-data --vocab-size 512
"""

import sys

from megatron.errors import ConfigError, run_cli


def model_provider(run, pstate):
    from megatron.model.gpt_model import GPTModel

    return GPTModel(run.model, tp=pstate.tp, sequence_parallel=run.parallel.sequence_parallel,
                    init_seed=run.training.seed)


def vocab_size(args) -> int:
    if args.demo_corpus:
        from megatron.data.demo_corpus import BYTE_VOCAB

        return BYTE_VOCAB
    if args.mock_data:
        if args.vocab_size is None:
            raise ConfigError("--mock-data needs --vocab-size (the null tokenizer's vocabulary)")
        return args.vocab_size
    raise ConfigError("no data source: pass --mock-data --vocab-size N or --demo-corpus")


def datasets_provider(args, run, num_samples):
    """(train, valid) datasets; every item is {"text": int64 array of seq_length + 1 tokens}."""
    seq, seed = run.model.seq_length, run.training.seed
    if args.demo_corpus:
        from megatron.data.demo_corpus import ByteWindowDataset

        return ByteWindowDataset(seq, seed, "train"), ByteWindowDataset(seq, seed, "valid")
    from megatron.data.mock_dataset import MockGPTDataset

    vocab = run.model.vocab_size
    return MockGPTDataset(num_samples[0], seq, vocab, seed), MockGPTDataset(max(1, num_samples[1]), seq, vocab,
                                                                            seed + 1)


def forward_step(model, batch):
    from megatron.training.step import gpt_forward_step

    return gpt_forward_step(model, batch)


def main(argv=None):
    from megatron.training.pretrain import Providers, pretrain

    pretrain(argv, Providers(model_provider, datasets_provider, forward_step, vocab_size))


if __name__ == "__main__":
    sys.exit(run_cli(main))
