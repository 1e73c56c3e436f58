"""Model runners for the embedded engine: the KV cache and the forward passes of a running batch
(``SlotRunner`` for Qwen2/Llama, ``HFCacheRunner`` for the rest). docs/internals.md#rlmeshenginerunner"""

from __future__ import annotations

import inspect
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rlmesh.engine.simulated import SimulatedModel, SimulatedRunner

SLOT_MODEL_TYPES = frozenset({"qwen2", "llama"})


class Runner(Protocol):
    size: int

    def prefill(self, prompts: list[list[int]], copies: list[int]) -> torch.Tensor:
        """Appends ``copies[i]`` rows for each prompt (consecutive); returns the logits ``[rows, V]``
        of each new row's next token."""
        ...

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feeds one token per row (``[size]``); returns the next-token logits ``[size, V]``."""
        ...

    def retire(self, keep: list[int]) -> list[int]:
        """Keeps only rows ``keep`` (ascending); returns the new order as old row indices."""
        ...

    def reset(self) -> None: ...


def make_runner(model: PreTrainedModel | SimulatedModel) -> Runner:
    """A ``SlotRunner`` where the architecture allows it, else the generic ``HFCacheRunner``; a
    ``SimulatedRunner`` for a simulated model."""
    if isinstance(model, SimulatedModel):
        return SimulatedRunner(model)
    return SlotRunner(model) if slot_runner_supports(model) else HFCacheRunner(model)


def slot_runner_supports(model: PreTrainedModel) -> bool:
    cfg = model.config
    if cfg.model_type not in SLOT_MODEL_TYPES or not hasattr(model, "model"):
        return False
    # Sliding-window layers attend to a window, not the whole row: leave them to HF.
    layer_types = getattr(cfg, "layer_types", None) or []
    return all(t == "full_attention" for t in layer_types)


class SlotRunner:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.body = model.model
        attn = self.body.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.scaling = attn.scaling
        self.size = 0
        self._slots = 0
        self._length = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._lens = torch.zeros(0, dtype=torch.long)  # tokens held per row = the next position

    def reset(self) -> None:
        self.size = 0
        self._lens.zero_()

    def _reserve(self, slots: int, length: int) -> None:
        """Grows the cache (doubling) to hold ``slots`` rows of ``length`` tokens."""
        if slots <= self._slots and length <= self._length:
            return
        new_slots = self._slots if slots <= self._slots else max(slots, 2 * self._slots)
        new_length = self._length if length <= self._length else max(length, 2 * self._length)
        p = next(self.model.parameters())
        shape = (new_slots, self.kv_heads, new_length, self.head_dim)

        def grow(old: torch.Tensor | None) -> torch.Tensor:
            t = torch.zeros(shape, dtype=p.dtype, device=p.device)
            if old is not None and self.size:
                t[: self.size, :, : old.shape[2]] = old[: self.size]
            return t

        layers = len(self.body.layers)
        self._keys = [grow(self._keys[i] if self._keys else None) for i in range(layers)]
        self._values = [grow(self._values[i] if self._values else None) for i in range(layers)]
        lens = torch.zeros(new_slots, dtype=torch.long)
        lens[: self.size] = self._lens[: self.size]
        self._lens, self._slots, self._length = lens, new_slots, new_length

    def _qkv(self, attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.body.norm(h))

    def prefill(self, prompts: list[list[int]], copies: list[int]) -> torch.Tensor:
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.tensor(p)  # right padding: a row's positions are 0..len-1
        first, added = self.size, sum(copies)
        self._reserve(first + added, width + 1)
        source = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(copies))
        slots = slice(first, first + added)

        h = self.body.embed_tokens(ids)
        positions = torch.arange(width)[None].expand(len(prompts), width)
        cos, sin = self.body.rotary_emb(h, positions)
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
            # Causal attention needs no padding mask with right padding: a real position only
            # sees earlier positions, all real.
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.heads != self.kv_heads
            )
            self._keys[i][slots, :, :width] = k[source]
            self._values[i][slots, :, :width] = v[source]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(*h.shape[:2], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = h[torch.arange(len(prompts)), lengths - 1]
        self._lens[slots] = lengths[source]
        self.size += added
        return self._logits(last)[source]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        n = self.size
        span = int(self._lens[:n].max()) + 1  # the longest row, with the token written now
        self._reserve(n, span)
        positions = self._lens[:n]  # after _reserve, which may have replaced the tensor
        rows = torch.arange(n)
        masked = torch.arange(span)[None, :] > positions[:, None]  # [n, span]: not yet written
        groups = self.heads // self.kv_heads

        h = self.body.embed_tokens(tokens[:, None])
        cos, sin = self.body.rotary_emb(h, positions[:, None])
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(h), cos, sin)
            keys, values = self._keys[i], self._values[i]
            keys[rows, :, positions] = k[:, :, 0]
            values[rows, :, positions] = v[:, :, 0]
            # One query per row: batched matmuls over (row, kv head) beat SDPA's kernel here.
            q = q.reshape(n * self.kv_heads, groups, self.head_dim)
            kk = keys[:n, :, :span].reshape(n * self.kv_heads, span, self.head_dim)
            vv = values[:n, :, :span].reshape(n * self.kv_heads, span, self.head_dim)
            scores = torch.bmm(q, kk.transpose(1, 2)).mul_(self.scaling)
            scores = scores.view(n, self.heads, span).masked_fill_(masked[:, None, :], float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            o = torch.bmm(probs.view(n * self.kv_heads, groups, span), vv)
            h = h + attn.o_proj(o.view(n, 1, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self._lens[:n] += 1
        return self._logits(h)[:, 0]

    def retire(self, keep: list[int]) -> list[int]:
        order = list(range(self.size))
        kept = set(keep)
        holes = [i for i in range(len(keep)) if i not in kept]
        movers = [i for i in keep if i >= len(keep)]
        for hole, mover in zip(holes, movers, strict=True):
            for cache in (*self._keys, *self._values):
                cache[hole] = cache[mover]
            self._lens[hole] = self._lens[mover]
            order[hole] = mover
        self.size = len(keep)
        return order[: self.size]


class HFCacheRunner:
    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.reset()

    def reset(self) -> None:
        self.size = 0
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._positions = torch.zeros(0, dtype=torch.long)

    def prefill(self, prompts: list[list[int]], copies: list[int]) -> torch.Tensor:
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            **{self._cache_kw: DynamicCache(config=self.model.config)},
        )
        source = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(copies))
        layers = [(k[source], v[source]) for k, v in _layers(out.past_key_values)]
        self._merge(layers, mask[source], torch.tensor(lengths)[source])
        return out.logits[:, -1, :][source]

    def _merge(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, positions: torch.Tensor
    ) -> None:
        if self.size:
            assert self._cache is not None
            width = max(self._mask.shape[1], mask.shape[1])
            layers = [
                (
                    torch.cat([_left_pad(ko, width), _left_pad(kn, width)]),
                    torch.cat([_left_pad(vo, width), _left_pad(vn, width)]),
                )
                for (ko, vo), (kn, vn) in zip(_layers(self._cache), layers, strict=True)
            ]
            mask = torch.cat([_left_pad(self._mask, width), _left_pad(mask, width)])
            positions = torch.cat([self._positions, positions])
        self._cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
        self._mask, self._positions = mask, positions
        self.size = len(positions)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.cat([self._mask, torch.ones(self.size, 1, dtype=torch.long)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=self._positions[:, None],
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        self._cache, self._mask = out.past_key_values, mask
        self._positions = self._positions + 1
        return out.logits[:, -1, :]

    def retire(self, keep: list[int]) -> list[int]:
        if not keep:
            self.reset()
            return []
        assert self._cache is not None
        index = torch.tensor(keep)
        mask = self._mask[index]
        # Drop columns no remaining row uses (left padding of departed long rows).
        first = int((mask.sum(0) > 0).float().argmax())
        layers = [(k[index, :, first:], v[index, :, first:]) for k, v in _layers(self._cache)]
        self._cache = DynamicCache(ddp_cache_data=layers, config=self.model.config)
        self._mask, self._positions = mask[:, first:], self._positions[index]
        self.size = len(keep)
        return list(keep)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pads dim 1 (mask: [B, T]) or dim 2 (cache: [B, H, T, D]) on the left with zeros to ``width``."""
    dim = 1 if t.dim() == 2 else 2
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype), t], dim=dim)
