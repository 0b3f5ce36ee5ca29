"""Megatron-DeepSpeed's command-line flags: their definitions, upstream's flag classes applied (megatron/compat) and
every numeric flag checked against its range (megatron/flag_bounds.py). Flag names keep Megatron's spelling
(dashes), except DeepSpeed's own --deepspeed_config and --local_rank."""

from __future__ import annotations

import argparse

from megatron.compat import flags as compat
from megatron.config import model_names
from megatron.errors import ConfigError, launcher_rank
from megatron.flag_bounds import check_bounds


def _parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="use the plain GPTModel (no DeepSpeed pipeline engine); needed for ZeRO-2/3")
    g.add_argument("--enable-zbh1-pipeline", action="store_true",
                   help="upstream's zero-bubble H1 schedule: weight gradients deferred into the pipeline bubble "
                        "(docs/training.md, 'Pipeline schedules')")
    g.add_argument("--enable-zbh1-exact-semantics", action="store_true",
                   help="with --enable-zbh1-pipeline: weight gradients applied in micro-batch order (1F1B's bits)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B: each rank holds --num-layers / (PP x N) model chunks of N layers")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="Megatron-LM's spelling of the interleaved schedule: V model chunks per rank")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="DeepSpeed-Ulysses: split each sequence over this many ranks of the data-parallel dimension")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo", "ccl", "mpi"],
                   help="default: the accelerator's own (gloo on CPU, nccl=RCCL on ROCm)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by DeepSpeed's launcher")
    g.add_argument("--master-addr", default=None,
                   help="rank 0's host (default: MASTER_ADDR, else the launcher's); under Slurm a host outside the "
                        "job is replaced by the step's first node")
    g.add_argument("--master-port", type=int, default=None, help="rank 0's rendezvous port (default: MASTER_PORT, "
                                                                 "else 29500)")
    g.add_argument("--standalone-embedding-stage", action="store_true",
                   help="PP > 1: stage 0 holds only the embedding, the layers split over the other stages")
    g.add_argument("--rendezvous-timeout-secs", type=float, default=60.0,
                   help="how long ranks wait to meet rank 0 before one error line (the collective timeout is "
                        "--distributed-timeout-minutes)")


def _model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-size", choices=model_names(), default=None,
                   help="a named shape (explicit shape flags override its fields)")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--encoder-num-layers", type=int, help="upstream's other name for --num-layers (GPT has one stack)")
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-key-value-heads", "--num-query-groups", dest="num_key_value_heads", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--encoder-seq-length", type=int, help="upstream's other name for --seq-length")
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--normalization", type=str.lower, choices=["layernorm", "rmsnorm"], default=None)
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--openai-gelu", action="store_true", default=None,
                   help="GeLU with the tanh approximation (HF GPT-2's gelu_new) instead of the exact erf form")
    g.add_argument("--use-rotary-position-embeddings", action="store_true")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default=None)
    g.add_argument("--rotary-base", "--rotary-position-embeddings-theta", dest="rotary_base", type=float,
                   default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's channels that rotate (partial rotary, GPT-NeoX's rotary_pct)")
    g.add_argument("--squared-relu", action="store_true", help="MLP activation relu(x)^2 (upstream's; HF relu2)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="LayerNorm weights stored zero-centred, scaling by 1 + weight (Nemotron's LayerNorm1P)")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="add attention's and the MLP's output to their input norm's output, not the layer's input")
    g.add_argument("--fp32-residual-connection", action="store_true",
                   help="with --bf16/--fp16: keep the residual stream (and the tensors between stages) in fp32")
    g.add_argument("--embedding-weights-in-fp32", action="store_true",
                   help="look up word embeddings in an fp32 copy of the table (its gradient in fp32)")
    g.add_argument("--init-method-xavier-uniform", action="store_true",
                   help="xavier_uniform_ instead of N(0, --init-method-std) for every weight matrix")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--disable-bias-linear", action="store_true", default=None)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--use-cpu-initialization", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--checkpoint-activations", action="store_true", help="= --recompute-granularity full")
    g.add_argument("--recompute-activations", action="store_true", help="= --recompute-granularity selective")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recompute: uniform = checkpoints of --recompute-num-layers layers each; block = only "
                        "the first --recompute-num-layers layers (default: every layer, one checkpoint each)")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="with full recompute: checkpoints of --checkpoint-num-layers layers, as upstream")
    g.add_argument("--checkpoint-num-layers", type=int, default=None,
                   help="layers per checkpoint under --deepspeed-activation-checkpointing (default 1)")
    g.add_argument("--partition-activations", "--distribute-saved-activations", "--distribute-checkpointed-activations",
                   dest="partition_activations", action="store_true",
                   help="keep 1/TP of each checkpointed input, all-gathered for the recompute")
    g.add_argument("--checkpoint-in-cpu", action="store_true", help="keep checkpointed inputs in host memory")
    g.add_argument("--synchronize-each-layer", action="store_true",
                   help="accelerator synchronize around each checkpoint's forward and backward")
    g.add_argument("--profile-backward", action="store_true", help="print each checkpoint's forward/backward time")
    g.add_argument("--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-v2", dest="use_flash_attn_v2",
                   action="store_true",
                   help="the HIP flash-attention kernel (csrc/), when built")
    g.add_argument("--use-flash-attn-triton", action="store_true")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="add fc1's bias in the matmul instead of inside the GeLU")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="add the output projections' bias before dropout, not in the fused bias-dropout-add")
    g.add_argument("--compile", dest="torch_compile", action="store_true",
                   help="torch.compile each transformer layer (accelerators only; ignored on CPU)")


