"""The tests' own structure: every rank launch goes through tests/launch/, and the fault tests inject faults only
through MEGATRON_FAULT (megatron/faults.py), never by replacing a private name or a function of megatron or
DeepSpeed.

A rank launch is told from a single-process tool invocation by what the function around the call names (the module,
for a call at its top level): ``pretrain_gpt``, a distributed launcher (``torch.distributed.run``, ``torchrun``,
``mpirun``) or a rank variable (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ``SLURM_PROCID``: what a stand-in
``srun`` gives its ranks). Tools (``tools/*.py``, ``bench/*.py``, pytest, ``bash -n``, shellcheck, a compiler, a
batch script under the stand-in ``sbatch``, quick.sh's steps) name none of these; ``multiprocessing`` is a rank
launch wherever it is used.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LAUNCHER = TESTS / "launch"
LAUNCH_CALLS = {("subprocess", n) for n in ("run", "Popen", "call", "check_call", "check_output")} | {
    ("os", n) for n in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "execv",
                        "execve", "execvp", "execvpe")}
RANK_LAUNCH = re.compile(r"pretrain_gpt|torch\.distributed\.run|\btorchrun\b|\bmpirun\b|\bRANK\b|\bWORLD_SIZE\b|"
                         r"\bMASTER_PORT\b|\bSLURM_PROCID\b")

FAULT_TESTS = ["distributed/test_hangs.py", "checkpointing/common.py", "checkpointing/test_faults.py",
               "checkpointing/test_out_of_memory.py", "checkpointing/test_async_save.py",
               "checkpointing/test_integrity.py", "checkpointing/test_exits.py",
               "checkpointing/test_hierarchical_zero_checkpoint.py", "campaign/trainer.py", "campaign/common.py",
               "campaign/fakeslurm.py", "campaign/test_campaign.py", "campaign/test_failures.py",
               "unit/test_watchdog_protocol.py", "unit/test_faults.py"]
"""The fault tests by name; any other test file that sets MEGATRON_FAULT counts too."""
PATCHED_PACKAGES = ("megatron", "deepspeed", "pretrain_gpt")
OBSERVERS = {
    "log.TrainingLogger.iteration": "prints or records each logged loss exactly (tests/checkpointing/common.py)",
    "async_save.commit": "records when rank 0 commits a background save",
    "async_save.say": "records the save's log lines",
}
"""Functions a fault test may wrap: each calls the original unchanged and injects nothing (why, for each)."""


def _sources(root: Path = TESTS) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if LAUNCHER not in p.parents and "fixtures" not in p.parts)


def _called(node: ast.Call) -> tuple[str, str] | None:
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f.value.id, f.attr
    return None


def rank_launches(source: str) -> list[str]:
    """Where ``source`` launches ranks itself: ``line: what``."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and (n.split(".")[0] == "multiprocessing" or n.startswith("torch.multiprocessing"))
                   for n in names):
                found.append(f"{node.lineno}: imports multiprocessing (function ranks: tests/launch/functions.py)")
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called(node) in LAUNCH_CALLS:
            around = [s for s in scopes if s.lineno <= node.lineno <= s.end_lineno]
            text = ast.get_source_segment(source, min(around, key=lambda s: s.end_lineno - s.lineno)) if around \
                else source
            named = RANK_LAUNCH.search(text)
            if named:
                found.append(f"{node.lineno}: {'.'.join(_called(node))} near {named.group(0)!r}")
    return found


