"""The training loop stays readable top to bottom (issue 40): ``_train`` within 100 lines, docstring included, its
set-up and bookkeeping in helpers of megatron/training/, and a run's life outside the step reached through the one
Supervisor of megatron/resilience/."""

from __future__ import annotations

import ast
import glob
import inspect
import os

LOOP_MAX_LINES = 100
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_training_loop_fits_in_100_lines():
    from megatron.training.pretrain import _train

    lines, first = inspect.getsourcelines(_train)
    assert len(lines) <= LOOP_MAX_LINES, (
        f"megatron/training/pretrain.py:{first} _train is {len(lines)} lines (at most {LOOP_MAX_LINES}): move set-up "
        "or bookkeeping into a helper (streams.py, iteration_log.py) or the Supervisor (megatron/resilience/)")


def test_training_reaches_resilience_only_through_the_supervisor():
    """Watchdog, deadline, run control, stragglers and failure records are wired in one place: training/ imports the
    Supervisor (and the Decision it returns), never the parts."""
    allowed = {"megatron.resilience.supervisor", "megatron.resilience.control"}
    found = {}
    for path in sorted(glob.glob(os.path.join(REPO, "megatron", "training", "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.resilience"):
                found.setdefault(node.module, []).append((os.path.basename(path), [a.name for a in node.names]))
    assert set(found) <= allowed, found
    assert all(names == ["Decision"] for _, names in found.get("megatron.resilience.control", [])), found
