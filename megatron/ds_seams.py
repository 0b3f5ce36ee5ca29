"""Every place we read or replace a DeepSpeed internal, in one module, each read from DeepSpeed 0.19.8.

Nothing else in megatron/, tools/ or bench/ reads a private DeepSpeed name or replaces a DeepSpeed object's attribute
(tests/unit/test_ds_private_names.py greps for it). ``TOUCHES`` lists what each function here relies on and
``OVERRIDES`` the DeepSpeed methods our subclasses replace; tests/unit/test_ds_seams.py checks both against the
installed DeepSpeed, one line per entry that no longer matches. Upgrading DeepSpeed: run that test first.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import deepspeed
import torch

from megatron.errors import ConfigError

DEEPSPEED_VERSION = "0.19.8"  # the version every entry below was read from


@dataclass(frozen=True)
class Touch:
    """One DeepSpeed name a function here relies on. ``where`` is the dotted path of the DeepSpeed object that holds
    or proves it; ``params`` its parameter names as written in DeepSpeed's source (a function or method we call or
    replace); ``text`` what its source must still say (an instance attribute it sets, a call through what we set)."""

    seam: str
    name: str
    where: str
    params: tuple[str, ...] | None = None
    kind: type | None = None
    text: tuple[str, ...] = ()


@dataclass(frozen=True)
class Override:
    """A DeepSpeed method one of our subclasses replaces. ``called_from`` (with ``call``) is where DeepSpeed calls it:
    an override DeepSpeed stops calling breaks silently. The override takes ``params`` first and may add keyword
    parameters with defaults (our pipeline instructions' ``chunk``)."""

    ours: str
    where: str
    params: tuple[str, ...]
    why: str
    called_from: str | None = None
    call: str = ""


@dataclass(frozen=True)
class BackendOp:
    """A method of DeepSpeed's TorchBackend (deepspeed/comm/torch.py) that ``wrap_comm_backend`` wraps."""

    params: tuple[str, ...]  # as written in deepspeed/comm/torch.py, self first
    group_by_position: bool = False  # deepspeed.comm passes its group by position (every other op: by keyword)
    peer: str | None = None  # point-to-point: the peer's parameter (dst / src)

    def position(self, param: str) -> int:
        """Where ``param`` sits in the bound method's positional arguments."""
        return self.params.index(param) - 1


_PIPE_ENGINE = "deepspeed.runtime.pipe.engine.PipelineEngine"
_PIPE_MODULE = "deepspeed.runtime.pipe.module.PipelineModule"
_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
_GROUPS = "deepspeed.utils.groups"
_TORCH_CKPT = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine"
_FRAGMENT = "deepspeed.utils.tensor_fragment"
_BACKEND = "deepspeed.comm.torch.TorchBackend"
_CONFIG = "deepspeed.runtime.config"
_PARTITION = "deepspeed.runtime.zero.partition_parameters.Init"
_STAGE3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
_TOOL_SEAMS = ("removed_config_keys", "watching_config_models")  # used by tools/ only, not checked at run time
_MARK = "_megatron_wrapped"  # set on DeepSpeed's comm backend once wrapped: a second install changes nothing

_P2P = ("self", "tensor", "{peer}", "group", "tag")
BACKEND_OPS: dict[str, BackendOp] = {
    "all_reduce": BackendOp(("self", "tensor", "op", "group", "async_op"), group_by_position=True),
    "inference_all_reduce": BackendOp(("self", "tensor", "op", "group"), group_by_position=True),
    "all_reduce_coalesced": BackendOp(("self", "tensors", "op", "group", "async_op"), group_by_position=True),
    "reduce": BackendOp(("self", "tensor", "dst", "op", "group", "async_op")),
    "reduce_scatter": BackendOp(("self", "output", "input_list", "op", "group", "async_op")),
    "reduce_scatter_tensor": BackendOp(("self", "output_tensor", "input_tensor", "op", "group", "async_op")),
    "broadcast": BackendOp(("self", "tensor", "src", "group", "async_op")),
    "broadcast_object_list": BackendOp(("self", "object_list", "src", "group", "device")),
    "all_gather": BackendOp(("self", "tensor_list", "tensor", "group", "async_op")),
    "all_gather_into_tensor": BackendOp(("self", "output_tensor", "input_tensor", "group", "async_op")),
    "all_gather_base": BackendOp(("self", "output_tensor", "input_tensor", "group", "async_op")),
    "all_gather_coalesced": BackendOp(("self", "output_tensors", "input_tensors", "group", "async_op")),
    "all_gather_object": BackendOp(("self", "object_list", "obj", "group")),
    "all_to_all_single": BackendOp(("self", "output", "input", "output_split_sizes", "input_split_sizes", "group",
                                    "async_op")),
    "all_to_all": BackendOp(("self", "output_tensor_list", "input_tensor_list", "group", "async_op")),
    "gather": BackendOp(("self", "tensor", "gather_list", "dst", "group", "async_op")),
    "scatter": BackendOp(("self", "tensor", "scatter_list", "src", "group", "async_op")),
    "barrier": BackendOp(("self", "group", "async_op", "device_ids")),
    "monitored_barrier": BackendOp(("self", "group", "timeout", "wait_all_ranks")),
    **{op: BackendOp(tuple(p.format(peer=peer) for p in _P2P), peer=peer)
       for op, peer in (("send", "dst"), ("isend", "dst"), ("recv", "src"), ("irecv", "src"))},
}

TOUCHES: tuple[Touch, ...] = (
    Touch("wrap_pipeline_instructions", "_INSTRUCTION_MAP", f"{_PIPE_ENGINE}._INSTRUCTION_MAP", kind=dict),
    Touch("wrap_pipeline_instructions", "_INSTRUCTION_MAP", f"{_PIPE_ENGINE}._exec_schedule",
          ("self", "pipe_schedule"), text=("self._INSTRUCTION_MAP[type(cmd)]",)),
    *(Touch("set_expert_groups", name, f"{_GROUPS}.{name}", kind=dict)
      for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                   "_EXPERT_DATA_PARALLEL_GROUP_RANKS")),
    Touch("set_expert_groups", "_EXPERT_PARALLEL_GROUP", f"{_GROUPS}._get_expert_parallel_group", ("group_name",),
          text=("return _EXPERT_PARALLEL_GROUP[group_name]",)),
    Touch("set_expert_groups", "_EXPERT_DATA_PARALLEL_GROUP", f"{_GROUPS}._get_expert_data_parallel_group",
          ("group_name",), text=("return _EXPERT_DATA_PARALLEL_GROUP[group_name]",)),
    Touch("set_pipeline_partition", "_topo", f"{_PIPE_MODULE}.__init__", text=("self._topo = topology",
                                                                                "self.global_rank = ")),
    Touch("set_pipeline_partition", "_set_bounds", f"{_PIPE_MODULE}._set_bounds", ("self", "start", "stop"),
          text=("self._local_start = start", "self._local_stop = stop")),
    Touch("set_layer_bounds", "_set_bounds", f"{_PIPE_MODULE}._set_bounds", ("self", "start", "stop"),
          text=("self._local_start = start", "self._local_stop = stop")),
    Touch("pipeline_instruction_map", "_INSTRUCTION_MAP", f"{_PIPE_ENGINE}._INSTRUCTION_MAP", kind=dict),
    Touch("pipeline_instruction_map", "_INSTRUCTION_MAP", f"{_PIPE_ENGINE}._exec_schedule",
          ("self", "pipe_schedule"), text=("self._INSTRUCTION_MAP[type(cmd)]",)),
    Touch("send_pipe_meta", "_send_tensor_meta", f"{_PIPE_ENGINE}._send_tensor_meta", ("self", "buffer", "recv_stage")),
    Touch("recv_pipe_meta", "_recv_tensor_meta", f"{_PIPE_ENGINE}._recv_tensor_meta", ("self", "send_stage"),
          text=("return self._allocate_or_extend_buffers(0, recv_shape, recv_dtype)", "buffers = tuple(buffers)")),
    Touch("engine_backward", "_running_engine_backward", f"{_ENGINE}._backward_post_hook", ("self",),
          text=("if not self._running_engine_backward:",)),
    Touch("engine_backward", "_running_engine_backward", f"{_PIPE_ENGINE}._exec_backward_pass",
          text=("self._running_engine_backward = True",)),
    Touch("pipeline_engine_class", "PipelineEngine", "deepspeed.initialize",
          text=("engine_cls = DualPipeVEngine if isinstance(model, DualPipeVModule) else PipelineEngine",)),
    Touch("engine_ds_config", "_config", f"{_ENGINE}.__init__", text=("self._config = config_class",)),
    Touch("engine_ds_config", "_config", f"{_TORCH_CKPT}.__init__", ("self", "config_params"),
          text=("self.zipfile_serialization = ",)),
    Touch("swap_checkpoint_engine", "checkpoint_engine", f"{_ENGINE}._save_zero_checkpoint",
          ("self", "save_path", "tag"), text=("self.checkpoint_engine.save(",)),
    Touch("swap_checkpoint_engine", "checkpoint_engine", f"{_ENGINE}._load_checkpoint",
          text=("checkpoint_engine=self.checkpoint_engine",)),
    Touch("zero_files_skipped", "save_zero_checkpoint", f"{_ENGINE}.save_checkpoint",
          text=("if self.save_zero_checkpoint:",)),
    Touch("hp_mapping", "_hp_mapping", "deepspeed.utils.mixed_precision_linkage.link_hp_params",
          text=("lp_param._hp_mapping = ",)),
    Touch("hp_mapping", "_hp_mapping", f"{_FRAGMENT}.tensor_fragment",
          text=("lp_fragment_address: fragment_address", "hp_fragment_address: fragment_address",
                "param_group_index: int")),
    Touch("hp_mapping", "_hp_mapping", f"{_FRAGMENT}.fragment_address", text=("numel: int", "start: int")),
    Touch("zero3_part", "ds_tensor", f"{_PARTITION}._partition_numel", ("self", "param"),
          text=("return param.ds_tensor.ds_numel",)),
    Touch("zero3_part", "ds_shape", f"{_PARTITION}._convert_to_deepspeed_param", ("self", "param"),
          text=("param.ds_shape = param.shape", "param.ds_process_group = ")),
    Touch("zero3_part", "ds_process_group", f"{_STAGE3}._get_param_partition_group", ("self", "param"),
          text=('getattr(param, "ds_process_group", self.dp_process_group)',)),
    Touch("zero3_part", "ds_process_group", f"{_STAGE3}.set_full_hp_param",
          text=("my_rank = self._get_param_partition_rank(param)", "fp32_opt_state_partition.numel() * my_rank")),
    Touch("zero3_fp32_partitions", "fp32_partitioned_groups_flat", f"{_STAGE3}.initialize_optimizer_states",
          ("self",), text=("self.fp32_partitioned_groups_flat[i]",)),
    Touch("zero3_fp32_partitions", "fp32_partitioned_groups_flat", f"{_STAGE3}._get_fp32_opt_state_partition",
          text=("self.optimizer.state[fp32_param][optim_state_key]",)),
    Touch("wrap_comm_backend", "cdb", "deepspeed.comm.comm.cdb"),
    Touch("wrap_comm_backend", "cdb", "deepspeed.comm.comm.new_group", ("ranks",), text=("cdb.new_group(ranks)",)),
    Touch("wrap_comm_backend", "cdb", f"{_BACKEND}.new_group", ("self", "ranks")),
    *(Touch("wrap_comm_backend", "cdb", f"{_BACKEND}.{op}", spec.params) for op, spec in BACKEND_OPS.items()),
    Touch("skip_shm_comm_op", "__compatible_ops__", "deepspeed.ops.__compatible_ops__", kind=dict),
    Touch("skip_shm_comm_op", "__compatible_ops__", "deepspeed.comm.torch.build_shm_op", (),
          text=("deepspeed.ops.__compatible_ops__.get(builder.NAME, False)",)),
    Touch("removed_config_keys", "_REMOVED_TOP_LEVEL_CONFIG_KEYS", f"{_CONFIG}._REMOVED_TOP_LEVEL_CONFIG_KEYS"),
    Touch("removed_config_keys", "_REMOVED_ZERO_CONFIG_KEYS", f"{_CONFIG}._REMOVED_ZERO_CONFIG_KEYS"),
    Touch("watching_config_models", "DeepSpeedConfigModel", "deepspeed.runtime.config_utils.DeepSpeedConfigModel."
          "__init__", ("self", "strict", "data")),
)

