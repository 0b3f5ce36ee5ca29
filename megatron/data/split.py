"""--split: the train/valid/test proportions and the document boundaries upstream derives from them."""

from __future__ import annotations

from megatron.errors import ConfigError


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``969/30/1``) -> three normalized train/valid/test fractions."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--split {split!r} must be up to three numbers such as 969,30,1") from None
    if not parts or len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(
            f"--split {split!r} must be up to three non-negative numbers with a positive sum, e.g. 969,30,1"
        )
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_boundaries(split: str, num_documents: int) -> list[int]:
    """Document index boundaries ``[0, end_train, end_valid, num_documents]`` for --split, as upstream computes
    them: each boundary is the sum of the rounded split sizes, then all are shifted together so the last one equals
    the document count (the rounding error goes to train's end, not to test)."""
    bounds = [0]
    for f in parse_split(split):
        bounds.append(bounds[-1] + int(round(f * float(num_documents))))
    shift = bounds[-1] - num_documents
    return [0] + [b - shift for b in bounds[1:]]
