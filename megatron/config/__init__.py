"""Validated configuration dataclasses: the single source of truth for a run, frozen (``dataclasses.replace`` makes a
variant, validated again).

Only the parser (megatron/arguments) turns flags into them; every other module takes these objects. Each check a user
can fail raises ``ConfigError`` naming the flags; numeric ranges come from one table (megatron/flag_bounds.py).
"""

from megatron.config.checkpoint import CheckpointSettings
from megatron.config.data import DataConfig
from megatron.config.log import LogOptions, ProfileConfig
from megatron.config.model import ModelConfig
from megatron.config.moe import MoEConfig
from megatron.config.optimizer import OptimizerConfig, PrecisionConfig
from megatron.config.parallel import ParallelConfig
from megatron.config.run import RunConfig
from megatron.config.runtime import DeepSpeedSettings, RuntimeConfig
from megatron.config.sizes import model_names, named_model
from megatron.config.training import TrainingConfig

__all__ = ["CheckpointSettings", "DataConfig", "DeepSpeedSettings", "LogOptions", "ModelConfig", "MoEConfig",
           "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "ProfileConfig", "RunConfig", "RuntimeConfig",
           "TrainingConfig", "model_names", "named_model"]