OVERRIDES: tuple[Override, ...] = (
    Override("megatron.core.pipeline.module.ChunkedPipelineModule", f"{_PIPE_MODULE}._partition_layers",
             ("self", "method"), "the virtual stages' split given by the model (GPTModelPipe's is analytic: "
             "DeepSpeed's 'parameters' builds every layer to count it; it puts the remainder on the first stages)",
             f"{_PIPE_MODULE}.__init__", "self._partition_layers(method="),
    Override("megatron.model.gpt_model_pipe.GPTModelPipe", f"{_PIPE_MODULE}._synchronize_tied_weights", ("self",),
             "DeepSpeed's in-place broadcast of the tied weight, under no_grad (else autograd warns on every "
             "backward)", f"{_PIPE_MODULE}.__init__", "self._synchronize_tied_weights()"),
    Override("megatron.core.pipeline.module.ChunkedPipelineModule", f"{_PIPE_MODULE}._build", ("self",),
             "builds each of the rank's model chunks (interleaved schedule)", f"{_PIPE_MODULE}.__init__",
             "self._build()"),
    Override("megatron.core.pipeline.module.ChunkedPipelineModule", f"{_PIPE_MODULE}.stage_owner",
             ("self", "layer_idx"), "the rank of a layer's virtual stage (the tied embedding's group)",
             f"{_PIPE_MODULE}._index_tied_modules", "self.stage_owner(idx)"),
    Override("megatron.core.pipeline.module.ChunkedPipelineModule", f"{_PIPE_MODULE}.save_state_dict",
             ("self", "save_dir", "checkpoint_engine", "exclude_frozen_params"), "every chunk's layer files",
             f"{_PIPE_ENGINE}.module_state_dict", "self.module.save_state_dict("),
    Override("megatron.core.pipeline.module.ChunkedPipelineModule", f"{_PIPE_MODULE}.load_state_dir",
             ("self", "load_dir", "checkpoint_engine", "strict"), "every chunk's layer files",
             f"{_PIPE_ENGINE}.load_module_state_dict", "self.module.load_state_dir("),
    *(Override("megatron.core.pipeline.engine.ScheduledPipelineEngine", f"{_PIPE_ENGINE}.{name}", params,
               "zero-bubble H1 and interleaved 1F1B (megatron/core/pipeline/engine.py)",
               f"{_PIPE_ENGINE}.{caller}" if caller else None, call)
      for name, params, caller, call in (
          ("_train_schedule", ("self",), "train_batch", "sched = self._train_schedule()"),
          ("_inference_schedule", ("self", "micro_batches"), "eval_batch",
           "sched = self._inference_schedule(micro_batches)"),
          ("is_first_stage", ("self",), "_exec_load_micro_batch", "if self.is_first_stage():"),
          ("is_last_stage", ("self",), "_exec_forward_pass", "if self.is_last_stage():"),
          ("train_batch", ("self", "data_iter"), None, ""),
          ("reset_activation_shape", ("self",), None, ""),
          ("_exec_load_micro_batch", ("self", "buffer_id"), "_exec_schedule", "self._INSTRUCTION_MAP[type(cmd)]"),
          ("_exec_forward_pass", ("self", "buffer_id"), "_exec_schedule", "self._INSTRUCTION_MAP[type(cmd)]"),
          ("_exec_backward_pass", ("self", "buffer_id"), "_exec_schedule", "self._INSTRUCTION_MAP[type(cmd)]"),
          ("_exec_send_activations", ("self", "buffer_id"), "_exec_schedule", "self._INSTRUCTION_MAP[type(cmd)]"),
          ("_exec_recv_activations", ("self", "buffer_id"), "_exec_schedule", "self._INSTRUCTION_MAP[type(cmd)]"),
          ("_exec_send_grads", ("self", "buffer_id"), "_exec_schedule", "self._INSTRUCTION_MAP[type(cmd)]"),
          ("_exec_recv_grads", ("self", "buffer_id"), None, ""))),
    Override("megatron.model.moe.MoE", "deepspeed.moe.layer.MoE.set_deepspeed_parallelism",
             ("self", "use_data_before_expert_parallel_"),
             "our expert groups exist already (set_expert_groups); DeepSpeed's would make its own",
             f"{_ENGINE}._configure_distributed_model",
             "module.set_deepspeed_parallelism(self._config.use_data_before_expert_parallel_)"),
    Override("megatron.checkpointing.live.safe_io.SafeCheckpointEngine", f"{_TORCH_CKPT}.save",
             ("self", "state_dict", "path"), "hash and fsync every file DeepSpeed writes (DeepSpeed passes them by "
             "keyword in places)", f"{_ENGINE}._save_checkpoint", "self.checkpoint_engine.save(state_dict=state, "
             "path=save_path)"),
    Override("megatron.checkpointing.live.safe_io.SafeCheckpointEngine", f"{_TORCH_CKPT}.load",
             ("self", "path", "map_location"), "weights_only loads of every file DeepSpeed reads"),
)


