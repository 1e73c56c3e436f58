"""Full, HF-named actor weights for a push or an export, bucket by bucket (LoRA merged, ZeRO-3
gathered on rank 0). docs/design.md#buckets-groups-and-names"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import deepspeed
import torch

from rlmesh.learner.ppo.model_loading import hf_model, is_peft

__all__ = ["PushUnit", "iter_weight_buckets", "push_units"]

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass
class PushUnit:
    """One tensor to send: its HF name, the parameters it is computed from, how to compute it."""

    name: str
    params: list[torch.nn.Parameter]
    compute: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        p = self.params[0]
        numel = getattr(p, "ds_numel", None) or p.numel()  # ZeRO-3 params are empty outside a gather
        return int(numel) * p.element_size()


def _lora_merge(base: torch.nn.Parameter, layer: torch.nn.Module, adapter: str) -> Callable[[], torch.Tensor]:
    def compute() -> torch.Tensor:
        # Exactly peft's merge: base_layer.weight.data += get_delta_weight(adapter).
        return base.data + layer.get_delta_weight(adapter)

    return compute


def _adapter_params(layer: torch.nn.Module, adapter: str) -> list[torch.nn.Parameter]:
    params: list[torch.nn.Parameter] = []
    for attr in ("lora_A", "lora_B"):  # ModuleDicts of Linear (or Embedding) layers
        container = getattr(layer, attr, None)
        if container is not None and adapter in container:
            params += list(container[adapter].parameters())
    for attr in ("lora_embedding_A", "lora_embedding_B"):  # ParameterDicts
        container = getattr(layer, attr, None)
        if container is not None and adapter in container:
            params.append(container[adapter])
    return params


def push_units(module: torch.nn.Module) -> list[PushUnit]:
    """The tensors of the actor as the plain HF model names them, in ``named_parameters`` order."""
    model = hf_model(module)
    adapter = module.active_adapter if is_peft(module) else ""
    if isinstance(adapter, list):
        adapter = adapter[0]
    modules = dict(model.named_modules())
    units: list[PushUnit] = []
    for name, param in model.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapters are merged below; peft's untouched copy of a saved module is stale
        if ".modules_to_save." in name:
            owner, _, rest = name.partition(".modules_to_save.")
            units.append(PushUnit(f"{owner}.{rest.split('.', 1)[1]}", [param], lambda p=param: p.data))
            continue
        if ".base_layer." not in name:
            units.append(PushUnit(name, [param], lambda p=param: p.data))
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = modules[owner]
        out_name = f"{owner}.{leaf}"
        if leaf != "weight":
            units.append(PushUnit(out_name, [param], lambda p=param: p.data))
            continue
        lora_params = _adapter_params(layer, adapter)
        units.append(PushUnit(out_name, [param, *lora_params], _lora_merge(param, layer, adapter)))
    return units


def _buckets(units: list[PushUnit], bucket_bytes: int) -> Iterator[list[PushUnit]]:
    bucket: list[PushUnit] = []
    size = 0
    for unit in units:
        bucket.append(unit)
        size += unit.nbytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def iter_weight_buckets(
    module: torch.nn.Module, bucket_bytes: int, *, zero3: bool, materialize: bool, copy: bool = True
) -> Iterator[NamedTensors]:
    """Buckets of ``(hf_name, tensor)`` of about ``bucket_bytes`` each (a tensor is never split).

    Args:
        module: the actor (plain or peft-wrapped), possibly ZeRO-3 partitioned.
        bucket_bytes: target bucket size.
        zero3: gather each bucket's parameters first (collective: call on every rank).
        materialize: build the tensors (rank 0); other ranks get empty lists, bucket for bucket.
        copy: copies that stay valid for good. Without it a bucket's tensors are the parameters'
            own storage (a merged LoRA weight excepted), valid only until the next bucket is asked
            for (ZeRO-3 frees the gathered storage then) and until the next optimizer step: for a
            consumer that is done with each bucket before it asks for the next, as
            ``WeightPusher.push_buckets`` is, which copies or sends it at once anyway.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    for bucket in _buckets(push_units(module), bucket_bytes):
        params = [p for unit in bucket for p in unit.params]
        gather = (
            deepspeed.zero.GatheredParameters(params, modifier_rank=None)
            if zero3
            else contextlib.nullcontext()
        )
        out: NamedTensors = []
        with gather, torch.no_grad():
            if materialize:
                # A copy: gathered storage is freed on exit, and later optimizer steps must not
                # change tensors a consumer still holds.
                out = [(unit.name, unit.compute().detach()) for unit in bucket]
                if copy:
                    out = [(name, t.clone()) for name, t in out]
        yield out
