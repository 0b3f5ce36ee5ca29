"""Extract every key DeepSpeed's config accepts, as dotted paths, by watching it parse.

How: DeepSpeedConfig is built from a dict that records every key it is asked for (``in``, ``get``, ``[]``).
One pass with an empty config gives the top-level keys; one pass per top-level key, with that key set to
a recording sub-dict, gives the keys read inside that section. Sections parsed by a pydantic model (ZeRO,
fp16/bf16, monitors, comms, compile, ...) read nothing key by key, so each pydantic model built during a
pass is caught, and its fields (aliases and nested models included) are listed. DeepSpeed's own list of
removed top-level/ZeRO keys (which it refuses) is added as well. Sections DeepSpeed reads outside
DeepSpeedConfig are probed the same way through their parser functions.

    python tools/extract_ds_config_keys.py megatron/compat/ds_schema_keys.txt

Keys read outside DeepSpeedConfig's parse, found by reading the source, are listed in READ_ELSEWHERE.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

MARK = "__megatron_probe__"
# pipeline: get_pipeline_config copies the section over its defaults (keys below) and the pipeline engine
# reads use_reentrant; optimizer/scheduler: DeepSpeed reads 'params' only when 'type' is there;
# sequence_parallel_size: read by DeepSpeedConfig.__init__ only without an mpu.
READ_ELSEWHERE = ("pipeline.stages", "pipeline.partition", "pipeline.seed_layers",
                  "pipeline.activation_checkpoint_interval", "pipeline.pipe_partitioned", "pipeline.grad_partitioned",
                  "pipeline.use_reentrant",
                  "optimizer.params", "scheduler.params", "sequence_parallel_size")
BASE = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


class Recorder(dict):
    def __init__(self, data, seen, prefix):
        super().__init__(data)
        self._seen, self._prefix = seen, prefix

    def _note(self, key):
        if isinstance(key, str) and key != MARK:
            self._seen.add(self._prefix + key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def keys(self):
        outer = self

        class _Keys(list):
            def __contains__(self, key):
                outer._note(key)
                return list.__contains__(self, key)

        return _Keys(super().keys())


def _model_keys(model, prefix, out):
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        for key in {name, field.alias} - {None}:
            out.add(prefix + key)
        ann = field.annotation
        for cand in (ann, *getattr(ann, "__args__", ())):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                _model_keys(cand, prefix + (field.alias or name) + ".", out)


def _catch_models(found):
    from megatron import ds_seams

    def seen(model, data):
        if MARK not in data:
            return data
        found.add(model)
        return {k: v for k, v in data.items() if k != MARK}

    return ds_seams.watching_config_models(seen)


def _parse(cfg):
    from deepspeed.runtime.config import DeepSpeedConfig

    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Exception):
        DeepSpeedConfig(cfg)


def extract() -> list[str]:
    logging.disable(logging.CRITICAL)  # DeepSpeed warns about every key it is shown; undone below
    try:
        return _extract()
    finally:
        logging.disable(logging.NOTSET)


def _extract() -> list[str]:
    from megatron import ds_seams

    seen: set[str] = set()
    _parse(Recorder(BASE, seen, ""))
    removed_top, removed_zero = ds_seams.removed_config_keys()
    seen |= removed_top
    seen |= {"zero_optimization." + k for k in removed_zero}
    top = sorted(k for k in seen if "." not in k)
    for key in top:
        sub, models = set(), set()
        with _catch_models(models):
            _parse(Recorder({**BASE, key: Recorder({MARK: 1}, sub, key + ".")}, set(), ""))
        seen |= sub
        for model in models:
            _model_keys(model, key + ".", seen)
    from deepspeed.runtime.config import get_pipeline_config

    pipeline = {"pipeline." + k for k in get_pipeline_config({})}
    assert pipeline <= set(READ_ELSEWHERE), f"new pipeline keys: {pipeline - set(READ_ELSEWHERE)}"
    return sorted(seen | set(READ_ELSEWHERE))


def header() -> str:
    import deepspeed

    return f"# DeepSpeed {deepspeed.__version__}: every key its config reads (tools/extract_ds_config_keys.py)\n"


if __name__ == "__main__":
    with contextlib.redirect_stdout(io.StringIO()):
        keys = extract()
        text = header() + "".join(k + "\n" for k in keys)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
