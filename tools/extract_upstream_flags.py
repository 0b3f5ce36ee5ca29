"""Write upstream Megatron-DeepSpeed's pretrain_gpt.py flags (its own parser, DeepSpeed's config flags included) as
the JSON data file megatron/compat/upstream_flags.json, one flag per line.

    cd UPSTREAM && DS_ACCELERATOR=cpu PYTHONPATH=$PWD:$PWD/pydeps python /path/to/tools/extract_upstream_flags.py \\
        > /path/to/megatron/compat/upstream_flags.json

UPSTREAM is a checkout prepared by ../shared/upstream/setup.sh (commit 4efb479d for the file in the repo). The parser
is captured at its parse_args() call, so nothing is parsed and no process group is made.
"""

from __future__ import annotations

import argparse
import json
import sys

_ACTIONS = {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false",
            "_StoreConstAction": "store_const", "_AppendAction": "append"}
_PLAIN = (int, float, str, bool, type(None), list)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _capture(self, *args, **kwargs):
    raise _Captured(self)


def upstream_parser() -> argparse.ArgumentParser:
    sys.argv = ["pretrain_gpt.py"]
    argparse.ArgumentParser.parse_args = _capture
    argparse.ArgumentParser.parse_known_args = _capture
    import megatron.arguments as upstream_arguments  # upstream's module, from the current directory

    try:
        upstream_arguments.parse_args()
    except _Captured as c:
        return c.parser
    raise RuntimeError("upstream's parse_args returned without parsing")


def rows(parser: argparse.ArgumentParser) -> list[dict]:
    out = []
    for act in parser._actions:
        if not act.option_strings or act.dest == "help":
            continue
        out.append({
            "flags": list(act.option_strings), "dest": act.dest,
            "action": _ACTIONS.get(type(act).__name__, type(act).__name__),
            "nargs": act.nargs if isinstance(act.nargs, (int, str, type(None))) else str(act.nargs),
            "type": getattr(act.type, "__name__", None) if act.type else None,
            "default": act.default if isinstance(act.default, _PLAIN) else repr(act.default),
            "choices": list(act.choices) if act.choices else None,
            "group": next((g.title for g in parser._action_groups if act in g._group_actions), None),
        })
    return out


def main() -> None:
    data = rows(upstream_parser())
    sys.stdout.write("[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in data) + "\n]\n")


if __name__ == "__main__":
    main()
