"""The node counts a campaign's successor may start on (``CAMPAIGN_MIN_NODES`` up to this job's: the ``sbatch -N
MIN-MAX`` of examples/frontier/campaign.sh) must each serve the run: checked in every job before any process group."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from megatron.checkpointing.resume_checks import check_resume, loads_optimizer
from megatron.checkpointing.state import DEEPSPEED_FORMAT, HZERO_FORMAT, plain_run
from megatron.config import RunConfig
from megatron.core.hierarchical_zero.config import parse_levels
from megatron.errors import ConfigError


def check_node_range(run: RunConfig, ranks_per_node: int, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse, in one line, a ``CAMPAIGN_MIN_NODES`` from which up to this job's node count some count cannot train
    this run (sizes that do not divide, a global batch that does not split over its DP, a checkpoint that would not
    load there in place), naming the first such count and the smallest minimum that would serve. Here rather than in
    campaign.sh: only the trainer knows the ranks per node, the parallel sizes and the global batch after the
    DeepSpeed JSON is merged; and the first job, submitted by hand, says it at once."""
    minimum, nodes = environ.get("CAMPAIGN_MIN_NODES", ""), environ.get("SLURM_JOB_NUM_NODES", "")
    if not (minimum.isdigit() and nodes.isdigit()) or not 0 < int(minimum) < int(nodes):
        return  # no range (campaign.sh refuses a malformed CAMPAIGN_MIN_NODES before the job step)
    minimum, nodes = int(minimum), int(nodes)
    refused = {k: why for k in range(minimum, nodes) if (why := _refusal(run, k * ranks_per_node)) is not None}
    if not refused:
        return
    first, serving = min(refused), max(refused) + 1
    ranks = first * ranks_per_node
    fix = (f"set CAMPAIGN_MIN_NODES={serving} (every count from {serving} to {nodes} serves)" if serving < nodes
           else "unset CAMPAIGN_MIN_NODES (no smaller range serves this run)")
    raise ConfigError(f"CAMPAIGN_MIN_NODES={minimum}: the next job may start on {first} node{'s' * (first > 1)} "
                      f"({ranks} rank{'s' * (ranks > 1)}), where {refused[first]}; {fix}")


def _refusal(run: RunConfig, world_size: int) -> str | None:
    """Why this run could not go on at ``world_size`` ranks (the flags, then the resume of its checkpoints), or
    None. The global batch follows DP there when it was not given, as configure() would fill it."""
    implicit = run.flags.get("global_batch_size") is None
    try:
        at = dataclasses.replace(
            run, parallel=dataclasses.replace(run.parallel, world_size=world_size),
            training=dataclasses.replace(run.training, global_batch_size=None) if implicit else run.training)
        if run.checkpoint.save:
            meta = _meta(run)
            check_resume(meta, at, loads_optimizer(at.checkpoint, meta), run.checkpoint.save)
    except ConfigError as e:
        return str(e)
    return None


def _meta(run: RunConfig) -> dict:
    """What this run's checkpoints record of it (megatron_meta.json), as far as check_resume reads it."""
    p = run.parallel
    meta = {"run": plain_run(run), "has_optimizer": not run.checkpoint.no_save_optim,
            "format": HZERO_FORMAT if p.zero_hierarchy else DEEPSPEED_FORMAT}
    if p.zero_hierarchy:
        meta["hierarchy"] = {"dp_size": p.dp, "levels": list(parse_levels(p.zero_hierarchy)),
                             "weights": p.zero_hierarchy_weights, "int8": p.zero_hierarchy_int8}
    return meta
