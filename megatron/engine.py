"""The one seam to DeepSpeed: build and check the ds_config from the validated RunConfig, then call
``deepspeed.initialize``. Nothing else in the project imports ``deepspeed`` for training.

The validated RunConfig is the single source of truth. What a user's ``--deepspeed_config`` decides for the run
as upstream (its ZeRO stage, clipping, precision, recompute, hierarchical ZeRO where no flag gives them) is in it
already (megatron/arguments/deepspeed_json.py); the JSON may add DeepSpeed knobs, but a batch size, clipping,
precision or ZeRO stage that disagrees with the flags is refused with a message naming both values, never silently
resolved. Every key of the JSON is honoured, an accepted no-op (said
once in the log) or refused before the process group: megatron/compat/ds_config_keys.py classes them.
The fp16 loss-scale keys are the exception upstream made: the JSON wins over a contradicting flag, with a
warning. The JSON 'optimizer'/'scheduler' sections are not used, as upstream (one log line each).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from megatron import ds_seams
from megatron.compat import ds_json
from megatron.compat.ds_json import load_ds_config
from megatron.config import RunConfig
from megatron.core import hierarchical_zero
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline.engine import ScheduledPipelineEngine
from megatron.errors import ConfigError
from megatron.model.moe import MoE
from megatron.model.moe_experts import expert_group_name
from megatron.optim.grad_norm import grad_norm
from megatron.optim.lr_schedule import OptimizerParamScheduler
from megatron.optim.optimizer import make_optimizer, param_groups
from megatron.progress import PROGRESS

NOTES_KEY = "megatron_notes"  # log lines for rank 0, stripped before DeepSpeed sees the config
TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deepspeed_configs")


def template_path(zero_stage: int, precision: str) -> str:
    return os.path.join(TEMPLATE_DIR, f"zero{zero_stage}_{precision}.json")


def _agree(cfg: dict, key: str, want, flag: str, source: str) -> None:
    have = cfg.get(key)
    if isinstance(have, str) and have.startswith("filled from"):
        have = None
    if have is not None and have != want:
        raise ConfigError(f"{source} sets {key}={have} but {flag} gives {want}: make them agree or drop "
                          f"{key} from the JSON (it is filled from the flags)")
    cfg[key] = want


def build_ds_config(run: RunConfig) -> dict:
    """The complete ds_config for this run: the user's JSON (``run.deepspeed``, already merged into the config by
    megatron/arguments/deepspeed_json.py) or the template for the ZeRO stage and precision, filled from the config
    and checked against it. A pure function of ``run``: it reads the config and writes only the dict it returns."""
    p, t, o, prec, ds = run.parallel, run.training, run.optimizer, run.precision, run.deepspeed
    user_config, source = ds.config, ds.source
    cfg = json.loads(ds.user_json) if user_config else load_ds_config(template_path(p.zero_stage, prec.name))
    notes = ds_json.apply_table(cfg, source)  # unknown and refused keys stop here, before any process group
    notes = notes if user_config else []  # our own template's keys need no word
    accel_cpu = get_accelerator().device_name() == "cpu"
    ds_json.check_offload(cfg, o, p.zero_stage, accel_cpu, source)
    offload = ds_json.offload_device(cfg) == "cpu"
    if (offload or o.cpu_optimizer or o.optimizer != "adam") and p.zero_hierarchy:
        raise ConfigError("--zero-hierarchy runs its own AdamW: drop --optimizer sgd / --cpu-optimizer / "
                          "offload_optimizer, or --zero-hierarchy")
    notes += ds_json.optimizer_note(cfg, o, offload)
    ds_json.check_monitors(cfg, source)

    gas = t.grad_accumulation_steps(p.dp)
    _agree(cfg, "train_micro_batch_size_per_gpu", t.micro_batch_size, "--micro-batch-size", source)
    _agree(cfg, "train_batch_size", t.global_batch_size, "--global-batch-size", source)
    _agree(cfg, "gradient_accumulation_steps", gas, "--global-batch-size/(--micro-batch-size x DP)", source)
    _agree(cfg, "gradient_clipping", float(o.clip_grad), "--clip-grad", source)
    offload = [k for k in ("offload_optimizer", "offload_param")
               if (cfg.get("zero_optimization", {}).get(k) or {}).get("device", "none") != "none"]
    if t.rampup_batch_size is not None and offload:
        # ZeRO-Offload sizes its host gradient accumulation for the JSON's accumulation steps at setup.
        raise ConfigError(f"--rampup-batch-size with {source}'s zero_optimization.{offload[0]}: ZeRO-Offload "
                          "keeps a fixed number of micro-batches per step; drop one of them")

    zero = cfg.setdefault("zero_optimization", {})
    if zero.get("stage", p.zero_stage) != p.zero_stage:
        raise ConfigError(f"{source} sets zero_optimization.stage={zero['stage']} but --zero-stage gives "
                          f"{p.zero_stage}: make them agree or drop one")
    zero["stage"] = p.zero_stage
    _zero_hierarchy(cfg, run, source)
    if p.ulysses > 1 and p.zero_stage == 3:
        if zero.get("reduce_scatter") is False:
            # Its all-reduce path divides by DP and its reduce-scatter path by SP x DP, chosen per bucket size.
            raise ConfigError(f"{source} sets zero_optimization.reduce_scatter=false with --ds-sequence-parallel-size "
                              f"{p.ulysses}: DeepSpeed's ZeRO-3 then scales SP gradients inconsistently; drop the key")
        zero["reduce_scatter"] = True
    if run.model.moe.enabled and p.zero_stage in (1, 2) and zero.get("reduce_scatter") is False:
        # Its all-reduce path reduces a whole gradient bucket over the data-parallel group, experts included.
        raise ConfigError(f"{source} sets zero_optimization.reduce_scatter=false with --num-experts: DeepSpeed then "
                          "sums different experts' gradients over the data-parallel group; drop the key")
    if run.model.moe.enabled and p.zero_stage == 2 and zero.get("contiguous_gradients") is False:
        raise ConfigError(f"{source} sets zero_optimization.contiguous_gradients=false with --num-experts: DeepSpeed's "
                          "ZeRO-2 partitions expert gradients only from the contiguous buffer; drop the key")
    schedule = p.pipeline_schedule
    if p.pp > 1 and (p.sequence_parallel or run.model.moe.enabled or schedule != "1f1b"):
        # The engine's pipe/grad partitioning sends 1/TP of a stage's output and all-gathers it on the next
        # stage, assuming every TP rank holds the same tensor; with SP each holds its own sequence slice. With
        # experts a stage sends two tensors that need gradients, which its partitioning cannot (upstream asserts).
        # The zero-bubble and interleaved schedules (megatron/core/pipeline/engine.py) send whole tensors.
        pipe_cfg = cfg.setdefault("pipeline", {})
        why = "corrupts activations with --sequence-parallel: drop the key or --sequence-parallel" \
            if p.sequence_parallel else "cannot send the MoE loss between stages (--num-experts): drop the key" \
            if run.model.moe.enabled else f"is not built for the {schedule} pipeline schedule: drop the key"
        for key in ("pipe_partitioned", "grad_partitioned"):
            if pipe_cfg.get(key):
                raise ConfigError(f"{source} sets pipeline.{key}=true, which {why}")
            pipe_cfg[key] = False
    notes += _activation_checkpointing(cfg, run)

    if ds.precision_from_json:
        notes.append(f"> {source} enables {ds.precision_from_json} and neither --fp16 nor --bf16 is given: training "
                     f"in {ds.precision_from_json}, as upstream under --deepspeed")
    for name in ("fp16", "bf16"):
        enabled_in_json = bool(cfg.get(name, {}).get("enabled", False))
        wanted = getattr(prec, name)
        if user_config and name in cfg and enabled_in_json != wanted:
            raise ConfigError(f"{source} has {name}.enabled={str(enabled_in_json).lower()} but --{name} is "
                              f"{'set' if wanted else 'not set'}: make them agree")
        if wanted:
            cfg.setdefault(name, {})["enabled"] = True
        else:
            cfg.pop(name, None)
    if prec.fp16 and not get_accelerator().is_fp16_supported():
        raise ConfigError(f"--fp16: DeepSpeed does not support fp16 on this {get_accelerator().device_name()} device; "
                          "use --bf16 (advised on MI250X) or neither for fp32")
    notes += ds_json.fp16_loss_scale(cfg, prec, source, user_json=bool(user_config))
    ds_json.check_loss_scale_values(cfg, source)
    # Upstream's FusedAdam is on DeepSpeed's tested list; torch's AdamW/SGD are the same updates.
    cfg["zero_allow_untested_optimizer"] = True
    cfg.setdefault("steps_per_print", 10**9)
    cfg[NOTES_KEY] = list(run.notes) + notes
    return cfg


def log_notes(ds_config: dict, rank: int) -> None:
    """Print build_ds_config's notes (no-op keys, unused sections, warnings) once, on rank 0."""
    if rank == 0:
        for line in ds_config.get(NOTES_KEY, ()):
            print(line, flush=True)