def _scripts(tree: ast.AST) -> list[ast.AST]:
    """The module and every string in it that is itself a Python program (``python -c`` scripts)."""
    out = [tree]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            try:
                out.append(ast.parse(node.value))
            except SyntaxError:
                pass
    return out


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` (subscripts skipped) as ["a", "b", "c"]; None when it is not rooted at a name."""
    parts = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _patched_names(tree: ast.AST) -> set[str]:
    """Names bound to a module or class of megatron, DeepSpeed or pretrain_gpt by this program's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] in PATCHED_PACKAGES}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PATCHED_PACKAGES:
            names |= {a.asname or a.name for a in node.names}
    return names


def fault_patches(source: str) -> list[str]:
    """Where ``source`` (a fault test) replaces a private name, or a function of megatron / DeepSpeed not in
    OBSERVERS: ``line: what``."""
    found = []
    for tree in _scripts(ast.parse(source)):
        ours = _patched_names(tree)
        for node in ast.walk(tree):
            targets: list[list[str]] = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                        chain = _chain(el) if isinstance(el, ast.Attribute | ast.Subscript) else None
                        if chain and len(chain) > 1:
                            targets.append(chain)
            elif isinstance(node, ast.Call) and _called(node) and _called(node)[1] in ("setattr", "setitem") \
                    and len(node.args) >= 2:
                obj, name = node.args[0], node.args[1]
                chain = _chain(obj) or ["?"]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    targets.append([*chain, name.value])
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                targets.append([*(_chain(node.args[0]) or ["?"]), str(node.args[1].value)])
            for chain in targets:
                dotted = ".".join(chain)
                if chain[0] != "self" and any(p.startswith("_") for p in chain[1:]):
                    found.append(f"{node.lineno}: replaces the private name {dotted}")
                elif chain[0] in ours and dotted not in OBSERVERS:
                    found.append(f"{node.lineno}: replaces {dotted} (inject faults through MEGATRON_FAULT)")
    return found


def test_every_rank_launch_goes_through_tests_launch():
    found = {str(p.relative_to(TESTS)): rank_launches(p.read_text()) for p in _sources()}
    assert not {k: v for k, v in found.items() if v}, found


def test_the_fault_tests_inject_through_megatron_fault_only():
    names = {TESTS / n for n in FAULT_TESTS} | {p for p in _sources() if "MEGATRON_FAULT" in p.read_text()}
    names.discard(Path(__file__))
    assert all(p.exists() for p in names), sorted(str(p) for p in names if not p.exists())
    found = {str(p.relative_to(TESTS)): fault_patches(p.read_text()) for p in sorted(names)}
    assert not {k: v for k, v in found.items() if v}, found


def test_the_checks_find_what_they_forbid():
    """Today's rules against the patterns they replaced (the fault tests' former monkeypatches and launches)."""
    old_faults = '''
import pretrain_gpt
from deepspeed.runtime.pipe.engine import PipelineEngine
from megatron.training import pretrain
from megatron.checkpointing.live import integrity

def patch(monkeypatch, wd, run):
    PipelineEngine._INSTRUCTION_MAP[cmd] = lambda self, **k: run(self, **k)
    pretrain.train_step = slow_step
    pretrain_gpt.forward_step = forward_step
    monkeypatch.setattr(wd, "_die", print)
    self._mine = 1

SCRIPT = """
from megatron.checkpointing.live import integrity
integrity.write_torch = slowed
"""
'''
    found = fault_patches(old_faults)
    assert [f.split(": ", 1)[1] for f in found] == [
        "replaces the private name PipelineEngine._INSTRUCTION_MAP", "replaces pretrain.train_step (inject faults "
        "through MEGATRON_FAULT)", "replaces pretrain_gpt.forward_step (inject faults through MEGATRON_FAULT)",
        "replaces the private name wd._die", "replaces integrity.write_torch (inject faults through MEGATRON_FAULT)"
    ], found
    launches = '''
import multiprocessing as mp
import subprocess, sys

def ranks(world):
    env = dict(RANK="0", WORLD_SIZE=str(world))
    return subprocess.Popen([sys.executable, "-c", "pass"], env=env)

def two_ranks():
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "x.py"])

def a_tool():
    subprocess.run([sys.executable, "tools/verify_checkpoint.py", "ckpt"], check=True)
'''
    assert [f.split(": ", 1)[1] for f in rank_launches(launches)] == [
        "imports multiprocessing (function ranks: tests/launch/functions.py)", "subprocess.Popen near 'RANK'",
        "subprocess.run near 'torch.distributed.run'"]
