"""User-facing errors: one line that names the flag or file and the fix."""


class MegatronError(Exception):
    """An error the user can fix. Entry points print its message on one line and exit with code 2."""

    exit_code = 2


class ConfigError(MegatronError):
    """An impossible or inconsistent set of flags / ds_config keys."""


class DataError(MegatronError):
    """A missing, corrupt or mismatched data file."""


class CheckpointError(MegatronError):
    """A missing, corrupt or incompatible checkpoint."""


class TrainingError(MegatronError):
    """Training cannot go on (e.g. a persistent NaN/Inf loss)."""


class DistributedError(MegatronError):
    """A lost peer, a collective timeout, or a rank layout that cannot be discovered."""


def run_cli(main, argv=None) -> int:
    """Call ``main(argv)``; turn a MegatronError into one line on stderr and a non-zero exit code."""
    import sys

    try:
        rc = main(argv)
    except MegatronError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0 if rc is None else int(rc)
