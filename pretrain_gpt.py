"""Pretrain a GPT (GPT-2 or Llama variant) with TP x PP x ZeRO-DP: Megatron-DeepSpeed's entry point.

    python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 100 --lr 1e-3 --mock-data --vocab-size 512

Data: --data-path (Megatron .bin/.idx, blended by weight; or --train-data-path / --valid-data-path /
--test-data-path, one blend per split) with a --tokenizer-type (default GPT2BPETokenizer, as
upstream), or --mock-data, or --demo-corpus (the embedded default corpus, byte tokens). --dry-run prints the layout
and exits.
"""

import os
import sys

from megatron.arguments import configure
from megatron.config import DataConfig
from megatron.errors import ConfigError, run_cli
from megatron.tokenizer import FixedVocabulary, build_tokenizer
from megatron.topology import discover_ranks

# The model, data and training modules are imported where they are used: they bring torch and DeepSpeed, which
# --help, --dry-run and a refused flag (one line, on a login node) do not need.


def model_provider(run, pstate):
    """GPTModelPipe (DeepSpeed's pipeline engine) when PP > 1, else the plain GPTModel (see gpt_model_pipe.py)."""
    if run.parallel.pp > 1:
        from megatron.model.gpt_model_pipe import GPTModelPipe

        p = run.parallel  # the pipeline schedule's chunks per rank and deferred weight gradients
        return GPTModelPipe(run.model, pstate, sequence_parallel=p.sequence_parallel, init_seed=run.training.seed,
                            standalone_embedding_stage=p.standalone_embedding_stage,
                            virtual_stages=p.virtual_stages(run.model.num_layers),
                            defer_weight_grads=p.pipeline_schedule in ("zbh1", "zbh1-exact"))
    from megatron.model.gpt_model import GPTModel

    return GPTModel(run.model, tp=pstate.tp, sequence_parallel=run.parallel.sequence_parallel,
                    init_seed=run.training.seed, ulysses=pstate.ulysses, ep=pstate.ep)


def tokenizer_provider(data: DataConfig):
    """The data's tokenizer, built once (its files are opened here, before any process group)."""
    source = data.source()
    if source == "--demo-corpus":
        from megatron.data.demo_corpus import BYTE_EOD, BYTE_VOCAB

        return FixedVocabulary(BYTE_VOCAB, BYTE_EOD)
    if source == "--mock-data":
        if data.vocab_size is None:
            raise ConfigError("--mock-data needs --vocab-size (the null tokenizer's vocabulary)")
        return FixedVocabulary(data.vocab_size, None)  # uniform random tokens: no documents
    return build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                           tokenizer_model=data.tokenizer_model, vocab_size=data.vocab_size)


def datasets_provider(run, tokenizer, num_samples):
    """(train, valid, test) datasets: --split's three parts of --data-path, or the per-split paths' own; every item
    is {"text": int64 array of seq_length + 1 tokens}. ``num_samples``: (train, valid, test) samples wanted; a split
    given none (or, with per-split paths, no path) is None."""
    seq, seed, data = run.model.seq_length, run.training.seed, run.data
    if data.files:
        import deepspeed.comm as dist

        from megatron.data.gpt_builder import build_per_split_datasets, build_train_valid_test_datasets

        rank = dist.get_rank() if dist.is_initialized() else 0
        build, paths = ((build_per_split_datasets, data.split_paths()) if data.per_split else
                        (build_train_valid_test_datasets, data.data_path))
        return build(
            paths, data.split, seq, seed, tuple(num_samples), data.data_cache_path, tokenizer.vocab_size,
            barrier=dist.barrier if dist.is_initialized() else None, build_on_this_rank=rank == 0,
            log=lambda m: print(m, flush=True) if rank == 0 else None, per_epoch_order=data.per_epoch_doc_shuffle)
    if data.demo_corpus:
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


def pretrain_from_flags(argv: list[str], providers) -> dict:
    """The flags parsed once into a validated RunConfig (and the tokenizer built once), then ``pretrain``: the world
    size comes from the launcher's environment (Slurm, torchrun or MPI), never from the devices."""
    from megatron.training.pretrain import pretrain

    ranks = discover_ranks(os.environ)
    run, tokenizer = configure(argv, ranks.world_size, providers.tokenizer)
    return pretrain(run, tokenizer, providers, ranks)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--dry-run" in argv:
        from tools.show_layout import main as show_layout  # a tool of this checkout, not of the package

        return show_layout([a for a in argv if a != "--dry-run"])
    from megatron.training.pretrain import Providers

    pretrain_from_flags(argv, Providers(model_provider, datasets_provider, forward_step, tokenizer_provider))


if __name__ == "__main__":
    sys.exit(run_cli(main))
