"""Hierarchical ZeRO's per-rank shards as a format training writes: every rank writes and reads only its own file
(shards.py), RNG state included; the metadata records the tier layout the shards belong to."""

from __future__ import annotations

import os

import torch.distributed as tdist

from megatron.checkpointing.hzero import shards
from megatron.checkpointing.live.commit import Failure
from megatron.checkpointing.live.directory import TaggedFormat
from megatron.checkpointing.live.safe_io import SafeCheckpointEngine
from megatron.checkpointing.state import HZERO_FORMAT, rng_state
from megatron.core import comm, hierarchical_zero


def _ranks_per_node(engine) -> int:
    return hierarchical_zero.ranks_per_node(engine.cfg)


class HierarchicalZeroFormat(TaggedFormat):
    FORMAT = HZERO_FORMAT

    def checkpoint_engine(self, engine) -> SafeCheckpointEngine:
        return shards.checkpoint_engine(engine)

    def write(self, engine, save_dir: str, tmp_tag: str, meta: dict) -> Failure | None:
        meta.update(hierarchy=shards.layout(engine, _ranks_per_node(engine)),
                    shards={str(r): e for r, e in enumerate(comm.all_gather_object(shards.shard_table_entry(engine)))})
        try:
            shards.save_shard(engine, os.path.join(save_dir, tmp_tag), tdist.get_rank(), rng_state(),
                              not self.run.checkpoint.no_save_optim)
        except OSError as e:  # e.g. the directory could not be created
            return (os.path.join(save_dir, tmp_tag), e)
        return None

    def restore(self, engine, ckpt_dir: str, meta: dict, load_optim: bool) -> tuple[str | None, dict]:
        shards.check_engine_layout(engine, meta, _ranks_per_node(engine), ckpt_dir)
        shard = shards.load_shard(engine, ckpt_dir, tdist.get_rank(), load_optim, not self.run.checkpoint.finetune)
        return ckpt_dir, {**meta, "rng_state": shard["rng"]}