def _zero_hierarchy(cfg: dict, run: RunConfig, source: str) -> None:
    """Fill and check the ``megatron_frontier`` section (hierarchical ZeRO); initialize_engine strips it. The mode's
    refusals are the config's (megatron/config/parallel.py), which holds it whether the flags or the JSON turned it
    on."""
    p = run.parallel
    if p.zero_hierarchy and not run.deepspeed.hierarchy_from_json:
        section = cfg.setdefault(hierarchical_zero.SECTION, {})
        levels = list(hierarchical_zero.config.parse_levels(p.zero_hierarchy))
        _agree(section, "zero_hierarchy", levels, "--zero-hierarchy", source)
        if p.zero_hierarchy_weights:
            _agree(section, "zero_hierarchy_weights", p.zero_hierarchy_weights, "--zero-hierarchy-weights", source)
        section["zero_hierarchy_int8"] = bool(section.get("zero_hierarchy_int8")) or p.zero_hierarchy_int8
    hierarchical_zero.from_ds_config(cfg)  # the section's own keys and tiers
    section = cfg.get(hierarchical_zero.SECTION) or {}
    if section.get("zero_hpz"):  # DeepSpeed's own hpZ, sized from our topology, never from device_count()
        hpz = hierarchical_zero.hpz_partition_size(cfg, p.tp, p.zero_stage, hierarchical_zero.ranks_per_node(section))
        _agree(cfg["zero_optimization"], "zero_hpz_partition_size", hpz, f"{hierarchical_zero.SECTION}.zero_hpz",
               source)