def resolve(where: str):
    """The object at a dotted path: the longest importable module, then attributes. AttributeError if absent."""
    parts = where.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AttributeError(where)


_checked: set[str] = set()


def _require(seam: str) -> None:
    """At a function's first use: every name it relies on exists (presence only; tests/unit/test_ds_seams.py checks
    signatures and sources). A missing one is one line naming the patch, not an AttributeError inside DeepSpeed."""
    if seam in _checked:
        return
    for t in TOUCHES:
        if t.seam == seam:
            try:
                resolve(t.where)
            except (AttributeError, ImportError):
                raise ConfigError(
                    f"DeepSpeed {deepspeed.__version__} has no {t.where}, which megatron/ds_seams.py {seam} relies on "
                    f"(read from DeepSpeed {DEEPSPEED_VERSION}): install deepspeed=={DEEPSPEED_VERSION} or update "
                    "the seam (python -m pytest tests/unit/test_ds_seams.py names what changed)") from None
    _checked.add(seam)


def check_installed() -> None:
    """At engine creation: every name a training run relies on exists, so a changed DeepSpeed fails here in one line
    rather than at the first save hours later. Presence only, each name once per process (milliseconds)."""
    for seam in dict.fromkeys(t.seam for t in TOUCHES):
        if seam not in _TOOL_SEAMS:
            _require(seam)


