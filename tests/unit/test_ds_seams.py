"""megatron/ds_seams.py against the installed DeepSpeed: each name it relies on, and each override, still there with
the parameters and source it was read from (one line per entry that changed); and what each seam function does."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from types import SimpleNamespace

import deepspeed
import pytest

from megatron import ds_seams
from megatron.errors import ConfigError


def _written_params(where: str) -> tuple[str, ...] | None:
    """A function's parameter names as its source writes them (decorators such as TorchBackend's hide them from
    inspect.signature)."""
    owner_path, name = where.rsplit(".", 1)
    owner = ds_seams.resolve(owner_path)
    tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
    body = tree.body[0].body if inspect.isclass(owner) else tree.body
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            a = node.args
            return tuple(x.arg for x in (*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else ()), *a.kwonlyargs,
                                         *([a.kwarg] if a.kwarg else ())))
    return None


def _problem(seam: str, where: str, params=None, kind=None, text=()) -> str | None:
    """None, or one line: the seam, the DeepSpeed name and what changed since the version it was read from."""
    head = f"ds_seams.{seam}: {where}"
    since = f"(read from DeepSpeed {ds_seams.DEEPSPEED_VERSION}, installed {deepspeed.__version__})"
    try:
        obj = ds_seams.resolve(where)
    except (AttributeError, ImportError):
        return f"{head} is missing {since}"
    if kind is not None and not isinstance(obj, kind):
        return f"{head} is a {type(obj).__name__}, not a {kind.__name__} {since}"
    if params is not None:
        now = _written_params(where)
        if now != params:
            return f"{head} parameters changed: ({', '.join(params)}) -> ({', '.join(now or ())}) {since}"
    if text:
        source = inspect.getsource(obj)
        for t in text:
            if t not in source:
                return f"{head} source no longer says {t!r} {since}"
    return None


@pytest.mark.parametrize("touch", ds_seams.TOUCHES, ids=lambda t: f"{t.seam}:{'.'.join(t.where.rsplit('.', 2)[-2:])}")
def test_touch_matches_installed_deepspeed(touch):
    problem = _problem(touch.seam, touch.where, touch.params, touch.kind, touch.text)
    assert problem is None, problem


@pytest.mark.parametrize("override", ds_seams.OVERRIDES, ids=lambda o: ".".join(o.where.rsplit(".", 2)[-2:]))
def test_override_matches_installed_deepspeed(override):
    name = override.where.rsplit(".", 1)[1]
    seam = f"override {override.ours.rsplit('.', 1)[1]}.{name}"
    problem = _problem(seam, override.where, override.params)
    if problem is None and override.called_from:
        problem = _problem(seam, override.called_from, text=(override.call,))
        problem = problem and problem.replace("source no longer says", "no longer calls the override:")
    assert problem is None, problem
    module, cls_name = override.ours.rsplit(".", 1)
    ours = getattr(importlib.import_module(module), cls_name)
    assert issubclass(ours, ds_seams.resolve(override.where.rsplit(".", 1)[0])), f"{override.ours} left its base"
    assert name in vars(ours), f"{override.ours} no longer overrides {name}: drop it from ds_seams.OVERRIDES"
    # DeepSpeed's parameters first; ours may add keyword parameters with defaults after them (what our own
    # instructions pass, e.g. a pipeline chunk), which DeepSpeed's calls leave at their defaults.
    params = inspect.signature(vars(ours)[name]).parameters
    mine, extra = tuple(params)[:len(override.params)], list(params.values())[len(override.params):]
    assert mine == override.params, f"{override.ours}.{name}{tuple(params)}: DeepSpeed calls it as {override.params}"
    assert all(p.default is not p.empty for p in extra), f"{override.ours}.{name}: its own parameters need defaults"


def test_every_seam_function_is_registered():
    seams = {t.seam for t in ds_seams.TOUCHES}
    for seam in seams:
        assert callable(getattr(ds_seams, seam, None)), f"TOUCHES names {seam}, which ds_seams does not define"
    assert {"wrap_pipeline_instructions", "set_expert_groups", "set_pipeline_partition", "engine_ds_config",
            "swap_checkpoint_engine", "zero_files_skipped", "hp_mapping", "wrap_comm_backend",
            "removed_config_keys", "watching_config_models"} <= seams


def test_backend_ops_positions_are_the_written_ones():
    # megatron/core/tracking.py finds the group (and a p2p op's peer) by these positions when passed by position.
    for op, spec in ds_seams.BACKEND_OPS.items():
        assert "group" in spec.params, op
        if spec.group_by_position:
            assert spec.position("group") == 2, op
        if spec.peer:
            assert spec.position(spec.peer) == 1, op


def test_missing_name_is_one_line_naming_the_patch(monkeypatch):
    gone = ds_seams.Touch("wrap_pipeline_instructions", "_INSTRUCTION_MAP",
                          "deepspeed.runtime.pipe.engine.PipelineEngine._NO_SUCH_MAP")
    monkeypatch.setattr(ds_seams, "TOUCHES", (gone,))
    monkeypatch.setattr(ds_seams, "_checked", set())
    with pytest.raises(ConfigError) as e:
        ds_seams.wrap_pipeline_instructions(SimpleNamespace(), lambda kind, fn: fn)
    msg = str(e.value)
    assert "\n" not in msg
    assert "PipelineEngine._NO_SUCH_MAP" in msg and "wrap_pipeline_instructions" in msg
    assert f"deepspeed=={ds_seams.DEEPSPEED_VERSION}" in msg and "tests/unit/test_ds_seams.py" in msg


def test_check_installed_passes_on_this_deepspeed(monkeypatch):
    monkeypatch.setattr(ds_seams, "_checked", set())
    ds_seams.check_installed()
    assert {t.seam for t in ds_seams.TOUCHES} - set(ds_seams._checked) == set(ds_seams._TOOL_SEAMS)


def test_wrap_pipeline_instructions_copies_per_engine_and_composes():
    class Engine:
        _INSTRUCTION_MAP = {int: lambda self: "int", str: lambda self: "str"}

    a, b = Engine(), Engine()
    ds_seams.wrap_pipeline_instructions(a, lambda kind, fn: lambda self: f"<{fn(self)}>")
    ds_seams.wrap_pipeline_instructions(a, lambda kind, fn: (lambda self: f"[{fn(self)}]") if kind is int else fn)
    assert a._INSTRUCTION_MAP[int](a) == "[<int>]" and a._INSTRUCTION_MAP[str](a) == "<str>"
    assert b._INSTRUCTION_MAP[int](b) == "int" and Engine._INSTRUCTION_MAP[str](b) == "str"  # class map untouched


def test_set_expert_groups_leaves_only_ours():
    from deepspeed.utils import groups

    tables = (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
              groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS)
    saved = [dict(t) for t in tables]
    try:
        groups._EXPERT_PARALLEL_GROUP["stale"] = "old"
        ds_seams.set_expert_groups("ep_size_2", "EP", (0, 2), "EDP", (0, 1))
        assert [dict(t) for t in tables] == [{"ep_size_2": "EP"}, {"ep_size_2": [0, 2]}, {"ep_size_2": "EDP"},
                                             {"ep_size_2": [0, 1]}]
        assert groups._get_expert_parallel_group("ep_size_2") == "EP"
        assert groups._get_expert_data_parallel_group("ep_size_2") == "EDP"
    finally:
        for t, s in zip(tables, saved, strict=True):
            t.clear()
            t.update(s)


def test_set_pipeline_partition_bounds_this_stage():
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    bounds = {}
    module = SimpleNamespace(_topo=PipeDataParallelTopology(num_pp=2, num_dp=2), global_rank=3,
                             _set_bounds=lambda start, stop: bounds.update(start=start, stop=stop))
    ds_seams.set_pipeline_partition(module, [0, 3, 7])
    assert module.parts == [0, 3, 7] and bounds == {"start": 3, "stop": 7}  # rank 3: pipe stage 1


def test_checkpoint_engine_swap_and_zero_flag():
    engine = SimpleNamespace(checkpoint_engine="theirs", save_zero_checkpoint=True, _config="cfg")
    assert ds_seams.swap_checkpoint_engine(engine, "ours") == "theirs" and engine.checkpoint_engine == "ours"
    assert ds_seams.swap_checkpoint_engine(SimpleNamespace(), "ours") is None
    assert ds_seams.engine_ds_config(engine) == "cfg"
    with ds_seams.zero_files_skipped(engine, True):
        assert engine.save_zero_checkpoint is False
    assert engine.save_zero_checkpoint is True
    with pytest.raises(OSError), ds_seams.zero_files_skipped(engine, True):
        raise OSError("disk full")
    assert engine.save_zero_checkpoint is True
    with ds_seams.zero_files_skipped(engine, False):
        assert engine.save_zero_checkpoint is True


def test_hp_mapping():
    plain, linked, elsewhere = SimpleNamespace(), SimpleNamespace(_hp_mapping="frag"), SimpleNamespace(_hp_mapping=None)
    assert not ds_seams.is_hp_linked(plain) and ds_seams.hp_mapping(plain) is None
    assert ds_seams.is_hp_linked(linked) and ds_seams.hp_mapping(linked) == "frag"
    assert ds_seams.is_hp_linked(elsewhere) and ds_seams.hp_mapping(elsewhere) is None


def test_wrap_comm_backend_once(monkeypatch):
    from deepspeed.comm import comm as ds_comm

    class Backend:
        def all_reduce(self, tensor, op=None, group=None, async_op=False):
            return ("all_reduce", tensor)

        def send(self, tensor, dst, group=None, tag=0):
            return ("send", dst)

        def new_group(self, ranks):
            return "theirs"

    backend = Backend()
    monkeypatch.setattr(ds_comm, "cdb", backend)
    assert ds_seams.unwrapped_comm_backend() is backend
    seen = []

    def wrap(op, fn):
        def call(*args, **kwargs):
            seen.append(op)
            return fn(*args, **kwargs)

        return call

    ds_seams.wrap_comm_backend(backend, lambda ranks: "ours", wrap)
    assert backend.new_group([0]) == "ours"
    assert backend.all_reduce(1) == ("all_reduce", 1) and backend.send(2, 1) == ("send", 1)
    assert seen == ["all_reduce", "send"]
    assert ds_seams.unwrapped_comm_backend() is None  # wrapped once: a second install changes nothing
    monkeypatch.setattr(ds_comm, "cdb", None)
    assert ds_seams.unwrapped_comm_backend() is None


def test_removed_config_keys_and_config_models():
    top, zero = ds_seams.removed_config_keys()
    assert top and zero and all(isinstance(k, str) for k in top | zero)
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    orig, built = DeepSpeedConfigModel.__init__, []

    def seen(model, data):
        built.append(model)
        return {**data, "stage": 3} if model is DeepSpeedZeroConfig else data

    with ds_seams.watching_config_models(seen):
        assert DeepSpeedZeroConfig(stage=2).stage == 3
    assert DeepSpeedConfigModel.__init__ is orig
    assert built[0] is DeepSpeedZeroConfig
    assert DeepSpeedZeroConfig(stage=2).stage == 2
