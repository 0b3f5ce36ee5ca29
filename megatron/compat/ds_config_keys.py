"""Every key of DeepSpeed's JSON config, in exactly one class: honoured, accepted no-op, or refused.

The schema (``ds_schema_keys.txt``, one dotted key a line) was extracted from DeepSpeed 0.19.8 by
``tools/extract_ds_config_keys.py``, which watches ``DeepSpeedConfig`` parse a recording dict and lists the
fields of every pydantic section model (its docstring says how). ``TABLE`` classes each key; a ``X.*``
entry covers everything under ``X``. ``classify`` walks a user's JSON: a key that is in neither the schema
nor our own section is refused (DeepSpeed itself ignores a typo silently).

- honoured: passed to DeepSpeed, which does there what it does under upstream Megatron-DeepSpeed (upstream
  hands the same JSON to ``deepspeed.initialize``), or filled/checked from the flags by megatron/engine.py.
- accepted no-op: provably without effect on the run here (as upstream, where noted); said once in the log.
- refused: one line before any process group naming the key and what to use instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

HONOURED, NOOP, REFUSED = "honoured", "accepted no-op", "refused"
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_schema_keys.txt")
OWN_SECTION = "megatron_frontier"  # hierarchical ZeRO (megatron/core/hierarchical_zero), not DeepSpeed's

_PASS = "passed to DeepSpeed"
_FLAGS = "filled from the flags; a JSON value that disagrees is refused naming both"

TABLE: dict[str, tuple[str, str]] = {}


def _put(cls: str, why: str, *keys: str) -> None:
    for key in keys:
        assert key not in TABLE, key
        TABLE[key] = (cls, why)


def _section(name: str, cls: str, why: str) -> None:
    _put(cls, why, name, name + ".*")


# --- batch, clipping, precision: checked against or filled from the flags (megatron/engine.py) ---
_put(HONOURED, _FLAGS, "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
     "gradient_clipping")
_put(HONOURED, "fp16.enabled / bf16.enabled must agree with --fp16 / --bf16", "fp16", "fp16.enabled", "bf16",
     "bf16.enabled", "bfloat16", "bfloat16.enabled")
_put(HONOURED, "kept as written (the JSON wins, as upstream); a missing key is filled from --loss-scale, "
     "--initial-loss-scale, --loss-scale-window, --hysteresis, --min-loss-scale",
     "fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis", "fp16.min_loss_scale")
_put(HONOURED, _PASS, "fp16.consecutive_hysteresis", "fp16.auto_cast", "fp16.fp16_master_weights_and_grads",
     *(f"{s}.{k}" for s in ("bf16", "bfloat16") for k in ("immediate_grad_update", "check_grad_overflow",
                                                          "bf16_master_weights_and_grads", "bf16_optimizer_states")))

# --- ZeRO ---
_put(HONOURED, "must agree with --zero-stage (or sets it when the flag is not given)", "zero_optimization",
     "zero_optimization.stage")
_put(HONOURED, "ZeRO-Offload: our optimizer becomes DeepSpeed's CPU Adam with the flags' hyper-parameters "
     "(refused before the process group where CPU Adam cannot build)",
     "zero_optimization.offload_optimizer", "zero_optimization.offload_optimizer.device",
     "zero_optimization.cpu_offload")
_put(HONOURED, "filled from megatron_frontier.zero_hpz when set, else " + _PASS,
     "zero_optimization.zero_hpz_partition_size")
_put(HONOURED, _PASS, *(f"zero_optimization.{k}" for k in (
    "allgather_bucket_size", "allgather_partitions", "allgather_sequential", "compute_grad_norm",
    "contiguous_gradients", "cpu_offload_param", "cpu_offload_use_pin_memory", "elastic_checkpoint",
    "enable_sanity_checks",
    "gather_16bit_weights_on_model_save", "ignore_unused_parameters", "leaf_module", "leaf_module.classes",
    "leaf_module.name_suffixes", "leaf_module.names", "legacy_stage1", "load_from_fp32_weights",
    "log_trace_cache_warnings", "max_live_parameters", "max_reuse_distance", "memory_efficient_linear",
    "model_persistence_threshold", "module_granularity_threshold", "offload_optimizer.buffer_count",
    "offload_optimizer.cpuadam_cores_perc", "offload_optimizer.fast_init", "offload_optimizer.pin_memory",
    "offload_optimizer.ratio", "offload_param", "offload_param.buffer_count", "offload_param.buffer_size",
    "offload_param.device", "offload_param.max_in_cpu", "offload_param.pin_memory", "overlap_comm",
    "override_module_apply", "param_persistence_threshold", "parameter_alignment", "pipeline_loading_checkpoint",
    "prefetch_bucket_size", "reduce_bucket_size", "reduce_scatter", "round_robin_gradients",
    "save_muon_momentum_buffer_in_memory", "stage3_allgather_sequential", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_model_persistence_threshold", "stage3_module_granularity_threshold", "stage3_param_persistence_threshold",
    "stage3_prefetch_bucket_size", "stage3_use_all_reduce_for_fetch_params", "sub_group_size",
    "use_all_reduce_for_fetch_params", "use_multi_rank_bucket_allreduce", "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights", "zero_quantized_weights")))
_put(REFUSED, "NVMe offload (ZeRO-Infinity) is not built or tested here: use device \"cpu\" or \"none\"",
     "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path",
     "zero_optimization.offload_optimizer.pipeline_read", "zero_optimization.offload_optimizer.pipeline_write")
_put(REFUSED, "offload_optimizer.super_offload (SuperOffload) is not built or tested here: drop it",
     "zero_optimization.offload_optimizer.super_offload")
_section("zero_optimization.zenflow", REFUSED, "ZenFlow needs DeepSpeed's own ZenFlow optimizer; the optimizer "
         "comes from the flags here (as upstream): drop the section")
_put(REFUSED, "removed from DeepSpeed 0.19 (it refuses the key itself, after the process group): drop it",
     "zero_optimization.mics_shard_size", "zero_optimization.mics_hierarchical_params_gather",
     "zero_optimization.zeropp_loco_param")
_put(NOOP, "the optimizer comes from the flags as upstream's (a tested optimizer for ZeRO), so it is allowed anyway",
     "zero_allow_untested_optimizer")
_put(HONOURED, "false lets ZeRO-Offload use our client optimizer; we hand DeepSpeed its own CPU Adam, so either "
     "value works", "zero_force_ds_cpu_optimizer")

# --- optimizer and schedule: upstream passes its own optimizer and LR schedule to deepspeed.initialize ---
_section("optimizer", NOOP, "as upstream, the optimizer comes from --optimizer, --lr, --adam-*, --weight-decay; "
         "differing values are named in one log line")
_section("scheduler", NOOP, "as upstream, the LR schedule comes from --lr-decay-style, --lr-warmup-*, --min-lr; "
         "differing values are named in one log line")

# --- activation checkpointing (megatron/core/tensor_parallel/recompute.py) ---
_put(HONOURED, "done by our RNG-exact recompute (megatron/core/tensor_parallel/recompute.py CheckpointOptions); "
     "true here or in the matching flag turns it on (upstream's configure let the flag's default overwrite the "
     "JSON); no effect, said in the log, when nothing is recomputed", "activation_checkpointing",
     "activation_checkpointing.partition_activations", "activation_checkpointing.cpu_checkpointing",
     "activation_checkpointing.synchronize_checkpoint_boundary", "activation_checkpointing.profile")
_put(NOOP, "DeepSpeed uses it only to place partitions in one preallocated buffer (allocator layout, same "
     "results); our recompute keeps each partition as its own tensor",
     "activation_checkpointing.contiguous_memory_optimization")
_put(NOOP, "DeepSpeed uses it only to size the contiguous_memory_optimization buffer (upstream overwrites it "
     "from --num-layers / --checkpoint-num-layers); what is recomputed comes from the flags",
     "activation_checkpointing.number_checkpoints")

# --- pipeline engine ---
_put(HONOURED, "--sequence-parallel forces false (refused if set true); else " + _PASS, "pipeline",
     "pipeline.pipe_partitioned", "pipeline.grad_partitioned")
_put(HONOURED, "> 0 means full recompute of every layer (our RNG-exact checkpoint; the engine's own interval is "
     "zeroed)", "pipeline.activation_checkpoint_interval")
_put(NOOP, "DeepSpeed's pipeline engine never reads it: stages and partitioning come from the flags and "
     "GPTModelPipe (as upstream)", "pipeline.stages", "pipeline.partition", "pipeline.seed_layers")
_put(NOOP, "the engine's own checkpointing is off (interval zeroed); our layers checkpoint themselves",
     "pipeline.use_reentrant")

# --- communication, logging, profiling, timers: passed through; DeepSpeed acts on them as under upstream ---
_put(HONOURED, _PASS, "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "log_level",
     "disable_python_gc", "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
     "gradient_predivide_factor", "gradient_allreduce_op", "disable_allgather", "managed_gradient_accumulation",
     "data_types", "data_types.grad_accum_dtype")
for _name in ("tensorboard", "csv_monitor", "comms_logger", "flops_profiler", "timers", "aio"):
    _section(_name, HONOURED, _PASS)
_section("wandb", HONOURED, _PASS + " (refused before the process group when the wandb package is missing)")
_section("comet", HONOURED, _PASS + " (refused before the process group when the comet_ml package is missing)")
_put(REFUSED, "DeepSpeed casts parameters/buffers itself with it; precision comes from --fp16/--bf16 here: drop it",
     "data_types.param_dtype", "data_types.buffer_dtype", "data_types.keep_in_fp32_modules")
_put(HONOURED, _PASS, "checkpoint", "checkpoint.tag_validation", "checkpoint.use_node_local_storage",
     "checkpoint.parallel_write", "checkpoint.checkpoint_serialization")
_ASYNC = ("every checkpoint file goes through our hashing writer (integrity manifest, fsync, commit protocol), so "
          "DeepSpeed's own writers would be bypassed; for saves that do not stop training pass --async-save "
          "(Megatron-LM's flag: host copy, background writer, 'latest' moved once every rank's files are durable)")
_put(REFUSED, "DeepSpeed's fast / decoupled checkpoint writer: " + _ASYNC + "; drop the key", "checkpoint.writer")
_put(REFUSED, "a universal checkpoint is loaded by --universal-checkpoint (upstream's flag, which sets this key "
              "for DeepSpeed): drop the key and pass the flag",
     "checkpoint.load_universal")

# --- provable no-ops ---
_put(NOOP, "only affects deepspeed.initialize(training_data=...), which neither upstream nor this trainer uses",
     "dataloader_drop_last")
_put(NOOP, "DeepSpeed only logs a warning when it is not a multiple of 8; the vocabulary comes from the tokenizer",
     "vocabulary_size")
_put(NOOP, "the expert-parallel groups are always consecutive data-parallel ranks here (DeepSpeed's default order, "
     "megatron/topology.py); the other order changes only which ranks exchange tokens, not a number of the run",
     "use_data_before_expert_parallelism")
_put(NOOP, "DeepSpeed reads it only without an mpu; the sequence-parallel size comes from the flags",
     "sequence_parallel_size")
_section("autotuning", NOOP, "read only by the deepspeed launcher's --autotuning, never by a training run")

# --- refused: features not built here ---
_section("torch_autocast", REFUSED, "precision comes from --fp16/--bf16: drop the section")
_section("compile", REFUSED, "DeepCompile is not used here: drop the section (--compile compiles each layer)")
_section("tensor_parallel", REFUSED, "DeepSpeed AutoTP is for HF models: use --tensor-model-parallel-size")
_section("expert_parallel", REFUSED, "DeepSpeed's AutoEP rewrites Hugging Face MoE blocks: drop the section and use "
         "--num-experts / --moe-expert-parallel-size (docs/moe.md)")
_section("hybrid_engine", REFUSED, "the RLHF hybrid engine is not built here: drop the section")
_section("weight_quantization", REFUSED, "quantized weights (ZeRO-Init) are not built here: drop the section")
_section("data_efficiency", REFUSED, "curriculum learning / random-LTD are not built here: drop the section")
_section("datastates_ckpt", REFUSED, "DataStates asynchronous checkpointing is not built here: " + _ASYNC
         + "; drop the section")
for _name in ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
              "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning", "progressive_layer_drop"):
    _section(_name, REFUSED, "removed from DeepSpeed 0.19 (it refuses the key itself, after the process group): "
             "drop it")


LEGACY: dict[str, str] = {
    "aio.thread_count": "an older DeepSpeed's name (now intra_op_parallelism) that DeepSpeed 0.19.8 no longer reads; "
                        "aio settings only serve NVMe offload, which is refused here",
}
"""Keys real job scripts still carry that DeepSpeed 0.19.8 no longer reads: provable no-ops, said once (not typos)."""


@dataclass(frozen=True)
class Verdict:
    key: str
    cls: str
    why: str
    drop: bool = False
    """An off value of a refused key: removed before DeepSpeed sees it (DeepSpeed refuses some keys outright)."""


def schema_keys() -> list[str]:
    with open(SCHEMA_FILE) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def lookup(key: str) -> tuple[str, str] | None:
    """The class of one dotted key: its own entry, else the nearest ``ancestor.*`` entry."""
    if key in TABLE:
        return TABLE[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        hit = TABLE.get(".".join(parts[:i]) + ".*")
        if hit is not None:
            return hit
    return None


def _off(value) -> bool:
    """null, false, {} or a section with "enabled": false: the key asks for nothing."""
    return value is None or value is False or value == {} or isinstance(value, dict) and value.get("enabled") is False


def classify(cfg: dict) -> list[Verdict]:
    """One verdict per key of the user's JSON, parents before children. A key DeepSpeed does not know is
    refused; a refused key whose value is off (null, false, {}, ``{"enabled": false}``) is an accepted no-op
    and is dropped from the config."""
    schema = set(schema_keys())
    parents = {k.rsplit(".", 1)[0] for k in schema if "." in k}
    out: list[Verdict] = []

    def walk(d: dict, prefix: str) -> None:
        for name, value in d.items():
            key = prefix + name
            if key == OWN_SECTION or key.startswith(OWN_SECTION + "."):
                out.append(Verdict(key, HONOURED, "hierarchical ZeRO (megatron/core/hierarchical_zero)"))
                continue
            if key in LEGACY:
                out.append(Verdict(key, NOOP, LEGACY[key], drop=True))
                continue
            hit = lookup(key)
            if key not in schema and key.rsplit(".", 1)[0] in parents:
                hit = None  # a sibling of known keys that is not one of them: a typo
            if hit is None:
                out.append(Verdict(key, REFUSED, "not a DeepSpeed 0.19.8 config key (DeepSpeed would ignore it "
                                                 "silently): check the spelling or drop it"))
                continue
            cls, why = hit
            if key in parents and value is not None and not isinstance(value, dict) and cls != REFUSED:
                out.append(Verdict(key, REFUSED, f"must be a JSON object of {key}.* keys, got {value!r}"))
                continue
            if cls == REFUSED and _off(value):
                out.append(Verdict(key, NOOP, f"set to {value!r}, which asks for nothing; dropped", drop=True))
                continue
            out.append(Verdict(key, cls, why))
            if isinstance(value, dict) and key in parents:
                walk(value, key + ".")

    walk(cfg, "")
    return out
