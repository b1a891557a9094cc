"""Ring attention over the context-parallel group, causal load balanced, document-mask aware.

Shapes (per CP rank; ``L = S / cp`` local tokens, the head-tail layout of :mod:`nxd_lc.context.sharding`):
    q            [B, Hq, L, D]
    k, v         [B, Hkv, L, D]     Hq % Hkv == 0 (GQA: query head h uses KV head h // (Hq / Hkv))
    segment_ids  [B, L] integer     packed-document index (non-decreasing along the *global* sequence) or None
    output       [B, Hq, L, D]      dtype of q

Algorithm (ring attention, Liu et al. 2023, arXiv:2310.01889; flash-attention tiling and backward, Dao 2023,
arXiv:2307.08691). Rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of ``2cp`` (Megatron / torchtitan head-tail).
K/V blocks (with their segment ids) travel around the CP ring: at step ``i`` rank ``r`` holds the block of rank
``(r - i) mod cp``, while the next block is already in flight (:func:`collectives.ring_exchange`). Each local
query tile meets each key tile of the visiting block; the mask is causal on *global* positions (derived from
the chunk layout, so whole tiles are skipped or left unmasked without looking at data) AND same segment
(per-tile segment bounds, read on the host once per block, skip tile pairs that share no document and drop the
segment mask where both tiles lie in one document, so packed short documents cost about sum(len_doc^2)).
Partial results merge by their log-sum-exp in fp32 (online softmax)::

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Backward recomputes the probabilities from the saved ``lse`` (``P = exp(Q K^T scale - lse)``,
``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K scale``, ``dK = dS^T Q scale``, ``dV = P^T dO``); the K/V
blocks go around the ring again, and their dK/dV accumulators travel with them and are sent one last hop
back to the owner. Saved for backward: q, the local k/v/segment_ids, out and lse (fp32 ``[B, Hq, L]``).

On XLA devices (torch-xla, Neuron) every rank must trace the same graph and the step must not read the device
back: there the ring runs a rank-invariant formulation with the same FLOPs (the section "the rank-invariant ring"
below): the K/V exchange is a collective permute (:func:`collectives.ring_exchange`), which block pairs meet is a
device-side select on the CP rank, and segment ids are masked on the device without host bounds (no tile pair is
skipped for lying in different documents).

Memory is O(L): scores exist only per tile (``[B, Hq, T, T]`` fp32, ``T = tile_size``); nothing of shape
``[L, S]`` or ``[L, L]`` is built. All score/softmax arithmetic is fp32 whatever the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.compiler import is_compiling

from nxd_lc.context.sharding import local_chunk_ranges
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.runtime.accel import HOST, compiles_per_shape

__all__ = ["DEFAULT_TILE_SIZE", "ring_attention"]

DEFAULT_TILE_SIZE = 512  # tokens per query / key tile (fastest of 256/512/1024 on CPU at 4k-8k)
_KV_TAG, _GRAD_TAG = 0, 16  # distinct p2p tags: K/V and dK/dV exchanges can be in flight together


@dataclass(frozen=True)
class _Tile:
    """A run of ``length`` tokens starting at local index ``local`` and global position ``glob``."""

    local: int
    glob: int
    length: int


def _tiles(seq_len: int, cp_rank: int, cp_size: int, tile_size: int) -> list[_Tile]:
    """Tiles (at most ``tile_size`` tokens, never crossing a chunk edge) of CP rank ``cp_rank``'s tokens."""
    tiles, local = [], 0
    for start, stop in local_chunk_ranges(seq_len, cp_rank, cp_size, "ring"):
        for g in range(start, stop, tile_size):
            n = min(tile_size, stop - g)
            tiles.append(_Tile(local, g, n))
            local += n
    return tiles