def _moe(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts (docs/moe.md)")
    g.add_argument("--num-experts", type=int, nargs="+", default=[1],
                   help="experts of every MoE layer, or one count per MoE layer (1: dense)")
    g.add_argument("--expert-interval", type=int, default=2, help="every N-th layer is an MoE layer")
    g.add_argument("--topk", type=int, default=1, help="experts per token: 1 or 2")
    g.add_argument("--mlp-type", choices=["standard", "residual"], default="standard",
                   help="residual: PR-MoE (a dense MLP beside the experts)")
    g.add_argument("--moe-expert-parallel-size", type=int, default=1,
                   help="ranks of the data-parallel group the experts are split over")
    g.add_argument("--enable-expert-tensor-parallelism", action="store_true",
                   help="split the experts over the TP group like the dense MLP")
    g.add_argument("--moe-train-capacity-factor", type=float, default=1.0)
    g.add_argument("--moe-eval-capacity-factor", type=float, default=1.0)
    g.add_argument("--moe-min-capacity", type=int, default=4)
    g.add_argument("--disable-moe-token-dropping", dest="moe_token_dropping", action="store_false",
                   help="capacity from the busiest expert: no token is dropped")
    g.add_argument("--moe-loss-coeff", type=float, default=0.1, help="scale of the load-balancing loss")
    g.add_argument("--create-moe-param-group", action="store_true",
                   help="accepted: the experts' optimizer groups are always created (docs/moe.md)")
    g.add_argument("--disable-moe-top2-2nd-expert-sampling", dest="moe_top2_2nd_expert_sampling",
                   action="store_false", help="top-2: the second largest gate value, not a Gumbel sample")


def _batch(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None)


def _schedule(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimiser and schedule")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    # Sample- and token-based forms, counted as upstream (megatron/optim/lr_schedule.py).
    g.add_argument("--train-samples", type=int, default=None,
                   help="train this many samples (instead of --train-iters); the iterations follow, as upstream")
    g.add_argument("--train-tokens", type=int, default=None, help="also stop once this many tokens are consumed")
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-decay-samples", type=int, default=None, help="default: --train-samples")
    g.add_argument("--lr-warmup-tokens", type=int, default=None)
    g.add_argument("--lr-decay-tokens", type=int, default=None, help="decay over tokens instead of steps")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, take the LR schedule from the flags, not the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, take the LR schedule from the checkpoint, not the flags")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCR", "SAMPLES"),
                   help="grow the global batch from START by INCR over SAMPLES samples (needs --train-samples)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="with --weight-decay-incr-style linear/cosine: the decay at the first step")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="with --weight-decay-incr-style linear/cosine: the decay from the last step on")
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant",
                   help="raise the weight decay over the run's samples (constant: --weight-decay)")
    g.add_argument("--clip-grad", type=float, default=None,
                   help="0 disables clipping (default 1.0, or the DeepSpeed JSON's gradient_clipping, as upstream)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="adam = AdamW (upstream's FusedAdam default); the JSON 'optimizer' section is not used")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--cpu-optimizer", action="store_true", help="DeepSpeed's CPU Adam (for ZeRO-Offload)")
    g.add_argument("--cpu_torch_adam", "--cpu-torch-adam", dest="cpu_torch_adam", action="store_true",
                   help="with --cpu-optimizer: torch's AdamW instead of DeepSpeed's CPU Adam")
    g.add_argument("--seed", type=int, default=1234)


def _precision(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    # Loss-scale flags default to None (= not given): under --fp16 they fill what the DeepSpeed JSON leaves out.
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=None, help="default 2**32 (a power of 2)")
    g.add_argument("--min-loss-scale", type=float, default=None, help="default 1")
    g.add_argument("--loss-scale-window", type=int, default=None, help="default 1000")
    g.add_argument("--hysteresis", type=int, default=None, help="default 2")


def _logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--profile", choices=["pt", "pt-full"], default=None,
                   help="PyTorch profiler trace of --profile_steps into --tensorboard-dir (pt-full: with stacks)")
    g.add_argument("--profile_steps", "--profile-steps", dest="profile_steps", default="2,3",
                   help="START,END: the steps of this process to profile, counted from 1")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=None, help="ranks to profile (default: all)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="one device's peak for MFU (default: its datasheet figure, 191.5 on an MI250X GCD; "
                        "measured on CPU)")
    # Upstream Megatron-DeepSpeed's logging flags (megatron/config/log.py says what each does here).
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="write TensorBoard scalars every N iters")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="events the TensorBoard writer queues before it flushes to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write iteration-time and the --timing-log-level timers to TensorBoard")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", "--no-log-learning-rate-to-tensorboard",
                   dest="log_learning_rate_to_tensorboard", action="store_false",
                   help="(upstream's spelling, 'learnig', is kept; the correct one is accepted too)")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-optimizer-states-to-tensorboard", action="store_true",
                   help="norms and max of Adam's moments and the weights (one reduction per written iteration)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-params-norm", action="store_true", help="compute and log the parameters' L2 norm")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: iteration time only; 1: + forward-backward, optimizer; 2: + per micro-batch timers")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="timers printed as the max, (min, max) or every rank's time")
    g.add_argument("--no-barrier-with-level-1-timing", dest="barrier_with_L1_time", action="store_false",
                   help="level-1 timers start without a barrier over all ranks")
    g.add_argument("--wandb-project", default="",
                   help="Weights & Biases project (needs pip install '.[wandb]'); offline when the service cannot be "
                        "reached or no key is set, with the `wandb sync` command printed at the end")
    g.add_argument("--wandb-exp-name", default="", help="the W&B run's name (either flag starts W&B, as upstream)")
    g.add_argument("--wandb-save-dir", default="", help="where W&B writes (default: --save/wandb, as upstream)")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate the --load'ed checkpoint on the valid and test splits, then exit")