def wrap_pipeline_instructions(engine, wrap: Callable[[type, Callable], Callable]) -> None:
    """Give ``engine`` its own instruction map, each method replaced by ``wrap(instruction class, method)``; wraps
    the map the engine runs now (the class's, or an earlier wrap's), so wraps compose.

    DeepSpeed 0.19.8, deepspeed/runtime/pipe/engine.py: ``PipelineEngine._INSTRUCTION_MAP`` (a class-level dict,
    instruction class -> unbound method), read through ``self`` in ``_exec_schedule``, so an instance copy
    instruments one engine only. Why: the progress record's phases (megatron/engine.py) and bench/pipeline.py's timers.
    """
    _require("wrap_pipeline_instructions")
    current = vars(engine).get("_INSTRUCTION_MAP", type(engine)._INSTRUCTION_MAP)
    engine._INSTRUCTION_MAP = {kind: wrap(kind, fn) for kind, fn in current.items()}


def set_expert_groups(name: str, ep_group, ep_ranks: list[int], edp_group, edp_ranks: list[int]) -> None:
    """Make ``name``'s expert-parallel and expert-data-parallel groups (and their ranks) the only ones DeepSpeed knows.

    DeepSpeed 0.19.8, deepspeed/utils/groups.py: the module dicts ``_EXPERT_PARALLEL_GROUP``,
    ``_EXPERT_PARALLEL_GROUP_RANKS``, ``_EXPERT_DATA_PARALLEL_GROUP``, ``_EXPERT_DATA_PARALLEL_GROUP_RANKS``, read
    by name (``_get_expert_parallel_group``, ``_get_expert_data_parallel_group``) by the engine and ZeRO. Why:
    DeepSpeed's MoE layer would create them for its own rank layout; ours come from megatron/topology.py."""
    _require("set_expert_groups")
    from deepspeed.utils import groups

    tables = (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
              groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS)
    for table, value in zip(tables, (ep_group, list(ep_ranks), edp_group, list(edp_ranks)), strict=True):
        table.clear()
        table[name] = value


