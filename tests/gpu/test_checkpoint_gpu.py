"""Checkpoints on one GPU, through the CPU suite's own checks: bf16 exact resume (check_resume_exact, which
tests/checkpointing/test_resume.py runs on CPU), HF export logits vs ours, SIGTERM saves and exits 0
(tests/checkpointing/test_exits.py's test, unchanged), and --async-save: the host copy lands in pinned buffers reused
from one save to the next, and a bf16 run resumes bit for bit from a background save written while it trained."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.checkpointing.common import check_resume_exact, pretrain_on, slow_async_pretrain
from tests.checkpointing.test_exits import test_signal_saves_exits_zero_and_resumes as signal_test
from tests.checkpointing.test_resume import _batch
from tests.gpu.helpers import BF16_REL, STATIC_KERNELS, device_args
from tests.models import CKPT_GPT, LLAMA

GPU_BASE = device_args(CKPT_GPT)


@pytest.fixture(autouse=True)
def _static_kernels(monkeypatch):
    """Spawned ranks inherit the environment: one fixed kernel choice for the straight and the resumed run."""
    for k, v in STATIC_KERNELS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS picks the same reduction order every run


@pytest.mark.parametrize("zero", [1, 3])
def test_bf16_resume_exact(tmp_path, zero):
    check_resume_exact(1, GPU_BASE + ["--bf16", "--zero-stage", str(zero)], str(tmp_path))


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-4), ("bf16", BF16_REL)])
def test_hf_export_logits_match_ours(tmp_path, precision, tol):
    """Train 2 iterations (Llama variant), export to HF, and the HF model's loss on iteration 3's batch equals the
    loss our run logged at iteration 3 (the same weights), within the dtype's tolerance."""
    from transformers import AutoModelForCausalLM

    from tools.convert_checkpoint_to_hf import main as to_hf

    save = str(tmp_path / "ckpt")
    flags = ["--bf16"] if precision == "bf16" else []
    args = GPU_BASE + LLAMA + flags + ["--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "1",
                                       "--vocab-size", "256", "--train-iters", "3", "--save", save,
                                       "--save-interval", "2"]
    straight = pretrain_on(1, args)["losses"]
    with open(f"{save}/latest", "w") as f:
        f.write("global_step2")
    assert to_hf(["--load", save, "--tag", "global_step2", "--out", str(tmp_path / "hf")]) == 0
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=dtype).eval().to("cuda")
    tokens = _batch(3, vocab=256).to("cuda")
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()
    assert abs(loss - straight[3]) <= tol * abs(straight[3]), (loss, straight[3])


def test_sigterm_saves_and_exits_zero(tmp_path):
    signal_test(tmp_path, signal.SIGTERM)


def test_host_copy_goes_to_pinned_buffers_reused_between_saves():
    from megatron.checkpointing.live.host_copy import HostCopier

    flat = torch.arange(4096, dtype=torch.float32, device="cuda")
    state = {"w": flat.view(64, 64), "part": flat[128:256], "step": torch.tensor(3)}
    copier = HostCopier()
    first = copier.copy(state, "f.pt")
    assert first["w"].device.type == "cpu" and first["w"].is_pinned()
    assert torch.equal(first["w"], state["w"].cpu()) and torch.equal(first["part"], state["part"].cpu())
    assert first["w"].untyped_storage().data_ptr() == first["part"].untyped_storage().data_ptr()  # one storage
    assert copier.bytes_needed(state, "f.pt") == 8  # only the CPU scalar: the device storage has its buffer
    ptr = first["w"].untyped_storage().data_ptr()
    flat.add_(1.0)
    second = copier.copy(state, "f.pt")
    assert second["w"].untyped_storage().data_ptr() == ptr and torch.equal(second["w"], state["w"].cpu())


def test_bf16_resume_exact_from_a_background_save(tmp_path):
    save = str(tmp_path / "ckpt")
    args = GPU_BASE + ["--bf16", "--zero-stage", "1", "--train-iters", "4"]
    got = slow_async_pretrain(1, args + ["--async-save", "--save", save, "--save-interval", "2"],
                              slow_tag="global_step2.tmp-", slow_s=1.0, timeout=300)
    events = got["events"]
    assert events.index(("commit", "global_step2")) > events.index(("iteration", 3)), events
    with open(f"{save}/latest", "w") as f:
        f.write("global_step2")
    resumed = pretrain_on(1, args + ["--load", save])["losses"]
    assert resumed == {3: got["losses"][3], 4: got["losses"][4]}, (resumed, got["losses"])


@pytest.mark.parametrize("saved,now", [(1, 3), (3, 1)])
def test_zero_stage_change_in_place(tmp_path, saved, now):
    """Saved at one ZeRO stage, resumed at the other on the same GPU, in place (megatron/checkpointing/relayout/): into
    ZeRO-3 the fp32 masters and Adam moments go to the device through DeepSpeed's safe_set_local_*, out of it they are
    read from its fp32 partitions; iterations 3-4 follow the straight run (fp32, 1e-4: cuBLAS as the HF check)."""
    from tests.checkpointing.test_relayout import _resumed
    from tests.launch import run_distributed

    save = str(tmp_path / "ckpt")
    args = GPU_BASE + ["--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "256", "--train-iters", "4"]
    straight = pretrain_on(1, args + ["--zero-stage", str(saved), "--save", save, "--save-interval", "2"])["losses"]
    with open(f"{save}/latest", "w") as f:
        f.write("global_step2")
    out = run_distributed(_resumed, 1, timeout=300, argv=args + ["--zero-stage", str(now), "--load", save])[0]
    assert sorted(out["losses"]) == [3, 4], out["losses"]
    assert all(abs(out["losses"][i] / straight[i] - 1) < 1e-4 for i in (3, 4)), (out["losses"], straight)
    assert any(s.startswith(f"> layout changed from TP 1 x PP 1 x DP 1 x EP 1, ZeRO-{saved} (1 rank) to TP 1 x PP 1 x "
                            f"DP 1 x EP 1, ZeRO-{now} (1 rank): resumed global_step2 in place (weights, fp32 master "
                            "weights, Adam moments at step 2;") for s in out["said"]), out["said"]
