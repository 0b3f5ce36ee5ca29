"""DeepSpeed's own layout read slice by slice, for a rank that resumes it at another layout (relayout/): per
parameter (our names, experts by global index) and source TP rank, where its weights, fp32 master weights and Adam
moments sit in the files of a ``global_stepN/`` directory. Files are opened memory-mapped, so reading a slice reads
the pages of that slice only; the optimizer files of a pipeline stage are opened only when this rank holds one of
that stage's parameters.

ZeRO-1/2 and DeepSpeed's bf16 optimizer write per DP rank a flat fp32 partition per parameter group, and per
parameter the slice of it in that partition (``param_slice_mappings``: start in the partition, length). A
parameter's slices, in partition order, are its flattened TP shard: the position of each in the shard is the sum of
the lengths before it. ZeRO-0 in fp32 keeps torch AdamW's whole-tensor state in the model file (read.py's order).

ZeRO-3 keeps the weights only in its optimizer files: per DP rank ``d`` of ``D`` a flat fp32 partition per sub-group,
in which every parameter (``param_shapes`` order, of DP rank 0's model file) takes ``c = ceil(n / D)`` elements: the
elements ``[d c, (d + 1) c)`` of its flattened TP shard (the last rank's end in padding). Adam's state of sub-group
``g`` is laid out alike (DeepSpeed's zero_to_fp32 reads the weights with the same arithmetic).
"""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass

import torch

from megatron.checkpointing.ds_layout.files import LAYER_FILE, OPTIM_FILE, expert_files, model_file, place
from megatron.checkpointing.live.safe_io import safe_load
from megatron.errors import CheckpointError
from megatron.model.param_names import canonical_name, expert_index, experts_per_layer, with_expert

MOMENTS = ("exp_avg", "exp_avg_sq")
_FP32_GROUPS = {False: "single_partition_of_fp32_groups", True: "fp32_flat_groups"}  # by "written at ZeRO-3"


@dataclass(frozen=True)
class Piece:
    """``tensor`` (1-D, mapped) holds the elements ``[start, start + numel)`` of one flattened source TP shard."""

    start: int
    tensor: torch.Tensor
    path: str


@dataclass
class _Slice:
    path: str
    group: int
    at: int
    numel: int
    part: int