def _deepspeed(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DeepSpeed")
    g.add_argument("--deepspeed", action="store_true", help="accepted for compatibility: DeepSpeed is always used")
    g.add_argument("--deepspeed_config", "--deepspeed-config", "--deepscale_config", dest="deepspeed_config",
                   default=None)
    g.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3])
    g.add_argument("--zero-hierarchy", default=None, metavar="TIERS",
                   help="hierarchical ZeRO-3 over Frontier's tiers, e.g. package,node,network (needs --zero-stage 3)")
    g.add_argument("--zero-hierarchy-weights", choices=["package", "node"], default=None,
                   help="tier sharing one copy of the 16-bit weights (default: node); forward all-gathers stay in it")
    g.add_argument("--zero-hierarchy-int8", action="store_true",
                   help="block-wise int8 on the network stage of --zero-hierarchy (with error feedback)")


def _data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens, no files")
    g.add_argument("--demo-corpus", action="store_true",
                   help="the embedded default corpus (Python standard-library docstrings, byte tokens)")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary of the null/mock tokenizer")
    g.add_argument("--data-path", nargs="*", default=None, help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend")
    g.add_argument("--train-data-path", nargs="*", default=None,
                   help="the train split's own corpora (instead of --data-path and --split), in --data-path's form")
    g.add_argument("--valid-data-path", nargs="*", default=None,
                   help="the valid split's own corpora (without it: no validation)")
    g.add_argument("--test-data-path", nargs="*", default=None,
                   help="the test split's own corpora (without it: no test evaluation)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions")
    g.add_argument("--data-cache-path", default=None, help="where sample/shuffle index files are cached")
    g.add_argument("--tokenizer-type", default=None,
                   help="GPT2BPETokenizer (the default with --data-path, as upstream) | GPTSentencePieceTokenizer | "
                        "Llama2Tokenizer | SentencePieceTokenizer | HFTokenizer | NullTokenizer")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None, help="HF tokenizer dir / tokenizer.json, or SentencePiece model")
    g.add_argument("--dataloader-type", choices=["single", "cyclic"], default="single",
                   help="single: samples in index order; cyclic: upstream's random order per epoch (seeded by epoch)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss on the prediction after an end-of-document token (upstream's flag)")
    g.add_argument("--no-data-sharding", dest="data_sharding", action="store_false",
                   help="--dataloader-type cyclic: one permutation of all samples, dealt to the DP ranks in turn "
                        "(default: each rank permutes its own contiguous share), as upstream")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--per-epoch-doc-shuffle", action="store_true",
                   help="NOT upstream's order: shuffle each epoch's documents on its own (this project's order "
                        "before upstream's became the default); the same flags then read other samples")


