"""Every flag of upstream Megatron-DeepSpeed's pretrain_gpt.py in exactly one class, as data.

- honoured: our parser defines the flag (megatron/arguments/parser.py) and it does here what it does upstream;
- no-op: provably without effect here (``NOOPS``); accepted and said once in the log. A no-op may hold only for
  some values (``NoOp.accepts``); other values are refused with ``NoOp.otherwise``;
- refused: one line before any process group, naming the flag and what to use instead (``REFUSALS``, or the
  whole upstream parser group in ``REFUSED_GROUPS``).

A no-op or refused flag given at upstream's default value is upstream's default behaviour, which is ours, so it is
accepted without a word (``--num-experts 1``, ``--DDP-impl local``). The flag list comes from upstream's own parser
(``upstream_flags.json``, written by ``tools/extract_upstream_flags.py``); ``tests/unit/test_compat_flags.py``
fails when a flag is in no class or in two.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from megatron.errors import ConfigError

HONOURED, NOOP, REFUSED = "honoured", "no-op", "refused"
_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_flags.json")
_DEST_PREFIX = "upstream__"
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class NoOp:
    why: str
    """Why the flag changes nothing here (printed once when it is given)."""
    accepts: Callable[[object, argparse.Namespace], bool] | None = None
    """The values (given the other flags) for which it is a no-op; None: every value."""
    otherwise: str = ""
    """The fix printed for the other values."""


@dataclass(frozen=True)
class Refused:
    instead: str
    """Why it is refused (the real reason: upstream refuses it too, another model, a library or hardware we lack, or
    arithmetic not built), then what to do instead; one line."""


_DS = "DeepSpeed's engine does data parallelism and the optimizer step here, as upstream under --deepspeed"
_KERNEL = "a kernel choice with the same arithmetic; megatron/kernels picks the fastest backend"
_PIPE = "Megatron's own pipeline schedule; pipelines run on DeepSpeed's engine here, as upstream under --deepspeed"
_NOT_GPT = "not used by GPT pretraining (upstream reads it only for BERT/T5/ICT models)"
_TUTEL = ("needs Tutel, a CUDA MoE kernel library not shipped here (the same gate and dispatch arithmetic runs in "
          "torch): drop the flag")
_FPDT = ("FPDT (DeepSpeed's fpdt_layer) needs the flash_attn CUDA package, not shipped here: drop the flag "
         "(DeepSpeed-Ulysses: --ds-sequence-parallel-size)")
_INDEX_FILES = ("explicit index-cache file names are not read: caches (upstream's included) are found through "
                "--data-cache-path")
_NEVER_READ = "upstream defines it and never reads it (at 4efb479d)"
_SWITCH = ("Megatron-LM's switch MLP (argmax routing without capacity or load-balancing loss) is not built: use "
           "--num-experts with --topk 1 (DeepSpeed-MoE)")


def _is_rope(args: argparse.Namespace) -> bool:
    return bool(args.use_rotary_position_embeddings or args.position_embedding_type == "rope")


def _flash(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "use_flash_attn_v2", False) or getattr(args, "use_flash_attn_triton", False)
                or getattr(args, _DEST_PREFIX + "use_flash_attn_builder", False))


def _kv_channels_is_head_dim(value, args: argparse.Namespace) -> bool:
    return (args.hidden_size is not None and args.num_attention_heads
            and value == args.hidden_size // args.num_attention_heads)


NOOPS: dict[str, NoOp] = {
    # kernels and fusions: same arithmetic, another kernel
    "--no-masked-softmax-fusion": NoOp(_KERNEL),
    "--no-gradient-accumulation-fusion": NoOp(_KERNEL),
    "--no-persist-layer-norm": NoOp(_KERNEL),
    "--disable-mem-efficient-ln": NoOp(_KERNEL),
    "--use-flash-attn-builder": NoOp(_KERNEL),
    "--no-async-tensor-model-parallel-allreduce": NoOp("upstream turns async TP all-reduce off under --deepspeed"),
    "--attention-softmax-in-fp32": NoOp("attention softmax is always computed in fp32 here (SDPA / flash kernels "
                                        "accumulate in fp32)"),
    "--no-query-key-layer-scaling": NoOp("query-key layer scaling divides by the layer number before the softmax and "
                                         "multiplies it back inside; with the fp32 softmax here it is the identity"),
    "--onnx-safe": NoOp("it only changes how GeLU is written for ONNX export", lambda v, a: not a.squared_relu,
                        "with --squared-relu upstream runs the erf GeLU instead of squared ReLU (its activation "
                        "order); drop one of them"),
    # data-parallel wrappers and Megatron's own optimizer plumbing, unused under DeepSpeed
    "--DDP-impl": NoOp(_DS),
    "--no-contiguous-buffers-in-local-ddp": NoOp(_DS),
    "--accumulate-allreduce-grads-in-fp32": NoOp(_DS + " (bf16 gradients accumulate in DeepSpeed's fp32 buffers)"),
    "--use-distributed-optimizer": NoOp(_DS + " (ZeRO shards the optimizer; Megatron's distributed optimizer is "
                                        "never built under --deepspeed)"),
    "--no-scatter-gather-tensors-in-pipeline": NoOp(_PIPE),
    "--use-ring-exchange-p2p": NoOp(_PIPE),
    "--overlap-p2p-communication": NoOp(_PIPE),
    "--empty-unused-memory-level": NoOp("it only returns cached allocator memory; no value changes the arithmetic"),
    "--zero-reduce-scatter": NoOp("upstream never reads it: the DeepSpeed JSON's zero_optimization section decides"),
    "--zero-contigious-gradients": NoOp("upstream never reads it: the DeepSpeed JSON's zero_optimization section "
                                        "decides"),
    "--zero-reduce-bucket-size": NoOp("upstream never reads it: set zero_optimization.reduce_bucket_size in the JSON"),
    "--zero-allgather-bucket-size": NoOp("upstream never reads it: set zero_optimization.allgather_bucket_size in "
                                         "the JSON"),
    "--use-pin-memory": NoOp("upstream never reads it: the JSON's offload sections decide pinning"),
    "--remote-device": NoOp("only 'none' (ZeRO-3 parameters stay on the device)", lambda v, a: v == "none",
                            "ZeRO-3 parameter offload through zero.Init(remote_device=...) is not built here: use "
                            "--remote-device none"),
    # data format and loading
    "--data-impl": NoOp("the memory-mapped .bin/.idx reader is the only one, as upstream's 'mmap' and 'infer'"),
    "--mmap-warmup": NoOp("it only pre-reads the memory map; the samples are the same"),
    "--no-load-lr-state": NoOp("upstream parses it and never reads it"),
    "--no-save-rng": NoOp("the RNG state is always saved; whether a resume uses it is --no-load-rng"),
    "--exit-signal-handler": NoOp("SIGTERM and SIGUSR1 always save a checkpoint and exit 0 here"),
    "--contigious-checkpointing": NoOp("it only packs DeepSpeed's checkpoint partitions into one buffer (allocator "
                                       "layout); each checkpointed input is its own tensor here"),
    "--split-transformers": NoOp("upstream only doubles the buffer count of DeepSpeed's contiguous checkpointing with "
                                 "it (allocator layout); each checkpointed input is its own tensor here"),
    "--memory-centric-tiled-linear": NoOp(_NEVER_READ),
    "--tile-factor": NoOp(_NEVER_READ),
    "--scattered-embeddings": NoOp(_NEVER_READ),
    "--ds_fused_adam": NoOp("the same AdamW update: torch's fused AdamW is used on every accelerator"),
    "--log-num-zeros-in-grad": NoOp("under --deepspeed upstream's train_step returns no count either (it comes only "
                                    "from Megatron's own optimizer)"),
    "--deepscale": NoOp("DeepSpeed is always used here (an old spelling of --deepspeed)"),
    # GPT needs none of these
    "--decoder-seq-length": NoOp(_NOT_GPT),
    "--retriever-seq-length": NoOp(_NOT_GPT),
    "--sample-rate": NoOp(_NOT_GPT),
    "--mask-prob": NoOp(_NOT_GPT),
    "--short-seq-prob": NoOp(_NOT_GPT),
    "--bert-no-binary-head": NoOp(_NOT_GPT),
    # conditional no-ops
    "--no-position-embedding": NoOp(
        "with rotary embeddings there is no learned position table (upstream drops it too)",
        lambda v, a: _is_rope(a),
        "a GPT without any position embedding is not built here: add --use-rotary-position-embeddings or drop "
        "--no-position-embedding"),
    # Upstream's per-document resets reach only what reads them: its RoPE is computed from the sequence length,
    # not from position_ids (language_model.py), and its flash-attention path is causal without a mask
    # (transformer.py); there the flags change nothing, elsewhere they are refused.
    "--reset-position-ids": NoOp(
        "with rotary embeddings upstream has no learned position table and its RoPE ignores position ids",
        lambda v, a: _is_rope(a),
        "per-document positions for learned position embeddings are not built here: use rotary embeddings "
        "(--use-rotary-position-embeddings, where upstream's flag has no effect) or drop --reset-position-ids"),
    "--reset-attention-mask": NoOp(
        "upstream's flash-attention path (--use-flash-attn-*) is causal and ignores the per-document mask",
        lambda v, a: _flash(a),
        "per-document attention masks are not built here (upstream applies them only without flash attention): "
        "drop --reset-attention-mask, or pass --use-flash-attn-v2 as upstream's Frontier scripts do"),
    "--kv-channels": NoOp(
        "it equals --hidden-size / --num-attention-heads, the head dim used here", _kv_channels_is_head_dim,
        "a head dim other than --hidden-size / --num-attention-heads is not built here: drop --kv-channels"),
}

REFUSALS: dict[str, Refused] = {
    # deprecated upstream too (upstream asserts)
    "--batch-size": Refused("deprecated, and upstream refuses it too: use --micro-batch-size"),
    "--warmup": Refused("deprecated, and upstream refuses it too: use --lr-warmup-fraction or --lr-warmup-iters"),
    "--model-parallel-size": Refused("deprecated, and upstream refuses it too: use --tensor-model-parallel-size"),
    # mixture of experts: the DeepSpeed-MoE flags are honoured (megatron/config/moe.py); these two are not
    "--num-experts-switch": Refused(_SWITCH),
    "--use-tutel": Refused(_TUTEL),
    # other arithmetic, not built
    "--fp16-lm-cross-entropy": Refused("a cross entropy over fp16 logits is not built (upstream allows it only with "
                                       "--fp16); the loss is computed in fp32 here: drop the flag"),
    "--data-parallel-random-init": Refused("other initial weights on each data-parallel replica are not built; every "
                                           "replica starts from the same weights here: drop the flag"),
    "--no-initialization": Refused("leaving the weights uninitialised is not built (a --load overwrites every weight "
                                   "anyway): drop the flag"),
    # other models and entry points than GPT pretraining
    "--decoder-num-layers": Refused("an encoder-decoder (T5) setting; GPT has one layer stack: use --num-layers"),
    "--pipeline-model-parallel-split-rank": Refused("an encoder-decoder (T5) pipeline split; GPT has no decoder: drop "
                                                    "the flag"),
    "--random-ltd": Refused("DeepSpeed's random layer-token drop (its data-efficiency library) is not wired into this "
                            "model: drop the flag"),
    "--ds-inference": Refused("upstream's DeepSpeed-inference text generation, not pretraining: drop the flag"),
    "--inference": Refused("upstream's text-generation mode, not pretraining: drop the flag"),
    "--lazy-mpu-init": Refused("for programs that call upstream's initialize_megatron and build the groups themselves; "
                               "pretrain_gpt.py builds them: drop the flag"),
    "--use-dataset-only": Refused("upstream's data-analysis mode (datasets without a model), not pretraining: build "
                                  "them with megatron.data or tools/ directly"),
    "--force-ds-sequence-parallel": Refused("DeepSpeed's sequence-parallel attention forced at sequence-parallel size "
                                            "1 is not built: drop the flag (DeepSpeed-Ulysses: "
                                            "--ds-sequence-parallel-size N > 1)"),
    "--ds-sequence-parallel-fpdt": Refused(_FPDT),
    "--ds-sequence-parallel-fpdt-chunk-size": Refused(_FPDT),
    "--ds-sequence-parallel-fpdt-offloading": Refused(_FPDT),
    # data
    "--aml-data-download-path": Refused("AzureML's dataset mount is not built: prefix each --data-path with the "
                                        "folder yourself (what upstream does with it)"),
    "--vocab-extra-ids": Refused("T5's sentinel tokens, not used by GPT: drop the flag"),
    "--train-data-exact-num-epochs": Refused("sizing the train split by an exact epoch count (upstream's data "
                                             "analysis) is not built: use --train-iters or --train-samples"),
    "--return-data-index": Refused("each sample's index in the batch (upstream's data analysis) is not built: drop "
                                   "the flag"),
    "--data-efficiency-curriculum-learning": Refused("DeepSpeed's data-efficiency curriculum is not wired into this "
                                                     "data pipeline: drop the flag"),
    "--train-idx-path": Refused(_INDEX_FILES),
    "--train-desc-path": Refused(_INDEX_FILES),
    "--train-doc-idx-path": Refused(_INDEX_FILES),
    "--train-sample-idx-path": Refused(_INDEX_FILES),
    "--train-shuffle-idx-path": Refused(_INDEX_FILES),
    "--repeated-dataloader": Refused("DeepSpeed's RepeatingLoader wrapper is not built: drop the flag"),
    "--trust-remote-code": Refused("it would run Python code from a tokenizer's directory, which this trainer never "
                                   "does (security): drop the flag"),
}

REFUSED_GROUPS: dict[str, str] = {
    "vision": "vision models, not GPT: drop the vision flags",
    "biencoder": "ICT/biencoder retrieval models, not GPT: drop the biencoder flags",
    "retro": "RETRO, a retrieval-augmented model other than GPT: drop the retro flags",
    "Knowledge distillation": "distillation from a teacher model is not built: drop the distillation flags",
    "inference": "upstream's text generation, not pretraining: drop the inference flags",
    "Transformer-Engine": "needs NVIDIA's Transformer Engine library, not shipped here, and fp8 matmuls, which the "
                          "MI250X lacks: drop the fp8 flags (use --bf16)",
    "autoresume": "ADLR autoresume is not built here: under Slurm the run saves and exits 0 before the job's end by "
                  "itself (--job-end-margin-secs), and examples/frontier's scripts submit the job that resumes it "
                  "(docs/campaigns.md)",
}


@functools.lru_cache(maxsize=1)
def upstream_flags() -> tuple[dict, ...]:
    with open(_DATA) as f:
        return tuple(json.load(f))


def defined_option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if not a.dest.startswith(_DEST_PREFIX)}


def rule(row: dict, ours: set[str]) -> list[tuple[str, object]]:
    """Every class ``row`` (an upstream flag) falls in; exactly one entry when the tables are right."""
    found = []
    if any(f in ours for f in row["flags"]):
        found.append((HONOURED, None))
    for f in row["flags"]:
        if f in NOOPS:
            found.append((NOOP, NOOPS[f]))
        if f in REFUSALS:
            found.append((REFUSED, REFUSALS[f]))
    if row["group"] in REFUSED_GROUPS and not found:
        # A whole group refused, but not a flag of it that we define: upstream files --no-data-sharding under
        # vision, yet its GPT data loader reads it.
        found.append((REFUSED, Refused(REFUSED_GROUPS[row["group"]])))
    return found


def add_upstream_flags(parser: argparse.ArgumentParser) -> None:
    """Let the parser accept every upstream flag it does not define, so apply() can classify what was given."""
    ours = defined_option_strings(parser)
    group = parser.add_argument_group("upstream Megatron-DeepSpeed flags accepted as no-ops or refused "
                                      "(megatron/compat/flags.py)")
    for row in upstream_flags():
        if any(f in ours for f in row["flags"]):
            continue
        kw = {"dest": _DEST_PREFIX + row["dest"], "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if row["action"] in ("store_true", "store_false"):
            kw["action"] = "store_const"
            kw["const"] = row["action"] == "store_true"
        else:
            if row["type"] in _TYPES:
                kw["type"] = _TYPES[row["type"]]
            if row["nargs"] is not None:
                kw["nargs"] = row["nargs"]
            if row["choices"]:
                kw["choices"] = row["choices"]
        group.add_argument(*row["flags"], **kw)


def apply(args: argparse.Namespace) -> list[str]:
    """Refuse what must be refused (ConfigError, one line); return one note per no-op that was given.
    The upstream-only attributes are removed from ``args``."""
    given = {k[len(_DEST_PREFIX):]: v for k, v in vars(args).items() if k.startswith(_DEST_PREFIX)}
    notes = _classify(given, args)  # the conditions may read other upstream-only flags: removed only after
    for k in list(vars(args)):
        if k.startswith(_DEST_PREFIX):
            delattr(args, k)
    return notes


def _classify(given: dict, args: argparse.Namespace) -> list[str]:
    if not given:
        return []
    by_dest = {row["dest"]: row for row in upstream_flags()}
    notes = []
    for dest, value in given.items():
        row = by_dest[dest]
        flag = row["flags"][0]
        if value == row["default"]:
            continue  # upstream's default behaviour, which is ours
        classes = [c for c in rule(row, set()) if c[0] != HONOURED]
        if not classes:
            raise ConfigError(f"{flag}: upstream Megatron-DeepSpeed flag with no class in megatron/compat/flags.py "
                              "(a bug: please report it)")
        kind, r = classes[0]
        if kind == REFUSED:
            raise ConfigError(f"{flag} is refused: {r.instead}")
        if r.accepts is not None and not r.accepts(value, args):
            shown = f"{flag} {value}" if row["action"] == "store" else flag
            raise ConfigError(f"{shown}: {r.otherwise}")
        notes.append(f"{flag} is accepted and has no effect here: {r.why}")
    return notes


REFUSED_CHOICES: dict[str, dict[str, str]] = {
    "--distributed-backend": {"hccl": "Habana Gaudi devices are not supported"},
}
"""Values of honoured flags that are refused (argparse names the flag and the valid choices in one line)."""


DEFAULT_DIFFERENCES: dict[str, str] = {
    "--normalization": "unset means layernorm, as upstream, unless --model-size names a variant with rmsnorm",
    "--micro-batch-size": "upstream requires the flag; here it defaults to 1",
    "--recompute-num-layers": "unset means every layer when recompute is on, as upstream's default of 1 layer per "
                              "uniform chunk",
    "--dataloader-type": "upstream's unset value becomes 'single' in its validate_args",
    "--distributed-backend": "unset means the accelerator's own: nccl (RCCL) on GPUs as upstream, gloo on CPU",
    "--num-workers": "0 loads in the training process; the worker count changes no sample or order",
    "--clip-grad": "unset means the JSON's gradient_clipping when it has one, else 1.0 as upstream",
    "--checkpoint-num-layers": "unset means 1, as upstream",
    "--initial-loss-scale": "unset means the JSON's fp16 value, else DeepSpeed's default, as upstream under "
                            "--deepspeed (upstream's flag default only reaches its non-DeepSpeed scaler)",
    "--min-loss-scale": "unset means the JSON's fp16 value, else DeepSpeed's default, as upstream under --deepspeed",
    "--loss-scale-window": "unset means the JSON's fp16 value, else DeepSpeed's default, as upstream under --deepspeed",
    "--hysteresis": "unset means the JSON's fp16 value, else DeepSpeed's default, as upstream under --deepspeed",
    "--zero-stage": "unset means the DeepSpeed JSON's stage (upstream reads the JSON too; its 1.0 only reaches "
                    "zero.Init)",
}
"""Honoured flags whose default differs from upstream's parser, and why the run is the same."""
