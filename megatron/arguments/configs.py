"""The parsed flags -> the validated config dataclasses (megatron/config). Only the parser side and entry points
call this; every module after it takes the configs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from collections.abc import Callable

from megatron.arguments.deepspeed_json import with_deepspeed_json
from megatron.arguments.checkpoint_args import take_checkpoint_args
from megatron.arguments.parser import given_dests, parse_args
from megatron.config import (
    CheckpointSettings,
    DataConfig,
    LogOptions,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ProfileConfig,
    RunConfig,
    RuntimeConfig,
    TrainingConfig,
    named_model,
)
from megatron.errors import ConfigError
from megatron.tokenizer import DEFAULT_TOKENIZER_TYPE, Vocabulary


_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
# Upstream's model variants, each a ModelConfig field named as its flag's dest.
_VARIANTS = ("squared_relu", "apply_layernorm_1p", "apply_residual_connection_post_layernorm",
             "fp32_residual_connection", "embedding_weights_in_fp32", "init_method_xavier_uniform")


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    overrides = {
        "num_layers": args.num_layers, "hidden_size": args.hidden_size, "ffn_hidden_size": args.ffn_hidden_size,
        "num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads,
        "seq_length": args.seq_length, "max_position_embeddings": args.max_position_embeddings,
        "normalization": args.normalization, "swiglu": args.swiglu, "openai_gelu": args.openai_gelu,
        "untie_embeddings_and_output_weights": args.untie_embeddings_and_output_weights,
    }
    if args.position_embedding_type or args.use_rotary_position_embeddings:
        overrides["position_embedding_type"] = args.position_embedding_type or "rope"
    if args.disable_bias_linear:
        overrides["add_bias_linear"] = False
    overrides = {k: v for k, v in overrides.items() if v is not None}
    granularity = args.recompute_granularity or ("full" if args.checkpoint_activations else
                                                 "selective" if args.recompute_activations else None)
    recompute_layers, chunk = _recompute_layout(args, granularity)
    common = dict(
        vocab_size=vocab_size, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        layernorm_epsilon=args.layernorm_epsilon, rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        use_cpu_initialization=args.use_cpu_initialization, attention_backend=attention_backend(args),
        recompute_granularity=granularity, recompute_num_layers=recompute_layers, checkpoint_chunk_layers=chunk,
        recompute_partition=args.partition_activations, recompute_on_cpu=args.checkpoint_in_cpu,
        recompute_synchronize=args.synchronize_each_layer, recompute_profile=args.profile_backward,
        bias_gelu_fusion=args.bias_gelu_fusion, bias_dropout_fusion=args.bias_dropout_fusion,
        torch_compile=args.torch_compile, **{f: getattr(args, f) for f in _VARIANTS},
        moe=_by_name(MoEConfig, args, num_experts=tuple(args.num_experts)),
    )
    if args.model_size:
        return named_model(args.model_size, **overrides, **common)
    missing = [f"--{f.replace('_', '-')}" for f in _SHAPE_FLAGS if getattr(args, f) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not given: pass the model shape or --model-size NAME")
    return ModelConfig(**overrides, **common)


def _recompute_layout(args: argparse.Namespace, granularity: str | None) -> tuple[int | None, int]:
    """(layers recomputed, layers per checkpoint) with upstream's meaning of the recompute flags.

    Upstream's full recompute takes --deepspeed-activation-checkpointing's branch first (checkpoints of
    --checkpoint-num-layers over all layers), else --recompute-method: uniform = checkpoints of
    --recompute-num-layers over all layers, block = the first --recompute-num-layers layers one by one."""
    if args.recompute_method is not None and granularity != "full":
        raise ConfigError(f"--recompute-method {args.recompute_method} applies to full recompute only (as upstream): "
                          "add --recompute-granularity full (or --checkpoint-activations), or drop it")
    if granularity == "full" and args.deepspeed_activation_checkpointing:
        return None, args.checkpoint_num_layers or 1
    if args.recompute_method == "uniform":
        return None, args.recompute_num_layers or 1
    if args.recompute_method == "block":
        return args.recompute_num_layers or 1, 1
    return args.recompute_num_layers, 1


def recompute_notes(args: argparse.Namespace, granularity: str | None) -> list[str]:
    """Recompute flags that are provable no-ops for this command line (as upstream), said once in the log."""
    notes, full = [], granularity == "full"
    if args.deepspeed_activation_checkpointing and not full:
        notes.append("--deepspeed-activation-checkpointing: nothing is recomputed without --checkpoint-activations "
                     "or --recompute-granularity full (as upstream)")
    if args.checkpoint_num_layers is not None and not (full and args.deepspeed_activation_checkpointing):
        notes.append("--checkpoint-num-layers has no effect without --deepspeed-activation-checkpointing and full "
                     "recompute (as upstream; --recompute-method uniform --recompute-num-layers N is the same)")
    for flag, given in (("--partition-activations", args.partition_activations),
                        ("--checkpoint-in-cpu", args.checkpoint_in_cpu),
                        ("--synchronize-each-layer", args.synchronize_each_layer),
                        ("--profile-backward", args.profile_backward)):
        if given and not full:
            notes.append(f"{flag} has no effect: nothing is recomputed without full recompute")
    return ["> " + n for n in notes]


def attention_backend(args: argparse.Namespace) -> str:
    if args.use_flash_attn_v2 and args.use_flash_attn_triton:
        raise ConfigError("--use-flash-attn-v2 and --use-flash-attn-triton are both set: pick one")
    return "hip" if args.use_flash_attn_v2 else "triton" if args.use_flash_attn_triton else "auto"


def _by_name(cls, args: argparse.Namespace, **given):
    """A config dataclass whose fields are named as their flags' dests: each filled from its flag, unless ``given``
    (a value the flag does not hold as is: a default resolved, a list made a tuple, a number from elsewhere)."""
    return cls(**{f.name: given[f.name] if f.name in given else getattr(args, f.name)
                  for f in dataclasses.fields(cls) if f.name in given or hasattr(args, f.name)})


def run_config_from_args(args: argparse.Namespace, world_size: int, vocab_size: int) -> RunConfig:
    """The flags' settings, with what a --deepspeed_config decides merged in (megatron/arguments/deepspeed_json.py),
    validated together as the RunConfig is built; raises ConfigError naming the flags and the fix. The learning rate,
    the length of training and the data must be given."""
    if args.lr is None:
        raise ConfigError("--lr not given: set a learning rate, e.g. --lr 3e-4")
    if args.train_iters is None and args.train_samples is None:
        raise ConfigError("--train-iters not given: set how many iterations (or --train-samples) to train")
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are both given: pick one")
    return build_run_config(args, world_size, vocab_size, data_config_from_args(args))


def build_run_config(args: argparse.Namespace, world_size: int, vocab_size: int, data: DataConfig) -> RunConfig:
    """The RunConfig of the flags with ``data`` as its data settings (what run_config_from_args checks first, a dry
    run does not need)."""
    model = model_config_from_args(args, vocab_size)
    parallel = _by_name(ParallelConfig, args, world_size=world_size, zero_stage=args.zero_stage or 0,
                        num_layers_per_virtual_pipeline_stage=_layers_per_chunk(args, model.num_layers))
    fields = with_deepspeed_json(dict(
        model=model,
        parallel=parallel,
        optimizer=_by_name(OptimizerConfig, args, clip_grad=1.0 if args.clip_grad is None else args.clip_grad),
        precision=_by_name(PrecisionConfig, args),
        training=_by_name(TrainingConfig, args,
                          rampup_batch_size=tuple(args.rampup_batch_size) if args.rampup_batch_size else None),
        data=data,
        checkpoint=CheckpointSettings(
            save=args.save, load=args.load, load_tag=args.load_tag, save_interval=args.save_interval,
            no_save_optim=args.no_save_optim, no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
            finetune=args.finetune,
            exit_on_missing=args.exit_on_missing_checkpoint, keep_last=args.keep_last_n_checkpoints,
            trust_checkpoint=args.trust_checkpoint, verify=args.verify_checkpoint,
            universal_checkpoint=args.universal_checkpoint, async_save=args.async_save),
        logging=log_options_from_args(args),
        profile=ProfileConfig(mode=args.profile, steps=args.profile_steps,
                              ranks=tuple(args.profile_ranks) if args.profile_ranks is not None else None,
                              tensorboard_dir=args.tensorboard_dir),
        runtime=_by_name(RuntimeConfig, args),
    ), args.deepspeed_config, zero_stage_given=args.zero_stage is not None, clip_grad_given=args.clip_grad is not None)
    # The notes speak of the flags as given (the JSON's recompute keys are build_ds_config's to say).
    return RunConfig(**fields, notes=flag_notes(args, model, parallel, fields["precision"]),
                     flags=dict(vars(args), tokenizer_type=data.tokenizer_type))


def _layers_per_chunk(args: argparse.Namespace, num_layers: int) -> int | None:
    """--num-layers-per-virtual-pipeline-stage, or Megatron-LM's --virtual-pipeline-model-parallel-size V as
    num_layers / (PP x V); None when one chunk per rank results (that is the 1F1B schedule)."""
    n, v, pp = args.num_layers_per_virtual_pipeline_stage, args.virtual_pipeline_model_parallel_size, \
        args.pipeline_model_parallel_size
    if v is not None:
        if n is not None:
            raise ConfigError("--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage are "
                              "the same setting (Megatron-LM's and upstream's): keep one")
        if num_layers % (pp * v):
            raise ConfigError(f"--virtual-pipeline-model-parallel-size {v}: --num-layers {num_layers} is not a "
                              f"multiple of {v} x --pipeline-model-parallel-size {pp}; use a V with V x {pp} dividing "
                              f"{num_layers}")
        n = num_layers // (pp * v)
    return None if n is not None and pp > 1 and n * pp == num_layers else n


def flag_notes(args: argparse.Namespace, model: ModelConfig, parallel: ParallelConfig,
               precision: PrecisionConfig) -> tuple[str, ...]:
    """Flags that are provable no-ops for this command line (as upstream), said once in the log."""
    notes = recompute_notes(args, model.recompute_granularity)
    if args.rotary_percent != 1.0 and model.position_embedding_type != "rope":
        notes.append(f"> --rotary-percent {args.rotary_percent:g} has no effect without rotary embeddings "
                     "(--position-embedding-type rope), as upstream")
    if args.split != DataConfig.split and any(getattr(args, f"{s}_data_path") for s in ("train", "valid", "test")):
        notes.append(f"> --split {args.split} selects no documents with the per-split data paths (each split reads "
                     "its corpora whole); it only names the index cache, as upstream")
    if args.standalone_embedding_stage and parallel.pp == 1:
        notes.append("> --standalone-embedding-stage has no effect with --pipeline-model-parallel-size 1, as upstream")
    if model.squared_relu and model.torch_compile and model.bias_gelu_fusion:  # upstream drops it silently
        notes.append("> --bias-gelu-fusion falls back with --squared-relu (no GeLU to fuse): fc1 adds its bias in "
                     "its matmul and --compile compiles the squared ReLU alone, as upstream")
    if model.embedding_weights_in_fp32 and precision.name == "fp32":
        notes.append("> --embedding-weights-in-fp32 has no effect in an fp32 run: the table is fp32 already")
    if args.enable_zbh1_pipeline and parallel.pp == 1:
        notes.append("> --enable-zbh1-pipeline has no effect with --pipeline-model-parallel-size 1 (one stage has "
                     "no bubble to fill), as upstream")
    chunk = args.num_layers_per_virtual_pipeline_stage or args.virtual_pipeline_model_parallel_size
    if chunk and parallel.pp > 1 and parallel.num_layers_per_virtual_pipeline_stage is None:
        notes.append("> --num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size give one "
                     "model chunk per rank: that is the 1F1B schedule, which runs")
    if parallel.ep > 1 and not model.moe.enabled:
        notes.append(f"> --moe-expert-parallel-size {parallel.ep} has no effect: no layer has experts "
                     "(--num-experts), as upstream")
    return tuple(notes)


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    """The data settings. With data files (--data-path or the per-split paths) and no --tokenizer-type, upstream's
    default tokenizer (GPT-2 BPE), whose files must then be given (recorded as the tokenizer type, so checkpoints
    name it too)."""
    tokenizer_type = args.tokenizer_type
    paths = {f: getattr(args, f) for f in ("data_path", "train_data_path", "valid_data_path", "test_data_path")}
    given = next((f"--{f.replace('_', '-')}" for f, v in paths.items() if v), None)
    if tokenizer_type is None and given:
        missing = [flag for flag, v in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)) if not v]
        if missing:
            raise ConfigError(f"{given} without --tokenizer-type uses {DEFAULT_TOKENIZER_TYPE} (upstream's "
                              f"default), which needs {' and '.join(missing)} (GPT-2's vocab.json / merges.txt); "
                              "or pass --tokenizer-type with its files")
        tokenizer_type = DEFAULT_TOKENIZER_TYPE
    tuples = {f: tuple(v) if v is not None else None for f, v in paths.items()}
    return _by_name(DataConfig, args, tokenizer_type=tokenizer_type, **tuples).validate()


_TB_ONLY = ("log_timers_to_tensorboard", "log_batch_size_to_tensorboard", "log_validation_ppl_to_tensorboard",
            "log_optimizer_states_to_tensorboard", "log_memory_to_tensorboard", "log_world_size_to_tensorboard")


def log_options_from_args(args: argparse.Namespace) -> LogOptions:
    """The logging flags; the writers' own ones given without a writer (--tensorboard-dir or W&B) are a no-op, said
    once. W&B needs the wandb package: without it, one line naming the extra, before any process group."""
    project, name = args.wandb_project or None, args.wandb_exp_name or None  # upstream's '' is not given
    wandb = bool(project or name)
    given = [f"--{n.replace('_', '-')}" for n in _TB_ONLY if getattr(args, n)]
    notes = []
    if given and not args.tensorboard_dir and not wandb:
        notes.append(f"{', '.join(given)} without --tensorboard-dir or --wandb-project: nothing is written, as "
                     "upstream")
    if args.wandb_save_dir and not wandb:
        notes.append("--wandb-save-dir without --wandb-project or --wandb-exp-name: no W&B run is started, as "
                     "upstream")
    if wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"{'--wandb-project' if project else '--wandb-exp-name'} needs the wandb package, not "
                          "installed here: pip install 'megatron-frontier[wandb]' (in the checkout: pip install "
                          "--no-build-isolation -e '.[wandb]'), or drop the --wandb-* flags")
    wandb_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
    return LogOptions(
        tensorboard_dir=args.tensorboard_dir, tensorboard_log_interval=args.tensorboard_log_interval,
        tensorboard_queue_size=args.tensorboard_queue_size, timers_to_tb=args.log_timers_to_tensorboard,
        batch_size_to_tb=args.log_batch_size_to_tensorboard, lr_to_tb=args.log_learning_rate_to_tensorboard,
        loss_scale_to_tb=args.log_loss_scale_to_tensorboard,
        validation_ppl_to_tb=args.log_validation_ppl_to_tensorboard,
        optimizer_states_to_tb=args.log_optimizer_states_to_tensorboard, memory_to_tb=args.log_memory_to_tensorboard,
        world_size_to_tb=args.log_world_size_to_tensorboard, params_norm=args.log_params_norm,
        timing_level=args.timing_log_level, timing_option=args.timing_log_option,
        barrier_l1=args.barrier_with_L1_time, skip_train=args.skip_train, wandb_project=project, wandb_exp_name=name,
        wandb_dir=wandb_dir if wandb else None, notes=tuple(notes)).validate()


def configure(argv: list[str], world_size: int, tokenizer_provider: Callable[[DataConfig], Vocabulary]
              ) -> tuple[RunConfig, Vocabulary]:
    """The one way in: flags -> the validated RunConfig, and the tokenizer, built once from the data settings (its
    vocabulary sizes the model). Every error is a one-line ConfigError, before any process group."""
    args = parse_args(argv)
    if args.use_checkpoint_args:
        take_checkpoint_args(args, given_dests(argv))
    tokenizer = tokenizer_provider(data_config_from_args(args))
    return run_config_from_args(args, world_size, tokenizer.vocab_size), tokenizer