def _activation_checkpointing(cfg: dict, run: RunConfig) -> list[str]:
    """Notes on the recompute DeepSpeed's activation-checkpointing keys chose (megatron/arguments/deepspeed_json.py
    merged them into the model config). The engine's own ``pipeline.activation_checkpoint_interval`` is zeroed: our
    layers checkpoint themselves (DeepSpeed's checkpoint would not replay our TP RNG tracker)."""
    m, notes = run.model, []
    if int(cfg.get("pipeline", {}).get("activation_checkpoint_interval", 0) or 0) > 0:
        cfg["pipeline"]["activation_checkpoint_interval"] = 0
    flags = {key: flag for key, _, flag in ds_json.ACTIVATION_CHECKPOINTING}
    for key in run.deepspeed.recompute_from_json:
        notes.append(f"{ds_json.NOTE} activation_checkpointing.{key}=true honoured (upstream's "
                     f"--deepspeed-activation-checkpointing overwrote it with {flags[key]}'s default, false)")
    full = m.recompute_granularity == "full"
    chosen = [key for key, attr, _ in ds_json.ACTIVATION_CHECKPOINTING if getattr(m, attr)]
    if chosen and not full:
        notes.append(f"{ds_json.NOTE} activation_checkpointing {', '.join(chosen)}: no effect, nothing is "
                     "recomputed without --checkpoint-activations / --recompute-granularity full")
    if full and m.recompute_partition and run.parallel.tp == 1:
        notes.append("> --partition-activations / partition_activations: no effect with "
                     "--tensor-model-parallel-size 1 (nothing to split the checkpoints over)")
    elif full and m.recompute_partition and run.parallel.sequence_parallel:
        notes.append("> --partition-activations / partition_activations: no effect with --sequence-parallel "
                     "(each rank's checkpointed input is already its 1/TP of the sequence)")
    if run.parallel.pp > 1 and m.checkpoint_chunk_layers > 1 and full:
        raise ConfigError(f"checkpoints of {m.checkpoint_chunk_layers} layers (--checkpoint-num-layers / "
                          "--recompute-method uniform --recompute-num-layers) with --pipeline-model-parallel-size "
                          f"{run.parallel.pp}: the pipeline checkpoints layer by layer; use 1 layer per checkpoint")
    return notes