class DeepSpeedSource:
    """The checkpoint ``ckpt_dir`` of DeepSpeed's layout (``meta``: its megatron_meta.json) as pieces. ``wanted``:
    the names this rank holds (the optimizer files of stages holding none of them stay closed)."""

    def __init__(self, ckpt_dir: str, meta: dict, wanted: set[str]) -> None:
        p = meta["run"]["parallel"]
        self.dir, self.meta = ckpt_dir, meta
        self.tp, self.pp = p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"]
        self.zero = p["zero_stage"]
        self.ep = p.get("moe_expert_parallel_size", 1)
        self.nl = meta["run"]["model"]["num_layers"]
        self.wanted = {_local0(n) for n in wanted}
        self._weights: dict[int, dict[str, torch.Tensor]] = {}
        self._stages: dict[int, list[set[str]]] = {}
        self._slices: dict[int, dict[str, list[_Slice]]] = {}
        self._optim: dict[str, dict] = {}
        self._adamw: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}  # ZeRO-3: TP shard shapes (its model files hold no weights)
        self.has_zero_files = bool(glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")))

    # ------------------------------------------------------------------ what the files hold
    @property
    def has_master(self) -> bool:
        """An fp32 master copy apart from the weights (ZeRO-1/2, the bf16 optimizer)."""
        return self.has_zero_files

    def moments_why_not(self) -> str | None:
        """None when the files hold Adam moments this reader maps to parameters, else why not."""
        if not self.meta.get("has_optimizer", True):
            return "the checkpoint was saved with --no-save-optim"
        if self.has_zero_files:
            return None
        if self.pp == 1 and self.zero == 0:
            return None if self._adamw_state(0) else "the optimizer had not stepped yet"
        return "pipeline ZeRO-0 files keep no per-parameter map"

    def adam_step(self) -> int:
        """The optimizer's step count (the same in every file)."""
        if self.has_zero_files:
            path = sorted(glob.glob(os.path.join(self.dir, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")))[0]
            first = _group_state(self._optim_file(path), 0)
        else:
            first = next(iter(self._adamw_state(0).values()), {})
        return int(first.get("step", 0))

    def counters(self) -> dict:
        """DeepSpeed's step counters of the run (model file of model-parallel rank 0)."""
        sd = safe_load(model_file(self.dir, 0) if self.zero < 3 else _zero3_model_file(self.dir, 0), mmap=True)
        return {k: sd.get(k) for k in ("global_steps", "global_samples", "skipped_steps")}

    def loss_scaler(self):
        """fp16: the dynamic loss scaler of one ZeRO file (equal on every rank), or None."""
        paths = sorted(glob.glob(os.path.join(self.dir, "*zero_pp_rank_0_mp_rank_00_optim_states.pt")))
        if not paths:
            return None
        osd = self._optim_file(paths[0])
        return osd.get("loss_scaler"), osd.get("dynamic_loss_scale")

    # ------------------------------------------------------------------ pieces
    def shard_shape(self, name: str, j: int) -> tuple[int, ...]:
        """The shape of source TP rank ``j``'s shard of ``name``."""
        if self.zero < 3:
            return tuple(self.shard(name, j).shape)
        self._slice_index(j)
        return self._found(self._shapes.get(name), name, j)

    def shard(self, name: str, j: int) -> torch.Tensor:
        """The weight ``name`` of source TP rank ``j`` (mapped)."""
        return self._found(self._weight_index(j).get(name), name, j)

    def _found(self, found, name: str, j: int):
        if found is None:
            raise no_tensor(self.dir, name, j)
        return found

    def pieces(self, name: str, kind: str, j: int) -> list[Piece]:
        """The pieces of ``name``'s ``kind`` (weight, master, exp_avg, exp_avg_sq) in source TP rank ``j``'s shard."""
        if kind == "weight" and self.zero == 3:  # the fp32 partitions are its only copy of the weights
            kind = "master"
        if kind == "weight" or kind == "master" and not self.has_zero_files:
            return [Piece(0, self.shard(name, j).reshape(-1), self.dir)]
        if not self.has_zero_files:
            st = self._adamw_state(j).get(name)
            if st is None:
                raise CheckpointError(f"{model_file(self.dir, j)} holds no Adam moments for {name}")
            return [Piece(0, st[kind].reshape(-1), model_file(self.dir, j))]
        out, start = [], 0
        for s in self._slice_index(j).get(name, []):
            osd = self._optim_file(s.path)
            if kind == "master":
                flat = osd[_FP32_GROUPS[self.zero == 3]][s.group]
            else:
                flat = _group_state(osd, s.group)[kind]
            out.append(Piece(start, flat.narrow(0, s.at, s.numel), s.path))
            start += s.numel
        if not out:
            raise CheckpointError(f"{self.dir}: no ZeRO optimizer file holds {name} (TP rank {j}): saved from a "
                                  "different model variant")
        return out

    # ------------------------------------------------------------------ indexes, built once per source TP rank
    def _weight_index(self, j: int) -> dict[str, torch.Tensor]:
        """Every weight of TP rank ``j``: model files (the first stage's copy of a tied weight wins), pipeline layer
        files, per-expert files (global expert index)."""
        if j in self._weights:
            return self._weights[j]
        index: dict[str, torch.Tensor] = {}
        stages: list[set[str]] = []
        for stage in range(self.pp):
            sd = safe_load(model_file(self.dir, stage * self.tp + j), mmap=True)
            for k, v in (sd.get("module") or {}).items():
                if v is not None and (c := canonical_name(k, self.nl)) is not None:
                    index.setdefault(c, v)
            stages.append({_local0(c) for g in sd.get("param_shapes") or [] for k in g
                           if (c := canonical_name(k, self.nl)) is not None})
        layers = []
        for f in os.listdir(self.dir):
            if (m := LAYER_FILE.match(f)) and int(m.group(2) or 0) == j:
                layers.append((int(m.group(1)), os.path.join(self.dir, f)))
        for idx, path in sorted(layers):
            for k, v in safe_load(path, mmap=True).items():
                if v is not None and (c := canonical_name(f"{idx}.{k}", self.nl)) is not None:
                    index.setdefault(c, v)
        for _, _, mp, path in expert_files(self.dir):
            if mp % self.tp == j:
                for k, v in safe_load(path, mmap=True).items():
                    if (c := canonical_name(k, self.nl)) is not None:
                        index[c] = v
        self._weights[j], self._stages[j] = index, stages
        return index

    def _slice_index(self, j: int) -> dict[str, list[_Slice]]:
        """name -> its slices in the ZeRO files of TP rank ``j``, in partition order; only stages holding a wanted
        parameter are opened, and of a tied weight only its first stage's slices are kept."""
        if j in self._slices:
            return self._slices[j]
        if self.zero == 3:
            self._slices[j] = self._zero3_slices(j)
            return self._slices[j]
        weights = self._weight_index(j)
        per_layer = experts_per_layer(weights)
        index: dict[str, list[_Slice]] = {}
        for stage, names in enumerate(self._stages[j]):
            if self.pp > 1 and not names & self.wanted:
                continue
            mp = stage * self.tp + j
            mine: dict[str, list[_Slice]] = {}
            for path in glob.glob(os.path.join(self.dir, f"*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt")):
                dp = int(OPTIM_FILE.search(path).group(1))
                osd = self._optim_file(path)
                mappings = osd.get("param_slice_mappings")
                if mappings is None:
                    raise CheckpointError(f"checkpoint file {path} has no param_slice_mappings: written by an older "
                                          "DeepSpeed; convert it with tools/reshard_checkpoint.py")
                for g, group in enumerate(mappings):
                    for local, addr in group.items():
                        if (c := canonical_name(local, self.nl)) is None:
                            continue
                        name, part = place(c, dp, self.ep, per_layer)
                        mine.setdefault(name, []).append(_Slice(path, g, int(addr.start), int(addr.numel), part))
            for name, found in mine.items():
                index.setdefault(name, sorted(found, key=lambda s: s.part))
        self._slices[j] = index
        return index

    def _zero3_slices(self, j: int) -> dict[str, list[_Slice]]:
        """ZeRO-3: name -> its chunks in the DP ranks' files of TP rank ``j`` (the module docstring's arithmetic)."""
        paths = {int(OPTIM_FILE.search(p).group(1)): p
                 for p in glob.glob(os.path.join(self.dir, f"*zero_pp_rank_*_mp_rank_{j:02d}_optim_states.pt"))}
        first = self._optim_file(paths[0]) if 0 in paths else {}
        count = first.get("partition_count")
        if sorted(paths) != list(range(count or 0)) or not paths:
            raise CheckpointError(f"{self.dir}: the ZeRO-3 optimizer files of model-parallel rank {j} are of DP "
                                  f"ranks {sorted(paths)}, partitioned over {count}: the checkpoint is incomplete")
        index: dict[str, list[_Slice]] = {}
        flats = first[_FP32_GROUPS[True]]
        for g, group in enumerate(safe_load(_zero3_model_file(self.dir, j), mmap=True)["param_shapes"]):
            at = 0
            for local, shape in group.items():
                n = math.prod(shape)
                chunk = -(-n // count)
                if (c := canonical_name(local, self.nl)) is not None:
                    self._shapes[c] = tuple(shape)
                    index[c] = [_Slice(paths[d], g, at, min(chunk, n - d * chunk), d) for d in range(count)
                                if d * chunk < n]
                at += chunk
            if g >= len(flats) or at != flats[g].numel():
                raise CheckpointError(f"{paths[0]}: its fp32 partition {g} does not hold its parameters' "
                                      f"{at} elements: not the ZeRO-3 layout this reader knows (DeepSpeed 0.19.8)")
        return index

    def _optim_file(self, path: str) -> dict:
        if path not in self._optim:
            self._optim[path] = safe_load(path, mmap=True)["optimizer_state_dict"]
        return self._optim[path]

    def _adamw_state(self, j: int) -> dict[str, dict[str, torch.Tensor]]:
        """ZeRO-0 fp32: torch AdamW's state in model file ``j``, by name (read.py's parameter order)."""
        if j not in self._adamw:
            sd = safe_load(model_file(self.dir, j), mmap=True)
            opt, module = sd.get("optimizer") or {}, sd["module"]
            states = opt.get("state") or {}
            names = [n for n, v in module.items() if v.dim() > 1] + [n for n, v in module.items() if v.dim() == 1]
            out = {}
            for i, n in enumerate(names):
                if i in states and (c := canonical_name(n, self.nl)) is not None:
                    out[c] = states[i]
            self._adamw[j] = out
        return self._adamw[j]


def no_tensor(ckpt_dir: str, name: str, j: int) -> CheckpointError:
    """A source checkpoint lacks a parameter this model has (also relayout/hzero_source.py's)."""
    return CheckpointError(f"{ckpt_dir} has no tensor {name} (TP rank {j}): saved from a different model variant")


def _group_state(osd: dict, g: int) -> dict:
    """Adam's state of parameter group ``g`` (a dict keyed by group, or DeepSpeed's elastic list form); ZeRO-3: of
    flat sub-group ``g``."""
    base = osd["base_optimizer_state"] if "base_optimizer_state" in osd else osd["optimizer_state_dict"]
    return base["state"].get(g, {}) if isinstance(base, dict) else base[g]


def _zero3_model_file(ckpt_dir: str, mp: int) -> str:
    """DP rank 0's model file of model-parallel rank ``mp`` at ZeRO-3 (every DP rank writes one, alike)."""
    return os.path.join(ckpt_dir, f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt")


def _local0(name: str) -> str:
    """Experts compared by layer only (the model files name a rank's experts by local index)."""
    return with_expert(name, 0) if expert_index(name) is not None else name
