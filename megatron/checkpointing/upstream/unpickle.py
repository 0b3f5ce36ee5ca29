"""Loading upstream's ``.pt`` files: weights-only first; their pickled Python objects (an ``argparse.Namespace``, its
enums, numpy RNG state) only with ``--trust-checkpoint``, and then with ``megatron.*`` classes replaced by inert
placeholders (never resolved against this package, whose names overlap upstream's)."""

from __future__ import annotations

import pickle
import types

import torch

from megatron.checkpointing.live.safe_io import safe_load
from megatron.errors import CheckpointError

TRUST_HINT = "pass --trust-checkpoint to unpickle it if you trust where it came from"


class _Placeholder:
    """Stands in for an upstream ``megatron.*`` class (e.g. its ModelType enum) inside a trusted pickle."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state


# What upstream's pickles hold (args Namespace, numpy RNG state, torch tensors and dtypes, DeepSpeed's data classes,
# enums); even a trusted file gets nothing else (no os.system & co.): defence in depth.
_ALLOWED_MODULES = ("torch", "numpy", "collections", "argparse", "_codecs", "deepspeed", "enum", "datetime",
                    "pathlib")
_ALLOWED_BUILTINS = {"set", "frozenset", "slice", "complex", "range", "bytearray", "bytes", "int", "float", "str",
                     "bool", "list", "dict", "tuple", "object"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        root = module.split(".")[0]
        if root == "megatron":
            return type(name, (_Placeholder,), {"__module__": "upstream." + module})
        if (root in _ALLOWED_MODULES and root + ".hub" != module[:len(root) + 4]) or (
                module == "builtins" and name in _ALLOWED_BUILTINS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed even with --trust-checkpoint")


_PICKLE = types.ModuleType("upstream_pickle")
_PICKLE.Unpickler = _Unpickler
_PICKLE.load = pickle.load
_PICKLE.__name__ = "upstream_pickle"


def load_file(path: str, trust: bool):
    """A ``.pt`` file of an upstream checkpoint: weights_only first; pickled objects only with ``trust``."""
    try:
        return safe_load(path)
    except CheckpointError as e:
        if "disallowed global" not in str(e):
            raise
        if not trust:
            raise CheckpointError(f"checkpoint file {path} was pickled with Python objects (argparse.Namespace, ...) "
                                  f"that weights-only loading refuses; {TRUST_HINT}") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except Exception as e:  # noqa: BLE001 - any failure of a foreign pickle is a bad file, named in one line
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint file {path} could not be unpickled ({first})") from None


def args_of(state: dict, path: str) -> dict:
    """Upstream's parsed flags (the ``args`` its save_checkpoint stores) as a dict."""
    args = state.get("args")
    if args is None:
        raise CheckpointError(f"checkpoint file {path} holds no 'args': neither upstream Megatron's (its "
                              "save_checkpoint stores them) nor a complete checkpoint of ours (megatron_meta.json is "
                              "missing beside it); point the marker at a complete checkpoint")
    return vars(args) if not isinstance(args, dict) else args