def set_pipeline_partition(module, parts: list[int]) -> None:
    """What ``PipelineModule._partition_layers`` leaves behind, from our own split: ``parts`` (stage boundaries) and
    this rank's stage bounds.

    DeepSpeed 0.19.8, deepspeed/runtime/pipe/module.py: ``PipelineModule._topo`` (the grid, set in ``__init__``),
    ``global_rank`` and ``_set_bounds(start, stop)``. Why: ChunkedPipelineModule overrides ``_partition_layers``
    (``OVERRIDES``)."""
    _require("set_pipeline_partition")
    module.parts = parts
    stage = module._topo.get_coord(module.global_rank).pipe
    module._set_bounds(start=parts[stage], stop=parts[stage + 1])


def set_layer_bounds(module, start: int, stop: int) -> None:
    """Make specs [start, stop) the layers ``module`` builds, saves and loads now (one chunk of a rank's).

    DeepSpeed 0.19.8, deepspeed/runtime/pipe/module.py: ``PipelineModule._set_bounds(start, stop)``, read by its
    ``_build`` and its layer-file paths. Why: megatron/core/pipeline/module.py holds several chunks per rank."""
    _require("set_layer_bounds")
    module._set_bounds(start=start, stop=stop)


def pipeline_instruction_map(extra: dict) -> dict:
    """DeepSpeed's instruction map (instruction class -> engine method) with ``extra``'s entries added or replaced,
    for a PipelineEngine subclass's own ``_INSTRUCTION_MAP``.

    DeepSpeed 0.19.8, deepspeed/runtime/pipe/engine.py: ``PipelineEngine._INSTRUCTION_MAP``, read through ``self`` in
    ``_exec_schedule`` (DualPipeVEngine extends it the same way). Why: megatron/core/pipeline/engine.py."""
    _require("pipeline_instruction_map")
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return {**PipelineEngine._INSTRUCTION_MAP, **extra}


