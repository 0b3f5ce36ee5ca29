"""Pipeline ZeRO-0 Adam moments read by name (megatron/checkpointing/ds_layout/read.py): each stage's model file holds
torch's optimizer state by index and the names format.py records beside it; a tied weight on two stages keeps the
first stage's; a file without the names is refused in one line (the moments cannot follow other layers)."""

import os

import pytest
import torch

from megatron.checkpointing.ds_layout.files import model_file
from megatron.checkpointing.ds_layout.read import OPTIMIZER_NAMES, zero0_moments
from megatron.errors import CheckpointError


def _stage(ckpt_dir: str, mp: int, names: list[str] | None, values: list[float]) -> None:
    state = {i: {"step": torch.tensor(2.0), "exp_avg": torch.full((2,), v), "exp_avg_sq": torch.full((2,), v * v)}
             for i, v in enumerate(values)}
    saved = {"module": None, "optimizer": {"state": state, "param_groups": [{"params": list(state)}]}}
    if names is not None:
        saved[OPTIMIZER_NAMES] = names
    torch.save(saved, model_file(ckpt_dir, mp))


def test_moments_by_recorded_name_first_stage_wins(tmp_path):
    d = str(tmp_path)
    _stage(d, 0, ["embedding.word_embeddings.weight", "layers.0.mlp.dense_h_to_4h.weight"], [1.0, 2.0])
    _stage(d, 1, ["embedding.word_embeddings.weight", "layers.1.mlp.dense_h_to_4h.weight", None], [9.0, 3.0, 4.0])
    (moments,), step = zero0_moments(d, 1, 2, pp=2)
    assert step == 2 and set(moments) == {"embedding.word_embeddings.weight", "layers.0.mlp.dense_h_to_4h.weight",
                                          "layers.1.mlp.dense_h_to_4h.weight"}
    assert moments["embedding.word_embeddings.weight"]["exp_avg"].tolist() == [1.0, 1.0]
    assert moments["layers.1.mlp.dense_h_to_4h.weight"]["exp_avg_sq"].tolist() == [9.0, 9.0]


def test_a_pipeline_file_without_names_is_refused(tmp_path):
    d = str(tmp_path)
    _stage(d, 0, None, [1.0])
    with pytest.raises(CheckpointError, match="keeps no names of its optimizer's parameters") as e:
        zero0_moments(d, 1, 2, pp=1)
    assert os.path.basename(model_file(d, 0)) in str(e.value) and "\n" not in str(e.value)
