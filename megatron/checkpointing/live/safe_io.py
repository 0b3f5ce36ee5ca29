"""Safe reads of checkpoint files, and DeepSpeed's checkpoint engine made to hash and fsync what it writes.

Every ``.pt`` file is read with ``torch.load(weights_only=True)``: the restricted unpickler builds only
tensors, containers and a short allowlist of DeepSpeed's own plain classes, so a checkpoint from an
untrusted place cannot run code. Any failure to read becomes a one-line ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from megatron import ds_seams
from megatron.checkpointing.live import integrity
from megatron.errors import CheckpointError


def _deepspeed_safe_globals() -> list:
    """The classes DeepSpeed 0.19 pickles into its own files (found by loading real ZeRO-0..3 and bf16
    checkpoints with weights_only=True). Each is a plain data holder: no ``__reduce__`` that runs code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str, map_location="cpu", mmap: bool = False):
    """``torch.load(path, weights_only=True)`` with DeepSpeed's allowlist; errors name the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete; load an older one "
                              "(edit the 'latest' file) or start without --load")
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found:
            raise CheckpointError(f"checkpoint file {path} holds the disallowed global {found.group(1)}; refusing "
                                  "to unpickle it (a checkpoint must not be able to run code)") from None
        raise CheckpointError(f"checkpoint file {path} is corrupt ({str(e).strip().splitlines()[0][:200]}); "
                              "load an older checkpoint (edit the 'latest' file)") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated ({first}); "
                              "load an older checkpoint (edit the 'latest' file)") from None


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, but every save is hashed while it streams to the file (the
    integrity manifest, integrity.py) and fsynced before the save returns, and every load is ``weights_only``.
    Installed on the engine by ``install``; DeepSpeed routes its model, ZeRO and pipeline-layer files through
    ``engine.checkpoint_engine``.

    A failed write (ENOSPC, EDQUOT, EIO) does not raise here: it is kept in ``failure`` and later writes of the
    same save are skipped, so this rank still reaches DeepSpeed's barriers with the others; the save protocol
    (directory.py) then agrees on the failure over all ranks and reports it once."""

    drop_optimizer = False
    """--no-save-optim under ZeRO-0: DeepSpeed keeps the optimizer inside the model file; write None there."""
    failure: tuple[str, OSError] | None = None
    """(path, error) of this save's first failed write on this rank."""

    def save(self, state_dict, path: str) -> None:
        if self.failure is not None:
            return
        if self.drop_optimizer and isinstance(state_dict, dict) and state_dict.get("optimizer") is not None:
            state_dict = {**state_dict, "optimizer": None}
        try:
            integrity.write_torch(state_dict, path, zipfile=self.zipfile_serialization)
        except OSError as e:
            self.failure = (path, e)

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location=map_location)


def install(engine) -> SafeCheckpointEngine:
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        ds_seams.swap_checkpoint_engine(engine, SafeCheckpointEngine(ds_seams.engine_ds_config(engine)))
    return engine.checkpoint_engine