@dataclass(frozen=True)
class _Segments:
    """Segment ids of one side (queries or a visiting K/V block) with per-tile, per-row min/max on the host."""

    ids: torch.Tensor  # [B, L] integer
    lo: list[list[int]] | None  # lo[tile][b] = min segment id of row b in the tile; None: bounds not read
    hi: list[list[int]] | None  # hi[tile][b] = max segment id of row b in the tile; None: bounds not read


def _segments(seg: torch.Tensor | None, tiles: list[_Tile]) -> _Segments | None:
    """Tile bounds of ``seg`` (one device -> host copy per call; None without segment ids)."""
    if seg is None:
        return None
    host = seg.detach().to(HOST)  # host read (a graph break under torch.compile)
    parts = [host[:, t.local:t.local + t.length] for t in tiles]
    return _Segments(seg, [p.amin(dim=1).tolist() for p in parts], [p.amax(dim=1).tolist() for p in parts])


def _tile_mask(qi: int, ki: int, q_tiles: list[_Tile], k_tiles: list[_Tile], seg_q: _Segments | None,
               seg_k: _Segments | None, device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """(skip, mask) for query tile ``qi`` and key tile ``ki``; mask is bool, broadcastable to the scores viewed
    as ``[B, Hkv, Tq, G, Tk]`` (True = attend: ``[Tq, 1, Tk]`` causal, ``[B, 1, Tq, 1, Tk]`` with segments), or
    None when every pair is allowed.

    Decided on the host: skip when every key is after every query, or (document masking) when in every row the
    tiles share no segment (max key segment < min query segment or the reverse); no segment mask when every row
    of both tiles is one and the same segment; no causal mask when every key precedes every query. Segments
    without host bounds (the rank-invariant XLA path) are never skipped and always masked.
    """
    qt, kt = q_tiles[qi], k_tiles[ki]
    if kt.glob > qt.glob + qt.length - 1:
        return True, None
    mask = None
    if seg_q is not None and seg_k is not None:
        known = seg_q.lo is not None and seg_q.hi is not None and seg_k.lo is not None and seg_k.hi is not None
        qlo, qhi, klo, khi = (seg_q.lo[qi], seg_q.hi[qi], seg_k.lo[ki], seg_k.hi[ki]) if known else ([],) * 4
        if known and all(kh < ql or kl > qh for ql, qh, kl, kh in zip(qlo, qhi, klo, khi)):
            return True, None
        if not known or not all(ql == qh == kl == kh for ql, qh, kl, kh in zip(qlo, qhi, klo, khi)):
            sq = seg_q.ids[:, qt.local:qt.local + qt.length]
            sk = seg_k.ids[:, kt.local:kt.local + kt.length]
            mask = (sq[:, :, None] == sk[:, None, :])[:, None, :, None]  # [B, 1, Tq, 1, Tk]
    if kt.glob + kt.length - 1 > qt.glob:  # the tiles overlap in position: causal mask needed
        qpos = torch.arange(qt.glob, qt.glob + qt.length, device=device)
        kpos = torch.arange(kt.glob, kt.glob + kt.length, device=device)
        causal = (kpos[None, :] <= qpos[:, None])[:, None]  # [Tq, 1, Tk]
        mask = causal if mask is None else mask & causal
    return False, mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float, group: int) -> torch.Tensor:
    """fp32 scores ``[B, Hkv, Tq*G, Tk]`` of query rows ``[B, Hkv, Tq*G, D]`` (token-major: row = t * G + g)
    and keys ``[B, Hkv, Tk, D]``; disallowed pairs are -inf. One GEMM per KV head, no K/V expansion."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is None:
        return s
    b, h, rows, tk = s.shape
    return s.view(b, h, rows // group, group, tk).masked_fill_(~mask, float("-inf")).view(b, h, rows, tk)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -inf (rows that saw no key yet) replaced by 0, so ``exp(-inf - 0) = 0`` instead of NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.logaddexp(a, b)`` (-inf where both are -inf). On XLA devices, where torch-xla has no lowering of
    ``logaddexp`` (its CPU fallback would execute the pending graph and read it back: a host read, and on several
    devices a collective outside the ordered graph), as ``m + log(exp(a - m) + exp(b - m))`` with ``m`` the finite
    maximum."""
    if not _rank_invariant(a):
        return torch.logaddexp(a, b)
    m = _finite(torch.maximum(a, b))
    return m + torch.log(torch.exp(a - m) + torch.exp(b - m))


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results (out ``[..., R, D]``, lse ``[..., R]``, fp32)."""
    new = _logaddexp(lse, lse_b)
    ref = _finite(new)
    merged = out * torch.exp(lse - ref).unsqueeze(-1) + out_b * torch.exp(lse_b - ref).unsqueeze(-1)
    return merged, new


def _rows(x: torch.Tensor, t: _Tile) -> torch.Tensor:
    """Tile ``t`` of a token-major grouped tensor ``[B, Hkv, L, G(, D)]`` as rows ``[B, Hkv, T*G(, D)]`` (a view)."""
    return x[:, :, t.local:t.local + t.length].flatten(2, 3)


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_tiles: list[_Tile],
                   k_tiles: list[_Tile], seg_q: _Segments | None, seg_k: _Segments | None,
                   out: torch.Tensor, lse: torch.Tensor, scale: float) -> None:
    """Fold one K/V block into the running (out, lse) in place.

    q/out ``[B, Hkv, L, G, D]`` fp32, lse ``[B, Hkv, L, G]`` fp32, k/v ``[B, Hkv, L, D]`` fp32.
    """
    group = q.shape[3]
    for qi, qt in enumerate(q_tiles):
        q_t, o_acc, l_acc = _rows(q, qt), _rows(out, qt), _rows(lse, qt)
        touched = False
        for ki, kt in enumerate(k_tiles):
            skip, mask = _tile_mask(qi, ki, q_tiles, k_tiles, seg_q, seg_k, q.device)
            if skip:
                continue
            ks = slice(kt.local, kt.local + kt.length)
            s = _scores(q_t, k[:, :, ks], mask, scale, group)
            m = _finite(s.amax(dim=-1, keepdim=True))  # row max, 0 for fully masked rows
            p = s.sub_(m).exp_()  # in place: one exp per score
            denom = p.sum(dim=-1, keepdim=True)
            o_b = torch.matmul(p, v[:, :, ks]) / torch.where(denom == 0, 1.0, denom)
            l_b = (torch.log(denom) + m).squeeze(-1)  # log-sum-exp of the tile; -inf for fully masked rows
            o_acc, l_acc = _merge(o_acc, l_acc, o_b, l_b)
            touched = True
        if touched:
            _rows(out, qt).copy_(o_acc)
            _rows(lse, qt).copy_(l_acc)


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, q_tiles: list[_Tile], k_tiles: list[_Tile],
                    seg_q: _Segments | None, seg_k: _Segments | None, dq: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient contributions of one K/V block: adds into ``dq`` in place, returns this block's (dK, dV).

    q/dout/dq ``[B, Hkv, L, G, D]``, lse/delta ``[B, Hkv, L, G]``, k/v and the results ``[B, Hkv, L, D]``;
    all fp32. Formulas: FlashAttention-2 backward (Dao 2023, Algorithm 2); the sums over the G query heads
    sharing a KV head happen inside the dK/dV GEMMs (rows are token-major ``t * G + g``).
    """
    group = q.shape[3]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for qi, qt in enumerate(q_tiles):
        q_t, do_t, dq_t = _rows(q, qt), _rows(dout, qt), _rows(dq, qt)
        lse_t, delta_t = _finite(_rows(lse, qt)).unsqueeze(-1), _rows(delta, qt).unsqueeze(-1)
        for ki, kt in enumerate(k_tiles):
            skip, mask = _tile_mask(qi, ki, q_tiles, k_tiles, seg_q, seg_k, q.device)
            if skip:
                continue
            ks = slice(kt.local, kt.local + kt.length)
            k_t, v_t = k[:, :, ks], v[:, :, ks]
            p = _scores(q_t, k_t, mask, scale, group).sub_(lse_t).exp_()  # [B, Hkv, T*G, Tk]
            ds = torch.matmul(do_t, v_t.transpose(-1, -2)).sub_(delta_t).mul_(p)
            dq_t.add_(torch.matmul(ds, k_t), alpha=scale)
            dk[:, :, ks].add_(torch.matmul(ds.transpose(-1, -2), q_t), alpha=scale)
            dv[:, :, ks].add_(torch.matmul(p.transpose(-1, -2), do_t))
    return dk, dv


