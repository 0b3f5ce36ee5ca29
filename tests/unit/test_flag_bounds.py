"""Every numeric flag is bounded (megatron/flag_bounds.py): each int/float flag of the parser, tried with 0, -1 and
10**12, ends in a one-line ConfigError naming it or is a value its table row allows, never a traceback, and
everything up to the process group (configs, ds_config, checkpoint settings, preflight) runs on what is allowed."""

import pytest

from megatron.arguments import build_parser, parse_args, run_config_from_args
from megatron.errors import MegatronError
from megatron.flag_bounds import BOUNDS, numeric_actions
from tests.models import CONFIG_GPT

TINY = CONFIG_GPT
VALUES = (0, -1, 10**12)


def _up_to_process_group(argv: list[str]) -> None:
    """What pretrain() does with the flags before initialize_megatron (no model, no process group)."""
    from megatron.checkpointing.support import check_supported as check_checkpoint_support
    from megatron.engine import build_ds_config
    from megatron.preflight import preflight
    from megatron.preflight.layout import check_layout

    args = parse_args(argv)
    run = run_config_from_args(args, 1, args.vocab_size or 200)
    ds_config = build_ds_config(run)
    check_checkpoint_support(run, ds_config, run.checkpoint)
    preflight(run)
    check_layout(ds_config)


def test_every_numeric_flag_has_a_row():
    missing = [a.option_strings[0] for a in numeric_actions(build_parser()) if a.dest not in BOUNDS]
    assert not missing, f"numeric flags without a range in megatron/flag_bounds.py: {missing}"


@pytest.mark.parametrize("action", numeric_actions(build_parser()), ids=lambda a: a.option_strings[0])
def test_zero_minus_one_and_absurd_values(action):
    flag, bound = action.option_strings[0], BOUNDS[action.dest]
    repeat = action.nargs if isinstance(action.nargs, int) else 1  # --rampup-batch-size takes three numbers
    for value in VALUES:
        try:
            _up_to_process_group(TINY + [flag, *[str(value)] * repeat])
        except MegatronError as e:  # one line; an out-of-range value is named by its own flag
            text = str(e)
            assert "\n" not in text and text, (flag, value, text)
            if not bound.allows(value):
                assert text.startswith(f"{flag} ") and ": out of range; valid: " in text or "invalid choice" in text, \
                    (flag, value, text)
        else:
            assert bound.allows(value), f"{flag} {value} was accepted but lies outside {bound.describe()}"


@pytest.mark.parametrize("flag, value", [("--ffn-hidden-size", "0"), ("--init-method-std", "-1"),
                                         ("--num-attention-heads", "0"), ("--hidden-dropout", "1"),
                                         ("--watchdog-timeout-secs", "1e12"), ("--seed", "-1")])
def test_reported_cases_are_one_line_errors(flag, value):
    with pytest.raises(MegatronError, match=rf"^{flag} \S+: out of range; valid: "):
        parse_args(TINY + [flag, value])


def test_documented_special_values_pass():
    args = parse_args(TINY + ["--clip-grad", "0", "--watchdog-timeout-secs", "0", "--eval-iters", "0"])
    assert (args.clip_grad, args.watchdog_timeout_secs, args.eval_iters) == (0, 0, 0)
