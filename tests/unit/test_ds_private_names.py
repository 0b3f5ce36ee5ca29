"""No DeepSpeed private name read, and no DeepSpeed object's attribute replaced, outside megatron/ds_seams.py.

Scans megatron/, tools/, bench/ and pretrain_gpt.py (not tests/). A hit is one line naming the file, the line and
the name; the fix is a named function in megatron/ds_seams.py, listed in its TOUCHES (or OVERRIDES for a subclass
method that must stay where it is). What counts as a DeepSpeed private name: those the seam registers, ``cdb``, and
every ``_name`` the installed DeepSpeed defines that our own code does not.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re

import pytest

from megatron import ds_seams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCANNED = ("megatron", "tools", "bench", "pretrain_gpt.py")
SEAM = os.path.join("megatron", "ds_seams.py")
# Underscore names of Python's and torch's own API that DeepSpeed's source also happens to define.
PYTHON_API = {"_replace", "_fields", "_asdict", "_make", "_exit", "_actions", "_action_groups", "_group_actions",
              "_cdata"}
REGISTERED = {t.name for t in ds_seams.TOUCHES if t.name.startswith("_")} | {"cdb"}
REPLACED = {t.name for t in ds_seams.TOUCHES if not t.name.startswith("_")} - {"cdb"}
FIX = "route it through megatron/ds_seams.py (a named function listed in TOUCHES)"


def _files() -> list[str]:
    out = []
    for entry in SCANNED:
        path = os.path.join(ROOT, entry)
        if os.path.isfile(path):
            out.append(entry)
            continue
        for d, _, names in os.walk(path):
            out += [os.path.relpath(os.path.join(d, n), ROOT) for n in names if n.endswith(".py")]
    return sorted(f for f in out if f != SEAM)


def _deepspeed_private() -> set[str]:
    """Every ``_name`` DeepSpeed's source defines: methods, classes, instance and module attributes."""
    root = os.path.dirname(importlib.util.find_spec("deepspeed").origin)
    pattern = re.compile(r"(?:\bself\.|\bdef\s+|\bclass\s+|^[ \t]*)(_[A-Za-z]\w*)", re.M)
    names: set[str] = set()
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f), errors="ignore") as fh:
                    names |= set(pattern.findall(fh.read()))
    return {n for n in names if not n.endswith("__")}


def _ds_bases(tree: ast.Module, bound: dict[str, bool], known: frozenset[str] = frozenset()) -> set[str]:
    """Names of this file's classes that derive from a DeepSpeed class (directly, through one of these, or through
    ``known``: classes of other scanned files that do, imported here)."""
    derived: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            roots = {_root(b) for b in node.bases}
            if any(bound.get(r) for r in roots) or roots & derived or roots & (known & set(bound)):
                derived.add(node.name)
    return derived


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _imports(tree: ast.Module) -> dict[str, bool]:
    """Every name an import binds in this file -> True when it comes from deepspeed."""
    bound: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[(a.asname or a.name).split(".")[0]] = a.name.split(".")[0] == "deepspeed"
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                bound[a.asname or a.name] = (node.module or "").split(".")[0] == "deepspeed" and node.level == 0
    return bound


