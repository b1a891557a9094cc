"""Inference key/value cache for the decoder (evaluation, generation): no gradient, one process group layout.

Each layer keeps its keys and values after RoPE, ``[B, Hkv_local, T, D]`` (this TP rank's KV heads, T cached
positions), in the model's dtype. A forward with a cache attends the new positions to every cached one plus
themselves (bottom-right causal; :func:`nxd_lc.context.local.cached_attention`) and appends them. The
prompt is run once (prefill) and each generated token, or each candidate continuation, costs one forward over its
own tokens only. :meth:`KVCache.truncate` drops positions again (re-scoring several continuations of one prompt).

Layouts: tensor parallelism (heads are local to the rank). Context parallelism: the sequence is not sharded; every
CP rank of a replica runs the same whole sequence (its weights are those of the other CP ranks) and keeps the whole
cache, so the forwards and their logits are the same on every CP rank and attention needs no CP collective (the
RoPE length all-reduce agrees, every rank having the same positions). Without gradients the memory of a whole
sequence per rank is the cache plus one layer's activations; the evaluation's ``--kv-cache off`` keeps the
sequence sharded instead. Not sequence parallelism (a decode step of one token cannot be split over TP ranks) nor
pipeline parallelism: :meth:`nxd_lc.models.llama.model.LlamaForCausalLM.kv_cache_unsupported` says why.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """One layer's cached keys and values, ``[B, Hkv_local, T, D]`` each (None before the first forward)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """T, the cached positions."""
        return 0 if self.keys is None else int(self.keys.shape[2])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' k / v ``[B, Hkv_local, S, D]``; return all of them, ``[B, Hkv_local, T + S, D]``.

        Raises:
            ValueError: a batch, head or head-dim size other than the cached one.
        """
        if self.keys is None or self.values is None:
            self.keys, self.values = k.detach(), v.detach()
        else:
            if k.shape[:2] != self.keys.shape[:2] or k.shape[3] != self.keys.shape[3]:
                raise ValueError(f"KV cache: new keys {tuple(k.shape)} do not match the cached "
                                 f"{tuple(self.keys.shape)} in batch, heads or head_dim")
            self.keys = torch.cat([self.keys, k.detach()], dim=2)
            self.values = torch.cat([self.values, v.detach()], dim=2)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


class KVCache:
    """The caches of all decoder layers of one model (see module doc).

    Args:
        num_layers: decoder layers.
    """

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerKVCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Cached positions (the next position id)."""
        return self.layers[0].length if self.layers else 0

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer.

        Raises:
            ValueError: ``length`` negative or beyond the cached length.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate({length}): the cache holds {self.length} positions")
        for layer in self.layers:
            layer.truncate(length)
