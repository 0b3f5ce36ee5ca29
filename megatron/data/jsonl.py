"""Reading jsonl corpora line by line, with bad lines reported by number (shared by the tools/ scripts)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence

from megatron.errors import DataError

BAD_LINES_CHOICES = ("stop", "skip")


class BadLine(ValueError):
    """One jsonl line that cannot be used; the message says why."""


def parse_jsonl_line(raw: bytes | str, keys: Sequence[str]) -> dict[str, str]:
    """The text under each of ``keys`` in one jsonl line; raises BadLine with the reason."""
    try:
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        obj = json.loads(raw)
    except UnicodeDecodeError as e:
        raise BadLine(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise BadLine(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadLine(f"a JSON {type(obj).__name__}, not an object")
    out = {}
    for key in keys:
        if key not in obj:
            raise BadLine(f"no key {key!r} (keys: {', '.join(list(obj)[:8])}); choose it with --json-keys")
        if not isinstance(obj[key], str):
            raise BadLine(f"{key!r} is a {type(obj[key]).__name__}, not a string")
        out[key] = obj[key]
    return out


def bad_line_error(path: str, lineno: int, reason: str) -> DataError:
    return DataError(f"{path}:{lineno}: {reason}; fix or delete the line, or pass --bad-lines skip")


def require_file(path: str, flag: str = "--input") -> None:
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path} not found")


class BadLineLog:
    """Counts skipped lines and prints the first few, so a mostly-broken corpus is not skipped silently."""

    def __init__(self, path: str, policy: str, show: int = 5) -> None:
        if policy not in BAD_LINES_CHOICES:
            raise ValueError(policy)
        self.path, self.policy, self.show = path, policy, show
        self.count = 0

    def report(self, lineno: int, reason: str) -> None:
        if self.policy == "stop":
            raise bad_line_error(self.path, lineno, reason)
        self.count += 1
        if self.count <= self.show:
            print(f"warning: skipping {self.path}:{lineno}: {reason}", file=sys.stderr, flush=True)

    def summary(self) -> str | None:
        return f"skipped {self.count} bad line(s) of {self.path}" if self.count else None


def iter_texts(path: str, keys: Sequence[str], bad_lines: str = "stop") -> Iterator[str]:
    """Texts of a ``.jsonl`` file (every key of every line), or the lines of any other text file."""
    require_file(path)
    log = BadLineLog(path, bad_lines)
    is_jsonl = path.endswith((".jsonl", ".json"))
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if not is_jsonl:
                yield raw.decode("utf-8", errors="replace")
                continue
            try:
                yield from parse_jsonl_line(raw, keys).values()
            except BadLine as e:
                log.report(lineno, str(e))
    if log.summary():
        print(f"warning: {log.summary()}", file=sys.stderr, flush=True)
