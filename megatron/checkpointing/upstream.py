"""Read checkpoints written by upstream Megatron-DeepSpeed and by plain Megatron-LM into our full-state form.

Two layouts are recognised in a ``--load`` directory (neither has our ``megatron_meta.json`` / ``full_state.json``):

* Megatron-DeepSpeed: ``latest`` (DeepSpeed's tag) and/or ``latest_checkpointed_iteration.txt`` (Megatron's
  iteration) next to ``global_stepN/``, which holds ``mp_rank_XX_model_states.pt`` (weights under
  ``module`` without pipeline; with DeepSpeed's pipeline engine only the run's state) plus, under the pipeline
  engine, ``layer_XX-model_YY-model_states.pt`` (one file per pipeline layer and TP rank), plus ZeRO-0/1/2
  optimizer files ``zero_pp_rank_D_mp_rank_XX_optim_states.pt``.
* Plain Megatron: ``latest_checkpointed_iteration.txt`` next to ``iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt``
  (XX the TP rank, YYY the pipeline stage), the model as nested dicts under ``model``.

Everything becomes GPTModel's names (full_state.py), merged over TP and PP: the weights, the Adam moments where
the files map them to parameters (DeepSpeed ZeRO-1/2 ``param_slice_mappings``), the iteration, consumed samples, LR
position and RNG states. Upstream's fused QKV (this commit's ``ParallelAttention.forward``) is, on each TP rank,
all local queries, then all keys, then all values ``[Q | K | V]``; ours is per KV group ``[q_1 .. q_g, k, v]``:
``qkv_to_ours`` permutes each TP rank's rows (weights and Adam moments) before the TP merge.

Names (upstream -> ours; pipeline files drop the ``language_model.`` / ``encoder.layers.N.`` prefixes and number
layers by file): ``language_model.embedding.word_embeddings.weight`` -> ``embedding.word_embeddings.weight``,
``...position_embeddings.weight`` -> ``embedding.position_embeddings``, ``language_model.encoder.layers.N.X`` (or
``transformer.layers``) -> ``layers.N.X`` for ``input_layernorm``, ``self_attention.query_key_value``,
``self_attention.dense``, ``post_attention_layernorm``, ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``;
``encoder.final_layernorm`` -> ``final_layernorm``; ``language_model.output_layer.weight`` ->
``output_layer.linear.weight``.

Upstream's model files pickle Python objects (an ``argparse.Namespace``, its enums, numpy RNG state), which
``weights_only=True`` refuses: they are unpickled only with ``--trust-checkpoint``, and then with ``megatron.*``
classes replaced by inert placeholders (never resolved against this package, whose names overlap upstream's).
"""

from __future__ import annotations

import glob
import os
import pickle
import re
import types
from dataclasses import dataclass, field

import torch

from megatron.checkpointing.full_state import VOCAB_PARAMS, merge_tp
from megatron.checkpointing.safe_io import safe_load
from megatron.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's marker: the iteration number (or "release")
_MP_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_ITER_RANK = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
TRUST_HINT = "pass --trust-checkpoint to unpickle it if you trust where it came from"


@dataclass
class Found:
    kind: str  # "deepspeed" (Megatron-DeepSpeed global_stepN/), "universal" (DeepSpeed's ds_to_universal.py
    # output, upstream_universal.py) or "megatron" (iter_NNNNNNN/)
    path: str  # the iteration's directory
    iteration: int


@dataclass
class Converted:
    """An upstream checkpoint in our names, merged over TP/PP; vocabulary rows as upstream padded them."""
    weights: dict[str, torch.Tensor]
    padded_vocab_size: int
    model: dict  # our ModelConfig field names -> upstream's values (for the shape check)
    iteration: int
    consumed_samples: int
    lr_num_steps: int  # in iterations, as our scheduler counts (upstream counts samples)
    layout: dict  # tp, pp, dp, zero_stage of the writer
    moments: dict[str, dict[str, torch.Tensor]] | None = None
    optimizer_step: int = 0
    optimizer_note: str = ""
    rng_states: list = field(default_factory=list)  # per model-parallel rank (tp, pp): upstream's list over DP