class _Parsed:
    def __init__(self, path: str, source: str, known: frozenset[str] = frozenset()) -> None:
        self.path = path
        self.tree = ast.parse(source, path)
        self.bound = _imports(self.tree)
        self.derived = _ds_bases(self.tree, self.bound, known)

    def own_names(self) -> set[str]:
        """``_names`` this file defines itself (outside classes deriving from DeepSpeed's)."""
        names: set[str] = set()
        skip: set[int] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef) and node.name in self.derived:
                skip |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(self.tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _root(node) == "self":
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
        return {n for n in names if n.startswith("_")}


def _overrides() -> dict[tuple[str, str], set[str]]:
    """(file, class) -> the DeepSpeed methods it may override (and reach through ``super()``)."""
    out: dict[tuple[str, str], set[str]] = {}
    for o in ds_seams.OVERRIDES:
        module, cls = o.ours.rsplit(".", 1)
        out.setdefault((module.replace(".", os.sep) + ".py", cls), set()).add(o.where.rsplit(".", 1)[1])
    return out


def _hits(p: _Parsed, private: set[str], ours: set[str], allowed: dict) -> list[str]:
    hits: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        hits.append(f"{p.path}:{node.lineno}: {what}: {FIX}")

    def private_name(name: str) -> bool:
        return name in REGISTERED or (name in private and name not in ours and name not in PYTHON_API)

    permitted: set[int] = set()  # registered overrides: their def and their super() call
    for node in ast.walk(p.tree):
        if isinstance(node, ast.ClassDef):
            names = allowed.get((p.path, node.name), set())
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in names:
                    permitted |= {id(item)} | {id(n) for n in ast.walk(item) if isinstance(n, ast.Attribute)
                                               and n.attr == item.name}
            if node.name in p.derived:
                for item in node.body:
                    if (isinstance(item, ast.FunctionDef) and private_name(item.name)
                            and id(item) not in permitted):
                        hit(item, f"overrides DeepSpeed's private {item.name} (register it in ds_seams.OVERRIDES)")
    for node in ast.walk(p.tree):
        if id(node) in permitted:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            parts = node.module.split(".") + [a.name for a in node.names]
            for name in parts:
                if name.startswith("_") or name == "cdb":
                    hit(node, f"imports DeepSpeed's private {name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "deepspeed" and any(x.startswith("_") for x in a.name.split(".")):
                    hit(node, f"imports DeepSpeed's private {a.name}")
        elif isinstance(node, ast.Attribute):
            base = _root(node.value)
            foreign = base is not None and base in p.bound and not p.bound[base]  # os._exit, torch._foo
            if private_name(node.attr) and not foreign and not node.attr.endswith("__"):
                hit(node, f"reads or writes DeepSpeed's private {node.attr}")
            elif isinstance(node.ctx, ast.Store | ast.Del) and (p.bound.get(base) or node.attr in REPLACED):
                hit(node, f"replaces DeepSpeed's {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name, base = node.args[1].value, _root(node.args[0])
            if private_name(name) and not (base in p.bound and not p.bound[base]):
                hit(node, f"reads or writes DeepSpeed's private {name}")
            elif node.func.id in ("setattr", "delattr") and (p.bound.get(base) or name in REPLACED):
                hit(node, f"replaces DeepSpeed's {ast.unparse(node.args[0])}.{name}")
        elif isinstance(node, ast.Name) and node.id == "cdb":
            hit(node, "reads or writes DeepSpeed's private cdb")
    return list(dict.fromkeys(hits))


@pytest.fixture(scope="module")
def scanned():
    sources = {}
    for f in _files():
        with open(os.path.join(ROOT, f)) as fh:
            sources[f] = fh.read()
    known: frozenset[str] = frozenset()
    while True:  # a class deriving from one of ours that derives from DeepSpeed's derives from DeepSpeed's
        parsed = [_Parsed(f, src, known) for f, src in sources.items()]
        found = frozenset(name for p in parsed for name in p.derived)
        if found == known:
            break
        known = found
    ours: set[str] = set()
    for p in parsed:
        ours |= p.own_names()
    return parsed, _deepspeed_private(), ours - REGISTERED


def test_no_deepspeed_private_name_outside_the_seam(scanned):
    parsed, private, ours = scanned
    allowed = _overrides()
    hits = [h for p in parsed for h in _hits(p, private, ours, allowed)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("source,expected", [
    ("from deepspeed.utils import groups\ngroups._EXPERT_PARALLEL_GROUP['x'] = 1\n", "private _EXPERT_PARALLEL_GROUP"),
    ("def f(engine):\n    return engine._config\n", "private _config"),
    ("def f(engine):\n    engine.checkpoint_engine = None\n", "replaces DeepSpeed's engine.checkpoint_engine"),
    ("from deepspeed.comm import comm\ncomm.cdb.all_reduce = None\n", "private cdb"),
    ("from deepspeed.comm.comm import cdb\n", "imports DeepSpeed's private cdb"),
    ("def f(p):\n    return getattr(p, '_hp_mapping', None)\n", "private _hp_mapping"),
    ("def f(opt):\n    return opt._param_slice_mappings\n", "private _param_slice_mappings"),
    ("from deepspeed.runtime.config_utils import DeepSpeedConfigModel\nDeepSpeedConfigModel.__init__ = None\n",
     "replaces DeepSpeed's DeepSpeedConfigModel.__init__"),
    ("from deepspeed.pipe import PipelineModule\nclass M(PipelineModule):\n    def _partition_layers(self):\n"
     "        pass\n", "overrides DeepSpeed's private _partition_layers"),
    ("from deepspeed.pipe import PipelineModule\nclass M(PipelineModule):\n    def _set_bounds(self, start, stop):\n"
     "        pass\n", "overrides DeepSpeed's private _set_bounds"),
])
def test_the_scan_catches(scanned, source, expected):
    _, private, ours = scanned
    hits = _hits(_Parsed("probe.py", source), private, ours, _overrides())
    assert any(expected in h for h in hits), hits


def test_the_scan_leaves_our_own_names_alone(scanned):
    _, private, ours = scanned
    source = ("import os\nclass Saver:\n    def __init__(self):\n        self._pending = None\n"
              "def f(s, t):\n    os._exit(0)\n    return s._pending, t._replace(a=1)\n")
    p = _Parsed("probe.py", source)
    assert _hits(p, private, ours | p.own_names(), _overrides()) == []
