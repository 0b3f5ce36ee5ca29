"""Named tiny runs for the tests, each defined once: model shapes (``Model``: CLI flags or a ModelConfig) and runs (a
shape plus its batch, length, data and logging flags, as a flag list to extend). Only runs that are really the same
are one entry; a test whose numbers depend on its exact flags has its own entry here."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Model:
    """A tiny GPT's shape."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int | None = None
    """None: the test gives it."""
    vocab_size: int | None = None
    """None: the test gives it (or the tokenizer does)."""
    divisible_by: int | None = None
    """--make-vocab-size-divisible-by (None: the default, 128)."""

    def flags(self) -> list[str]:
        out = ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size), "--num-attention-heads",
               str(self.num_attention_heads)]
        for flag, value in (("--seq-length", self.seq_length), ("--vocab-size", self.vocab_size),
                            ("--make-vocab-size-divisible-by", self.divisible_by)):
            if value is not None:
                out += [flag, str(value)]
        return out

    def config(self, **fields):
        """The ModelConfig of this shape; ``fields`` sets the rest (or overrides the shape's)."""
        from megatron.config import ModelConfig

        shape = {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                 "num_attention_heads": self.num_attention_heads, "seq_length": self.seq_length,
                 "vocab_size": self.vocab_size}
        if self.divisible_by is not None:
            shape["make_vocab_size_divisible_by"] = self.divisible_by
        return ModelConfig(**{**shape, **fields})


def replaced(flags: list[str], changes: dict[str, str]) -> list[str]:
    """``flags`` with the value after each flag named in ``changes`` replaced (each must be there)."""
    out = list(flags)
    for flag, value in changes.items():
        out[out.index(flag) + 1] = value
    return out


# --- shapes ---------------------------------------------------------------------------------------------------------
GPT_H64 = Model(2, 64, 4, 32)
"""The CLI and config tests' GPT."""
GPT_H32 = Model(2, 32, 4, 16)
"""The config unit tests' smallest GPT."""
GPT_H32_V200 = Model(2, 32, 4, 16, 200, 32)
"""The same with its vocabulary (200 tokens, padded to 224): the checkpoint, fault and campaign tests' GPT."""
GPT_L4 = Model(4, 64, 4, 32)
"""Four layers: room for MoE layers (--expert-interval 2) and pipeline stages."""
GPT_L1 = Model(1, 16, 2)
"""One layer, for tests of schedules and data that need the least model (they give the sequence length)."""

LLAMA = ["--normalization", "rmsnorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--num-key-value-heads", "2"]
"""The Llama variant's architecture flags (on any shape with heads divisible by 2)."""
TINY_MOE = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-experts", "4",
            "--expert-interval", "2", "--topk", "2", "--disable-moe-top2-2nd-expert-sampling",
            "--moe-train-capacity-factor", "2", "--moe-loss-coeff", "0.01", "--create-moe-param-group"]
"""The MoE model of the upstream MoE fixtures (tests/fixtures/upstream_ckpt/make_fixtures.sh: the same flags)."""

# --- runs ---------------------------------------------------------------------------------------------------------
TINY_GPT = GPT_H64.flags() + [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
    "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0", "--use-cpu-initialization",
    "--hidden-dropout", "0", "--attention-dropout", "0"]
"""pretrain_gpt.py as the CLI tests run it (tests/functional, tests/gpu): 10 iterations, dropout 0."""
CKPT_MODEL = GPT_H32_V200.flags() + ["--mock-data", "--log-interval", "1", "--eval-iters", "0",
                                     "--use-cpu-initialization", "--seed", "7", "--distributed-backend", "gloo"]
"""The checkpoint tests' GPT, logging, seed and backend, without batch sizes, learning rate or length (the ramp-up
tests take theirs from tests/fixtures/lr_schedule)."""
CKPT_GPT = CKPT_MODEL + ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters",
                         "1"]
"""The checkpoint and fault tests' run (no --train-iters: each test gives its length)."""
TINY_LLAMA = CKPT_GPT + LLAMA
"""The same run with the Llama architecture."""
CAMPAIGN_GPT = GPT_H32_V200.flags() + ["--max-position-embeddings", "16", "--eval-iters", "0",
                                       "--use-cpu-initialization", "--seed", "7", "--peak-tflops", "1",
                                       "--save-interval", "100000"]
"""What the campaign tests append to examples/frontier/smoke_1node.sbatch's flags (the script gives the rest)."""
SCHEDULE_GPT = replace(GPT_L1, vocab_size=64, divisible_by=16).flags() + [
    "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--use-cpu-initialization"]
"""The upstream LR-log comparison's run (tests/functional/test_lr_log_upstream.py: each case gives its batch, length
and schedule)."""
CONFIG_GPT = GPT_H32.flags() + ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
                                "--train-iters", "4", "--mock-data", "--vocab-size", "200"]
"""Flags that configure (parse and validate) without training: the config unit tests'."""
CONFIG_GPT_H64 = GPT_H64.flags() + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
                                    "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]
"""The same on the H64 shape (validation and preflight tests)."""
CONFIG_GPT_L4 = GPT_L4.flags() + ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
                                  "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]
"""The same on four layers (MoE and DeepSpeed JSON tests)."""