def _grouped(x: torch.Tensor, num_kv: int) -> torch.Tensor:
    """``[B, Hq, L, D]`` -> fp32 token-major ``[B, Hkv, L, G, D]`` (query head h = kv * G + g, HF repeat_kv
    order), contiguous."""
    b, h, n, d = x.shape
    return x.float().reshape(b, num_kv, h // num_kv, n, d).transpose(2, 3).contiguous()


def _ungrouped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_grouped`: ``[B, Hkv, L, G, D]`` -> ``[B, Hkv * G, L, D]`` in ``dtype``."""
    b, hkv, n, g, d = x.shape
    return x.transpose(2, 3).reshape(b, hkv * g, n, d).to(dtype)


def _ring_group(over_cp: bool) -> collectives.ProcessGroup | None:
    """The CP group, or None (this rank alone: the tiled kernel as local document-masked attention)."""
    return parallel_state.get_context_parallel_group() if over_cp else None


def _stage_local_index(group: collectives.ProcessGroup | None, device: torch.device) -> torch.Tensor | None:
    """Under pipeline parallelism on XLA the ring runs inside one stage's graph, which the other stages do not run:
    the CP rank as device data, so that :func:`collectives.ring_exchange` exchanges by an all-gather over the CP
    group (a collective permute waits for every device); None otherwise."""
    if group is None or device.type != "xla" or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    return parallel_state.rank_tensor("cp", device)


def _rotation(k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor | None, group: collectives.ProcessGroup | None
              ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``(step, k fp32, v fp32, segment ids)`` of every CP rank's block: at step ``i`` the block of CP rank
    ``(rank - i) mod cp`` (this rank's first); the next block is already in flight (``ring_exchange``) while the
    caller works on one."""
    cp = collectives.group_size(group)
    block = [k.float().contiguous(), v.float().contiguous()] + ([seg.contiguous()] if seg is not None else [])
    index = _stage_local_index(group, k.device)
    for step in range(cp):
        pending = collectives.ring_exchange(block, group, tag=_KV_TAG, rank_index=index) if step < cp - 1 else None
        yield step, block[0], block[1], (block[2] if seg is not None else None)
        if pending is not None:
            block = pending.wait()


def _ring_blocks(k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor | None, group: collectives.ProcessGroup | None,
                 seq_len: int, tile: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[_Tile], _Segments | None]]:
    """``(k fp32, v fp32, key tiles, key segments)`` of every CP rank's block in :func:`_rotation`'s order, with
    the key tiles' global positions and segment bounds read on the host."""
    cp, rank = collectives.group_size(group), collectives.group_rank(group)
    for step, k_block, v_block, seg_block in _rotation(k, v, seg, group):
        k_tiles = _tiles(seq_len, (rank - step) % cp, cp, tile)
        yield k_block, v_block, k_tiles, _segments(seg_block, k_tiles)


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor | None, scale: float,
                  tile: int, over_cp: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring forward: ``(out [B, Hq, L, D] in q's dtype, lse [B, Hkv, L, G] fp32)`` (module docstring)."""
    group = _ring_group(over_cp)
    if _rank_invariant(q):
        return _invariant_forward(q, k, v, seg, scale, tile, group)
    cp, rank = collectives.group_size(group), collectives.group_rank(group)
    hkv, seq_len = k.shape[1], q.shape[2] * cp
    q_tiles = _tiles(seq_len, rank, cp, tile)
    qf = _grouped(q, hkv)
    out = torch.zeros_like(qf)
    lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    seg_q = _segments(seg, q_tiles)
    for k_block, v_block, k_tiles, seg_k in _ring_blocks(k, v, seg, group, seq_len, tile):
        _block_forward(qf, k_block, v_block, q_tiles, k_tiles, seg_q, seg_k, out, lse, scale)
    return _ungrouped(out, q.dtype), lse


def _ring_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   seg: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, scale: float,
                   tile: int, over_cp: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring backward: ``(dq, dk, dv)`` in the dtypes of q, k, v (module docstring)."""
    group = _ring_group(over_cp)
    if _rank_invariant(q):
        return _invariant_backward(grad_out, q, k, v, seg, out, lse, scale, tile, group)
    cp, rank = collectives.group_size(group), collectives.group_rank(group)
    hkv, seq_len = k.shape[1], q.shape[2] * cp
    q_tiles = _tiles(seq_len, rank, cp, tile)
    qf, dof = _grouped(q, hkv), _grouped(grad_out, hkv)
    delta = (dof * _grouped(out, hkv)).sum(-1)  # rowsum(dO * O) [B, Hkv, L, G]
    dq = torch.zeros_like(qf)
    incoming = None  # in-flight dK/dV accumulators of the block this rank handles next
    seg_q = _segments(seg, q_tiles)
    for k_block, v_block, k_tiles, seg_k in _ring_blocks(k, v, seg, group, seq_len, tile):
        dk, dv = _block_backward(qf, k_block, v_block, dof, lse, delta, q_tiles, k_tiles, seg_q, seg_k, dq, scale)
        incoming = _pass_on_grads(dk, dv, incoming, group)
    dk, dv = incoming.wait()
    return _ungrouped(dq, q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _pass_on_grads(dk: torch.Tensor, dv: torch.Tensor, incoming: collectives.RingExchange | None,
                   group: collectives.ProcessGroup | None) -> collectives.RingExchange:
    """Add the dK/dV accumulators that arrived (``incoming``, when any) to this block's and send the sums on to the
    next rank (the last hop brings them back to the block's owner)."""
    if incoming is not None:
        dk_in, dv_in = incoming.wait()
        dk, dv = dk + dk_in, dv + dv_in
    return collectives.ring_exchange([dk, dv], group, tag=_GRAD_TAG, rank_index=_stage_local_index(group, dk.device))


# ---- the rank-invariant ring (XLA) ---------------------------------------------------------------------------------
# On XLA every rank must trace the same graph (a collective in graphs that differ per rank hangs or compiles per rank)
# and a host read stops the host from tracing ahead. The ring above decides tile skips and masks from global
# positions (Python ints that depend on the CP rank) and reads segment bounds on the host. The same attention,
# written so that only device data depends on the rank: with the head-tail layout (halves = chunks r and 2cp-1-r),
# at step 0 the relations between local tiles are the same on every rank (rank 0's tiles stand for all); at a step
# i > 0 the visiting block of rank s = (r - i) mod cp contributes exactly two full (unmasked by position) quadrants
# of c x c tokens (c = L / 2): second-half queries x first-half keys always, plus first x first when s < r (i <= r)
# or second x second when s > r. That choice is a device-side select on the CP rank as data
# (:func:`parallel_state.rank_tensor`), so the FLOPs are those of the skipping ring. Segment ids stay on the device:
# no tile pair is skipped for lying in different documents, the mask is applied instead.


def _rank_invariant(x: torch.Tensor) -> bool:
    """True where the ring must not read the host or give ops rank- or data-dependent shapes: XLA devices
    (torch-xla, Neuron: every rank traces the same graph) and TorchNeuron's native device
    (:func:`~nxd_lc.runtime.accel.compiles_per_shape`: each host read waits for the device, and each new op shape is
    a compile; the skipping ring read the segment bounds, 24 device-to-host reads per step on the stand-in device
    at CP 2, 2 layers)."""
    return x.device.type == "xla" or compiles_per_shape(x.device)


def _quadrant_tiles(half: int, tile: int) -> tuple[list[_Tile], list[_Tile]]:
    """(query tiles, key tiles) of two ``half``-token halves in which every key precedes every query (no position
    mask, no skip)."""
    keys = [_Tile(g, g, min(tile, half - g)) for g in range(0, half, tile)]
    return [_Tile(t.local, t.glob + half, t.length) for t in keys], keys


def _pick(first: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x``'s first half along ``dim`` where ``first`` ([1] bool device tensor) else its second half (a copy)."""
    a, b = x.chunk(2, dim)
    return torch.where(first, a, b)


def _put(first: torch.Tensor, x: torch.Tensor, part: torch.Tensor, dim: int) -> None:
    """Write ``part`` into ``x``'s first half along ``dim`` where ``first`` else into its second half (in place)."""
    a, b = x.chunk(2, dim)
    a.copy_(torch.where(first, part, a))
    b.copy_(torch.where(first, b, part))


def _device_segments(seg: torch.Tensor | None) -> _Segments | None:
    """Segment ids without host bounds: every tile pair is masked by id equality (no host read)."""
    return None if seg is None else _Segments(seg, None, None)


def _half_segments(seg: torch.Tensor | None, half: int | torch.Tensor) -> _Segments | None:
    """Segments of half ``half`` (0 / 1, or ``first`` as in :func:`_pick`) of ``seg [B, L]``."""
    if seg is None:
        return None
    return _device_segments(seg.chunk(2, 1)[half] if isinstance(half, int) else _pick(half, seg, 1))


def _first_half_turn(step: int, device: torch.device) -> torch.Tensor:
    """``[1]`` bool on ``device``: at ring step ``step > 0`` the visiting block precedes this rank (s < r), i.e.
    the first x first quadrant is the active one; computed from the CP rank (the ring's group is the CP group) as
    device data."""
    return parallel_state.rank_tensor("cp", device) >= step


def _invariant_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor | None, scale: float,
                       tile: int, group: collectives.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_ring_forward` with a rank-invariant graph and no host read (see above)."""
    cp, hkv, n = collectives.group_size(group), k.shape[1], q.shape[2]
    own = _tiles(n * cp, 0, cp, tile)  # rank 0's tiles: at step 0 every rank's tiles relate the same way
    q_tiles, k_tiles = _quadrant_tiles(n // 2, tile)
    qf = _grouped(q, hkv)
    out = torch.zeros_like(qf)
    lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for step, kb, vb, sb in _rotation(k, v, seg, group):
        if step == 0:
            _block_forward(qf, kb, vb, own, own, _device_segments(seg), _device_segments(sb), out, lse, scale)
            continue
        c = n // 2
        _block_forward(qf[:, :, c:], kb[:, :, :c], vb[:, :, :c], q_tiles, k_tiles, _half_segments(seg, 1),
                       _half_segments(sb, 0), out[:, :, c:], lse[:, :, c:], scale)
        first = _first_half_turn(step, q.device)
        out_s, lse_s = _pick(first, out, 2), _pick(first, lse, 2)
        _block_forward(_pick(first, qf, 2), _pick(first, kb, 2), _pick(first, vb, 2), q_tiles, k_tiles,
                       _half_segments(seg, first), _half_segments(sb, first), out_s, lse_s, scale)
        _put(first, out, out_s, 2)
        _put(first, lse, lse_s, 2)
    return _ungrouped(out, q.dtype), lse


def _invariant_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        seg: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, scale: float, tile: int,
                        group: collectives.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_ring_backward` with a rank-invariant graph and no host read (see above)."""
    cp, hkv, n = collectives.group_size(group), k.shape[1], q.shape[2]
    own = _tiles(n * cp, 0, cp, tile)
    q_tiles, k_tiles = _quadrant_tiles(n // 2, tile)
    c = n // 2
    qf, dof = _grouped(q, hkv), _grouped(grad_out, hkv)
    delta = (dof * _grouped(out, hkv)).sum(-1)  # rowsum(dO * O) [B, Hkv, L, G]
    dq = torch.zeros_like(qf)
    incoming = None
    for step, kb, vb, sb in _rotation(k, v, seg, group):
        if step == 0:
            dk, dv = _block_backward(qf, kb, vb, dof, lse, delta, own, own, _device_segments(seg),
                                     _device_segments(sb), dq, scale)
        else:
            dk1, dv1 = _block_backward(qf[:, :, c:], kb[:, :, :c], vb[:, :, :c], dof[:, :, c:], lse[:, :, c:],
                                       delta[:, :, c:], q_tiles, k_tiles, _half_segments(seg, 1),
                                       _half_segments(sb, 0), dq[:, :, c:], scale)
            first = _first_half_turn(step, q.device)
            dq_s = torch.zeros_like(dq[:, :, :c])
            dk_s, dv_s = _block_backward(_pick(first, qf, 2), _pick(first, kb, 2), _pick(first, vb, 2),
                                         _pick(first, dof, 2), _pick(first, lse, 2), _pick(first, delta, 2),
                                         q_tiles, k_tiles, _half_segments(seg, first), _half_segments(sb, first),
                                         dq_s, scale)
            _put(first, dq, _pick(first, dq, 2) + dq_s, 2)
            dk = torch.cat([dk1 + torch.where(first, dk_s, 0.0), torch.where(first, 0.0, dk_s)], dim=2)
            dv = torch.cat([dv1 + torch.where(first, dv_s, 0.0), torch.where(first, 0.0, dv_s)], dim=2)
        incoming = _pass_on_grads(dk, dv, incoming, group)
    dk, dv = incoming.wait()
    return _ungrouped(dq, q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Autograd function (eager): forward/backward of :func:`ring_attention` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor | None,
                scale: float, tile: int, over_cp: bool) -> torch.Tensor:
        result, lse = _ring_forward(q, k, v, seg, scale, tile, over_cp)
        ctx.save_for_backward(q, k, v, seg, result, lse)
        ctx.scale, ctx.tile, ctx.over_cp = scale, tile, over_cp
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, seg, out, lse = ctx.saved_tensors
        return (*_ring_backward(grad_out, q, k, v, seg, out, lse, ctx.scale, ctx.tile, ctx.over_cp),
                None, None, None, None)


# Under torch.compile the ring (point-to-point sends, host-side tile bounds) is one opaque custom op with its own
# backward op (torch.library): the traced decoder layer has no graph break and reads nothing on the host.
@torch.library.custom_op("nxd_lc::ring_attention_fwd", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor? seg, float scale, int tile, bool over_cp) "
                                "-> (Tensor, Tensor)")
def _ring_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Optional[torch.Tensor], scale: float,
                     tile: int, over_cp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _ring_forward(q, k, v, seg, scale, tile, over_cp)
    return out.contiguous(), lse.contiguous()


@_ring_forward_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Optional[torch.Tensor], scale: float,
      tile: int, over_cp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    return q.new_empty(q.shape), q.new_empty((b, hkv, n, hq // hkv), dtype=torch.float32)  # contiguous


@torch.library.custom_op("nxd_lc::ring_attention_bwd", mutates_args=(),
                         schema="(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? seg, Tensor out, Tensor lse, "
                                "float scale, int tile, bool over_cp) -> (Tensor, Tensor, Tensor)")
def _ring_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      seg: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, scale: float,
                      tile: int, over_cp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _ring_backward(grad_out, q, k, v, seg, out, lse, scale, tile, over_cp)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_ring_backward_op.register_fake
def _(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Optional[torch.Tensor],
      out: torch.Tensor, lse: torch.Tensor, scale: float, tile: int,
      over_cp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _ring_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, seg, scale, tile, over_cp = inputs
    ctx.save_for_backward(q, k, v, seg, output[0], output[1])
    ctx.scale, ctx.tile, ctx.over_cp = scale, tile, over_cp


def _ring_op_backward(ctx: Any, grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor]) -> tuple[Any, ...]:
    q, k, v, seg, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_backward_op(grad_out.contiguous(), q, k, v, seg, out, lse, ctx.scale, ctx.tile, ctx.over_cp)
    return dq, dk, dv, None, None, None, None


_ring_forward_op.register_autograd(_ring_op_backward, setup_context=_ring_setup_context)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor | None, tile_size: int,
           over_cp: bool = True) -> None:
    """Shape/argument checks of :func:`ring_attention` (ValueError naming the offending tensor)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"ring_attention expects q [B,Hq,L,D], k and v [B,Hkv,L,D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on B, L, D and "
                         f"the query heads must be a multiple of the KV heads")
    cp = parallel_state.get_context_parallel_world_size() if over_cp else 1
    if cp > 1 and q.shape[2] % 2:
        raise ValueError(f"ring_attention: the local sequence ({q.shape[2]} tokens) must hold 2 equal chunks; "
                         f"set data.seq_length to a multiple of 2 x context_parallel_size = {2 * cp}")
    if seg is not None and (tuple(seg.shape) != (q.shape[0], q.shape[2]) or seg.is_floating_point()):
        raise ValueError(f"ring_attention: segment_ids must be an integer [B, L] = {(q.shape[0], q.shape[2])} "
                         f"tensor, got {seg.dtype} {tuple(seg.shape)}")
    if tile_size < 1:
        raise ValueError(f"ring_attention: tile_size must be >= 1, got {tile_size}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment_ids: torch.Tensor | None = None,
                   scale: float | None = None, tile_size: int = DEFAULT_TILE_SIZE,
                   over_context_parallel: bool = True) -> torch.Tensor:
    """Causal (optionally document-masked) attention of this CP rank's queries over the whole sequence.

    Args:
        q: ``[B, Hq, L, D]`` local queries in the head-tail layout (chunks ``r`` and ``2cp-1-r``).
        k, v: ``[B, Hkv, L, D]`` local keys/values, same layout (not expanded to Hq heads).
        segment_ids: ``[B, L]`` local packed-document ids (sharded like the tokens) or None (one document).
        scale: score scale, default ``1 / sqrt(D)``.
        tile_size: query/key tile length in tokens (peak score memory ``B * Hq * tile_size^2 * 4`` bytes).
        over_context_parallel: False runs the same tiled kernel on this rank's q/k/v alone (no communication;
            q/k/v then hold a whole sequence in order): the document-masked attention of a compiled layer.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype; equal to full causal attention over the unsharded sequence, restricted
        to this rank's rows. With CP size 1 it is plain causal attention. Collective over the CP group (every
        CP rank must call it, forward and backward).

    Raises:
        ValueError: inconsistent shapes, an odd local length under CP > 1, non-integer segment_ids, bad tile.
    """
    _check(q, k, v, segment_ids, tile_size, over_context_parallel)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if is_compiling():  # one opaque custom op (forward + backward ops) in the traced graph
        return _ring_forward_op(q, k, v, segment_ids, scale, int(tile_size), over_context_parallel)[0]
    return _RingAttention.apply(q, k, v, segment_ids, scale, int(tile_size), over_context_parallel)
