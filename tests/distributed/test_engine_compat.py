"""DeepSpeed JSONs from Frontier job scripts through the real engine (one gloo rank):

- the JSON 'optimizer'/'scheduler' sections leave the run exactly as without them (upstream never uses them);
- --optimizer sgd trains as torch's SGD in a plain loop (tests/reference.py);
- the JSON fp16 loss-scale keys reach DeepSpeed's loss scaler (fp16 forced on CPU, as tests/checkpointing does);
- a ZeRO-Offload JSON trains as the plain AdamW loop, with --cpu_torch_adam, and with DeepSpeed's CPU Adam where
  that op is built already (its JIT build takes ~8 minutes here).
"""

import json
import os

import pytest

from tests.launch import run_distributed

STEPS, GBS, MBS = 3, 2, 1
ORNL_OPTIMIZER = {"optimizer": {"type": "Adam", "params": {"torch_adam": False, "adam_w_mode": False, "lr": "auto",
                                                            "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
                  "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 1}}}


def _run_config(zero=0, optimizer="adam", fp16=False, cpu_torch_adam=False, ds_json=None, tmp=None, **prec):
    """The run of these settings with ``ds_json`` as its --deepspeed_config (written into ``tmp``), no --zero-stage
    on the command line."""
    from megatron.arguments.deepspeed_json import with_deepspeed_json
    from megatron.config import OptimizerConfig, ParallelConfig, PrecisionConfig, RunConfig, TrainingConfig
    from megatron.config.sizes import named_model

    model = named_model("debug", use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                        seq_length=16, vocab_size=120, make_vocab_size_divisible_by=64)
    path = None
    if ds_json is not None:
        path = os.path.join(tmp, "ds.json")
        with open(path, "w") as f:
            json.dump(ds_json, f)
    fields = dict(model=model, parallel=ParallelConfig(world_size=1, zero_stage=zero),
                  optimizer=OptimizerConfig(lr=4e-3, min_lr=1e-3, lr_warmup_iters=1, clip_grad=0.5,
                                            weight_decay=0.1, optimizer=optimizer,
                                            cpu_optimizer=cpu_torch_adam, cpu_torch_adam=cpu_torch_adam),
                  precision=PrecisionConfig(fp16=fp16, **prec),
                  training=TrainingConfig(micro_batch_size=MBS, global_batch_size=GBS, train_iters=STEPS, seed=5))
    return RunConfig(**with_deepspeed_json(fields, path, zero_stage_given=False))


def _engine(run):
    from megatron.core.parallel_state import ParallelState
    from megatron.engine import build_ds_config, initialize_engine
    from megatron.model.gpt_model import GPTModel

    cfg = build_ds_config(run)
    state = ParallelState.build(1)
    engine = initialize_engine(GPTModel(run.model, tp=state.tp, init_seed=run.training.seed), run, state, cfg)
    return engine, cfg


def _losses(engine):
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.training.batches import microbatches
    from megatron.training.step import train_step

    data = microbatches(MockGPTDataset(4000, 16, 120, seed=9), 0, MBS, 0, 1, "cpu")
    return [train_step(engine, data, GBS // MBS).loss for _ in range(STEPS)]


def _worker(tmp, cpu_adam):
    from deepspeed.accelerator import get_accelerator

    from megatron.engine import NOTES_KEY
    from megatron.initialize import initialize_distributed

    initialize_distributed("gloo")
    out = {}
    plain, _ = _engine(_run_config(ds_json={"zero_optimization": {"stage": 0}}, tmp=tmp))
    out["plain"] = _losses(plain)
    with_sections, cfg = _engine(_run_config(ds_json={"zero_optimization": {"stage": 0}, **ORNL_OPTIMIZER},
                                                  tmp=tmp))
    out["with_sections"] = _losses(with_sections)
    out["notes"] = cfg[NOTES_KEY]
    out["sgd"] = _losses(_engine(_run_config(optimizer="sgd"))[0])
    offload_json = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    engine = _engine(_run_config(zero=2, cpu_torch_adam=True, ds_json=offload_json, tmp=tmp))[0]  # builds nothing
    out["offload_torch"] = (_losses(engine), type(engine.basic_optimizer).__name__)
    if cpu_adam:
        engine = _engine(_run_config(zero=2, ds_json=offload_json, tmp=tmp))[0]
        out["offload_cpu_adam"] = (_losses(engine), type(engine.basic_optimizer).__name__)

    type(get_accelerator()).is_fp16_supported = lambda self: True  # the CPU accelerator says no; torch can
    rebase = {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500,
                                                          "hysteresis": 2, "min_loss_scale": 1,
                                                          "initial_scale_power": 11}}
    engine, _ = _engine(_run_config(zero=1, fp16=True, ds_json=rebase, tmp=tmp))
    s = engine.optimizer.loss_scaler
    out["dynamic"] = (s.dynamic, s.cur_scale, s.scale_window, s.min_scale, s.delayed_shift)
    engine, _ = _engine(_run_config(zero=1, fp16=True, loss_scale=128.0, tmp=tmp,
                                    ds_json={"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}}))
    s = engine.optimizer.loss_scaler
    out["static"] = (s.dynamic, s.cur_scale)
    out["fp16_losses"] = _losses(engine)
    return out


def _cpu_adam_built() -> bool:
    """DeepSpeed's CPU Adam JIT-builds in ~8 minutes on this machine: use it only where it is built already."""
    import glob

    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return bool(glob.glob(os.path.join(root, "cpu_adam", "cpu_adam.so")) +
                glob.glob(os.path.join(root, "*", "cpu_adam", "cpu_adam.so")))


@pytest.mark.timeout(900)
def test_frontier_json_sections_through_the_engine(tmp_path):
    from tests.reference import reference_losses

    cpu_adam = _cpu_adam_built()
    res, = run_distributed(_worker, world_size=1, timeout=800, tmp=str(tmp_path), cpu_adam=cpu_adam)
    assert res["with_sections"] == res["plain"]  # bit-exact: the sections are not used, as upstream
    line, = [n for n in res["notes"] if "'optimizer' section" in n]
    assert "adam_w_mode=false" in line and "params.lr='auto'" in line
    assert any("'scheduler' section not used" in n and "warmup_max_lr=0.1" in n for n in res["notes"])

    ref = reference_losses(_run_config(), STEPS)
    assert max(abs(a - b) for a, b in zip(res["plain"], ref, strict=True)) < 1e-5
    ref_sgd = reference_losses(_run_config(optimizer="sgd"), STEPS)
    assert max(abs(a - b) for a, b in zip(res["sgd"], ref_sgd, strict=True)) < 1e-5
    assert abs(res["sgd"][-1] - res["plain"][-1]) > 1e-3  # SGD really is not AdamW

    # The JSON's loss-scale keys reach DeepSpeed's scaler (before: 2**32, window 1000, from flag defaults).
    assert res["dynamic"] == (True, 2.0**11, 500, 1, 2)
    assert res["static"] == (False, 128.0) and all(x == x for x in res["fp16_losses"])
    # ZeRO-Offload (before: a traceback after the model was built): the same updates as the plain AdamW loop.
    losses, kind = res["offload_torch"]
    assert kind == "AdamW" and max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-5
    if cpu_adam:
        losses, kind = res["offload_cpu_adam"]
        assert kind == "DeepSpeedCPUAdam" and max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-4
