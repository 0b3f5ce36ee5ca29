"""``--load`` of an upstream Megatron-DeepSpeed ``global_stepN/`` (or, with ``--universal-checkpoint``, DeepSpeed's
universal form of one) or plain Megatron ``iter_NNNNNNN/`` checkpoint: its preflight check (before any process
group) and its format (``UpstreamFormat``): the load into the model before deepspeed.initialize, then the engine's
LR position and Adam moments as after a full state's.

The checkpoint is read whole (reader.py: every TP/PP file, merged into our names), then each rank copies its
shard in, as for a full-state ``--load``; so any TP/PP/ZeRO layout here can resume it. Carried over: weights
(upstream's padded vocabulary rows too when the padded sizes agree), Adam moments (ZeRO-1/2 files), iteration,
consumed samples, LR position, and RNG states when this run's TP/PP/DP equal the writer's. Every rank reads every
file: for large models convert once with tools/convert_megatron_checkpoint.py and ``--load`` the full state.
"""

from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator

from megatron.checkpointing.full_state.format import FullStateFormat
from megatron.checkpointing.full_state.shard import load_into_model
from megatron.checkpointing.resume_checks import check_experts, check_model_shape
from megatron.checkpointing.state import Resume
from megatron.checkpointing.upstream.layout import Converted, Found, describe
from megatron.checkpointing.upstream.reader import header, read
from megatron.config import RunConfig
from megatron.core.parallel_state import ParallelState
from megatron.errors import CheckpointError
from megatron.model.param_names import VOCAB_PARAMS


def check_upstream(found: Found, settings, run) -> None:
    """Preflight of the upstream checkpoint ``found`` at ``--load``: this run can resume it (shapes checked from its
    first model file; its pickles need --trust-checkpoint), or one line saying why not."""
    _check(*header(found, settings.trust_checkpoint), run, settings.load)


def _check(fields: dict, padded_vocab: int, tp: int, run, where: str) -> None:
    check_model_shape(fields, run, where)
    check_experts(fields["moe"], run, where)  # the experts are read whole: any EP resumes them
    if fields["layernorm_epsilon"] != run.model.layernorm_epsilon:
        raise CheckpointError(f"--load {where}: upstream trained with --layernorm-epsilon {fields['layernorm_epsilon']}"
                              f", this run has {run.model.layernorm_epsilon}: pass the checkpoint's value")
    if run.model.padded_vocab_size(tp) != padded_vocab:
        raise CheckpointError(f"--load {where}: upstream padded its vocabulary to {padded_vocab} rows at TP {tp}; "
                              f"this run's vocabulary ({run.model.vocab_size} tokens, --make-vocab-size-divisible-by "
                              f"{run.model.make_vocab_size_divisible_by}) pads to {run.model.padded_vocab_size(tp)}: "
                              "use the tokenizer the checkpoint was trained with")


class UpstreamFormat(FullStateFormat):
    """``found``: the upstream checkpoint ``--load`` names (upstream.find's)."""

    def __init__(self, run: RunConfig, pstate: ParallelState, found: Found) -> None:
        super().__init__(run, pstate, found.path)
        self.found = found

    def load_into_model(self, model) -> None:
        """Before deepspeed.initialize: this rank's shard into ``model``; the Adam moments are kept for ``resume``."""
        self.loaded = load_upstream(self.found, model, self.run, self.pstate, self.run.checkpoint)


def load_upstream(found: Found, model, run, pstate, settings) -> Resume:
    """Before deepspeed.initialize: this rank's shard of the upstream checkpoint ``found`` into ``model``; a Resume
    with the Adam moments for the engine."""
    optim = not (settings.finetune or settings.no_load_optim)
    conv = read(found, settings.trust_checkpoint, with_optimizer=optim)
    _check(conv.model, conv.padded_vocab_size, conv.layout["tp"], run, settings.load)
    padded_here = run.model.padded_vocab_size(pstate.tp.size)
    weights = vocab_rows(conv, run.model.vocab_size, padded_here)
    if padded_here != conv.padded_vocab_size and pstate.global_rank == 0:
        print(f"> WARNING: this layout pads the vocabulary to {padded_here} rows, upstream to "
              f"{conv.padded_vocab_size}: padding rows enter the softmax, so the loss shifts slightly; keep "
              "--make-vocab-size-divisible-by x TP equal to resume upstream's loss exactly", flush=True)
    load_into_model(model, weights, run.model.num_layers, pstate.tp.size, pstate.tp.rank, found.path)
    if pstate.global_rank == 0:
        print(f"> upstream {found.kind} checkpoint {found.path}: {describe(conv)}"
              f"{'' if not optim else '; ' + (conv.optimizer_note or 'Adam moments loaded')}", flush=True)
    if settings.finetune:
        return Resume(0, 0, found.path)
    moments = (conv.moments, conv.optimizer_step) if optim and conv.moments else None
    return Resume(conv.iteration, conv.consumed_samples, found.path, conv.lr_num_steps,
                  rng=None if settings.no_load_rng else _rng(conv, pstate), moments=moments)


def _rng(conv: Converted, pstate) -> dict | None:
    """Upstream's RNG state for this rank when the layout is the writer's (states are per model-parallel rank)."""
    lay = conv.layout
    if (lay["tp"], lay["pp"], lay["dp"]) != (pstate.tp.size, pstate.pp.size, pstate.dp.size):
        return None
    rng = rng_for(conv, pstate.pp.rank * pstate.tp.size + pstate.tp.rank, pstate.dp.rank, pstate.dp.size)
    if rng is None:
        return None
    here = get_accelerator().get_rng_state()
    if rng["accelerator"].numel() != here.numel():  # e.g. written on CPU, resumed on a GPU: the forms differ
        return None
    tracker = rng["tracker"]
    if tracker and any(v.numel() != here.numel() for v in tracker.values()):
        return None
    return rng


def vocab_rows(conv: Converted, vocab_size: int, padded_here: int) -> dict[str, torch.Tensor]:
    """The weights with vocabulary rows fitted to this run: upstream's padded rows kept where the padded sizes
    agree (they take part in the softmax, so the loss is upstream's to the last digit), else cut to the vocab
    (then zero-padded by full_state.shard_like)."""
    keep = conv.padded_vocab_size if padded_here == conv.padded_vocab_size else vocab_size
    return {k: (v[:keep] if k in VOCAB_PARAMS else v) for k, v in conv.weights.items()}


def rng_for(conv: Converted, mp_index: int, dp_rank: int, dp_size: int) -> dict | None:
    """Our RNG-state dict (state.set_rng_state's form) from upstream's list for this model-parallel rank and DP
    rank; None when the layout changed or the checkpoint carries none."""
    if mp_index >= len(conv.rng_states):
        return None
    states = conv.rng_states[mp_index]
    if not states:
        return None
    s = states[dp_rank] if len(states) == dp_size else states[0] if len(states) == 1 else None
    if s is None:
        return None
    kind, keys, pos, has_gauss, gauss = s["np_rng_state"]
    return {"python": s["random_rng_state"],
            "numpy": {"kind": kind, "keys": torch.as_tensor(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "torch": s["torch_rng_state"], "accelerator": s["cuda_rng_state"],
            "tracker": dict(s.get("rng_tracker_states") or {})}
