"""Hierarchical ZeRO's shard files read slice by slice, for a rank that resumes them at another layout (relayout/):
per parameter (our names) and source TP rank, where its fp32 master weights and Adam moments sit in the files of a
``global_stepN/`` directory. The same interface as ds_layout/slices.py's ``DeepSpeedSource`` (``pieces``).

Every bucket is padded to a multiple of the saved DP size ``D``; of bucket ``b`` (``padded`` elements from
``offset``), the file of shard index ``s`` holds elements ``[s p, (s + 1) p)`` (``p = padded / D``), buckets one after
another (shards.merged_tp_states' arithmetic). A parameter's elements within its bucket follow the bucket's order of
parameters, so its flattened TP shard is the run of its bucket ``[o, o + n)``, whatever the tiers were. The master
copy is fp32 and holds the weights (the 16-bit secondary shards are rebuilt from it by the target).
"""

from __future__ import annotations

import math


from megatron.checkpointing.ds_layout.slices import Piece, no_tensor
from megatron.checkpointing.hzero.shards import shard_file
from megatron.checkpointing.live.safe_io import safe_load
from megatron.errors import CheckpointError
from megatron.model.param_names import canonical_name


class HZeroSource:
    """The hierarchical ZeRO checkpoint ``ckpt_dir`` (``meta``: its megatron_meta.json) as pieces."""

    has_master = True
    """The fp32 master shards are the weights."""

    def __init__(self, ckpt_dir: str, meta: dict) -> None:
        h, p = meta["hierarchy"], meta["run"]["parallel"]
        self.dir, self.meta = ckpt_dir, meta
        self.tp = p["tensor_model_parallel_size"]
        self.dp = h["dp_size"]
        nl = meta["run"]["model"]["num_layers"]
        # name -> (bucket index, offset in the bucket, shape); per bucket: where it starts in a shard file
        self._where: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._in_file: list[int] = []
        at = 0
        for bi, b in enumerate(h["buckets"]):
            o = 0
            for name, shape in b["params"]:
                if (c := canonical_name(name, nl)) is not None:
                    self._where[c] = (bi, o, tuple(shape))
                o += math.prod(shape)
            self._in_file.append(at)
            at += b["padded"] // self.dp
        self._padded = [b["padded"] for b in h["buckets"]]
        self._files = {(int(e["tp_rank"]), int(e["shard_index"])): int(r) for r, e in meta["shards"].items()}
        found = sorted(self._files)
        if found != [(t, s) for t in range(self.tp) for s in range(self.dp)]:
            raise CheckpointError(f"{ckpt_dir}: its shard table holds (TP rank, shard) {found}, not {self.tp} x "
                                  f"{self.dp}: the checkpoint is incomplete")
        self._states: dict[tuple[int, int], dict] = {}

    def _state(self, j: int, s: int) -> dict:
        if (j, s) not in self._states:
            self._states[(j, s)] = safe_load(shard_file(self.dir, self._files[(j, s)]), mmap=True)
        return self._states[(j, s)]

    def _adam(self, j: int, s: int) -> dict | None:
        opt = self._state(j, s).get("optimizer")
        return None if opt is None else opt["state"].get(0)

    # ------------------------------------------------------------------ what the files hold
    def moments_why_not(self) -> str | None:
        """None when the files hold Adam moments, else why not."""
        if not self.meta.get("has_optimizer", True):
            return "the checkpoint was saved with --no-save-optim"
        return None if self._adam(0, 0) is not None else "the optimizer had not stepped yet"

    def adam_step(self) -> int:
        adam = self._adam(0, 0)
        return int(adam["step"]) if adam is not None else 0

    def counters(self) -> dict:
        steps = self._state(0, 0)["steps"]
        return {"global_steps": steps["global"], "global_samples": None, "skipped_steps": steps["skipped"]}

    def loss_scaler(self):
        """Hierarchical ZeRO runs no fp16 loss scaler."""
        return None

    # ------------------------------------------------------------------ pieces
    def shard_shape(self, name: str, j: int) -> tuple[int, ...]:
        return self._found(name, j)[2]

    def _found(self, name: str, j: int) -> tuple[int, int, tuple[int, ...]]:
        if name not in self._where:
            raise no_tensor(self.dir, name, j)
        return self._where[name]

    def pieces(self, name: str, kind: str, j: int) -> list[Piece]:
        """The pieces of ``name``'s ``kind`` (weight = master, exp_avg, exp_avg_sq) in source TP rank ``j``'s shard."""
        bi, o, shape = self._found(name, j)
        n, per = math.prod(shape), self._padded[bi] // self.dp
        out = []
        for s in range(o // per, min(self.dp, -(-(o + n) // per))):
            lo, hi = max(o, s * per), min(o + n, (s + 1) * per)
            if lo >= hi:
                continue
            state = self._state(j, s)
            flat = state["master"] if kind in ("weight", "master") else self._adam(j, s)[kind]
            path = shard_file(self.dir, self._files[(j, s)])
            out.append(Piece(lo - o, flat.narrow(0, self._in_file[bi] + lo - s * per, hi - lo), path))
        return out
