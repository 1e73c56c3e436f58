"""The embedded engine's side of weight updates: receive broadcast tensors, load from disk, read
back by name, between decode steps. docs/internals.md#rlmeshengineweight_updates"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import PreTrainedModel

from rlmesh.runtime.net import bracket, gloo_interface_toward
from rlmesh.weights.bucket import FLATTENED_BUCKET, LOAD_FORMATS, layout, tensor_views, uint8_buffer
from rlmesh.weights.group import destroy_process_group, init_custom_process_group

log = logging.getLogger("rlmesh.engine")


class WeightUpdateError(RuntimeError):
    pass


def check_load_format(load_format: str | None) -> None:
    if load_format not in LOAD_FORMATS:
        raise WeightUpdateError(
            f"unknown load_format {load_format!r}; supported: null (one broadcast per tensor) "
            f"or {FLATTENED_BUCKET!r} (one uint8 broadcast of the whole bucket)"
        )


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}")
    return dtype


class EngineWeights:
    def __init__(self, model: PreTrainedModel, *, pack: bool = True) -> None:
        self.model = model
        self.groups: dict[str, dist.ProcessGroup] = {}
        # The receive buffer of the last update, kept for the next (see ``receiving``).
        self._spare: torch.Tensor | None = None
        self._spare_lock = threading.Lock()
        self.tainted: set[str] = set()  # parameters a failed direct receive left half written
        self.direct_updates = 0  # buckets received straight into the parameters
        self.receiving_direct = False
        self._packed: torch.Tensor | None = None
        self._layout: dict[
            str, tuple[int, int, torch.dtype, tuple[int, ...]]
        ] = {}  # name -> index, offset, ...
        self._order: list[str] = []
        if pack:
            self.pack()

    def pack(self) -> bool:
        """Moves the parameters into one buffer in ``named_parameters`` order (module docstring).
        Leaves them as they are, returning False, if one would not be aligned for its dtype."""
        named = list(self.model.named_parameters())
        dtypes = [p.dtype for _, p in named]
        shapes = [tuple(p.shape) for _, p in named]
        offsets, total = layout(dtypes, shapes)
        if any(o % d.itemsize for o, d in zip(offsets, dtypes, strict=True)) or any(
            p.device.type != "cpu" for _, p in named
        ):
            return False
        buffer = torch.empty(total, dtype=torch.uint8)
        views = tensor_views(buffer, offsets, dtypes, shapes)
        with torch.no_grad():
            for (_, p), view in zip(named, views, strict=True):
                view.copy_(p.data)
                p.data = view
        self._packed = buffer
        self._order = [n for n, _ in named]
        self._layout = {
            n: (i, o, d, s)
            for i, (n, o, d, s) in enumerate(zip(self._order, offsets, dtypes, shapes, strict=True))
        }
        return True

    def direct_span(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        load_format: str | None,
    ) -> slice | None:
        """The bytes of the packed parameters a flattened bucket would fill exactly, or None when
        it is not a run of the layout (then it goes through a buffer)."""
        if (
            load_format != FLATTENED_BUCKET
            or self._packed is None
            or not names
            or names[0] not in self._layout
        ):
            return None
        first, start, _, _ = self._layout[names[0]]
        if self._order[first : first + len(names)] != list(names):
            return None
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            _, _, want_dtype, want_shape = self._layout[name]
            if torch_dtype(dtype) != want_dtype or tuple(int(d) for d in shape) != want_shape:
                return None
        _, last_offset, last_dtype, last_shape = self._layout[names[-1]]
        end = last_offset + torch.Size(last_shape).numel() * last_dtype.itemsize
        return slice(start, end)

    def receive_direct(self, names: Sequence[str], span: slice, group_name: str) -> None:
        """Receives a flattened bucket straight into the parameters (hold ``engine.exclusive``)."""
        pg = self.groups.get(group_name)
        if pg is None:
            raise WeightUpdateError(
                f"no weight update group {group_name!r}; call /init_weights_update_group first"
            )
        assert self._packed is not None
        self.receiving_direct = True
        try:
            dist.broadcast(self._packed[span], src=0, group=pg)
        except BaseException:
            self.tainted.update(names)
            log.error(
                "weight receive failed midway: %d parameters are half written; generation holds", len(names)
            )
            raise
        finally:
            self.receiving_direct = False
        self.tainted.difference_update(names)
        self.direct_updates += 1

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
            # The sender of the old group restarted (SGLang replaces a group of the same name too).
            log.warning("weight update group %s exists; replacing it", group_name)
            destroy_process_group(self.groups.pop(group_name))
        self.groups[group_name] = init_custom_process_group(
            backend,
            f"tcp://{bracket(master_address)}:{master_port}",
            world_size,
            rank_offset,
            group_name,
            timeout_s,
            # Off loopback, gloo must listen where the trainer can reach it: the route toward it.
            gloo_interface=gloo_interface_toward(master_address),
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
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None = None,
        out: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Receives the tensors from rank 0: one broadcast each, in order (``load_format`` None), or
        one uint8 broadcast of all their bytes (``"flattened_bucket"``). Either way they land in
        one uint8 buffer — ``out`` when it is big enough, else a new one — and are returned as
        views of it. Unknown names are still received (so the broadcast stays in step with the
        sender) and reported when loading."""
        pg, torch_dtypes, offsets, total = self._plan(names, dtypes, shapes, group_name, load_format)
        buffer = uint8_buffer(total, "cpu", out)
        if load_format == FLATTENED_BUCKET:
            dist.broadcast(buffer, src=0, group=pg)
            tensors = tensor_views(buffer, offsets, torch_dtypes, shapes)
        else:
            tensors = tensor_views(buffer, offsets, torch_dtypes, shapes)  # all aligned: views
            works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
            for work in works:  # all posted before any is awaited, as SGLang does
                work.wait()
        return dict(zip(names, tensors, strict=True))

    @contextmanager
    def receiving(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None = None,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """``receive`` into a buffer kept from one update to the next: its tensors are valid only
        inside the block (load them there). The engine keeps one bucket's bytes for this; a new
        buffer each time would page-fault all of them in again, costing more than the copy."""
        *_, total = self._plan(names, dtypes, shapes, group_name, load_format)
        with self._spare_lock:
            buffer, self._spare = self._spare, None  # a concurrent update allocates its own
        if buffer is None or buffer.numel() < total:
            buffer = torch.empty(total, dtype=torch.uint8)
        # A failed collective raises here, and the buffer is not kept: the transport may hold it.
        received = self.receive(names, dtypes, shapes, group_name, load_format, out=buffer)
        try:
            yield received
        finally:
            with self._spare_lock:
                if self._spare is None or self._spare.numel() < buffer.numel():
                    self._spare = buffer

    def _plan(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        load_format: str | None,
    ) -> tuple[dist.ProcessGroup, list[torch.dtype], list[int], int]:
        """Checks an update's arguments; returns its group, dtypes, byte offsets and total bytes."""
        check_load_format(load_format)
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightUpdateError(
                f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        pg = self.groups.get(group_name)
        if pg is None:
            raise WeightUpdateError(
                f"no weight update group {group_name!r}; call /init_weights_update_group first"
            )
        bad = [list(s) for s in shapes if any(int(d) < 0 for d in s)]
        if bad:
            raise WeightUpdateError(f"negative sizes in shapes {bad[:3]}")
        torch_dtypes = [torch_dtype(d) for d in dtypes]
        # flattened_bucket is packed back to back (the wire layout); one broadcast per tensor
        # lets each start on a 64-byte boundary.
        offsets, total = layout(torch_dtypes, shapes, 1 if load_format == FLATTENED_BUCKET else 64)
        return pg, torch_dtypes, offsets, total

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
        self.tainted.difference_update(tensors)

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
