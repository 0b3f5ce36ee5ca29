"""Write the compatibility tables of docs/compatibility.md from the code: every upstream Megatron-DeepSpeed flag and
every DeepSpeed JSON key with its class (megatron/compat/). ``--check`` exits 1 when the file is stale (a test runs it).

    python tools/compat_table.py           # rewrite the block between the markers in docs/compatibility.md
    python tools/compat_table.py --check
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron.arguments import build_parser
from megatron.compat import flags as compat

DOC_NAME = "docs/compatibility.md"
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), DOC_NAME)
BEGIN, END = "<!-- compat-table:begin (tools/compat_table.py writes this block) -->", "<!-- compat-table:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flag_rows() -> list[tuple[str, str, str]]:
    ours = compat.defined_option_strings(build_parser())
    out = []
    for row in compat.upstream_flags():
        classes = compat.rule(row, ours)
        kind, r = classes[0] if len(classes) == 1 else ("UNCLASSIFIED", None)
        if kind == compat.HONOURED:
            note = compat.DEFAULT_DIFFERENCES.get(row["flags"][0], "")
            note = f"default differs: {note}" if note else ""
        elif kind == compat.NOOP:
            note = r.why + (f"; other values refused: {r.otherwise}" if r.accepts else "")
        elif kind == compat.REFUSED:
            note = r.instead
        else:
            note = "in no class or several: a bug"
        refused_values = compat.REFUSED_CHOICES.get(row["flags"][0])
        if refused_values:
            note = "; ".join(filter(None, [note, "refused values: " + ", ".join(
                f"{v} ({why})" for v, why in refused_values.items())]))
        out.append((", ".join(f"`{f}`" for f in row["flags"]), kind, note))
    return out


def key_rows() -> list[tuple[str, str, str]]:
    try:
        from megatron.compat import ds_config_keys
    except ImportError:
        return []
    names = {ds_config_keys.HONOURED: compat.HONOURED, ds_config_keys.NOOP: compat.NOOP,
             ds_config_keys.REFUSED: compat.REFUSED}
    rows = []
    for key in ds_config_keys.schema_keys():
        kind, why = ds_config_keys.lookup(key) or ("UNCLASSIFIED", "in no class: a bug")
        rows.append((f"`{key}`", names.get(kind, kind), why))
    rows += [(f"`{key}`", compat.NOOP, why) for key, why in ds_config_keys.LEGACY.items()]
    return rows


def _table(title: str, rows: list[tuple[str, str, str]]) -> list[str]:
    counts = {k: sum(1 for _, kind, _ in rows if kind == k) for k in (compat.HONOURED, compat.NOOP, compat.REFUSED)}
    summary = ", ".join(f"{n} {k}" for k, n in counts.items())
    lines = [f"<details><summary>{title}: {len(rows)} ({summary})</summary>", "", "| name | class | note |",
             "| --- | --- | --- |"]
    lines += [f"| {name} | {kind} | {_cell(note)} |" for name, kind, note in rows]
    return lines + ["", "</details>", ""]


def render() -> str:
    lines = [BEGIN, ""]
    lines += _table("Upstream Megatron-DeepSpeed `pretrain_gpt.py` flags", flag_rows())
    keys = key_rows()
    if keys:
        lines += _table("DeepSpeed JSON keys", keys)
    return "\n".join(lines + [END])


def updated_doc(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC_NAME} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + render() + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help=f"exit 1 if {DOC_NAME}'s tables are stale")
    args = p.parse_args(argv)
    with open(DOC) as f:
        text = f.read()
    new = updated_doc(text)
    if args.check:
        if new != text:
            print(f"{DOC_NAME}'s compatibility tables are stale: run python tools/compat_table.py", file=sys.stderr)
            return 1
        return 0
    with open(DOC, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
