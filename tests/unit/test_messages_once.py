"""Every user-facing message exists once: the same text raised from two places drifts apart at the first edit (the
world-size divisibility message once existed three times). Scans megatron/ and tools/ with ``ast`` for the constant
text of each message passed to a megatron.errors exception."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ERRORS = {"ConfigError", "DataError", "CheckpointError", "TrainingError", "DistributedError", "MegatronError"}
MIN_LENGTH = 40  # shorter texts ("{} not found") are words, not messages


def _text(node: ast.expr) -> str | None:
    """The message's text with every f-string placeholder as ``{}``; None when it is not written out here."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is not None or right is not None:
            return (left or "{}") + (right or "{}")
    return None


def _error_name(call: ast.Call) -> str | None:
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return name if name in ERRORS else None


def messages() -> dict[str, list[str]]:
    """Normalised message text -> the places (path:line) that raise it."""
    found = defaultdict(list)
    for folder in ("megatron", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and _error_name(node) and node.args:
                    text = _text(node.args[0])
                    if text is not None:
                        text = re.sub(r"\s+", " ", text).strip()
                        found[text].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_scan_sees_the_messages():
    found = messages()
    assert len(found) > 300  # every module's refusals, not an empty walk
    assert any(t.startswith("world size {} is not divisible by --tensor-model-parallel-size") for t in found)


def test_every_message_is_raised_from_one_place():
    twice = {text: places for text, places in messages().items()
             if len(places) > 1 and len(text) > MIN_LENGTH}
    assert not twice, "the same message raised from several places (raise it from one function): " + "; ".join(
        f"{text!r} at {', '.join(places)}" for text, places in sorted(twice.items()))
