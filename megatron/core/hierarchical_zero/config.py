"""Settings of hierarchical ZeRO, read from the ds_config section ``megatron_frontier`` (filled from the CLI).

ds_config keys (all inside ``"megatron_frontier": {...}``, which megatron/engine.py removes before DeepSpeed sees
the config):

* ``zero_hierarchy``: tiers the gradient reduce-scatter walks, fastest first, ending in ``"network"``,
  e.g. ``["package", "node", "network"]`` (CLI ``--zero-hierarchy package,node,network``).
* ``zero_hierarchy_weights``: the tier whose ranks share one copy of the 16-bit weights, ``"node"`` (default when
  listed, else the first tier) or ``"package"`` (CLI ``--zero-hierarchy-weights``); forward/backward all-gathers
  then stay inside it.
* ``zero_hierarchy_int8``: block-wise int8 on the network stage (weights all-gather and gradient reduce-scatter),
  with error feedback on the gradients (CLI ``--zero-hierarchy-int8``).
* ``zero_hierarchy_block``: elements per int8 block (one fp32 scale each), default 256.
* ``ranks_per_node``: ranks on one node; default the launcher's (never ``device_count()``). Tests set 4 so that
  8 local processes stand for 2 nodes x 2 packages x 2 GCDs.
* ``zero_hpz``: ``"node"`` or ``"package"`` instead of ``zero_hierarchy``: DeepSpeed's own ZeRO++ hpZ, with
  ``zero_optimization.zero_hpz_partition_size`` filled with the data-parallel ranks of one node / package taken
  from the topology (TP=1 only: DeepSpeed builds hpZ groups from contiguous global ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError

SECTION = "megatron_frontier"
LEVELS = ("package", "node", "network")


@dataclass(frozen=True)
class HierarchyConfig:
    levels: tuple[str, ...] = LEVELS
    """Tiers of the gradient reduce-scatter, fastest first; the last is always 'network'."""
    weights: str = "node"
    """Tier whose ranks share one copy of the 16-bit weights (the secondary partition)."""
    int8: bool = False
    block: int = 256
    ranks_per_node: int | None = None

    def validate(self) -> HierarchyConfig:
        bad = [lv for lv in self.levels if lv not in LEVELS]
        if bad or not self.levels or list(self.levels) != sorted(self.levels, key=LEVELS.index) \
                or len(set(self.levels)) != len(self.levels) or self.levels[-1] != "network":
            raise ConfigError(f"--zero-hierarchy {','.join(self.levels)}: list distinct tiers from fastest to "
                              "slowest, ending in 'network' (e.g. package,node,network or node,network)")
        if self.weights not in self.levels:
            raise ConfigError(f"--zero-hierarchy-weights {self.weights}: choose one of the --zero-hierarchy tiers "
                              f"({','.join(self.levels)})")
        if self.block < 8 or self.block % 8:
            raise ConfigError(f"zero_hierarchy_block {self.block}: use a multiple of 8 (256 is a good default)")
        if self.ranks_per_node is not None and not 1 <= self.ranks_per_node <= 8:
            raise ConfigError(f"ranks_per_node {self.ranks_per_node}: a Frontier node holds 1 to 8 ranks")
        return self

    def to_section(self) -> dict:
        out = {"zero_hierarchy": list(self.levels), "zero_hierarchy_weights": self.weights,
               "zero_hierarchy_int8": self.int8, "zero_hierarchy_block": self.block}
        if self.ranks_per_node is not None:
            out["ranks_per_node"] = self.ranks_per_node
        return out


def parse_levels(text: str) -> tuple[str, ...]:
    """``'package,node,network'`` -> ('package', 'node', 'network')."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def from_ds_config(cfg: dict) -> HierarchyConfig | None:
    """The mode from a ds_config, or None when ``megatron_frontier.zero_hierarchy`` is absent."""
    section = cfg.get(SECTION) or {}
    unknown = set(section) - {"zero_hierarchy", "zero_hierarchy_weights", "zero_hierarchy_int8",
                              "zero_hierarchy_block", "ranks_per_node", "zero_hpz"}
    if unknown:
        raise ConfigError(f"ds_config section '{SECTION}' has unknown keys {sorted(unknown)}: see "
                          "megatron/core/hierarchical_zero/config.py for the supported ones")
    levels = section.get("zero_hierarchy")
    if not levels:
        return None
    if isinstance(levels, str):
        levels = parse_levels(levels)
    levels = tuple(levels)
    default_weights = "node" if "node" in levels else levels[0]
    return HierarchyConfig(levels=levels, weights=section.get("zero_hierarchy_weights") or default_weights,
                           int8=bool(section.get("zero_hierarchy_int8", False)),
                           block=int(section.get("zero_hierarchy_block", 256)),
                           ranks_per_node=section.get("ranks_per_node")).validate()


def hpz_partition_size(cfg: dict, tp: int, zero_stage: int, ranks_per_node: int) -> int | None:
    """DeepSpeed's ``zero_hpz_partition_size`` for ``megatron_frontier.zero_hpz`` (None when it is not set)."""
    section = cfg.get(SECTION) or {}
    tier = section.get("zero_hpz")
    if tier is None:
        return None
    if tier not in ("node", "package"):
        raise ConfigError(f"{SECTION}.zero_hpz={tier!r}: choose 'node' or 'package'")
    if section.get("zero_hierarchy"):
        raise ConfigError(f"{SECTION} sets both zero_hpz (DeepSpeed's hpZ) and zero_hierarchy (ours): pick one")
    if zero_stage != 3:
        raise ConfigError(f"{SECTION}.zero_hpz needs --zero-stage 3, got {zero_stage}")
    if tp != 1:
        raise ConfigError(f"{SECTION}.zero_hpz with --tensor-model-parallel-size {tp}: DeepSpeed's hpZ groups are "
                          "contiguous global ranks, which mix TP peers; use --zero-hierarchy instead")
    return ranks_per_node if tier == "node" else min(2, ranks_per_node)
