"""Ring context-parallel scenarios for the multi-device XLA test bed (:mod:`xla_testbed`), one thread per device.

:func:`train_packed` is :func:`xla_scenarios.train` (nxd_lc's training-step code on a tiny Llama, 3 optimizer
steps of 2 micro-batches, losses and global gradient norms read after each step) with packed documents: every
micro-batch gets ``segment_ids`` (several documents per row, boundaries inside the CP chunks), which the
LightningModule shards with the tokens; at CP = 1 they become local document-masked attention, at CP > 1 the
ring's segment masks. Used by ``tests/test_xla_ring.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import xla_scenarios

_PATCH_LOCK = threading.Lock()
_COUNTS: dict[int, int] = {}  # device-thread id -> ring-attention calls that received segment ids
_FIRST_GRADS: dict[int, dict[str, list[float]] | None] = {}  # device-thread id -> step-1 gradients (when asked)
#: document lengths of the rows (row parity picks one; sums = xla_scenarios.SEQ)
DOCS = ([3, 3, 5, 5], [7, 9])


def _segment_ids(rows: int, device: Any) -> Any:
    """``[rows, SEQ]`` int64 document index of each token, row ``b`` packed as ``DOCS[b % 2]``."""
    import torch

    layouts = [torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(docs)]) for docs in DOCS]
    return torch.stack([layouts[b % 2] for b in range(rows)]).to(device)


def _patch_once() -> None:
    """Add ``segment_ids`` to every micro-batch of ``training_step``, count the ring calls that get them, and
    record the first step's reduced gradients where asked (class / module attributes of this child process,
    patched once for every device thread)."""
    from nxd_lc.context import attention
    from nxd_lc.lightning.module import NxDLanguageModel

    with _PATCH_LOCK:
        if getattr(NxDLanguageModel.training_step, "_packed", False):
            return
        step, ring = NxDLanguageModel.training_step, attention.ring_attention
        before_optimizer = NxDLanguageModel.on_before_optimizer_step

        def packed_step(self: Any, batch: dict, batch_idx: int) -> Any:
            ids = batch["input_ids"]
            return step(self, {**batch, "segment_ids": _segment_ids(ids.shape[0], ids.device)}, batch_idx)

        def counting_ring(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("segment_ids") is not None:
                key = threading.get_ident()
                _COUNTS[key] = _COUNTS.get(key, 0) + 1
            return ring(*args, **kwargs)

        def recording_before_optimizer(self: Any, optimizer: Any) -> None:
            before_optimizer(self, optimizer)
            key = threading.get_ident()
            if key in _FIRST_GRADS and _FIRST_GRADS[key] is None:  # asked for, not yet recorded
                _FIRST_GRADS[key] = {n: p.grad.detach().cpu().reshape(-1).tolist()
                                     for n, p in self.model.named_parameters() if p.grad is not None}

        packed_step._packed = True  # type: ignore[attr-defined]
        NxDLanguageModel.training_step = packed_step
        NxDLanguageModel.on_before_optimizer_step = recording_before_optimizer
        attention.ring_attention = counting_ring


def train_packed(rank: int, world: int, grads: bool = False, **kwargs: Any) -> dict[str, Any]:
    """:func:`xla_scenarios.train` on packed documents (``kwargs`` as there); adds ``segments_seen``: whether
    this rank's ring attention received segment ids (always False at CP = 1, where no ring runs), and with
    ``grads`` (TP = 1 only: full tensors) ``first_grads``: every parameter's gradient of step 1 after the
    gradient reductions, flattened (a host read per parameter, the same on every rank)."""
    _patch_once()
    key = threading.get_ident()
    if grads:
        _FIRST_GRADS[key] = None
    result = xla_scenarios.train(rank, world, **kwargs)
    result["segments_seen"] = _COUNTS.get(key, 0) > 0
    if grads:
        result["first_grads"] = _FIRST_GRADS[key]
    return result


def ring_kernel_on_one_device(rank: int, world: int) -> dict[str, Any]:
    """The ring kernel on one XLA device (``over_context_parallel=False``: the compiled layer's document-masked
    attention), forward and backward of fixed random inputs; returns the CPU fallback ops and device-to-host
    transfers counted while tracing and running them, the output, the q/k/v gradients and the inputs (nested lists)."""
    import torch
    import torch_xla.debug.metrics as met

    from nxd_lc.context import ring_attention
    from nxd_lc.runtime import xla as xla_runtime

    device = xla_runtime.xla_device()
    torch.manual_seed(0)
    b, n = 2, 12  # a small graph: XLA:CPU compiles every tile pair
    q, k, v, grad = torch.randn(b, 4, n, 8), torch.randn(b, 2, n, 8), torch.randn(b, 2, n, 8), torch.randn(b, 4, n, 8)
    seg = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    seg_x, grad_x = seg.to(device), grad.to(device)
    xla_runtime.sync()
    met.clear_all()
    out = ring_attention(*leaves, segment_ids=seg_x, tile_size=5, over_context_parallel=False)
    out.backward(grad_x)
    xla_runtime.sync()
    fallbacks = [name for name in met.counter_names() if name.startswith("aten::")]
    transfers = met.metric_data("TransferFromDeviceTime")
    return {"fallback_ops": fallbacks, "transfers": 0 if transfers is None else int(transfers[0]),
            "out": out.cpu().tolist(), "grads": [t.grad.cpu().tolist() for t in leaves],
            "inputs": {"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "seg": seg.tolist(), "grad": grad.tolist()}}
