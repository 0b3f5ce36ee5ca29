"""The MFU peak is the datasheet figure of the device the run is on, not always the MI250X's (GPU paths mocked)."""

from types import SimpleNamespace

import pytest

from megatron.training import peak


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend to run on an accelerator named by the returned setter."""
    name = {"value": ""}
    monkeypatch.setattr(peak, "get_accelerator", lambda: SimpleNamespace(device_name=lambda: "cuda",
                                                                         current_device_name=lambda: "cuda:0"))
    monkeypatch.setattr(peak.torch, "get_device_module",
                        lambda kind: SimpleNamespace(get_device_name=lambda dev: name["value"]))
    return lambda n: name.update(value=n)


def test_the_peak_follows_the_device(on_gpu):
    on_gpu("NVIDIA H100 80GB HBM3")
    assert peak.device_peak_tflops("bf16") == (989.4, "H100 bf16 dense datasheet peak")
    on_gpu("AMD Instinct MI250X")
    assert peak.device_peak_tflops("bf16")[0] == 191.5 and peak.device_peak_tflops("fp32")[0] == 47.9
    on_gpu("AMD Instinct MI250")  # the longer key wins: MI250X is not MI250
    assert peak.device_peak_tflops("fp16")[0] == 181.0
    on_gpu("Some Future GPU")
    value, source = peak.device_peak_tflops("bf16")
    assert value == 191.5 and "pass --peak-tflops" in source
    assert peak.device_peak_tflops("bf16", override=500.0) == (500.0, "--peak-tflops")
