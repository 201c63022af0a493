"""A preallocated KV cache that transformers' attention layers write into, with in-place compaction.

transformers' DynamicCache concatenates on every step (a copy of the whole cache per forward).
Here each layer owns one buffer of ``max_len`` rows; ``update`` writes the new rows in place and
returns views. After verification, ``compact`` moves the accepted tree rows next to the prefix and
drops the rest — no re-prefill, no reallocation.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _rows_in_use(buf: str) -> property:
    """`keys` / `values`: a view of the buffer's first `length` rows (None before the first write).
    CacheLayerMixin's constructor sets them to None; nothing else may set them."""
    def get(self) -> torch.Tensor | None:
        return getattr(self, buf)[:, :, :self.length] if self.is_initialized else None

    def set(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError(f"PreallocLayer's {buf} views follow its length; use update / compact / crop")

    return property(get, set)


class PreallocLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_dim: int | None = None) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        kw = dict(dtype=key_states.dtype, device=key_states.device)
        self.k_buf = torch.zeros(b, h, self.max_len, d, **kw)
        self.v_buf = torch.zeros(b, h, self.max_len, value_dim or d, **kw)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states.shape[-1])
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {end} > max_len {self.max_len}")
        self.k_buf[:, :, self.length:end] = key_states
        self.v_buf[:, :, self.length:end] = value_states
        self.length = end
        return self.keys, self.values

    # views of the rows in use, made when asked: the layers' one-call path moves `length` on its own,
    # and slicing 60 views per forward that nobody reads cost ~0.1 ms of a ~5 ms step
    keys = _rows_in_use("k_buf")
    values = _rows_in_use("v_buf")

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.length + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return -1  # behaves like a dynamic cache for transformers' mask code

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.length + max_length
        self._set_length(min(self.length, max_length))

    def _set_length(self, n: int) -> None:
        self.length = n

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Rows start+keep[i] -> start+i, then drop everything after start+len(keep)."""
        n = keep.numel()
        if n and self.is_initialized:
            src = keep + start
            # index_select copies first, so overlapping source and destination are safe
            self.k_buf[:, :, start:start + n] = self.k_buf.index_select(2, src)
            self.v_buf[:, :, start:start + n] = self.v_buf.index_select(2, src)
        self._set_length(start + n)

    def compact_rows(self, dst: list[int], src: int, keeps: list[torch.Tensor]) -> None:
        """Batched rows of different lengths: row b's entries src+keeps[b][i] -> dst[b]+i. The
        cache length becomes the longest row; shorter rows leave stale entries the caller masks."""
        if self.is_initialized:
            for b, (d, keep) in enumerate(zip(dst, keeps)):
                if keep.numel():
                    idx = keep + src
                    self.k_buf[b, :, d:d + keep.numel()] = self.k_buf[b].index_select(1, idx)
                    self.v_buf[b, :, d:d + keep.numel()] = self.v_buf[b].index_select(1, idx)
        self._set_length(max(d + k.numel() for d, k in zip(dst, keeps)))

    def select_rows(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self.k_buf, self.v_buf = self.k_buf.index_select(0, rows), self.v_buf.index_select(0, rows)
            self._set_length(self.length)

    def add_rows(self, max_len: int, source: "PreallocLayer | None" = None, count: int = 0) -> None:
        """Append batch rows: `source`'s rows (entries 0..its length), or `count` empty ones; the
        buffers grow to `max_len` entries if shorter. The length becomes the longest row's; shorter
        rows leave entries the caller masks."""
        max_len = max(max_len, self.max_len)
        if not self.is_initialized:  # nothing written yet: the first write sizes the batch
            self.max_len = max_len
            return
        old_k, old_v, n = self.k_buf, self.v_buf, self.length
        added = source.k_buf.shape[0] if source is not None else count
        b, h, _, d = old_k.shape
        self.k_buf = old_k.new_zeros(b + added, h, max_len, d)
        self.v_buf = old_v.new_zeros(b + added, h, max_len, old_v.shape[-1])
        self.k_buf[:b, :, :n] = old_k[:, :, :n]
        self.v_buf[:b, :, :n] = old_v[:, :, :n]
        if source is not None:
            m = source.length
            self.k_buf[b:, :, :m] = source.k_buf[:, :, :m]
            self.v_buf[b:, :, :m] = source.v_buf[:, :, :m]
            n = max(n, m)
        self.max_len = max_len
        self._set_length(n)

    def reset(self) -> None:
        self._set_length(0)


class KVCache(Cache):
    """A transformers ``Cache`` of preallocated layers (one per decoder layer, created lazily)."""

    def __init__(self, max_len: int):
        super().__init__(layer_class_to_replicate=lambda: PreallocLayer(max_len))
        self.max_len = max_len
        self._buffers: tuple | None = None  # (what it was made for, `_addresses`' answer)

    def compact(self, start: int, keep: torch.Tensor) -> None:
        for layer in self.layers:
            layer.compact(start, keep)

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            layer.crop(max_length)

    def compact_rows(self, dst: list[int], src: int, keeps: list[list[int]]) -> None:
        """Row b's entries src + keeps[b][i] -> dst[b] + i in every layer (see PreallocLayer's)."""
        device = self.layers[0].k_buf.device if self.layers and self.layers[0].is_initialized else None
        for layer in self.layers:
            layer.compact_rows(dst, src, [torch.tensor(k, dtype=torch.long, device=device) for k in keeps])

    def set_length(self, n: int) -> None:
        """Every layer's length, after a kernel wrote or moved their rows itself."""
        for layer in self.layers:
            layer._set_length(n)

    def buffer_addresses(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer's key and value buffer addresses (int64, layer order), for kernels that take
        all layers in one call; None until every layer is allocated."""
        found = self._addresses()
        return None if found is None else found[:2]

    def uniform_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where every layer's key and value buffers are fp32 CPU tensors alike in shape and
        contiguous: all their addresses (keys, then values) and one of them; else None."""
        found = self._addresses()
        return None if found is None else found[2]

    def _addresses(self) -> tuple | None:
        """(key addresses, value addresses, `uniform_buffers`' answer), remembered until the buffers
        change, which they do all at once (allocation, select_rows): rebuilding them and their checks
        every forward would cost more than the compaction they serve."""
        if not self.layers or not all(layer.is_initialized for layer in self.layers):
            return None
        like, last = self.layers[0].k_buf, self.layers[-1].v_buf
        old = self._buffers
        if old is not None and old[0][0] == len(self.layers) and old[0][1] is like and old[0][2] is last:
            return old[1]
        bufs = [t for layer in self.layers for t in (layer.k_buf, layer.v_buf)]
        ok = like.dtype == torch.float32 and like.device.type == "cpu" and all(
            t.shape == like.shape and t.is_contiguous() and t.dtype == like.dtype for t in bufs)
        k_ptrs = torch.tensor([layer.k_buf.data_ptr() for layer in self.layers])
        v_ptrs = torch.tensor([layer.v_buf.data_ptr() for layer in self.layers])
        uniform = (torch.cat([k_ptrs, v_ptrs]), like) if ok else None
        self._buffers = ((len(self.layers), like, last), (k_ptrs, v_ptrs, uniform))
        return self._buffers[1]

    def add_rows(self, source: "KVCache | int", max_len: int = 0) -> None:
        """Append batch rows (sequences joining a running batch): a cache of theirs, made by the same
        model, or that many empty rows; every buffer grows to the longer `max_len`."""
        if isinstance(source, KVCache):
            if len(source.layers) != len(self.layers):
                raise ValueError("the caches were made by different models")
            for layer, other in zip(self.layers, source.layers):
                layer.add_rows(source.max_len, other)
            self.max_len = max(self.max_len, source.max_len)
        else:
            for layer in self.layers:
                layer.add_rows(max_len, count=source)
            self.max_len = max(self.max_len, max_len)
        self._buffers = None
        self.layer_class_to_replicate = lambda: PreallocLayer(self.max_len)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        for layer in self.layers:
            layer.select_rows(rows)
