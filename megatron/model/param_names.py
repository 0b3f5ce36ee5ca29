"""The one map of parameter names: ours (GPTModel's, the full state's), GPTModelPipe's, HF transformers' (GPT-2,
Llama, GPT-NeoX, Nemotron, Mixtral, Qwen2-MoE) and upstream Megatron-DeepSpeed's (model files, pipeline layer files,
experts).

Checkpoint readers, writers and converters (megatron/checkpointing/) take every name from here; the tensor
arithmetic (transposes, fused-QKV order, TP splits) stays theirs. A layer's tensors are named by role (``qkv``,
``fc1``...) so one loop maps any two namings: ``OURS.at(i, "qkv")`` is ``layers.i.self_attention.query_key_value
.weight``, ``HF_LLAMA.at(i, "q")`` is ``model.layers.i.self_attn.q_proj.weight``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from functools import partial

import torch

from megatron.errors import CheckpointError


@dataclass(frozen=True)
class Naming:
    """One naming of the GPT's tensors: the top-level ones, and per layer each role's module (``layer``: the layer's
    prefix, ``{i}`` its 0-based index; ``experts``: the module holding the experts, ``expert``: one expert's parts)."""
    embedding: str
    final_norm: str
    head: str
    layer: str
    roles: dict[str, str]
    position: str | None = None
    expert: dict[str, str] = field(default_factory=dict)

    def at(self, i: int, role: str, kind: str = "weight") -> str:
        """Layer ``i``'s ``role`` tensor (``kind``: weight or bias)."""
        return f"{self.layer.format(i=i)}{self.roles[role]}.{kind}"

    def in_layer(self, i: int):
        """``at`` with the layer fixed: ``names(role, kind="weight")``."""
        return partial(self.at, i)

    def final(self, kind: str = "weight") -> str:
        return f"{self.final_norm}.{kind}"

    def expert_at(self, i: int, e: int, part: str, kind: str = "weight") -> str:
        """Expert ``e``'s ``part`` (fc1 / fc2; HF: gate / up / fc2) in layer ``i``."""
        return f"{self.layer.format(i=i)}{self.roles['experts']}.{e}.{self.expert[part]}.{kind}"


# ------------------------------------------------------------------------------------------------ ours (GPTModel)
OURS = Naming(
    embedding="embedding.word_embeddings.weight", position="embedding.position_embeddings",
    final_norm="final_layernorm", head="output_layer.linear.weight", layer="layers.{i}.",
    roles={"input_norm": "input_layernorm", "qkv": "self_attention.query_key_value", "attn_out": "self_attention.dense",
           "post_norm": "post_attention_layernorm", "fc1": "mlp.dense_h_to_4h", "fc2": "mlp.dense_4h_to_h",
           "router": "mlp.deepspeed_moe.gate.wg", "experts": "mlp.deepspeed_moe.experts.deepspeed_experts"},
    expert={"fc1": "dense_h_to_4h", "fc2": "dense_4h_to_h"})
"""GPTModel's names: the canonical ones of every full state (megatron/model/gpt_model.py builds these modules)."""

VOCAB_PARAMS = (OURS.embedding, OURS.head)
"""Tensors with a row per vocabulary entry (padded by TP size in a model, unpadded in a full state)."""
_QKV = "query_key_value"
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def layer_index(name: str) -> int | None:
    """The layer one of our names belongs to (None: a top-level tensor)."""
    m = _OUR_LAYER.match(name)
    return int(m.group(1)) if m else None


def is_fused_qkv(name: str) -> bool:
    """Our fused QKV weight or bias (rows per KV group [q_1 .. q_g, k, v])."""
    return _QKV in name


def tp_split(name: str, swiglu: bool) -> tuple[int, int] | None:
    """(partition dim, stride) of a TP-sharded tensor under our names, as megatron/model builds them: QKV, fc1 and the
    vocabulary column-parallel (fc1 of SwiGLU in two stacked blocks), attention output and fc2 row-parallel."""
    column = f"({_QKV}|{OURS.expert['fc1']})"
    if name in VOCAB_PARAMS or re.search(rf"{column}\.(weight|bias)$", name):
        return 0, 2 if swiglu and OURS.expert["fc1"] in name else 1
    if re.search(rf"({re.escape(OURS.roles['attn_out'])}|{OURS.expert['fc2']})\.weight$", name):
        return 1, 1
    return None


# ------------------------------------------------------------------------------------------------ GPTModelPipe
_PIPE_TIED = "tied_modules.embed."
"""DeepSpeed's prefix of the tied embedding (first and last stage) in a pipeline engine's module."""


def canonical_name(name: str, num_layers: int) -> str | None:
    """GPTModel's name for a parameter of GPTModel or GPTModelPipe (None: not a stored weight). GPTModelPipe numbers
    its layers: 0 the embedding, 1..L the transformer layers, L+1 the final norm, then the output layer."""
    if name.startswith(_PIPE_TIED):
        name = "0." + name[len(_PIPE_TIED):]
    m = re.match(r"^(\d+)\.(.+)$", name)
    if not m:
        return name
    idx, rest = int(m.group(1)), m.group(2)
    if idx == 0:
        return None if rest.startswith("head.") else f"embedding.{rest}"
    if idx <= num_layers:
        return f"{OURS.layer.format(i=idx - 1)}{rest}"
    return f"{OURS.final_norm}.{rest}" if idx == num_layers + 1 else f"output_layer.{rest}"


# ------------------------------------------------------------------------------------------------ experts
_EXPERT = re.compile(rf"^(.*\.{OURS.roles['experts'].rsplit('.', 1)[1]}\.)(\d+)(\..+)$")
"""An expert parameter: (the layer's expert prefix, the expert index, the rest)."""


def expert_index(name: str) -> int | None:
    """The expert index a parameter name carries (local or global by context), None for non-expert parameters."""
    m = _EXPERT.match(name)
    return int(m.group(2)) if m else None


def with_expert(name: str, index: int) -> str:
    """``name`` with its expert index replaced by ``index``."""
    m = _EXPERT.match(name)
    return f"{m.group(1)}{index}{m.group(3)}"


def expert_layer_key(name: str) -> str | None:
    """The layer prefix of an expert parameter (the name up to its expert index), None for other parameters."""
    m = _EXPERT.match(name)
    return m.group(1) if m else None


def to_global(name: str, ep_rank: int, num_local: int) -> str:
    """A rank-local expert name under its global index (non-expert names unchanged)."""
    i = expert_index(name)
    return name if i is None else with_expert(name, ep_rank * num_local + i)


def experts_per_layer(names) -> dict[str, int]:
    """{layer prefix: experts named} over a set of global names."""
    seen: dict[str, set[int]] = {}
    for n in names:
        if m := _EXPERT.match(n):
            seen.setdefault(m.group(1), set()).add(int(m.group(2)))
    return {k: len(v) for k, v in seen.items()}


def expert_offsets(module: torch.nn.Module) -> dict[str, int]:
    """{parameter name: global index of its expert minus its local index} for this rank's expert parameters
    (megatron/model/moe.py's MoE: ``deepspeed_moe.ep`` is the EP group, ``num_local_experts`` its share)."""
    out = {}
    for n, m in module.named_modules():
        ep = getattr(getattr(m, "deepspeed_moe", None), "ep", None)
        if ep is None or not hasattr(m, "num_local_experts"):
            continue
        for pn, _ in m.deepspeed_moe.experts.named_parameters():
            out[f"{n}.deepspeed_moe.experts.{pn}" if n else f"deepspeed_moe.experts.{pn}"] = (
                ep.rank * m.num_local_experts)
    return out


def globalize(param_name: str, canonical: str, offsets: dict[str, int]) -> str:
    """The full-state name of a model parameter: ``canonical`` with a local expert index made global."""
    off = offsets.get(param_name)
    return canonical if off is None else with_expert(canonical, expert_index(canonical) + off)


# ------------------------------------------------------------------------------------------------ HF transformers
HF_GPT2 = Naming(
    embedding="transformer.wte.weight", position="transformer.wpe.weight", final_norm="transformer.ln_f",
    head="lm_head.weight", layer="transformer.h.{i}.",
    roles={"input_norm": "ln_1", "post_norm": "ln_2", "qkv": "attn.c_attn", "attn_out": "attn.c_proj",
           "fc1": "mlp.c_fc", "fc2": "mlp.c_proj"})
"""GPT2LMHeadModel (its Conv1D weights are stored [in, out])."""

HF_LLAMA = Naming(
    embedding="model.embed_tokens.weight", final_norm="model.norm", head="lm_head.weight", layer="model.layers.{i}.",
    roles={"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
           "k": "self_attn.k_proj", "v": "self_attn.v_proj", "attn_out": "self_attn.o_proj", "gate": "mlp.gate_proj",
           "up": "mlp.up_proj", "fc2": "mlp.down_proj"})
"""LlamaForCausalLM (our SwiGLU fc1 is [gate; up])."""

HF_NEOX = Naming(
    embedding="gpt_neox.embed_in.weight", final_norm="gpt_neox.final_layer_norm", head="lm_head.weight",
    layer="gpt_neox.layers.{i}.",
    roles={"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
           "qkv": "attention.query_key_value", "attn_out": "attention.dense", "fc1": "mlp.dense_h_to_4h",
           "fc2": "mlp.dense_4h_to_h"})
"""GPTNeoXForCausalLM (sequential residual; its QKV is ours for one query per KV head)."""
HF_NEOX_HEADS = (HF_NEOX.head, "embed_out.weight")
"""GPT-NeoX's untied output layer, as transformers writes it and as older exports (Pythia) name it."""

HF_MIXTRAL = dataclasses.replace(
    HF_LLAMA, roles={**HF_LLAMA.roles, "router": "block_sparse_moe.gate", "experts": "block_sparse_moe.experts"},
    expert={"gate": "w1", "up": "w3", "fc2": "w2"})
"""MixtralForCausalLM: every layer's MLP a MoE block; an expert's (gate, up, down) are w1, w3, w2."""

HF_QWEN2_MOE = dataclasses.replace(
    HF_LLAMA, roles={**HF_LLAMA.roles, "router": "mlp.gate", "experts": "mlp.experts",
                     "shared_gate": "mlp.shared_expert.gate_proj", "shared_up": "mlp.shared_expert.up_proj",
                     "shared_down": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate"},
    expert={"gate": "gate_proj", "up": "up_proj", "fc2": "down_proj"})
"""Qwen2MoeForCausalLM: MoE layers' experts under mlp., plus the shared expert and its gate."""

HF_NEMOTRON = dataclasses.replace(
    HF_LLAMA, roles={**{k: v for k, v in HF_LLAMA.roles.items() if k not in ("gate", "up")}, "fc1": "mlp.up_proj"})
"""NemotronForCausalLM: Llama's names, a plain MLP (up_proj, down_proj) and LayerNorms with biases."""

HF = {"gpt2": HF_GPT2, "llama": HF_LLAMA, "gpt_neox": HF_NEOX, "mixtral": HF_MIXTRAL, "qwen2_moe": HF_QWEN2_MOE,
      "nemotron": HF_NEMOTRON}
"""HF ``model_type`` -> its naming."""


# ------------------------------------------------------------------------------------------------ upstream
# Megatron-DeepSpeed's GPTModel nests its state dict as {language_model: {embedding: .., encoder: .., output_layer:
# ..}}; flattened, a layer is ``language_model.encoder.layers.N.<our name within the layer>``.
_UP_LM = "language_model"
_UP_ENCODER = f"{_UP_LM}.encoder."
_UP_TOP = {OURS.embedding: f"{_UP_LM}.embedding.word_embeddings.weight",
           OURS.position: f"{_UP_LM}.embedding.position_embeddings.weight",
           OURS.head: f"{_UP_LM}.output_layer.weight"}
_UP_READ = {**{v: k for k, v in _UP_TOP.items()},
            **{f"{_UP_LM}.{part}.{OURS.final(kind)}": OURS.final(kind)
               for part in ("encoder", "transformer") for kind in ("weight", "bias")}}
_UP_LAYER = re.compile(rf"^(?:{_UP_LM}\.)?(?:encoder|transformer)\.layers\.(\d+)\.(.+)$")


def _no_buffer(rest: str) -> bool:
    """Upstream keeps rotary buffers in its state dict: not weights."""
    return "rotary" not in rest and not rest.endswith("inv_freq")


def from_upstream(name: str, layer_offset: int = 0) -> str | None:
    """Our name for an upstream GPTModel parameter, flattened (None: not a weight we keep). ``layer_offset``: the
    first layer of a plain Megatron pipeline stage, whose files number layers from 0."""
    if name in _UP_READ:
        return _UP_READ[name]
    m = _UP_LAYER.match(name)
    if m and _no_buffer(m.group(2)):
        return f"{OURS.layer.format(i=int(m.group(1)) + layer_offset)}{m.group(2)}"
    return None


def upstream_flat(name: str) -> str:
    """Upstream's flat name of one of ours (its optimizer files', param_shapes' and expert files' keys)."""
    return _UP_TOP.get(name) or f"{_UP_ENCODER}{name}"


def upstream_nested(name: str) -> tuple[str, ...]:
    """Where one of our full-state names sits in upstream's nested ``module``: (nesting keys..., leaf key)."""
    if name in _UP_TOP:
        return tuple(_UP_TOP[name].split("."))
    if name.startswith(f"{OURS.final_norm}.") or _OUR_LAYER.match(name):
        return (_UP_LM, "encoder", name)
    raise CheckpointError(f"{name}: no place for it in upstream's GPT model")


_UP_IN_LAYER = [OURS.at(0, role, kind)[len("layers.0."):] for role in ("input_norm", "qkv", "attn_out", "post_norm",
                                                                       "fc1", "fc2") for kind in ("weight", "bias")]
_UP_IN_LAYER.append(OURS.at(0, "router")[len("layers.0."):])
_UP_IN_EXPERT = [f"{OURS.expert[p]}.{kind}" for p in ("fc1", "fc2") for kind in ("weight", "bias")]
_UP_TOP_ORDER = {OURS.embedding: (0, 0), OURS.position: (0, 1), OURS.final("weight"): (2, 0),
                 OURS.final("bias"): (2, 1), OURS.head: (3, 0)}
_UP_EXPERT = re.compile(rf"^{re.escape(OURS.roles['experts'])}\.(\d+)\.(.+)$")


def upstream_order(name: str) -> tuple:
    """Sort key: upstream's module order of one of our full-state names (embedding, layers, final norm, head)."""
    if name in _UP_TOP_ORDER:
        return (_UP_TOP_ORDER[name][0], 0, _UP_TOP_ORDER[name][1])
    m = _OUR_LAYER.match(name)
    if m:
        rest = m.group(2)
        if e := _UP_EXPERT.match(rest):
            return (1, int(m.group(1)), len(_UP_IN_LAYER), int(e.group(1)), _UP_IN_EXPERT.index(e.group(2)))
        if rest in _UP_IN_LAYER:
            return (1, int(m.group(1)), _UP_IN_LAYER.index(rest))
    raise CheckpointError(f"{name}: not a parameter of upstream's GPT model")


# Upstream's GPTModelPipe: tensors named by pipeline layer index, file-local in layer_XX files (``word_embeddings
# .weight``) or engine-level (``2.self_attention.dense.weight``, ``tied_modules.embed.word_embeddings.weight``).
_PIPE_WORD = "word_embeddings.weight"
_PIPE_POSITION = "position_embeddings.weight"
_PIPE_ATTENTION = OURS.roles["qkv"].split(".")[0] + "."


def is_pipeline_name(name: str) -> bool:
    """A name of a pipeline engine's module (by layer index or the tied embedding)."""
    return name.startswith("tied_modules.") or name[:1].isdigit()


def pipe_roles_from_keys(keys: dict[int, set[str]]) -> dict[int, str]:
    """Pipeline layer index -> "embedding" / "layers.N" / "final_layernorm" / "output_layer", from the parameter names
    (within the layer) each index holds: embedding, the transformer layers, the final norm, the head."""
    roles, n = {}, 0
    for idx in sorted(keys):
        k = keys[idx]
        if _PIPE_WORD in k:
            roles[idx] = "embedding"
        elif any(x.startswith(_PIPE_ATTENTION) for x in k):
            roles[idx], n = OURS.layer.format(i=n)[:-1], n + 1
        elif k <= {"weight", "bias"} and n > 0:
            roles[idx] = OURS.final_norm
        elif any("weight" in x for x in k):
            roles[idx] = "output_layer"
    return roles


def _pipe_embedding(rest: str) -> str:
    return OURS.position if rest == _PIPE_POSITION else f"embedding.{rest}"


def from_upstream_pipe(name: str, roles: dict[int, str]) -> str | None:
    """Our name for a parameter of upstream's GPTModelPipe (``roles``: ``pipe_roles_from_keys``'s)."""
    if name.startswith(_PIPE_TIED):
        return _pipe_embedding(name[len(_PIPE_TIED):])
    m = re.match(r"^(\d+)\.(.+)$", name)
    if not m or int(m.group(1)) not in roles:
        return None
    role, rest = roles[int(m.group(1))], m.group(2)
    if role == "embedding":
        return _pipe_embedding(rest)
    if role == "output_layer":
        return OURS.head
    if not _no_buffer(rest):
        return None
    return f"{role}.{rest}"
