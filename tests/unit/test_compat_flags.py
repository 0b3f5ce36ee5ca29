"""Every upstream Megatron-DeepSpeed flag is honoured, a no-op or refused (megatron/compat/flags.py), never a
fourth class; refused flags fail in one line, no-ops are said, upstream's defaults are kept."""

import argparse

import pytest

from megatron.arguments import build_parser, parse_args
from megatron.compat import flags as compat
from megatron.errors import ConfigError

_ACTION_CLASSES = {"store": argparse._StoreAction, "store_true": argparse._StoreTrueAction,
                   "store_false": argparse._StoreFalseAction}


def _ours() -> set[str]:
    return compat.defined_option_strings(build_parser())


def _sample(row: dict) -> list[str]:
    """Command-line words that give ``row``'s flag a value other than upstream's default."""
    if row["action"] != "store":
        return []
    if row["choices"]:
        return [str(next(c for c in row["choices"] if c != row["default"]))]
    value = {"int": "7", "float": "0.5", "bool": "1"}.get(row["type"], "x")
    return [value] * (2 if row["nargs"] in ("+", "*") else 1)


def test_every_upstream_flag_is_in_exactly_one_class():
    ours = _ours()
    rows = compat.upstream_flags()
    assert len(rows) > 300  # upstream's parser has 318 flags at 4efb479d: the data file is whole
    wrong = {row["flags"][0]: [c for c, _ in compat.rule(row, ours)] for row in rows}
    wrong = {flag: classes for flag, classes in wrong.items() if len(classes) != 1}
    assert not wrong, f"flags in no class or in several: {wrong}"


def test_issue_44_flags_are_honoured():
    """W&B, the per-split data paths and the checkpoint-argument flags (issue 44) are honoured, no longer refused."""
    ours = _ours()
    rows = {row["flags"][0]: row for row in compat.upstream_flags()}
    flags = ("--wandb-project", "--wandb-exp-name", "--wandb-save-dir", "--train-data-path", "--valid-data-path",
             "--test-data-path", "--use-checkpoint-args", "--load-tag")
    assert {f: compat.rule(rows[f], ours)[0][0] for f in flags} == dict.fromkeys(flags, compat.HONOURED)


def test_tables_name_only_upstream_flags():
    known = {f for row in compat.upstream_flags() for f in row["flags"]}
    groups = {row["group"] for row in compat.upstream_flags()}
    stale = (set(compat.NOOPS) | set(compat.REFUSALS) | set(compat.DEFAULT_DIFFERENCES)) - known
    assert not stale, f"table entries that are not upstream flags: {stale}"
    assert set(compat.REFUSED_GROUPS) <= groups


def test_every_upstream_spelling_parses():
    """Every option string of every upstream flag reaches our classification, never argparse's 'unrecognized'."""
    ours = _ours()
    for row in compat.upstream_flags():
        honoured = compat.rule(row, ours)[0][0] == compat.HONOURED
        for flag in row["flags"]:
            try:
                parse_args([flag, *_sample(row)])
            except ConfigError as e:
                assert "unrecognized" not in str(e), (flag, str(e))
                assert honoured or "invalid choice" not in str(e), (flag, str(e))


def test_upstream_choices_of_honoured_flags_are_accepted_or_refused_by_name():
    parser = build_parser()
    by_opt = {s: a for a in parser._actions for s in a.option_strings}
    for row in compat.upstream_flags():
        action = next((by_opt[f] for f in row["flags"] if f in by_opt), None)
        if action is None or action.dest.startswith("upstream__") or not row["choices"] or not action.choices:
            continue
        refused = compat.REFUSED_CHOICES.get(row["flags"][0], {})
        missing = {c for c in row["choices"] if c not in action.choices} - set(refused)
        assert not missing, (row["flags"][0], missing)
        for choice in refused:
            with pytest.raises(ConfigError, match=row["flags"][0]):
                parse_args([row["flags"][0], str(choice)])


def test_refused_flags_fail_in_one_line_naming_the_flag():
    ours = _ours()
    checked = 0
    for row in compat.upstream_flags():
        classes = compat.rule(row, ours)
        if classes[0][0] != compat.REFUSED:
            continue
        with pytest.raises(ConfigError) as e:
            parse_args([row["flags"][0], *_sample(row)])
        msg = str(e.value)
        assert row["flags"][0] in msg and "\n" not in msg
        checked += 1
    assert checked > 50