def _dry_run(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout dry run and placement")
    g.add_argument("--dry-run", action="store_true",
                   help="print where every rank lands and the memory per GCD, then exit (no GPU, no process group)")
    g.add_argument("--world-size", type=int, default=None, help="ranks to plan for in --dry-run")
    g.add_argument("--nodes", type=int, default=None, help="nodes (8 GCDs each) to plan for in --dry-run")
    g.add_argument("--allow-tp-across-nodes", action="store_true",
                   help="warn instead of refusing when a TP group would span nodes")


def _checkpointing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing, exits and faults (megatron/checkpointing)")
    g.add_argument("--save", default=None, help="directory for checkpoints (DeepSpeed layout + 'latest')")
    g.add_argument("--load", default=None, help="resume from DIR/latest, or load a full-state directory")
    g.add_argument("--load-tag", default=None,
                   help="resume the checkpoint DIR/TAG of --load (e.g. global_step1000) instead of the one 'latest' "
                        "names")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape from the --load checkpoint (a shape flag given must agree with it)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true", help="ZeRO-0/1/2: save weights without optimizer state")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--trust-checkpoint", action="store_true",
                   help="--load of an upstream Megatron(-DeepSpeed) checkpoint: unpickle its Python objects (args, "
                        "RNG); only for checkpoints from a trusted place")
    g.add_argument("--universal-checkpoint", action="store_true",
                   help="--load is an upstream run's DeepSpeed universal checkpoint (ds_to_universal.py; "
                        "'latest_universal' names it): resumed at any TP/PP/ZeRO layout")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: a directory without a checkpoint is an error instead of a fresh start")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only; iteration, optimizer, LR schedule and RNG start fresh")
    g.add_argument("--verify-checkpoint", choices=["full", "size", "off"], default="full",
                   help="check --load's files against the checkpoint's integrity manifest before loading: full "
                        "(sizes and xxHash checksums, shared over the ranks), size, or off")
    g.add_argument("--async-save", action="store_true",
                   help="save in the background (Megatron-LM's flag): training waits only for a copy of each rank's "
                        "state to host memory; 'latest' moves once every rank's files are on disk")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None,
                   help="delete older checkpoints (the one 'latest' names is never deleted)")
    g.add_argument("--exit-interval", type=int, default=None, help="save and exit at this iteration multiple")
    g.add_argument("--kill-switch-file", default=None,
                   help="save and exit once this file exists (checked after every iteration; present at start: "
                        "exit before training), as upstream")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="save and exit after this wall time")
    g.add_argument("--job-end-margin-secs", type=float, default=None,
                   help="under Slurm: save and exit once the next step, a checkpoint save and this margin no longer "
                        "fit before the job's end (SLURM_JOB_END_TIME / squeue); default max(2 step times, 20%% of "
                        "the predicted save, 15 s)")
    g.add_argument("--max-nonfinite-loss-iters", type=int, default=3,
                   help="stop after this many consecutive NaN/Inf-loss iterations (nothing is saved meanwhile)")
    g.add_argument("--watchdog-timeout-secs", type=float, default=60.0,
                   help="exit every rank when one stops its heartbeat for this long (0 disables the watchdog, "
                        "hang detection included)")
    g.add_argument("--hang-timeout", type=float, default=None,
                   help="seconds without any rank moving before every rank exits naming the stuck one (default: "
                        "5 x the slowest recent step, at least 30 s, below the collective timeout; 0 disables)")
    g.add_argument("--hang-timeout-save", type=float, default=None,
                   help="the hang allowance while saving a checkpoint (default: the collective timeout)")
    g.add_argument("--hang-timeout-startup", type=float, default=None,
                   help="the hang allowance while building, loading and in the first two iterations (default: the "
                        "collective timeout)")
    g.add_argument("--straggler-interval", type=int, default=None,
                   help="iterations between straggler reports (default: 100, more when the report's all-gather "
                        "would cost over 0.5%% of the steps; 0 disables)")
    g.add_argument("--straggler-factor", type=float, default=1.5,
                   help="a rank whose own work per iteration exceeds this x the median ...")
    g.add_argument("--straggler-reports", type=int, default=3,
                   help="... in this many reports in a row is named a straggler (once)")
    g.add_argument("--skip-memory-check", action="store_true",
                   help="build the model even when the memory model's estimate exceeds what a rank can hold")


