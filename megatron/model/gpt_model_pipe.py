"""GPTModelPipe: GPTModel's layers as a DeepSpeed ``PipelineModule`` for pipeline (and 3D) parallelism.

Stage layout, in order: embedding (a ``TiedLayerSpec`` when the output layer reuses its weight), one
``LayerSpec`` per transformer layer, the final norm, the output layer (the tied spec again, or its own
weight), then the vocab-parallel cross entropy as the engine's ``loss_fn``. Between stages flows one
tensor, the hidden state ``[s(/tp with SP), b, h]``; the first stage takes tokens ``[b, s]`` and the loss
takes ``(labels [b, s], loss_mask [b, s])``. With mixture-of-experts layers (--num-experts) the first stage takes
``(tokens, sample_index [b])`` and a tuple flows instead: the hidden state, the tokens' random-draw keys and the
running sum of the balancing losses (megatron/model/moe_pipe.py); the loss adds --moe-loss-coeff x that sum in
training, and ``get_additional_losses`` reports the lm and MoE losses apart (the engine averages them over DP).

Which model PP=1 uses: the plain ``GPTModel`` on DeepSpeed's ordinary engine. At one stage the pipeline
engine adds nothing but restrictions (ZeRO-0/1 only, no external forward), so ``pretrain_gpt.py`` builds
GPTModelPipe only when ``--pipeline-model-parallel-size`` > 1; ``--no-pipeline-parallel`` with PP > 1 is
refused. This class itself also works at PP=1 (tests use that).

The pipeline grid's rank order is DeepSpeed's axes ``['pipe', 'data', 'model']``: rank =
pipe * (DP * TP) + data * TP + model, exactly ``ParallelState``'s (with DeepSpeed-Ulysses the data axis is
SP x DP: the engine then averages gradients over it, and ``LMLoss`` makes up the factor SP in the backward).
The constructor checks that the two agree group by group, then builds the layers with ``ParallelState``'s own
TP group.

Activation recompute: each stage checkpoints its first ``--recompute-num-layers`` transformer layers (all
of them by default), Megatron's "block" rule, because the first stage holds the most micro-batches in flight.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed.runtime.utils import partition_balanced, partition_uniform

from megatron import ds_seams
from megatron.config import ModelConfig
from megatron.core.moe.draws import token_keys
from megatron.core.parallel_state import GroupInfo, ParallelState
from megatron.core.pipeline.module import ChunkedPipelineModule
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.recompute import checkpoint_with
from megatron.core.ulysses import position_ids as sequence_position_ids
from megatron.core.ulysses import sequence_mean
from megatron.errors import ConfigError
from megatron.model.compile import compile_transformer_layers
from megatron.model.embedding import Embedding
from megatron.model.gpt_model import OutputLayer, checkpoint_options, recompute_layer_count
from megatron.model.moe_pipe import first_stage_extras, stage_output
from megatron.model.norms import Norm
from megatron.model.transformer import TransformerLayer

PARTITION_METHODS = ("type:TransformerLayer", "parameters", "uniform")


class EmbeddingPipe(Embedding):
    """tokens [b, s] -> [s(/tp), b, h]. When tied it also owns a weightless output head, so the last
    stage's copy of this module can project with ``word_embeddings.weight`` (see ``tied_output``).
    A model with experts: (tokens, sample_index [b]) -> (hidden, keys [s, b], balancing-loss sum [1])."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, *, tied_head: bool, ulysses: GroupInfo | None = None,
                 **common) -> None:
        super().__init__(cfg, padded_vocab_size, **common)
        self.head = OutputLayer(cfg, padded_vocab_size, **common) if tied_head else None
        self.ulysses = ulysses if ulysses is not None else GroupInfo([0], 0, None)
        self.moe, self.init_seed = cfg.moe.enabled, common["init_seed"]

    def forward(self, inputs):
        tokens, sample_index = inputs if isinstance(inputs, tuple) else (inputs, None)
        # DeepSpeed-Ulysses: tokens are this SP rank's slice; learned positions stay global.
        ulysses = self.ulysses
        positions = sequence_position_ids(tokens.shape[1], ulysses, tokens.device) if ulysses.size > 1 else None
        hidden = super().forward(tokens, positions)
        if not self.moe:
            return hidden
        if sample_index is None:  # as GPTModel: outside the data loader the micro-batch's order stands in
            sample_index = torch.arange(tokens.shape[0], device=tokens.device)
        return (hidden, *first_stage_extras(token_keys(sample_index, tokens.shape[1], self.init_seed)))


