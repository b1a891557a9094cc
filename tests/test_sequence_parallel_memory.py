"""What a sequence-parallel column-parallel linear keeps for its backward (2 gloo processes, TP 2).

Under sequence parallelism a column layer's input ``[B, S/tp, H]`` is all-gathered to ``[B, S, H]``. NxD
(``LinearWithAsyncCommunication``) and Megatron-LM keep only the shard and gather it again in backward; keeping the
gathered copy costs ``tp`` times the memory. Saved tensors are counted with
``torch.autograd.graph.saved_tensors_hooks`` (parameters left out, one count per storage), and
:func:`~nxd_lc.distributed.mappings.sequence_parallel_linears` is compared with the gather-then-``F.linear``
composition it replaces (outputs and every gradient, also under bf16 autocast and with frozen weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed

from nxd_lc.config.peft_schema import PeftConfig
from nxd_lc.distributed import parallel_state
from nxd_lc.distributed.mappings import gather_from_sequence_parallel_region, sequence_parallel_linears
from nxd_lc.layers import ColumnParallelLinear, GQAQKVColumnParallelLinear
from nxd_lc.layers.lora import convert_to_lora

pytestmark = pytest.mark.compat

B, S, H, R, TP = 2, 8, 16, 4, 2
F32 = 4


def _saved_activation_bytes(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the non-parameter tensors autograd keeps for one forward (each storage once) and their shapes."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.sum() for o in outs).backward()  # the kept tensors serve a working backward
    return sum(kept.values()), shapes


def _layers() -> dict[str, torch.nn.Module]:
    peft = PeftConfig(lora_rank=R, lora_alpha=8.0, lora_dropout=0.0, target_modules=["x"])
    layers: dict[str, torch.nn.Module] = {
        "column": ColumnParallelLinear(H, 12, sequence_parallel_enabled=True),
        "qkv_fused": GQAQKVColumnParallelLinear(H, 4, 2, 4, bias=True, sequence_parallel_enabled=True),
        "qkv_unfused": GQAQKVColumnParallelLinear(H, 4, 2, 4, fuse_qkv=False, sequence_parallel_enabled=True),
    }
    for name, base in (("lora_column", ColumnParallelLinear(H, 12, sequence_parallel_enabled=True)),
                       ("lora_qkv", GQAQKVColumnParallelLinear(H, 4, 2, 4, sequence_parallel_enabled=True))):
        base.requires_grad_(False)  # LoRA trains the adapters only
        layers[name] = convert_to_lora(base, peft)
    return layers


def _saved_bytes_worker(rank: int, world: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    shard = B * (S // world) * H * F32
    expected = {"column": shard, "qkv_fused": shard, "qkv_unfused": shard,
                "lora_column": shard + B * S * R * F32, "lora_qkv": shard + B * S * R * F32}  # + s * A x [B, S, r]
    for name, layer in _layers().items():
        torch.manual_seed(0)
        x = torch.randn(B, S // world, H, requires_grad=True)
        kept, shapes = _saved_activation_bytes(layer, x)
        inputs = [s for s in shapes if s[-1] == H]
        assert inputs and all(s == (B, S // world, H) for s in inputs), (name, shapes)  # the shard, never [B, S, H]
        assert kept == expected[name], (name, kept, expected[name], shapes)
        if rank == 0:
            print(f"{name}: {kept} bytes kept (gathered input would be {B * S * H * F32})")


@pytest.mark.distributed
def test_sp_column_layers_keep_only_the_sequence_shard() -> None:
    run_distributed(_saved_bytes_worker, TP)


def _reference(x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...]:
    full = gather_from_sequence_parallel_region(x, to_model_parallel=True)
    return tuple(F.linear(full, w, b) for w, b in zip(ws, bs))


def _run(fn, x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor | None],
         dys: list[torch.Tensor], autocast: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in (x, *ws, *bs)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ys = fn(leaves[0], leaves[1:1 + len(ws)], leaves[1 + len(ws):])
    sum((y.float() * dy).sum() for y, dy in zip(ys, dys)).backward()
    return [y.detach() for y in ys], [None if t is None else t.grad for t in leaves]


def _equivalence_worker(rank: int, world: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(1 + rank)  # each rank its own shard and output gradient
    x = torch.randn(B, S // world, H, requires_grad=True)
    ws = [torch.randn(6, H, requires_grad=True), torch.randn(4, H, requires_grad=True), torch.randn(R, H)]
    bs = [torch.randn(6, requires_grad=True), None, None]  # the third weight frozen, as a LoRA base
    dys = [torch.randn(B, S, w.shape[0]) for w in ws]
    for autocast in (False, True):
        got, got_grads = _run(sequence_parallel_linears, x, ws, bs, dys, autocast)
        ref, ref_grads = _run(_reference, x, ws, bs, dys, autocast)
        tol = {"atol": 6e-2, "rtol": 2e-2} if autocast else {}  # bf16 sums in another order
        for g, r in zip(got, ref):
            assert g.dtype == r.dtype
            torch.testing.assert_close(g, r, **tol)
        for g, r in zip(got_grads, ref_grads):
            assert (g is None) == (r is None)
            if g is not None:
                assert g.dtype == r.dtype
                torch.testing.assert_close(g, r, **tol)


@pytest.mark.distributed
def test_sequence_parallel_linears_equal_gather_then_linear() -> None:
    run_distributed(_equivalence_worker, TP)