class _Parser(argparse.ArgumentParser):
    """A bad flag is a ConfigError like every other early error: one line, printed once per job, exit 2
    (argparse's own exit prints the usage block on every rank)."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see python pretrain_gpt.py --help)")


# The groups of flags, in --help's order; those a parallel layout depends on (what the dry run reads, with
# --vocab-size, which sizes its model) are marked.
_GROUPS = ((_parallel, True), (_model, True), (_moe, True), (_batch, True), (_schedule, False), (_precision, True),
           (_logging, False), (_deepspeed, True), (_data, False), (_dry_run, True), (_checkpointing, False))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="Megatron-Frontier GPT pretraining", allow_abbrev=False)
    for add, _ in _GROUPS:
        add(p)
    compat.add_upstream_flags(p)  # last: every upstream flag we do not define, to classify what was given
    return p


def layout_flags() -> frozenset[str]:
    """The option strings of the flags a parallel layout depends on: the model, parallelism, batch, precision and
    DeepSpeed settings (tools/show_layout.py lists the other flags of a command line as ignored)."""
    p = argparse.ArgumentParser(add_help=False)
    for add, layout in _GROUPS:
        if layout:
            add(p)
    return frozenset(s for a in p._actions for s in a.option_strings) | {"--vocab-size"}


def parse_args(argv=None) -> argparse.Namespace:
    """Parse, apply upstream's flag classes (megatron/compat/flags.py: a refused flag is a ConfigError, a given
    no-op is said once), then check every numeric flag against its range (megatron/flag_bounds.py, the table beside
    these definitions): a value out of range is one ConfigError naming the flag and the range."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for note in compat.apply(args):
        if launcher_rank() == 0:
            print(f"> {note}", flush=True)
    check_bounds(parser, args)
    _resolve_aliases(args)
    return args


def given_dests(argv: list[str]) -> set[str]:
    """The dests of the flags ``argv`` gives, at whatever value (a flag given at its default counts; upstream's
    second names count as the first's: --encoder-num-layers is --num-layers)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(argv)))
    for name, alias in _ALIASES:
        if alias in given:
            given.add(name)
    return given


_ALIASES = (("num_layers", "encoder_num_layers"), ("seq_length", "encoder_seq_length"))


def _resolve_aliases(args: argparse.Namespace) -> None:
    """Upstream's second names for the layer count and sequence length (its validate_args does the same)."""
    for name, alias in _ALIASES:
        value, other = getattr(args, name, None), getattr(args, alias, None)
        if value is not None and other is not None:
            raise ConfigError(f"--{name.replace('_', '-')} and --{alias.replace('_', '-')} are both given: they are "
                              "the same setting, keep one")
        if value is None and other is not None:
            setattr(args, name, other)