def send_pipe_meta(engine, outputs, stage: int) -> None:
    """Send the shapes and dtypes of ``outputs`` (a tensor or a tuple) to pipeline ``stage`` (blocking).

    DeepSpeed 0.19.8, deepspeed/runtime/pipe/engine.py: ``PipelineEngine._send_tensor_meta(buffer, recv_stage)``.
    Why: the first send of each chunk of megatron/core/pipeline/engine.py, in DeepSpeed's own format."""
    _require("send_pipe_meta")
    engine._send_tensor_meta(outputs, stage)


def recv_pipe_meta(engine, stage: int) -> tuple[bool, list[tuple[torch.Size, torch.dtype]]]:
    """(one tensor rather than a tuple, [(shape, dtype)] of each) of what pipeline ``stage`` will send.

    DeepSpeed 0.19.8, deepspeed/runtime/pipe/engine.py: ``PipelineEngine._recv_tensor_meta(send_stage)``, which
    returns buffers of those shapes (its shared ones: only their shapes and dtypes are kept)."""
    _require("recv_pipe_meta")
    buffers = engine._recv_tensor_meta(stage)
    single = torch.is_tensor(buffers)
    return single, [(t.shape, t.dtype) for t in ([buffers] if single else buffers)]


@contextlib.contextmanager
def engine_backward(engine) -> Iterator[None]:
    """Within, ``engine`` counts as running its own backward: ZeRO's post-backward callbacks leave the gradients
    alone, as in a non-last pipeline stage's backward.

    DeepSpeed 0.19.8, deepspeed/runtime/engine.py: ``DeepSpeedEngine._running_engine_backward``, read by
    ``_backward_post_hook`` and set around the backward by ``PipelineEngine._exec_backward_pass``. Why: the weight
    pass of zero-bubble H1 (megatron/core/pipeline/engine.py)."""
    _require("engine_backward")
    saved = engine._running_engine_backward
    engine._running_engine_backward = True
    try:
        yield
    finally:
        engine._running_engine_backward = saved


@contextlib.contextmanager
def pipeline_engine_class(engine_cls: Callable) -> Iterator[None]:
    """Within, ``deepspeed.initialize`` builds a pipeline module's engine with ``engine_cls`` (called as
    DeepSpeed calls ``PipelineEngine``).

    DeepSpeed 0.19.8, deepspeed/__init__.py ``initialize``: ``engine_cls = DualPipeVEngine if ... else
    PipelineEngine`` (the module global). Why: megatron/engine.py's ScheduledPipelineEngine, without copying the
    engine construction."""
    _require("pipeline_engine_class")
    saved = deepspeed.PipelineEngine
    deepspeed.PipelineEngine = engine_cls
    try:
        yield
    finally:
        deepspeed.PipelineEngine = saved