def tied_output(module: EmbeddingPipe, x):
    """Last stage: [s(/tp), b, h] -> vocab-parallel logits [b, s, V/tp] with the tied word embeddings
    (with experts: (hidden, moe_sum) -> (logits, moe_sum))."""
    if isinstance(x, tuple):
        return module.head(x[0], None, module.word_embeddings.weight), x[1]
    return module.head(x, None, module.word_embeddings.weight)


class TransformerLayerPipe(TransformerLayer):
    """One transformer layer; ``recompute`` is set per stage after partitioning. In a model with experts it
    takes and returns (hidden, keys, moe_sum), an MoE layer adding its balancing loss to the sum."""

    recompute = False
    checkpoint_options = None
    tp_info = None

    def forward(self, x):
        if not isinstance(x, tuple):
            return self._run(x, None)
        hidden, keys, moe_sum = x
        hidden = self._run(hidden, keys)
        # Set by this forward (a recompute's replay overwrites it later, after it has been added here).
        return hidden, keys, (moe_sum + self.mlp.aux_loss if self.is_moe else moe_sum)

    def _run(self, x: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
        def layer(h: torch.Tensor) -> torch.Tensor:
            return TransformerLayer.forward(self, h, keys)

        if self.recompute and self.training:  # the replay draws with the same keys
            return checkpoint_with(layer, x, self.checkpoint_options, self.tp_info.group,
                                   self.tp_info.size)  # keeps only x [s, b, h] (or 1/TP of it)
        return layer(x)


class FinalNormPipe(Norm):
    """The final norm; with experts (hidden, keys, moe_sum) -> (normed hidden, moe_sum)."""

    def forward(self, x):
        if isinstance(x, tuple):
            return super().forward(x[0]), x[-1]
        return super().forward(x)


class OutputLayerPipe(OutputLayer):
    """Untied output layer: [s(/tp), b, h] -> logits [b, s, V/tp] (with experts: (hidden, moe_sum) -> (logits,
    moe_sum))."""

    def forward(self, x):
        if isinstance(x, tuple):
            return super().forward(x[0], None, None), x[1]
        return super().forward(x, None, None)


class LMLoss:
    """The engine's ``loss_fn``: masked mean of the vocab-parallel cross entropy, fp32 (as gpt_forward_step).

    With experts (``moe_loss_coeff`` given) it takes (logits, moe_sum) and, in training, returns lm + coeff x moe_sum
    (upstream's loss_func, and train_step's at PP=1); evaluation returns the lm loss alone, as the plain path's. The
    last micro-batch's two parts are kept detached in ``last`` for the engine's additional losses."""

    def __init__(self, pstate: ParallelState, moe_loss_coeff: float | None = None) -> None:
        self.tp, self.ulysses = pstate.tp, pstate.ulysses
        self.moe_loss_coeff = moe_loss_coeff
        self.training = True
        self.last: OrderedDict | None = None

    def __call__(self, outputs, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.moe_loss_coeff is None:
            return self._lm(outputs, labels)
        logits, moe_sum = outputs
        lm = self._lm(logits, labels)
        moe = self.moe_loss_coeff * moe_sum.reshape(())
        self.last = OrderedDict([("lm loss", lm.detach()), ("moe loss", moe.detach())])
        return lm + moe if self.training else lm

    def _lm(self, logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        target, mask = labels
        # logits arrive as the [b, s, V/tp] view of [s, b, V/tp]: undo the view so the loss's chunks are
        # contiguous, and no .float(): the loss upcasts one chunk at a time.
        losses = vocab_parallel_cross_entropy(logits.transpose(0, 1), target.t(), self.tp).t()  # [b, s]
        if self.ulysses.size > 1:
            # The pipeline engine averages gradients over its grid's data axis, SP x DP: the backward makes up SP.
            return sequence_mean(losses, mask, self.ulysses, grad_scale=float(self.ulysses.size))
        mask = mask.float()
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def spec_kinds(cfg: ModelConfig) -> list[str]:
    """Kinds of the spec list, in order: 'embedding', 'layer' x L, 'norm', 'output'."""
    return ["embedding"] + ["layer"] * cfg.num_layers + ["norm", "output"]


def spec_parameters(cfg: ModelConfig, tp: int, ep: int = 1) -> list[int]:
    """Parameters per spec on one TP (and, for MoE layers, EP) rank (analytic: no layer is built just to be
    counted)."""
    words = cfg.word_embedding_parameters(tp)
    # A tied output layer owns no weight but does the same matmul; weigh it like the untied one.
    return [words + cfg.position_parameters()] + [cfg.layer_parameters(tp, n, ep) for n in cfg.layer_experts()] + \
        [cfg.norm_parameters(), words]


def partition(cfg: ModelConfig, pp: int, method: str = "type:TransformerLayer", tp: int = 1,
              ep: int = 1, standalone_embedding: bool = False) -> list[int]:
    """Stage boundaries over the spec list: stage i holds specs [parts[i], parts[i+1]).

    'type:TransformerLayer' splits the transformer layers evenly, the remainder going to the first stages
    (the split megatron/perf/memory.py assumes); the embedding joins stage 0 (``standalone_embedding``, PP > 1: it
    is stage 0's only spec), norm and output the last.
    'parameters' balances the parameter count of one TP (and EP) rank; 'uniform' balances the number of specs.
    """
    n_specs = cfg.num_layers + 3
    standalone = standalone_embedding and pp > 1
    if method.lower().startswith("type:") and method.split(":", 1)[1].lower() in ("transformerlayer", "transformer"):
        stages = pp - 1 if standalone else pp
        if cfg.num_layers < stages:
            what = (f"the {stages} stages after the embedding's (--pipeline-model-parallel-size {pp}, "
                    "--standalone-embedding-stage)") if standalone else f"--pipeline-model-parallel-size {pp} stages"
            raise ConfigError(
                f"--num-layers {cfg.num_layers} cannot fill {what}: every stage needs a transformer layer; use "
                f"--num-layers >= {stages} (a multiple of {stages} balances the stages)")
        counts = cfg.stage_layer_counts(pp, standalone)
        parts = [0, 1 + counts[0]]
        for stage in range(1, pp):
            parts.append(parts[-1] + counts[stage])
        parts[-1] = n_specs  # norm + output join the last stage
        return parts
    if standalone:
        raise ConfigError(f"--standalone-embedding-stage with the {method!r} pipeline partition: it needs the "
                          "'type:TransformerLayer' partition, which places the layers")
    if method == "parameters":
        parts = partition_balanced(spec_parameters(cfg, tp, ep), pp)
    elif method == "uniform":
        parts = partition_uniform(n_specs, pp)
    else:
        raise ConfigError(f"pipeline partition method {method!r}: choose one of {', '.join(PARTITION_METHODS)}")
    empty = [s for s in range(pp) if parts[s + 1] <= parts[s]]
    if empty:
        raise ConfigError(f"partition {method!r} leaves stage(s) {empty} empty with {n_specs} pipeline layers on "
                          f"{pp} stages: use fewer stages or more --num-layers")
    return [int(p) for p in parts]


def check_topology(topo: PipeModelDataParallelTopology, pstate: ParallelState) -> None:
    """DeepSpeed's grid and our groups must list the same ranks, or TP would all-reduce across stages."""
    data = "ulysses_dp" if "ulysses_dp" in pstate.all_groups else "dp"  # Ulysses: the grid's data axis is SP x DP
    for axis, kind in (("model", "tp"), ("data", data), ("pipe", "pp")):
        theirs = sorted(sorted(g) for g in topo.get_axis_comm_lists(axis)) if topo.get_dim(axis) > 1 else None
        ours = sorted(sorted(g) for g in pstate.all_groups[kind])
        if theirs is not None and theirs != ours:
            raise RuntimeError(f"pipeline topology {axis} groups {theirs} differ from parallel_state {kind} {ours}")


class GPTModelPipe(ChunkedPipelineModule):
    """GPTModel's layers over ``pstate.pp.size`` stages; ``partition_method`` is one of PARTITION_METHODS.
    Built on every rank of the grid (it creates DeepSpeed's groups); each rank builds only its stage.

    ``virtual_stages`` v > 1 (--num-layers-per-virtual-pipeline-stage): each rank holds v chunks of the layer stack,
    chunk c of rank r being virtual stage c x PP + r (Megatron's interleaved layout; the split is even, so v x PP
    divides the layers). ``defer_weight_grads`` (--enable-zbh1-pipeline): the transformer layers' linears (QKV,
    projection, FC1, FC2, the experts' too) leave their weight gradients to the zero-bubble schedule's W pass; the
    output layer's and the norms', biases' and router's come in the backward pass as always."""

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool = False,
                 init_seed: int = 1234, partition_method: str = "type:TransformerLayer",
                 standalone_embedding_stage: bool = False, virtual_stages: int = 1,
                 defer_weight_grads: bool = False) -> None:
        self.cfg, self.pstate = cfg, pstate
        tp = pstate.tp
        seq_par = sequence_parallel and tp.size > 1
        padded = cfg.padded_vocab_size(tp.size)
        common = {"tp": tp, "sequence_parallel": seq_par, "init_seed": init_seed}
        specs: list = []
        if cfg.tie_embeddings:
            specs.append(TiedLayerSpec("embed", EmbeddingPipe, cfg, padded, tied_head=True, ulysses=pstate.ulysses,
                                       tied_weight_attr=["word_embeddings.weight"], **common))
        else:
            specs.append(LayerSpec(EmbeddingPipe, cfg, padded, tied_head=False, ulysses=pstate.ulysses, **common))
        specs += [LayerSpec(TransformerLayerPipe, cfg, i, ulysses=pstate.ulysses, num_experts=n, ep=pstate.ep, **common)
                  for i, n in enumerate(cfg.layer_experts())]
        specs.append(LayerSpec(FinalNormPipe, cfg.hidden_size, cfg.normalization, cfg.layernorm_epsilon, tp=tp,
                               sequence_parallel=seq_par, one_plus=cfg.apply_layernorm_1p))
        if cfg.tie_embeddings:
            specs.append(TiedLayerSpec("embed", EmbeddingPipe, cfg, padded, tied_head=True, forward_fn=tied_output,
                                       ulysses=pstate.ulysses, tied_weight_attr=["word_embeddings.weight"], **common))
        else:
            specs.append(LayerSpec(OutputLayerPipe, cfg, padded, **common))
        if virtual_stages > 1 and (partition_method != "type:TransformerLayer" or standalone_embedding_stage):
            raise ConfigError(f"pipeline partition method {partition_method!r} with {virtual_stages} virtual stages "
                              "per rank: the interleaved layout splits the layers evenly (type:TransformerLayer, "
                              "no --standalone-embedding-stage)")
        self._megatron_parts = partition(cfg, pstate.pp.size * virtual_stages, partition_method, tp.size,
                                         pstate.ep.size, standalone_embedding_stage)
        topo = PipeModelDataParallelTopology(num_pp=pstate.pp.size, num_mp=tp.size, num_dp=pstate.ulysses_dp.size)
        check_topology(topo, pstate)
        loss = LMLoss(pstate, cfg.moe.moe_loss_coeff if cfg.moe.enabled else None)
        super().__init__(specs, topology=topo, loss_fn=loss, partition_method=partition_method,
                         activation_checkpoint_interval=0, virtual_stages=virtual_stages, parts=self._megatron_parts)
        for funcs in self.chunk_modules():  # Megatron's block rule holds per model chunk
            layers = [f for f in funcs if isinstance(f, TransformerLayerPipe)]
            for i, layer in enumerate(layers):
                layer.recompute = i < recompute_layer_count(cfg, len(layers))
                layer.checkpoint_options, layer.tp_info = checkpoint_options(cfg, seq_par), tp
                for linear in layer.modules():
                    if isinstance(linear, ColumnParallelLinear | RowParallelLinear):
                        linear.defer_weight_grad = defer_weight_grads
        compile_transformer_layers(self, cfg.torch_compile)

    def forward(self, forward_input):
        out = super().forward(forward_input)
        # Every chunk but the loss's sends the MoE tuple on.
        return stage_output(out) if self.cfg.moe.enabled and not self.is_last_virtual_stage() else out

    def train(self, mode: bool = True):
        self.loss_fn.training = mode  # evaluation's loss is the lm loss alone, as on the plain path
        return super().train(mode)

    def get_additional_losses(self) -> OrderedDict | None:
        """The engine's extra losses (a model with experts): the last stage's lm and MoE loss of the latest
        micro-batch, which the engine sums over the batch, averages over DP and broadcasts to every stage (whose
        own call only counts the names)."""
        if not self.cfg.moe.enabled:
            return None
        return self.loss_fn.last or OrderedDict([("lm loss", None), ("moe loss", None)])

    def _synchronize_tied_weights(self) -> None:
        # An override of DeepSpeed's (registered in megatron/ds_seams.py OVERRIDES). It broadcasts the tied weight
        # in place; outside no_grad autograd records the broadcast (which has no backward) into the weight's graph
        # and warns on every backward.
        with torch.no_grad():
            super()._synchronize_tied_weights()



def stage_contents(cfg: ModelConfig, parts: list[int]) -> list[str]:
    """Human-readable contents of every stage, e.g. 'embedding, layers 0-3'."""
    kinds = spec_kinds(cfg)
    out = []
    for stage in range(len(parts) - 1):
        idx = range(parts[stage], parts[stage + 1])
        layers = [i - 1 for i in idx if kinds[i] == "layer"]
        items = ["embedding"] if kinds[idx[0]] == "embedding" else []
        if layers:
            items.append(f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}")
        items += [kinds[i] + (" (tied)" if kinds[i] == "output" and cfg.tie_embeddings else "")
                  for i in idx if kinds[i] in ("norm", "output")]
        out.append(", ".join(items))
    return out