# ----------------------------------------------------------------------------------------------- recognising
def find(load: str, universal: bool = False) -> Found | None:
    """The upstream checkpoint ``--load`` names, or None when the directory is not one (ours, empty, unknown).
    ``universal`` (--universal-checkpoint): the one ``latest_universal`` names, as upstream loads it."""
    if universal:
        from megatron.checkpointing import upstream_universal

        return upstream_universal.find(load)
    tag = _read(os.path.join(load, "latest"))
    if tag is not None:  # DeepSpeed's marker: upstream's global_stepN/ has no megatron_meta.json, ours has
        if "/" not in tag and _is_ds_dir(os.path.join(load, tag)):
            m = re.search(r"(\d+)$", tag)
            return Found("deepspeed", os.path.join(load, tag), int(m.group(1)) if m else 0)
        return None  # ours, or a broken marker that checkpoint.py names
    it = _read(os.path.join(load, TRACKER))
    if it is None:
        return None
    if it != "release" and not it.isdigit():
        raise CheckpointError(f"checkpoint marker {os.path.join(load, TRACKER)} holds {it[:40]!r}, not an iteration "
                              "number: write the iteration to resume (e.g. 1000) into it")
    ds = os.path.join(load, f"global_step{it}")
    if os.path.isfile(os.path.join(ds, "megatron_meta.json")):
        return None  # ours without its 'latest': checkpoint.py / preflight name that
    if _is_ds_dir(ds):
        return Found("deepspeed", ds, int(it) if it.isdigit() else 0)
    plain = os.path.join(load, "release" if it == "release" else f"iter_{int(it):07d}")
    if os.path.isdir(plain) and glob.glob(os.path.join(plain, "mp_rank_*", "model_optim_rng.pt")):
        return Found("megatron", plain, int(it) if it.isdigit() else 0)
    raise CheckpointError(f"checkpoint marker {os.path.join(load, TRACKER)} names iteration {it}, but neither "
                          f"{plain}/mp_rank_*/model_optim_rng.pt nor {ds}/mp_rank_*_model_states.pt exists: the "
                          "checkpoint is incomplete; write an iteration that was saved completely into the marker")


def _is_ds_dir(path: str) -> bool:
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "megatron_meta.json")):
        return False
    return any(_MP_FILE.match(f) or _LAYER_FILE.match(f) for f in os.listdir(path))