def engine_ds_config(engine):
    """The engine's parsed ``DeepSpeedConfig``.

    DeepSpeed 0.19.8, deepspeed/runtime/engine.py: ``DeepSpeedEngine._config`` (set in ``__init__``). Why: a
    checkpoint engine of ours is built from it as DeepSpeed builds its own (``TorchCheckpointEngine(config_params)``
    reads the serialization setting there)."""
    _require("engine_ds_config")
    return engine._config


def swap_checkpoint_engine(engine, new):
    """Install ``new`` as the engine's checkpoint engine; returns the one it had (None if none).

    DeepSpeed 0.19.8, deepspeed/runtime/engine.py: ``DeepSpeedEngine.checkpoint_engine``, through which
    ``save_checkpoint`` / ``load_checkpoint`` write and read every model, ZeRO and pipeline-layer file. Why: safe_io's
    hashed, fsynced, weights_only engine, and --async-save's recorder for one save (megatron/checkpointing/)."""
    _require("swap_checkpoint_engine")
    old = getattr(engine, "checkpoint_engine", None)
    engine.checkpoint_engine = new
    return old


@contextlib.contextmanager
def zero_files_skipped(engine, skip: bool) -> Iterator[None]:
    """Within, ``engine.save_checkpoint`` writes no ZeRO optimizer files when ``skip``.

    DeepSpeed 0.19.8, deepspeed/runtime/engine.py: ``DeepSpeedEngine.save_zero_checkpoint`` (an instance flag that
    ``save_checkpoint`` reads). Why: --no-save-optim."""
    _require("zero_files_skipped")
    saved = engine.save_zero_checkpoint
    try:
        if skip:
            engine.save_zero_checkpoint = False
        yield
    finally:
        engine.save_zero_checkpoint = saved


def is_hp_linked(param) -> bool:
    """True once ZeRO-1/2 or the bf16 optimizer has linked ``param`` to its fp32 partition (even where this rank
    holds no slice of it)."""
    _require("hp_mapping")
    return hasattr(param, "_hp_mapping")


def hp_mapping(param):
    """The ``tensor_fragment`` (lp/hp fragment addresses, param_group_index) of this rank's slice of ``param``'s fp32
    partition; None where it holds none.

    DeepSpeed 0.19.8, deepspeed/utils/mixed_precision_linkage.py ``link_hp_params``: ``param._hp_mapping``
    (deepspeed/utils/tensor_fragment.py ``tensor_fragment``). Why: Adam moments loaded into ZeRO-1/2 partitions
    (megatron/checkpointing/full_state/shard.py)."""
    _require("hp_mapping")
    return getattr(param, "_hp_mapping", None)


@dataclass(frozen=True)
class Zero3Part:
    """This rank's partition of one ZeRO-3 parameter: ``shape`` is the whole (TP-local) parameter's, ``start`` the
    first of its flattened elements this rank holds, ``size`` the partition's length (the last rank's ends in
    padding)."""

    shape: torch.Size
    start: int
    size: int


def zero3_part(param) -> Zero3Part | None:
    """Where ZeRO-3 put ``param`` (None for a parameter it does not partition).

    DeepSpeed 0.19.8, deepspeed/runtime/zero/partition_parameters.py ``Init._partition_param`` (and stage3.py's
    ``set_full_hp_param``): partition ``r`` of ``ds_process_group`` holds ``[r * ds_tensor.ds_numel, (r + 1) *
    ds_tensor.ds_numel)`` of the flattened ``ds_shape``. Why: fp32 master weights and Adam moments loaded at another
    layout (relayout/fill.py) go through the public safe_set_local_*, which take exactly that partition."""
    if not hasattr(param, "ds_id"):
        return None
    _require("zero3_part")
    size = int(param.ds_tensor.ds_numel)
    return Zero3Part(param.ds_shape, torch.distributed.get_rank(group=param.ds_process_group) * size, size)