def initialize_engine(model: torch.nn.Module, run: RunConfig, pstate: ParallelState, ds_config: dict):
    """Wrap ``model`` in a DeepSpeed engine with AdamW and Megatron's LR schedule."""
    ds_seams.check_installed()
    o = run.optimizer
    hcfg = hierarchical_zero.from_ds_config(ds_config)
    if hcfg is not None:  # our own sharded engine; DeepSpeed never sees the section
        return hierarchical_zero.create_engine(
            model, run, pstate, hcfg,
            lambda groups: make_optimizer(groups, o, weight_decay=o.weight_decay),
            lambda opt: OptimizerParamScheduler.from_run(opt, run))
    ds_config = {k: v for k, v in ds_config.items() if k not in (hierarchical_zero.SECTION, NOTES_KEY)}
    # From the flags, as upstream (megatron/optim/optimizer.py); ZeRO-Offload steps on the host.
    offload = ds_json.offload_device(ds_config) == "cpu"
    optimizer = make_optimizer(param_groups(model, o.weight_decay), o, offload=offload)
    scheduler = OptimizerParamScheduler.from_run(optimizer, run)
    if run.parallel.zero_stage == 3 and pstate.ulysses.size > 1:
        # DeepSpeed converts a plain module to ZeRO-3 over mpu.get_data_parallel_group() (pure DP), which would
        # leave SP peers unreduced; Ulysses shards and reduce-scatters over SP x DP, like ZeRO-1/2 do. That
        # reduce-scatter averages over SP x DP where the other stages divide by DP alone: the loss's backward
        # (megatron/core/ulysses.py sequence_mean) makes up the factor SP.
        deepspeed.zero.Init(module=model, data_parallel_group=pstate.ulysses_dp.group, config_dict_or_path=ds_config,
                            mpu=pstate)
        model.sequence_grad_scale = float(pstate.ulysses.size)
    if run.parallel.zero_stage == 3 and getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings:
        # The output layer reads the embedding's weight from outside that module: tell ZeRO-3 to gather it.
        deepspeed.zero.register_external_parameter(model, model.embedding.word_embeddings.weight)
    pipeline = isinstance(model, deepspeed.PipelineModule)
    experts = any(isinstance(m, MoE) for m in model.modules())
    if experts:
        _register_expert_groups(pstate)
    if (pipeline or experts) and _plain_fp32(run) and ds_config.get("gradient_clipping", 0) > 0:
        # DeepSpeed's ZeRO-0 clip under a pipeline counts replicated weights on stage 0 only (its "model
        # parallel rank" spans PP x TP), and with experts averages the ranks' norms (each counts its own experts
        # only): clip ourselves, after the DP, expert and tied-weight reductions.
        ds_config = dict(ds_config, gradient_clipping=0.0)
        optimizer.register_step_pre_hook(_pipeline_clip_hook(model, pstate, o.clip_grad))
    if pipeline and pstate.ulysses.size > 1:
        # Its grid's data axis is SP x DP, and it checks train_batch_size against micro-batch x accumulation x
        # that axis: every SP rank counts as a replica there (each holds 1/SP of the same samples).
        ds_config = dict(ds_config, train_batch_size=ds_config["train_batch_size"] * pstate.ulysses.size)
        # The engine then steps the schedule by that inflated count (it passes no lr_kwargs): count samples.
        scheduler.engine_samples_per_sample = pstate.ulysses.size
    # The pipeline engine takes its groups from the module's grid (which matches ``pstate``) and refuses an mpu.
    schedule = run.parallel.pipeline_schedule
    if pipeline and schedule != "1f1b":  # zero-bubble H1 / interleaved; 1F1B stays DeepSpeed's own engine
        v = run.parallel.virtual_stages(run.model.num_layers)
        if getattr(model, "num_chunks", 1) != v:
            raise ConfigError(f"the {schedule} pipeline schedule needs a model of {v} chunk(s) per rank: build "
                              f"GPTModelPipe with virtual_stages={v} (pretrain_gpt.py's model_provider does)")
        chosen = ds_seams.pipeline_engine_class(functools.partial(ScheduledPipelineEngine, schedule=schedule))
    else:
        chosen = contextlib.nullcontext()
    with chosen:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               mpu=None if pipeline else pstate, config=ds_config)
    if pipeline:
        _track_pipeline_phases(engine)
    return engine


