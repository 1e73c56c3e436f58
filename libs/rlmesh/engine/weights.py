"""The embedded engine's side of weight updates: receive broadcast tensors, load from disk, read
back by name. Every change happens between decode steps (``BatchEngine.exclusive``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import PreTrainedModel

from rlmesh.weights.group import destroy_process_group, init_custom_process_group

log = logging.getLogger("rlmesh.engine")


class WeightUpdateError(RuntimeError):
    pass


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}")
    return dtype


class EngineWeights:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.groups: dict[str, dist.ProcessGroup] = {}

    def params(self) -> dict[str, torch.Tensor]:
        # Tied weights appear once in named_parameters; accept both names for them.
        named = dict(self.model.named_parameters())
        named.update({k: v for k, v in self.model.state_dict(keep_vars=True).items() if k not in named})
        return named

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        if group_name in self.groups:
            raise WeightUpdateError(f"weight update group {group_name!r} already exists; destroy it first")
        self.groups[group_name] = init_custom_process_group(
            backend, f"tcp://{master_address}:{master_port}", world_size, rank_offset, group_name, timeout_s
        )
        log.info(
            "joined weight update group %s as rank %d of %d (%s)",
            group_name,
            rank_offset,
            world_size,
            backend,
        )

    def destroy_group(self, group_name: str) -> None:
        pg = self.groups.pop(group_name, None)
        if pg is None:
            raise WeightUpdateError(f"no weight update group {group_name!r}; known: {sorted(self.groups)}")
        destroy_process_group(pg)

    def receive(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], group_name: str
    ) -> dict[str, torch.Tensor]:
        """Receives each tensor from rank 0 in order. Unknown names are still received (so the
        broadcast stays in step with the sender) and reported afterwards."""
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightUpdateError(
                f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        pg = self.groups.get(group_name)
        if pg is None:
            raise WeightUpdateError(
                f"no weight update group {group_name!r}; call /init_weights_update_group first"
            )
        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(list(shape), dtype=torch_dtype(dtype))
            dist.broadcast(t, src=0, group=pg)
            received[name] = t
        return received

    def load(self, tensors: dict[str, torch.Tensor], *, strict: bool) -> None:
        """Copies tensors into the model by name; checks every name and shape before changing anything."""
        params = self.params()
        unknown = sorted(set(tensors) - set(params))
        problems = (
            [f"unknown parameter names {unknown[:10]}{'...' if len(unknown) > 10 else ''}"] if unknown else []
        )
        for name, t in tensors.items():
            if name in params and tuple(params[name].shape) != tuple(t.shape):
                problems.append(f"{name}: shape {list(t.shape)} != model's {list(params[name].shape)}")
        if strict:
            missing = sorted(set(dict(self.model.named_parameters())) - set(tensors))
            if missing:
                problems.append(f"missing parameters {missing[:10]}{'...' if len(missing) > 10 else ''}")
        if problems:
            raise WeightUpdateError("; ".join(problems))
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t)

    def load_from_disk(self, model_path: str) -> None:
        path = Path(model_path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"no safetensors file at {model_path}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        self.load(tensors, strict=True)

    def get(self, name: str, truncate_size: int) -> list:
        params = self.params()
        if name not in params:
            raise WeightUpdateError(f"unknown parameter {name!r}")
        t = params[name].detach()
        return (t[:truncate_size] if truncate_size > 0 else t).float().tolist()