def test_a_refused_flag_at_upstreams_default_is_upstreams_behaviour():
    args = parse_args(["--num-experts", "1", "--DDP-impl", "local", "--mlp-type", "standard"])
    assert not [k for k in vars(args) if k.startswith("upstream__")]


def test_noops_are_said_once_and_conditional_ones_refuse_other_values(capsys):
    parse_args(["--no-masked-softmax-fusion", "--data-impl", "mmap"])
    out = capsys.readouterr().out
    assert "--no-masked-softmax-fusion is accepted and has no effect here" in out
    assert "--data-impl is accepted" in out
    parse_args(["--use-rotary-position-embeddings", "--no-position-embedding"])
    with pytest.raises(ConfigError, match="--no-position-embedding"):
        parse_args(["--no-position-embedding"])  # learned positions off and no rotary: not built
    parse_args(["--kv-channels", "16", "--hidden-size", "64", "--num-attention-heads", "4"])
    with pytest.raises(ConfigError, match="--kv-channels 32"):
        parse_args(["--kv-channels", "32", "--hidden-size", "64", "--num-attention-heads", "4"])
    # Upstream's per-document resets: no effect where upstream itself ignores them (RoPE positions, the causal
    # flash path), refused where they would change its arithmetic.
    parse_args(["--use-rotary-position-embeddings", "--reset-position-ids"])
    with pytest.raises(ConfigError, match="--reset-position-ids"):
        parse_args(["--reset-position-ids"])  # learned positions: upstream restarts them per document
    parse_args(["--use-flash-attn-v2", "--reset-attention-mask"])
    parse_args(["--use-flash-attn-builder", "--reset-attention-mask"])
    with pytest.raises(ConfigError, match="--reset-attention-mask"):
        parse_args(["--reset-attention-mask"])


def test_upstream_aliases_are_the_same_setting():
    args = parse_args(["--encoder-num-layers", "3", "--encoder-seq-length", "64",
                       "--rotary-position-embeddings-theta", "500000", "--deepscale_config", "ds.json"])
    assert (args.num_layers, args.seq_length, args.rotary_base, args.deepspeed_config) == (3, 64, 500000.0, "ds.json")
    with pytest.raises(ConfigError, match="--num-layers and --encoder-num-layers"):
        parse_args(["--num-layers", "2", "--encoder-num-layers", "3"])


def test_honoured_flags_keep_upstreams_defaults():
    """A flag left out means what it means upstream, unless DEFAULT_DIFFERENCES says why the run is the same."""
    parser = build_parser()
    by_opt = {s: a for a in parser._actions for s in a.option_strings}
    differ = {}
    for row in compat.upstream_flags():
        actions = [by_opt[f] for f in row["flags"] if f in by_opt and not by_opt[f].dest.startswith("upstream__")]
        if not actions or row["action"] != "store":
            continue
        ours, up = actions[0].default, row["default"]
        same = ours == up
        if not same and isinstance(up, str) and ours is not None:
            same = str(ours).replace(" ", "") == up.replace(" ", "")
        if not same and ours is not None and up is not None:
            try:
                same = float(ours) == float(up)
            except (TypeError, ValueError):
                pass
        if not same:
            differ[row["flags"][0]] = (up, ours)
    assert set(differ) == set(compat.DEFAULT_DIFFERENCES), differ


def test_compatibility_doc_table_is_current():
    """docs/compatibility.md's tables are written from these tables (tools/compat_table.py)."""
    import subprocess
    import sys

    from tests.launch import REPO

    proc = subprocess.run([sys.executable, "tools/compat_table.py", "--check"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_refusal_says_why_then_what_to_do():
    """docs/compatibility.md promises a reason for each refused flag: one line, the why (several words), then after
    ': ' what to do instead."""
    texts = {flag: r.instead for flag, r in compat.REFUSALS.items()}
    texts |= {f"group {g}": t for g, t in compat.REFUSED_GROUPS.items()}
    bad = [flag for flag, text in texts.items()
           if "\n" in text or ": " not in text or len(text.split(": ")[0].split()) < 3 or not text.split(": ")[-1]]
    assert not bad, bad