def zero3_fp32_partitions(optimizer) -> list[torch.Tensor]:
    """ZeRO-3's flat fp32 partitions, the tensors its base optimizer keeps state for (its param_groups are emptied
    between steps).

    DeepSpeed 0.19.8, deepspeed/runtime/zero/stage3.py ``fp32_partitioned_groups_flat``. Why: torch AdamW creates
    its state at the first step; safe_set_local_optimizer_state writes into that state, so it must exist first."""
    _require("zero3_fp32_partitions")
    return list(optimizer.fp32_partitioned_groups_flat)


def unwrapped_comm_backend():
    """DeepSpeed's comm backend (a ``TorchBackend``) once ``init_distributed`` made it; None before, or once wrapped.

    DeepSpeed 0.19.8, deepspeed/comm/comm.py: the module global ``cdb`` (``deepspeed.comm``'s own name is the copy
    imported before init, so it is read from the module), through which ``deepspeed.comm`` calls every collective."""
    _require("wrap_comm_backend")
    from deepspeed.comm import comm as ds_comm

    backend = ds_comm.cdb
    return None if backend is None or getattr(backend, _MARK, False) else backend


def wrap_comm_backend(backend, new_group: Callable, wrap: Callable[[str, Callable], Callable] | None) -> None:
    """Replace ``backend.new_group`` by ``new_group(ranks)`` and, with ``wrap``, each method of ``BACKEND_OPS`` it has
    by ``wrap(op, method)``; marks it wrapped (``unwrapped_comm_backend`` then returns None).

    DeepSpeed 0.19.8, deepspeed/comm/torch.py ``TorchBackend``: ``new_group(ranks)`` (``deepspeed.comm.new_group``
    calls ``cdb.new_group(ranks)``) and the collectives of ``BACKEND_OPS``, replaced as instance attributes. Why:
    every group gets the run's timeout, and every collective records where this rank waits (megatron/core/tracking.py).
    """
    _require("wrap_comm_backend")
    backend.new_group = new_group
    if wrap is not None:
        for op in BACKEND_OPS:
            if hasattr(backend, op):
                setattr(backend, op, wrap(op, getattr(backend, op)))
    setattr(backend, _MARK, True)


def skip_shm_comm_op() -> None:
    """DeepSpeed's comm backend will not build nor load its CPU shared-memory all-reduce op.

    DeepSpeed 0.19.8, deepspeed/comm/torch.py ``build_shm_op`` (called by ``TorchBackend.__init__``): on the CPU
    accelerator it JIT-compiles that op (about 45 s of one core on a first start, under a lock every other starting
    rank waits on) and loads it in every rank, unless ``deepspeed.ops.__compatible_ops__`` marks its builder
    incompatible. Why: it serves only ``inference_all_reduce``, which training never calls (every collective here goes
    through torch.distributed); other accelerators have no such builder, so this changes nothing there."""
    _require("skip_shm_comm_op")
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def removed_config_keys() -> tuple[set[str], set[str]]:
    """The top-level and ``zero_optimization`` keys DeepSpeed refuses as removed.

    DeepSpeed 0.19.8, deepspeed/runtime/config.py: ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``, ``_REMOVED_ZERO_CONFIG_KEYS``.
    Why: tools/extract_ds_config_keys.py lists every key DeepSpeed knows."""
    _require("removed_config_keys")
    from deepspeed.runtime import config

    return set(config._REMOVED_TOP_LEVEL_CONFIG_KEYS), set(config._REMOVED_ZERO_CONFIG_KEYS)


@contextlib.contextmanager
def watching_config_models(seen: Callable[[type, dict], dict]) -> Iterator[None]:
    """Within, every pydantic config model DeepSpeed builds passes its keyword data through ``seen(model class,
    data) -> data`` first.

    DeepSpeed 0.19.8, deepspeed/runtime/config_utils.py: ``DeepSpeedConfigModel.__init__(self, strict=False,
    **data)``, replaced on the class while open. Why: tools/extract_ds_config_keys.py finds the sections parsed by a
    model rather than key by key."""
    _require("watching_config_models")
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    orig = DeepSpeedConfigModel.__init__

    def init(self, strict=False, **data):
        orig(self, strict=strict, **seen(type(self), data))

    DeepSpeedConfigModel.__init__ = init
    try:
        yield
    finally:
        DeepSpeedConfigModel.__init__ = orig
