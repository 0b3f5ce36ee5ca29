"""How the ranks are laid out: tensor, pipeline, Ulysses sequence and data parallelism, and the ZeRO stage."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.errors import ConfigError
from megatron.flag_bounds import check_fields
from megatron.topology import check_expert_parallel, check_world_divides


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks are laid out. Megatron's order: TP innermost, then DP, then PP outermost."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    zero_hierarchy: str | None = None
    """Hierarchical ZeRO-3 tiers, e.g. 'package,node,network' (megatron/core/hierarchical_zero); None = off."""
    zero_hierarchy_weights: str | None = None
    """Tier whose ranks share one copy of the 16-bit weights: 'node' or 'package' (default: node if listed)."""
    zero_hierarchy_int8: bool = False
    """Block-wise int8 on the network stage of hierarchical ZeRO (weights all-gather and gradient reduce)."""
    ds_sequence_parallel_size: int = 1
    """DeepSpeed-Ulysses sequence parallelism: SP ranks inside the data-parallel dimension each hold 1/SP of
    the sequence; attention switches to head-sharded with two all-to-alls (megatron/core/ulysses.py)."""
    no_pipeline_parallel: bool = False
    """--no-pipeline-parallel: the plain GPTModel, not DeepSpeed's pipeline engine (PP must be 1)."""
    moe_expert_parallel_size: int = 1
    """--moe-expert-parallel-size: each MoE layer's experts are split over this many consecutive ranks of the
    data-parallel group (megatron/topology.py parallel_groups: "ep", and "edp" for the experts' replicas)."""
    standalone_embedding_stage: bool = False
    """--standalone-embedding-stage: pipeline stage 0 holds the embedding alone and the transformer layers are split
    over the other PP - 1 stages (Megatron's meaning; upstream's --deepspeed pipeline ignores the flag)."""
    enable_zbh1_pipeline: bool = False
    """--enable-zbh1-pipeline: upstream's zero-bubble H1 schedule (weight gradients deferred into the bubble,
    megatron/core/pipeline); no effect at PP=1."""
    enable_zbh1_exact_semantics: bool = False
    """--enable-zbh1-exact-semantics: ZB-H1 applying weight gradients in micro-batch order (1F1B's bits)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """--num-layers-per-virtual-pipeline-stage N: interleaved 1F1B, each rank holding num_layers / (PP x N) chunks
    of N layers (Megatron-LM's --virtual-pipeline-model-parallel-size V gives N = num_layers / (PP x V))."""

    def __post_init__(self) -> None:
        if self.sequence_parallel and self.tp == 1:
            # Megatron silently turns it off; we do the same but keep the flag honest.
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def ulysses(self) -> int:
        return self.ds_sequence_parallel_size

    @property
    def ep(self) -> int:
        return self.moe_expert_parallel_size

    @property
    def pipeline_schedule(self) -> str:
        """'1f1b' (DeepSpeed's), 'zbh1', 'zbh1-exact' or 'interleaved' (megatron/core/pipeline/orders.py)."""
        if self.pp == 1:
            return "1f1b"
        if self.enable_zbh1_pipeline:
            return "zbh1-exact" if self.enable_zbh1_exact_semantics else "zbh1"
        return "1f1b" if self.num_layers_per_virtual_pipeline_stage is None else "interleaved"

    def virtual_stages(self, num_layers: int) -> int:
        """Model chunks per pipeline rank (v): num_layers / (PP x N) when interleaved, else 1."""
        n = self.num_layers_per_virtual_pipeline_stage
        return 1 if self.pipeline_schedule != "interleaved" else num_layers // (self.pp * n)

    @property
    def dp(self) -> int:
        """Pure data parallelism: ranks that load different samples (SP ranks share theirs)."""
        return self.world_size // (self.tp * self.pp * self.ulysses)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers per pipeline stage (``split_layers``)."""
        return split_layers(num_layers, self.pp, self.standalone_embedding_stage)

    def validate(self) -> None:
        """Raises ConfigError naming the flags; changes nothing."""
        check_fields(self, {"tensor_model_parallel_size": "--tensor-model-parallel-size",
                            "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
                            "ds_sequence_parallel_size": "--ds-sequence-parallel-size", "zero_stage": "--zero-stage",
                            "moe_expert_parallel_size": "--moe-expert-parallel-size"})
        if self.pp > 1 and self.no_pipeline_parallel:
            raise ConfigError(f"--no-pipeline-parallel with --pipeline-model-parallel-size {self.pp}: the plain "
                              "GPTModel has no stages; drop --no-pipeline-parallel or use PP=1")
        check_world_divides(self.world_size, self.tp, self.pp, self.ulysses)
        if self.zero_hierarchy:  # --zero-hierarchy, or the DeepSpeed JSON's megatron_frontier section
            self._validate_zero_hierarchy()
        self._validate_schedule()
        if self.pp > 1 and self.zero_stage >= 2:
            raise ConfigError(f"ZeRO-{self.zero_stage} with --pipeline-model-parallel-size {self.pp}: DeepSpeed's "
                              "pipeline engine supports ZeRO 0/1 only; use --zero-stage 1, or --no-pipeline-parallel "
                              "with --pipeline-model-parallel-size 1")

    def _validate_schedule(self) -> None:
        """The pipeline schedule's flags among themselves (RunConfig checks them against the layers and batch)."""
        check_fields(self, {"num_layers_per_virtual_pipeline_stage": "--num-layers-per-virtual-pipeline-stage"})
        if self.enable_zbh1_exact_semantics and not self.enable_zbh1_pipeline:
            raise ConfigError("--enable-zbh1-exact-semantics needs --enable-zbh1-pipeline (upstream asserts the "
                              "same): add it or drop the flag")
        if self.num_layers_per_virtual_pipeline_stage is None:
            return
        if self.enable_zbh1_pipeline:
            raise ConfigError("--enable-zbh1-pipeline and --num-layers-per-virtual-pipeline-stage: choose one "
                              "pipeline schedule")
        if self.pp == 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 (it "
                              "interleaves pipeline stages): drop it or add stages")

    def validate_expert_parallel(self) -> None:
        """With experts (RunConfig checks a model's; the planner's layouts set EP only for one)."""
        check_expert_parallel(self.world_size, self.tp, self.pp, self.ulysses, self.ep)

    def _validate_zero_hierarchy(self) -> None:
        """What hierarchical ZeRO-3 (megatron/core/hierarchical_zero) cannot run with."""
        if self.ulysses > 1:
            raise ConfigError(f"hierarchical ZeRO (--zero-hierarchy) with --ds-sequence-parallel-size {self.ulysses}: "
                              "its engine reduces over the DP groups only, not SP x DP; use --zero-stage 3 without it")
        if self.zero_stage != 3:
            raise ConfigError(f"--zero-hierarchy is a ZeRO-3 mode but --zero-stage is {self.zero_stage}: add "
                              "--zero-stage 3")
        if self.pp > 1:
            raise ConfigError(f"--zero-hierarchy (hierarchical ZeRO-3) with --pipeline-model-parallel-size {self.pp}: "
                              "like ZeRO-3 it shards weights per data-parallel rank and cannot run under DeepSpeed's "
                              "pipeline engine; use --pipeline-model-parallel-size 1 --no-pipeline-parallel")


def split_layers(num_layers: int, pp: int, standalone_embedding: bool = False) -> list[int]:
    """Transformer layers of each of ``pp`` pipeline stages: an even split, the remainder on the first stages; with
    ``standalone_embedding`` (and PP > 1) stage 0 gets none and the layers split over the other stages."""
    if standalone_embedding and pp > 1:
        return [0] + split_layers(num_layers, pp - 1)
    base, extra = divmod(num_layers, pp)
    return [base + (1 if stage < extra else 0) for stage in range(pp)]
