"""Read a real job-script case (tests/compat/cases/NAME.case) and turn it into a pretrain_gpt.py command line.

A case file holds its source (a public job script, named with repository, path and commit), what was scaled, the
world size, an optional DeepSpeed JSON beside it (NAME.json) and the flags as the script passes them, with the
script's own variables ($DATA_PATH, $VOCAB_FILE, $MERGE_FILE, $CHECKPOINT_PATH, $TENSORBOARD_DIR, $DS_CONFIG, ...)
left in place; the test fills them.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = os.path.join(REPO, "tests", "compat", "cases")
_VAR = re.compile(r"\$\{?([A-Z_][A-Z0-9_]*)\}?")


@dataclass
class Case:
    name: str
    source: str
    world: int
    flags: list[str]
    json: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def load(name: str) -> Case:
    path = os.path.join(CASES, f"{name}.case")
    meta, words = {}, []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("#"):
                key, _, value = line[1:].partition(":")
                meta.setdefault(key.strip(), value.strip())
            elif line:
                words += shlex.split(line.rstrip("\\"))
    json_path = os.path.join(CASES, f"{name}.json")
    env = dict(kv.split("=", 1) for kv in meta.get("env", "").split()) if meta.get("env") else {}
    return Case(name, meta["source"], int(meta["world"]), words, json_path if os.path.isfile(json_path) else None,
                env)


def names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CASES) if f.endswith(".case"))


def fill(words: list[str], values: dict[str, str]) -> list[str]:
    """Replace the script's variables; an unknown one is a broken case file."""
    def one(m: re.Match) -> str:
        if m.group(1) not in values:
            raise KeyError(f"case uses ${m.group(1)}, which the test does not provide")
        return values[m.group(1)]
    return [_VAR.sub(one, w) for w in words]