# The pipeline schedules' instructions (DeepSpeed's 1F1B, megatron/core/pipeline's), under the names the progress
# record gives them (the hang verdict and the
# straggler report read these phases; the plain engine's are set by megatron/training/step.py).
_PIPE_PHASES = {"LoadMicroBatch": "data", "ForwardPass": "forward", "BackwardPass": "backward",
                "BackwardInputPass": "backward", "WeightPass": "backward", "SendActivation": "send activation",
                "RecvActivation": "recv activation", "SendGrad": "send grad", "RecvGrad": "recv grad",
                "DrainSends": "send grad", "ReduceGrads": "reduce grads", "ReduceTiedGrads": "reduce tied grads",
                "OptimizerStep": "optimizer"}


def _track_pipeline_phases(engine) -> None:
    """Each schedule instruction enters its phase before it runs (this engine only)."""

    def tracked(kind: type, fn):
        phase = _PIPE_PHASES.get(kind.__name__, kind.__name__)

        def run(self, *args, **kwargs):
            PROGRESS.enter(phase)
            return fn(self, *args, **kwargs)

        return run

    ds_seams.wrap_pipeline_instructions(engine, tracked)


def _register_expert_groups(pstate: ParallelState) -> None:
    """DeepSpeed's engine and ZeRO find the expert groups by name in deepspeed.utils.groups, where its MoE layer
    would create them (and only for its own rank layout): ours (megatron/topology.py "ep" / "edp") are put there
    instead, under the name our MoE layers give their parameters, so the all-to-alls and the gradient reductions run
    over the same ranks. The run's expert groups are exactly these (an earlier engine's in this process are dropped)."""
    if pstate.ep.group is None and pstate.world_size > 1:
        raise RuntimeError("a model with experts needs its expert groups: build the ParallelState with ep_size")
    ds_seams.set_expert_groups(expert_group_name(pstate.ep.size), pstate.ep.group, pstate.ep.ranks, pstate.edp.group,
                               pstate.edp.ranks)


def is_pipeline(engine) -> bool:
    """True for DeepSpeed's pipeline engine (drive it with train_batch / eval_batch)."""
    return isinstance(engine, deepspeed.PipelineEngine)


def _plain_fp32(run: RunConfig) -> bool:
    return run.parallel.zero_stage == 0 and run.precision.name == "fp32"


def _pipeline_clip_hook(model: torch.nn.Module, pstate: ParallelState, max_norm: float):
    def hook(optimizer, args, kwargs) -> None:
        # The tied copy of the word embeddings on the last stage (ds_pipe_replicated) is counted once.
        params = [p for p in model.parameters() if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
        norm = grad_norm(params, pstate)  # on the device: the clip below needs no host sync
        optimizer.megatron_grad_norm = norm
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).reshape(())
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))  # x1.0 when within max_norm: exact

    return hook
