"""DeepSpeed universal checkpoints of upstream Megatron-DeepSpeed runs (``--universal-checkpoint``).

DeepSpeed's ``ds_to_universal.py`` turns a ``global_stepN/`` into ``global_stepN_universal/`` and writes its name
into ``latest_universal`` beside it. The folder holds the run's ``mp_rank_XX_model_states.pt`` (args, iteration,
LR position, RNG) and, per parameter under upstream's name, ``zero/NAME/{fp32,exp_avg,exp_avg_sq,step}.pt``: each
a dict with the whole tensor (``param``, merged over DP and TP) and how it was merged (``cat_dim``; no ``cat_dim``:
replicated over TP; ``param_n_sub_params`` 2: the two halves of a GLU weight merged separately;
``vocab_tensor``: vocabulary rows cut to the tokenizer's size).

Here the tensors are split back into the writer's TP shards and go through the same mapping as a ``global_stepN/``
(megatron/model/param_names.py: names; mapping.py: QKV order, TP merge in our layout), so any TP/PP/ZeRO layout can
resume them. Vocabulary rows beyond the tokenizer come back as zeros, as DeepSpeed's universal loader pads them.
"""

from __future__ import annotations

import os
import re

import torch

from megatron.checkpointing.live.safe_io import safe_load
from megatron.checkpointing.upstream.layout import MP_FILE, Converted, Found, is_ds_dir, read_marker
from megatron.checkpointing.upstream.mapping import merge_ranks, model_fields, pipe_final_norm_to_ours
from megatron.checkpointing.upstream.unpickle import args_of, load_file
from megatron.errors import CheckpointError
from megatron.model.param_names import from_upstream, from_upstream_pipe, is_pipeline_name, pipe_roles_from_keys

TRACKER = "latest_universal"
_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def find(load: str) -> Found:
    """The universal checkpoint that ``load``/latest_universal names (one line when there is none)."""
    tag = read_marker(os.path.join(load, TRACKER))
    if tag is None:
        raise CheckpointError(f"--universal-checkpoint: {load} has no '{TRACKER}' (DeepSpeed's ds_to_universal.py "
                              "writes it beside its output folder): convert global_stepN/ with it first, or drop "
                              "--universal-checkpoint to load 'latest'")
    path = os.path.join(load, tag)
    if "/" in tag or not os.path.isdir(os.path.join(path, "zero")) or not is_ds_dir(path):
        raise CheckpointError(f"{os.path.join(load, TRACKER)} names {tag!r}, but {path} is not a universal checkpoint "
                              "(zero/ and mp_rank_XX_model_states.pt): re-run ds_to_universal.py into it")
    m = re.search(r"(\d+)(?:_universal)?$", tag)
    return Found("universal", path, int(m.group(1)) if m else 0)


def tp_shards(d: dict, tp: int, padded_vocab: int, where: str) -> list[torch.Tensor]:
    """The writer's TP shards of one universal tensor file ``d``."""
    t = d["param"]
    if d.get("sub_param_shape") is not None:
        raise CheckpointError(f"{where}: a sub-parameter layout (sub_param_shape) this reader does not know; "
                              "convert with the DeepSpeed version upstream Megatron-DeepSpeed used")
    if d.get("vocab_tensor") and t.shape[0] < padded_vocab:  # zero rows up to upstream's padded vocabulary
        t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
    cat = d.get("cat_dim")
    if cat is None or tp == 1:
        return [t] * tp
    if d.get("param_n_sub_params") == 2:  # [all first halves | all second halves] -> rank i: [half0_i | half1_i]
        halves = [h.chunk(tp, dim=cat) for h in t.chunk(2, dim=cat)]
        return [torch.cat([halves[0][i], halves[1][i]], dim=cat) for i in range(tp)]
    if t.shape[cat] % tp:
        raise CheckpointError(f"{where}: {t.shape[cat]} entries along dim {cat} do not split over the writer's TP {tp}")
    return list(t.chunk(tp, dim=cat))


def _pipeline_roles(names: list[str]) -> dict[int, str]:
    keys: dict[int, set[str]] = {}
    for n in names:
        m = re.match(r"^(\d+)\.(.+)$", n)
        if m:
            keys.setdefault(int(m.group(1)), set()).add(m.group(2))
    return pipe_roles_from_keys(keys)


def read(found: Found, trust: bool, with_optimizer: bool) -> Converted:
    """The universal checkpoint ``found`` in our names, merged as a ``global_stepN/`` would be."""
    path, zero = found.path, os.path.join(found.path, "zero")
    mp_files = sorted((int(m.group(1)), f) for f in os.listdir(path) if (m := MP_FILE.match(f)))
    states = {r: load_file(os.path.join(path, f), trust) for r, f in mp_files}
    first = states[mp_files[0][0]]
    a = args_of(first, os.path.join(path, mp_files[0][1]))
    tp, pp = int(a.get("tensor_model_parallel_size", 1)), int(a.get("pipeline_model_parallel_size", 1))
    fields, padded_vocab = model_fields(a), int(a["padded_vocab_size"])
    names = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    pipeline = any(is_pipeline_name(n) for n in names)
    roles = _pipeline_roles(names) if pipeline else {}
    per_state = {s: [{} for _ in range(tp)] for s in _STATES}
    step, note = 0, "Adam moments loaded (universal checkpoint)"
    for n in names:
        ours = from_upstream_pipe(n, roles) if pipeline else from_upstream(n)
        if ours is None:
            continue
        for s in _STATES if with_optimizer else ("fp32",):
            f = os.path.join(zero, n, f"{s}.pt")
            if not os.path.isfile(f):
                if s == "fp32":
                    raise CheckpointError(f"universal checkpoint {path} lacks {f}: the conversion is incomplete; "
                                          "re-run ds_to_universal.py")
                note = f"universal checkpoint has no {s}.pt for {n}: Adam restarts"
                continue
            for i, shard in enumerate(tp_shards(safe_load(f), tp, padded_vocab, f)):
                per_state[s][i][ours] = shard
        if with_optimizer and os.path.isfile(os.path.join(zero, n, "step.pt")):
            step = int(torch.as_tensor(safe_load(os.path.join(zero, n, "step.pt"))).item())
    weights = merge_ranks(per_state["fp32"], fields)
    if pipeline:  # converted from the pipeline engine's checkpoint: its final norm is never 1p
        weights = pipe_final_norm_to_ours(weights, fields)
    moments = None
    if with_optimizer and note.startswith("Adam moments loaded"):
        moments = {}
        for s in ("exp_avg", "exp_avg_sq"):
            for name, t in merge_ranks(per_state[s], fields).items():
                moments.setdefault(name, {})[s] = t
    sched = first.get("lr_scheduler") or {}
    gbs = int(a["global_batch_size"])
    return Converted(
        weights=weights, padded_vocab_size=padded_vocab, model=fields,
        iteration=int(first.get("iteration", found.iteration)),
        consumed_samples=int(a.get("consumed_train_samples", 0)),
        lr_num_steps=int(sched.get("num_steps", 0)) // gbs if sched else int(first.get("iteration", 0)),
        layout={"tp": tp, "pp": pp, "dp": int(a.get("data_parallel_size", 1)),
                "zero_stage": int(a.get("zero_stage", 0)) if a.get("deepspeed") else 0, "ep": fields["moe"]["ep"]},
        moments=moments, optimizer_step=step if moments else 0,
        optimizer_note=note if with_optimizer else "",
        rng_states=[list(states[r].get("rng_state") or []) for r, _ in mp_files])