def _read(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint marker {path} is unreadable ({e})") from None


def has_unknown_content(load: str) -> str | None:
    """An entry that looks like checkpoint data in a directory without any marker we know (else None)."""
    for name in sorted(os.listdir(load)):
        full = os.path.join(load, name)
        if name.startswith(".") or ".tmp-" in name or ".old-" in name:
            continue
        if os.path.isdir(full) or name.endswith((".pt", ".pth", ".bin", ".safetensors", ".ckpt")):
            return name
    return None


# ----------------------------------------------------------------------------------------------- unpickling
class _Placeholder:
    """Stands in for an upstream ``megatron.*`` class (e.g. its ModelType enum) inside a trusted pickle."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state


# What upstream's pickles hold (args Namespace, numpy RNG state, torch tensors and dtypes, DeepSpeed's data classes,
# enums); even a trusted file gets nothing else (no os.system & co.): defence in depth.
_ALLOWED_MODULES = ("torch", "numpy", "collections", "argparse", "_codecs", "deepspeed", "enum", "datetime",
                    "pathlib")
_ALLOWED_BUILTINS = {"set", "frozenset", "slice", "complex", "range", "bytearray", "bytes", "int", "float", "str",
                     "bool", "list", "dict", "tuple", "object"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        root = module.split(".")[0]
        if root == "megatron":
            return type(name, (_Placeholder,), {"__module__": "upstream." + module})
        if (root in _ALLOWED_MODULES and root + ".hub" != module[:len(root) + 4]) or (
                module == "builtins" and name in _ALLOWED_BUILTINS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed even with --trust-checkpoint")


_PICKLE = types.ModuleType("upstream_pickle")
_PICKLE.Unpickler = _Unpickler
_PICKLE.load = pickle.load
_PICKLE.__name__ = "upstream_pickle"


def load_file(path: str, trust: bool):
    """A ``.pt`` file of an upstream checkpoint: weights_only first; pickled objects only with ``trust``."""
    try:
        return safe_load(path)
    except CheckpointError as e:
        if "disallowed global" not in str(e):
            raise
        if not trust:
            raise CheckpointError(f"checkpoint file {path} was pickled with Python objects (argparse.Namespace, ...) "
                                  f"that weights-only loading refuses; {TRUST_HINT}") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except Exception as e:  # noqa: BLE001 - any failure of a foreign pickle is a bad file, named in one line
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint file {path} could not be unpickled ({first})") from None


# ----------------------------------------------------------------------------------------------- names
_LAYER_NAME = re.compile(r"^(?:language_model\.)?(?:encoder|transformer)\.layers\.(\d+)\.(.+)$")
_PLAIN = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings",
    "language_model.encoder.final_layernorm.weight": "final_layernorm.weight",
    "language_model.encoder.final_layernorm.bias": "final_layernorm.bias",
    "language_model.transformer.final_layernorm.weight": "final_layernorm.weight",
    "language_model.transformer.final_layernorm.bias": "final_layernorm.bias",
    "language_model.output_layer.weight": "output_layer.linear.weight",
}


def our_name(name: str, layer_offset: int = 0) -> str | None:
    """GPTModel's name for an upstream GPTModel parameter (None: not a weight we keep, e.g. rotary buffers)."""
    if name in _PLAIN:
        return _PLAIN[name]
    m = _LAYER_NAME.match(name)
    if m:
        rest = m.group(2)
        if "rotary" in rest or rest.endswith("inv_freq"):
            return None
        return f"layers.{int(m.group(1)) + layer_offset}.{rest}"
    return None


def _pipe_roles(files: list[str]) -> dict[int, str]:
    """Pipeline layer index -> "embedding" / "layers.N" / "final_layernorm" / "output_layer", from the keys each
    ``layer_XX`` file holds (upstream's GPTModelPipe: embedding, the transformer layers, the final norm, the head)."""
    keys: dict[int, set[str]] = {}
    for f in files:
        idx = int(_LAYER_FILE.match(os.path.basename(f)).group(1))
        keys.setdefault(idx, set()).update(safe_load(f, mmap=True).keys())
    return roles_from_keys(keys)


def roles_from_keys(keys: dict[int, set[str]]) -> dict[int, str]:
    """Pipeline layer index -> role, from the parameter names (within the layer) each index holds."""
    roles, n = {}, 0
    for idx in sorted(keys):
        k = keys[idx]
        if "word_embeddings.weight" in k:
            roles[idx] = "embedding"
        elif any(x.startswith("self_attention.") for x in k):
            roles[idx], n = f"layers.{n}", n + 1
        elif k <= {"weight", "bias"} and n > 0:
            roles[idx] = "final_layernorm"
        elif any("weight" in x for x in k):
            roles[idx] = "output_layer"
    return roles


def pipe_name(name: str, roles: dict[int, str]) -> str | None:
    """Our name for a parameter of upstream's GPTModelPipe, file-local (``word_embeddings.weight`` in layer 1) or
    engine-level (``tied_modules.embed.word_embeddings.weight``, ``2.self_attention.dense.weight``)."""
    if name.startswith("tied_modules.embed."):
        rest = name[len("tied_modules.embed."):]
        return "embedding.position_embeddings" if rest == "position_embeddings.weight" else f"embedding.{rest}"
    m = re.match(r"^(\d+)\.(.+)$", name)
    if not m or int(m.group(1)) not in roles:
        return None
    role, rest = roles[int(m.group(1))], m.group(2)
    if role == "embedding":
        return "embedding.position_embeddings" if rest == "position_embeddings.weight" else f"embedding.{rest}"
    if role == "output_layer":
        return "output_layer.linear.weight"
    if "rotary" in rest or rest.endswith("inv_freq"):
        return None
    return f"{role}.{rest}"


def tp_split(name: str, swiglu: bool) -> tuple[int, int] | None:
    """(partition dim, stride) of a TP-sharded parameter under our names, as megatron/model builds them."""
    if name in VOCAB_PARAMS or re.search(r"(query_key_value|dense_h_to_4h)\.(weight|bias)$", name):
        return 0, 2 if swiglu and "dense_h_to_4h" in name else 1
    if re.search(r"(self_attention\.dense|dense_4h_to_h)\.weight$", name):
        return 1, 1
    return None


# ----------------------------------------------------------------------------------------------- reading
def read(found: Found, trust: bool, with_optimizer: bool = True) -> Converted:
    """The whole checkpoint ``found`` in our names (collective-free: every rank may call it)."""
    if found.kind == "deepspeed":
        return _read_deepspeed(found, trust, with_optimizer)
    if found.kind == "universal":
        from megatron.checkpointing import upstream_universal

        return upstream_universal.read(found, trust, with_optimizer)
    return _read_megatron(found, trust)


def header(found: Found, trust: bool) -> tuple[dict, int, int]:
    """(model fields, padded vocab size, TP size) from the first model file alone (the preflight check)."""
    a = first_args(found, trust)
    return model_fields(a), int(a["padded_vocab_size"]), int(a.get("tensor_model_parallel_size", 1))


def first_args(found: Found, trust: bool) -> dict:
    """Upstream's parsed flags (``args``) as a dict, from the first model file."""
    if found.kind in ("deepspeed", "universal"):
        names = sorted(f for f in os.listdir(found.path) if _MP_FILE.match(f))
        if not names:
            raise CheckpointError(f"checkpoint {found.path} has no mp_rank_XX_model_states.pt: the run's state is "
                                  "missing")
        path = os.path.join(found.path, names[0])
    else:
        path = os.path.join(found.path, sorted(d for d in os.listdir(found.path) if _ITER_RANK.match(d))[0],
                            "model_optim_rng.pt")
    return _args_of(load_file(path, trust), path)


def _args_of(state: dict, path: str) -> dict:
    args = state.get("args")
    if args is None:
        raise CheckpointError(f"checkpoint file {path} holds no 'args': neither upstream Megatron's (its "
                              "save_checkpoint stores them) nor a complete checkpoint of ours (megatron_meta.json is "
                              "missing beside it); point the marker at a complete checkpoint")
    return vars(args) if not isinstance(args, dict) else args


# Upstream variants this trainer does not implement: resuming them here would silently compute something else.
_UNSUPPORTED = {"squared_relu": "--squared-relu", "apply_residual_connection_post_layernorm":
                "--apply-residual-connection-post-layernorm", "num_experts": "--num-experts (MoE)",
                "rotary_percent": "--rotary-percent below 1"}


def model_fields(a: dict) -> dict:
    """Upstream's flags under our ModelConfig names (only those that decide shapes and arithmetic)."""
    for key, flag in _UNSUPPORTED.items():
        v = a.get(key)
        bad = (v not in (None, 1.0)) if key == "rotary_percent" else \
            any(n > 1 for n in (v if isinstance(v, (list, tuple)) else [v or 1])) if key == "num_experts" else bool(v)
        if bad:
            raise CheckpointError(f"upstream checkpoint trained with {flag} ({v}): this trainer has no such model; "
                                  "it cannot be resumed or converted here")
    rope = a.get("position_embedding_type") == "rope" or a.get("use_rotary_position_embeddings", False)
    return {
        "num_layers": a["num_layers"], "hidden_size": a["hidden_size"],
        "num_attention_heads": a["num_attention_heads"], "ffn_hidden_size": a.get("ffn_hidden_size"),
        "num_key_value_heads": a.get("num_key_value_heads") or a["num_attention_heads"],
        "max_position_embeddings": a.get("max_position_embeddings"),
        "make_vocab_size_divisible_by": a.get("make_vocab_size_divisible_by", 128),
        "normalization": a.get("normalization", "layernorm").lower(), "swiglu": bool(a.get("swiglu", False)),
        "openai_gelu": _tanh_gelu(a), "position_embedding_type": "rope" if rope else
        "learned_absolute", "untie_embeddings_and_output_weights": bool(a.get("untie_embeddings_and_output_weights")),
        "add_bias_linear": bool(a.get("add_bias_linear", True)),
        "layernorm_epsilon": float(a.get("layernorm_epsilon", 1e-5)),
    }


def qkv_to_ours(t: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """One TP rank's fused QKV rows (weight [rows, h] or bias [rows]) from upstream's [Q | K | V] (Q: ``heads``
    x ``head_dim`` rows, K and V: ``kv_heads`` x ``head_dim``) to ours, per KV group [q_1 .. q_g, k, v]."""
    rest = t.shape[1:]
    if t.shape[0] != (heads + 2 * kv_heads) * head_dim:
        raise CheckpointError(f"fused QKV has {t.shape[0]} rows on a TP rank, expected (heads {heads} + 2 x kv heads "
                              f"{kv_heads}) x head dim {head_dim}: a QKV layout this converter does not know")
    g = heads // kv_heads
    q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    q = q.reshape(kv_heads, g, head_dim, *rest)  # [nkv, g, d, (h)]
    k, v = k.reshape(kv_heads, 1, head_dim, *rest), v.reshape(kv_heads, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(t.shape)  # [nkv, g + 2, d, (h)] -> rows


def _local_heads(fields: dict, tp: int) -> tuple[int, int, int]:
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    if heads % tp or kv % tp:
        raise CheckpointError(f"upstream checkpoint: {heads} heads / {kv} KV heads do not split over TP {tp}")
    return heads // tp, kv // tp, fields["hidden_size"] // heads


def _tanh_gelu(a: dict) -> bool:
    """Upstream's MLP runs the tanh GeLU (our --openai-gelu) under --openai-gelu and also under its default
    --bias-gelu-fusion (``bias_gelu_impl`` is the tanh form); exact erf only with --no-bias-gelu-fusion/--onnx-safe."""
    if a.get("openai_gelu"):
        return True
    plain_gelu = not (a.get("onnx_safe") or a.get("swiglu") or a.get("squared_relu"))
    return bool(plain_gelu and a.get("bias_gelu_fusion", True) and a.get("add_bias_linear", True))


def merge_ranks(per_tp: list[dict[str, torch.Tensor]], fields: dict) -> dict[str, torch.Tensor]:
    """Our full tensors from upstream's per-TP-rank ones: QKV rows permuted on each rank, then merged over TP."""
    full = {}
    local = _local_heads(fields, len(per_tp))
    for name in per_tp[0]:
        split = tp_split(name, fields["swiglu"])
        shards = [qkv_to_ours(s[name], *local) if "query_key_value" in name else s[name] for s in per_tp]
        full[name] = merge_tp(shards, *split) if split else shards[0]
    return {k: v.detach().float().clone().contiguous() if v.is_floating_point() else v.clone()
            for k, v in full.items()}


def _read_deepspeed(found: Found, trust: bool, with_optimizer: bool) -> Converted:
    path = found.path
    mp_files = sorted((int(m.group(1)), f) for f in os.listdir(path) if (m := _MP_FILE.match(f)))
    if not mp_files:
        raise CheckpointError(f"checkpoint {path} has no mp_rank_XX_model_states.pt: the run's state is missing")
    states = {r: load_file(os.path.join(path, f), trust) for r, f in mp_files}  # pipeline: args/RNG only
    first_file, first = os.path.join(path, mp_files[0][1]), states[mp_files[0][0]]
    a = _args_of(first, first_file)
    tp, pp = int(a.get("tensor_model_parallel_size", 1)), int(a.get("pipeline_model_parallel_size", 1))
    fields = model_fields(a)
    layer_files = sorted(glob.glob(os.path.join(path, "layer_*-model_*-model_states.pt")))
    per_tp: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    roles: dict[int, str] = {}
    if layer_files:  # DeepSpeed's pipeline engine (upstream's default under --deepspeed, even at PP=1)
        roles = _pipe_roles(layer_files)
        for f in layer_files:
            m = _LAYER_FILE.match(os.path.basename(f))
            idx, rank = int(m.group(1)), int(m.group(2))
            for k, v in safe_load(f).items():
                name = pipe_name(f"{idx}.{k}", roles)
                if name is not None and torch.is_tensor(v):
                    per_tp[rank][name] = v
    else:
        if len(mp_files) != tp:
            raise CheckpointError(f"checkpoint {path} has {len(mp_files)} mp_rank_XX_model_states.pt files for "
                                  f"--tensor-model-parallel-size {tp}: the checkpoint is incomplete")
        for rank, fname in mp_files:
            module = states[rank].get("module")
            if not isinstance(module, dict):
                raise CheckpointError(f"checkpoint file {os.path.join(path, fname)} holds no 'module' weights")
            # state_dict_for_save_checkpoint nests {language_model: {embedding: .., encoder: ..}}: flatten it
            per_tp[rank] = {n: v for k, v in flatten(module).items()
                            if (n := our_name(k)) is not None and torch.is_tensor(v)}
    weights = merge_ranks(per_tp, fields)
    sched = first.get("lr_scheduler") or {}
    gbs = int(a["global_batch_size"])
    out = Converted(
        weights=weights, padded_vocab_size=int(a["padded_vocab_size"]), model=fields,
        iteration=int(first.get("iteration", found.iteration)),
        consumed_samples=int(a.get("consumed_train_samples", 0)),
        lr_num_steps=int(sched.get("num_steps", 0)) // gbs if sched else int(first.get("iteration", 0)),
        layout={"tp": tp, "pp": pp, "dp": int(a.get("data_parallel_size", 1)),
                "zero_stage": int(a.get("zero_stage", 0)) if a.get("deepspeed") else 0},
        rng_states=[list(states[r].get("rng_state") or []) for r, _ in mp_files])
    from megatron.checkpointing.upstream_moments import zero0_moments, zero12_moments

    if with_optimizer and not layer_files and not glob.glob(os.path.join(path, "*_optim_states.pt")):
        out.moments, out.optimizer_step, out.optimizer_note = zero0_moments(states, tp, fields, path)
    elif with_optimizer:
        shapes = {r: s.get("param_shapes") or [] for r, s in states.items()}
        out.moments, out.optimizer_step, out.optimizer_note = zero12_moments(path, tp, roles, fields, shapes)
    return out


def _read_megatron(found: Found, trust: bool) -> Converted:
    """Plain Megatron ``iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt``: weights; its optimizer keeps no parameter
    names (an index per Megatron param group), so Adam restarts."""
    ranks = {}
    for d in os.listdir(found.path):
        m = _ITER_RANK.match(d)
        if m and os.path.isfile(os.path.join(found.path, d, "model_optim_rng.pt")):
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(found.path, d, "model_optim_rng.pt")
    if not ranks:
        raise CheckpointError(f"{found.path} holds no mp_rank_XX[_YYY]/model_optim_rng.pt")
    states = {k: load_file(p, trust) for k, p in sorted(ranks.items())}
    first_path = ranks[min(ranks)]
    a = _args_of(states[min(ranks)], first_path)
    tp, pp = int(a.get("tensor_model_parallel_size", 1)), int(a.get("pipeline_model_parallel_size", 1))
    if len(ranks) != tp * pp:
        raise CheckpointError(f"{found.path} has {len(ranks)} mp_rank directories for TP {tp} x PP {pp}: incomplete")
    fields = model_fields(a)
    per_stage_layers = fields["num_layers"] // pp
    per_tp: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for (t, stage), state in states.items():
        model = state.get("model") or state.get("model0")
        if not isinstance(model, dict):
            raise CheckpointError(f"checkpoint file {ranks[(t, stage)]} holds no 'model' (a virtual-pipeline "
                                  "checkpoint? convert it with the same --virtual-pipeline layout first)")
        for k, v in flatten(model).items():
            if (n := our_name(k, stage * per_stage_layers)) is not None and torch.is_tensor(v):
                per_tp[t][n] = v
    weights = merge_ranks(per_tp, fields)
    first = states[min(ranks)]
    sched = first.get("opt_param_scheduler") or first.get("lr_scheduler") or {}
    gbs = int(a.get("global_batch_size") or 1)
    return Converted(
        weights=weights, padded_vocab_size=int(a["padded_vocab_size"]), model=fields,
        iteration=int(first.get("iteration", found.iteration)),
        consumed_samples=int(a.get("consumed_train_samples", 0)),
        lr_num_steps=int(sched.get("num_steps", 0)) // gbs if sched else int(first.get("iteration", 0)),
        layout={"tp": tp, "pp": pp, "dp": int(a.get("data_parallel_size", 1)), "zero_stage": 0},
        optimizer_note="a plain Megatron optimizer keeps no parameter names: Adam restarts",
        rng_states=[list(s.get("rng_state") or []) for _, s in sorted(states.items())])


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


# ----------------------------------------------------------------------------------------------- reporting
def describe(conv: Converted) -> str:
    lay = conv.layout
    return (f"TP {lay['tp']}, PP {lay['pp']}, DP {lay['dp']}, ZeRO-{lay['zero_stage']}, iteration {conv.iteration}, "
            f"consumed samples {conv.consumed_samples}")
