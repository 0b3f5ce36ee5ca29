"""``--compile``: torch.compile each transformer layer in place (nn.Module.compile).

Why per layer and not the whole model: every layer has the same shapes, so one compiled graph serves
all of them (dynamo caches per code object), compile time stays that of one layer, and the pieces that
do not trace well (the embedding's vocab-parallel masking, the cross entropy's chunk loop, DeepSpeed's
hooks) stay eager. Inductor then fuses the elementwise tails the profile charged to "elementwise" and
"dtype copies": bias-GeLU, bias-dropout-add, the norms' casts (megatron/model/fusions.py).

Off on CPU: the CPU runs are tests and small demos, where compiling costs more than it saves and the
suite pins eager numerics. Unmeasured on GPU in this repository so far (bench/gpu_throughput.py --compile).
"""

from __future__ import annotations

import logging

from torch import nn

from megatron.core.comm import accelerator_device_type
from megatron.model.transformer import TransformerLayer

log = logging.getLogger(__name__)


def compile_transformer_layers(model: nn.Module, enabled: bool, device_type: str | None = None) -> int:
    """Compile every TransformerLayer of ``model`` when ``enabled`` on an accelerator; returns how many."""
    if not enabled:
        return 0
    if device_type is None:
        device_type = accelerator_device_type()
    if device_type == "cpu":
        log.warning("--compile is ignored on CPU: the transformer layers run eager")
        return 0

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
