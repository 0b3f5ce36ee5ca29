"""The parser side: Megatron-DeepSpeed's flags (parser.py, with upstream's flag classes in megatron/compat and the
ranges in megatron/flag_bounds.py) and a user's DeepSpeed JSON (deepspeed_json.py) turned into one validated, frozen
RunConfig (configs.py; dry_run.py for --dry-run). Nothing after it reads argparse."""

from megatron.arguments.configs import (
    attention_backend,
    configure,
    data_config_from_args,
    log_options_from_args,
    model_config_from_args,
    recompute_notes,
    run_config_from_args,
)
from megatron.arguments.parser import build_parser, parse_args

__all__ = ["attention_backend", "build_parser", "configure", "data_config_from_args",
           "log_options_from_args", "model_config_from_args", "parse_args", "recompute_notes", "run_config_from_args"]
