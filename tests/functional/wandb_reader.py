"""A W&B run's history read back with wandb's own reader (`wandb leet inspect --json`: one JSON record per line;
0.31 has no Python reader), and the environment of a job without key or service (the tests' jobs never reach W&B)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.launch import clean_env

WANDB = os.path.join(os.path.dirname(sys.executable), "wandb")


def offline_env(tmp) -> dict[str, str]:
    """No key (an empty netrc; a key in the environment must be dropped by the caller), W&B's folders in ``tmp``, a
    service that is not there."""
    netrc = tmp / "netrc"
    netrc.write_text("")
    return {"WANDB_CONFIG_DIR": str(tmp / "wandb_cfg"), "WANDB_CACHE_DIR": str(tmp / "wandb_cache"),
            "WANDB_DATA_DIR": str(tmp / "wandb_data"), "NETRC": str(netrc), "WANDB_BASE_URL": "http://127.0.0.1:9",
            "WANDB__DISABLE_STATS": "true"}


def wandb_history(folders: list[str], env: dict[str, str]) -> dict[int, dict]:
    """step -> the logged row (every key logged at that step), over the folders (a campaign's jobs) in order."""
    rows: dict[int, dict] = {}
    for folder in folders:
        out = subprocess.run([WANDB, "leet", "inspect", "--json", folder], capture_output=True, text=True,
                             env=clean_env(env), check=True).stdout
        for record in (json.loads(line) for line in out.splitlines() if '"history"' in line):
            if record.get("type") == "history":
                item = record["history"]["item"]
                rows.setdefault(int(item["_step"]), {}).update(item)
    return rows
