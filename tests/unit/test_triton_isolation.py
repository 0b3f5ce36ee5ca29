"""Outside tests/unit/kernels, the Triton interpreter that tests/conftest.py sets up leaves no trace a user would not
have: TRITON_INTERPRET is unset again, so kernel selection on CPU is what a user gets (torch), in this process and in
the subprocesses tests start."""

from __future__ import annotations

import os

import torch

from megatron.kernels import select


def test_no_interpreter_outside_the_kernel_tests():
    assert os.environ.get("TRITON_INTERPRET") != "1", "tests/conftest.py must restore TRITON_INTERPRET"
    for op in ("attention", "norm"):
        assert select.choose(op, "auto", torch.device("cpu")) == "torch"
