"""The shape of megatron/checkpointing/ (issue 40): a short top level, parameter names written only in
megatron/model/param_names.py (and right: they are GPTModel's), and each checkpoint refusal written once."""

import ast
import collections
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron" / "checkpointing"
NAMES = ROOT / "megatron" / "model" / "param_names.py"

# Fragments of parameter names (ours, HF's, upstream's): a string holding one belongs in param_names.py.
NAME_FRAGMENTS = ("transformer.h.", "model.layers.", "gpt_neox.", "language_model", "input_layernorm",
                  "post_attention_layernorm", "query_key_value", "dense_h_to_4h", "dense_4h_to_h", "deepspeed_experts",
                  "deepspeed_moe", "block_sparse_moe", "embed_tokens", "lm_head", "word_embeddings.", "self_attention",
                  "self_attn", "final_layernorm", "output_layer", "tied_modules", "gate_proj", "o_proj", "c_attn")
# The converters and readers that name parameters: they take every name from param_names.py.
NAME_USERS = ("hf/dense.py", "hf/moe.py", "upstream/mapping.py", "upstream/reader.py", "upstream/moments.py",
              "upstream/universal.py", "upstream/writer.py", "upstream/writer_zero.py", "full_state/merge.py",
              "full_state/shard.py", "ds_layout/read.py")


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string constant of a module (f-string pieces included) except docstrings."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_top_level_holds_at_most_ten_modules():
    modules = sorted(p.name for p in PKG.glob("*.py"))
    assert len(modules) <= 10, modules
    subpackages = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    assert {"live", "ds_layout", "hzero", "full_state", "upstream", "hf"} <= set(subpackages), subpackages


def test_parameter_names_are_spelled_only_in_param_names():
    spelled = []
    for path in sorted(PKG.rglob("*.py")):
        for line, text in _strings(ast.parse(path.read_text())):
            spelled += [f"{path.relative_to(ROOT)}:{line}: {frag!r}" for frag in NAME_FRAGMENTS if frag in text]
    assert not spelled, "parameter names belong in megatron/model/param_names.py:\n" + "\n".join(spelled)
    for rel in NAME_USERS:
        tree = ast.parse((PKG / rel).read_text())
        imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "megatron.model.param_names" in imports, rel
    assert all(any(frag in text for _, text in _strings(ast.parse(NAMES.read_text())))
               for frag in ("transformer.h.", "model.layers.", "gpt_neox.", "language_model", "block_sparse_moe"))


@pytest.mark.parametrize("name", ["debug", "debug-llama"])
def test_our_names_are_gptmodels(name):
    """OURS names exactly the parameters GPTModel builds (per layer by role, and the top-level tensors)."""
    from megatron.config.sizes import named_model
    from megatron.core.parallel_state import single_process_state
    from megatron.model.gpt_model import GPTModel
    from megatron.model.param_names import OURS, VOCAB_PARAMS

    cfg = named_model(name, vocab_size=200, use_cpu_initialization=True)
    built = set(GPTModel(cfg, tp=single_process_state().tp, init_seed=1).state_dict())
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    norm_kinds = ("weight", "bias") if cfg.normalization == "layernorm" else ("weight",)
    named = {OURS.embedding, *(OURS.final(k) for k in norm_kinds)}
    named |= {OURS.position} if cfg.position_embedding_type == "learned_absolute" else set()
    named |= {OURS.head} if cfg.untie_embeddings_and_output_weights else set()
    for i in range(cfg.num_layers):
        named |= {OURS.at(i, role, k) for role in ("input_norm", "post_norm") for k in norm_kinds}
        named |= {OURS.at(i, role, k) for role in ("qkv", "attn_out", "fc1", "fc2") for k in kinds}
    assert built == named
    assert OURS.embedding in VOCAB_PARAMS and OURS.head in VOCAB_PARAMS


def _template(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def test_each_checkpoint_refusal_is_written_once():
    """A refusal (ConfigError) of the checkpoint code exists in one place; callers call it (support.py's table,
    resume_checks.py's checks)."""
    sites = collections.defaultdict(list)
    for path in sorted(PKG.rglob("*.py")) + [ROOT / "megatron" / "preflight" / "checkpoints.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args
                    and getattr(node.exc.func, "id", None) == "ConfigError"
                    and (text := _template(node.exc.args[0]))):
                sites[text].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not {t: w for t, w in sites.items() if len(w) > 1}
    source = "\n".join(p.read_text() for p in sorted((ROOT / "megatron").rglob("*.py")))
    assert source.count("--no-save-optim with --zero-stage 3") == 1
