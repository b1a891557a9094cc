"""The NKI flash-attention adapter calls the kernel as NxD does; checked against torch SDPA.

The real kernel only runs on Trainium; here a pure-PyTorch substitute with the kernel's signature (grid-indexed
``fwd[grid](q, k, v, seed, ...)`` / ``bwd[grid](q, k, v, o, dout, lse, seed, ...)``, q/k in [B, H, D, S], lse
[B, H, 128, S // 128] in ``FlashConfig.lse_dtype``) stands in for it. It strictly checks what it receives: the
layouts, the grid, the config fields, equal q and k/v head counts in the backward (as the kernel asserts), and
that the backward gets the lse the forward produced, in its dtype.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from nxd_lc.context import nki
from nxd_lc.context.nki import NkiKernels, flash_attention, nki_flash_attention

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

S = 2048  # the smallest sequence the kernel takes
P = 128  # nl.tile_size.pmax: lse is [B, H, P, S // P]
_ENV = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "NEURON_LOGICAL_NC_CONFIG")
neuron_platform = nki.neuron_platform  # the real detection (the autouse fixture patches the module's name)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(nki, "neuron_platform", lambda: None)  # no platform: lnc 1 unless told


@dataclass(frozen=True)
class _Config:
    """FlashConfig's fields and defaults; an unknown field is a TypeError, as with the real dataclass."""

    seq_tile_size: int = 2048
    attn_core_tile_size: int = 256
    training: bool = True
    should_transpose_v: bool = False
    lse_dtype: str = ""


class _NC:
    """Stands in for ``nki.language.nc(lnc)``: ``nc(lnc) * n`` -> ("nc", lnc, n)."""

    def __init__(self, lnc: int) -> None:
        self.lnc = lnc

    def __mul__(self, n: int) -> tuple[str, int, int]:
        return ("nc", self.lnc, n)


def _grid_heads(grid) -> int:
    """Programs along the head axis: Hq for (B, Hq); lnc * n for (B, nc(lnc) * n)."""
    heads = grid[1]
    return heads[1] * heads[2] if isinstance(heads, tuple) else heads


def _reference(q: torch.Tensor, k: torch.Tensor, v_sd: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, D, S]; v_sd [B, H, S, D] (equal heads) -> (o [B, H, S, D], lse [B, H, S] fp32)."""
    scores = (q.transpose(2, 3) @ k).float() * scale
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp().to(q.dtype) @ v_sd), lse


class _Kernel:
    """Grid-indexable pure-PyTorch kernel; records the grids and input shapes it was launched with."""

    def __init__(self, fn) -> None:
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return self.fn(grid, *args, **kwargs)
        return launch


class _Substitute:
    """The kernel pair; records the configs, the lse dtypes produced and received."""

    def __init__(self) -> None:
        self.configs: list[Optional[_Config]] = []
        self.lse_out: list[torch.dtype] = []
        self.lse_in: list[torch.dtype] = []

    def fwd(self, grid, q, k, v, seed, *, use_causal_mask, mixed_precision, dropout_p, softmax_scale, config):
        assert seed is None and dropout_p == 0.0 and mixed_precision
        self.configs.append(config)
        config = config or _Config()
        b, h, d, s = q.shape
        kh = k.shape[1]
        assert k.shape == (b, kh, d, s), "k must be [B, Hkv, D, S]"
        assert v.shape == ((b, kh, d, s) if config.should_transpose_v else (b, kh, s, d)), "v disagrees with config"
        assert _grid_heads(grid) == kh and grid[0] == b, "the forward's grid runs over (B, K/V heads)"
        assert kh == h, "the adapter hands the kernel k/v expanded to the query heads"
        out, lse = _reference(q, k, v.transpose(2, 3) if config.should_transpose_v else v, use_causal_mask,
                              softmax_scale)
        dtype = getattr(torch, config.lse_dtype) if config.lse_dtype else torch.float32  # fp32: mixed_precision
        self.lse_out.append(dtype)
        return out, lse.view(b, h, s // P, P).transpose(2, 3).to(dtype)

    def bwd(self, grid, q, k, v, o, dout, lse, seed, *, use_causal_mask, mixed_precision, dropout_p, softmax_scale):
        b, h, d, s = q.shape
        assert k.shape[1] == v.shape[1] == h, "flash_attn_bwd: K/V heads must equal the query heads"
        assert q.shape == k.shape == v.shape == o.shape == dout.shape, "bwd takes q, k, v, o, dout in [B, H, D, S]"
        assert _grid_heads(grid) == h and lse.shape == (b, h, P, s // P)
        assert lse.dtype == self.lse_out[-1], "the backward gets the forward's lse, in its dtype"
        self.lse_in.append(lse.dtype)
        with torch.enable_grad():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out, _ = _reference(qg, kg, vg.transpose(2, 3), use_causal_mask, softmax_scale)
            torch.testing.assert_close(out.detach().transpose(2, 3), o)
            return torch.autograd.grad(out, (qg, kg, vg), dout.transpose(2, 3))


def _kernels(with_nc: bool = True) -> NkiKernels:
    sub = _Substitute()
    return NkiKernels(fwd=_Kernel(sub.fwd), bwd=_Kernel(sub.bwd), make_config=_Config, nc=_NC if with_nc else None)


def _sub(kernels: NkiKernels) -> _Substitute:
    return kernels.fwd.fn.__self__


def _qkv(hq: int = 2, hkv: int = 1, d: int = 8, b: int = 1, seq: int = S,
         dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, seq, d, generator=g).to(dtype).requires_grad_() for h in (hq, hkv, hkv)]


def _sdpa(q, k, v, causal=True):
    """Independent reference: GQA by explicit repeat_interleave, then torch SDPA in fp32."""
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(rep, 1),
                                          v.float().repeat_interleave(rep, 1), is_causal=causal)


@pytest.mark.parametrize("transpose_nki_inputs", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_sdpa_forward_and_backward(transpose_nki_inputs: bool, causal: bool) -> None:
    q, k, v = _qkv()  # GQA: 2 query heads, 1 KV head
    ref = _sdpa(q, k, v, causal)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    kernels = _kernels()
    inputs = [t.transpose(2, 3) for t in (q, k, v)] if transpose_nki_inputs else [q, k, v]
    out = nki_flash_attention(*inputs, kernels=kernels, transpose_nki_inputs=transpose_nki_inputs, causal=causal)
    assert out.shape == (1, 2, S, 8)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [g.shape for g in grads] == [(1, 2, S, 8), (1, 1, S, 8), (1, 1, S, 8)]  # dk, dv summed to Hkv
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    (grid, shapes), = kernels.fwd.launches
    v_shape = (1, 2, 8, S) if transpose_nki_inputs else (1, 2, S, 8)  # NxD: should_transpose_v iff transposed
    assert grid == (1, 2) and shapes == [(1, 2, 8, S), (1, 2, 8, S), v_shape]
    assert _sub(kernels).configs == [_Config(should_transpose_v=True) if transpose_nki_inputs else None]
    (grid, shapes), = kernels.bwd.launches
    assert grid == (1, 2) and shapes[:3] == [(1, 2, 8, S)] * 3 and shapes[5] == (1, 2, P, S // P)


def test_lnc2_uses_the_sharded_grid() -> None:
    q, k, v = _qkv(hq=4, hkv=2)
    kernels = _kernels()
    out = nki_flash_attention(q, k, v, kernels=kernels, transpose_nki_inputs=False, lnc=2)
    ref = _sdpa(q, k, v)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    dout = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert kernels.fwd.launches[0][0] == kernels.bwd.launches[0][0] == (1, ("nc", 2, 2))


_BF16_ON = "bfloat16"


@pytest.mark.parametrize("env, dtype, lse", [
    ({}, torch.float32, None),
    ({}, torch.bfloat16, None),  # NxD tests XLA_DOWNCAST_BF16 == '0'; unset is not '0'
    ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0"}, torch.float32, None),
    ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0"}, torch.bfloat16, _BF16_ON),  # nxd_lc's env, bf16 q
    ({"XLA_DOWNCAST_BF16": "1"}, torch.float32, _BF16_ON),
    ({"XLA_USE_BF16": "1"}, torch.float32, _BF16_ON),
])
def test_lse_dtype_follows_nxd(monkeypatch: pytest.MonkeyPatch, env: dict, dtype: torch.dtype,
                               lse: Optional[str]) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert nki.default_lse_dtype(dtype) == lse and nki.default_lse_dtype(dtype, env) == lse
    q, k, v = _qkv(dtype=dtype)
    kernels = _kernels()
    out = nki_flash_attention(q, k, v, kernels=kernels, transpose_nki_inputs=False)
    out.float().sum().backward()
    assert out.dtype == dtype and k.grad is not None and k.grad.shape == k.shape
    torch.testing.assert_close(out.float(), _sdpa(q, k, v), atol=2e-5 if dtype == torch.float32 else 3e-2,
                               rtol=1e-4 if dtype == torch.float32 else 3e-2)
    sub = _sub(kernels)
    assert sub.configs == [None if lse is None else _Config(lse_dtype=lse)]
    assert sub.lse_in == [torch.bfloat16 if lse else torch.float32]


def test_explicit_lse_dtype_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_DOWNCAST_BF16", "1")
    for given, config, received in (("float32", _Config(lse_dtype="float32"), torch.float32),
                                    (None, None, torch.float32),
                                    ("auto", _Config(lse_dtype="bfloat16"), torch.bfloat16)):
        q, k, v = _qkv()
        kernels = _kernels()
        nki_flash_attention(q, k, v, kernels=kernels, transpose_nki_inputs=False, lse_dtype=given).sum().backward()
        assert _sub(kernels).configs == [config] and _sub(kernels).lse_in == [received]


def test_bad_inputs_raise_clear_errors() -> None:
    q, k, v = _qkv(seq=1024)
    for call in (lambda: nki_flash_attention(q, k, v, kernels=_kernels(), transpose_nki_inputs=False),
                 lambda: flash_attention(q, k, v, kernels=_kernels())):  # refused, not sent to SDPA
        with pytest.raises(ValueError, match="multiple of 2048.*data.seq_length"):
            call()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple of 2048"):  # [B,H,S,D] given where [B,H,D,S] is declared
        nki_flash_attention(q, k, v, kernels=_kernels(), transpose_nki_inputs=True)
    with pytest.raises(ValueError, match="trainer.lnc=3: must be 1"):
        nki_flash_attention(q, k, v, kernels=_kernels(), transpose_nki_inputs=False, lnc=3)
    with pytest.raises(ValueError, match="sharded NKI kernel"):
        nki_flash_attention(q, k, v, kernels=_kernels(with_nc=False), transpose_nki_inputs=False, lnc=2)
    q3, k3, v3 = _qkv(hq=3, hkv=1)
    with pytest.raises(ValueError, match="divisible by lnc"):
        nki_flash_attention(q3, k3, v3, kernels=_kernels(), transpose_nki_inputs=False, lnc=2)
    with pytest.raises(ValueError, match="4-D"):
        nki_flash_attention(q[0], k[0], v[0], kernels=_kernels(), transpose_nki_inputs=False)


def test_resolve_lnc(monkeypatch: pytest.MonkeyPatch) -> None:
    platform: list[Optional[str]] = [None]
    monkeypatch.setattr(nki, "neuron_platform", lambda: platform[0])
    assert nki.resolve_lnc(None) == 1 and nki.resolve_lnc(2) == 2
    platform[0] = "trn2"
    assert nki.resolve_lnc(None) == 2 and nki.resolve_lnc(1) == 1  # Trn2 default 2; trainer.lnc wins
    platform[0] = "trn3"
    assert nki.resolve_lnc(None) == 1  # NxDT defaults to 2 on Trn2 only
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    platform[0] = "trn2"
    assert nki.resolve_lnc(None) == 1 and nki.resolve_lnc(1) == 1  # env over platform
    with pytest.raises(ValueError, match="trainer.lnc=2 but NEURON_LOGICAL_NC_CONFIG=1"):  # grid != runtime's cores
        nki.resolve_lnc(2)
    platform[0] = "trn1"
    assert nki.resolve_lnc(None) == 1
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    with pytest.raises(ValueError, match="trainer.lnc=2 on Trainium1"):
        nki.resolve_lnc(2)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG=2 on Trainium1"):
        nki.resolve_lnc(None)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="on Trainium1"):  # the adapter resolves through it
        nki_flash_attention(q, k, v, kernels=_kernels(), transpose_nki_inputs=False)
    platform[0] = None
    kernels = _kernels()
    nki_flash_attention(q, k, v, kernels=kernels, transpose_nki_inputs=False)
    assert kernels.fwd.launches[0][0] == (1, ("nc", 2, 1))  # lnc from the env
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "x")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG"):
        nki.resolve_lnc(None)


def test_neuron_platform_reads_torch_neuronx(monkeypatch: pytest.MonkeyPatch) -> None:
    def detect(target: object) -> Optional[str]:
        def get_platform_target() -> object:
            if isinstance(target, Exception):
                raise target
            return target
        utils = types.ModuleType("torch_neuronx.utils")
        utils.get_platform_target = get_platform_target  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
        monkeypatch.setitem(sys.modules, "torch_neuronx.utils", utils)
        neuron_platform.cache_clear()
        return neuron_platform()

    try:
        assert [detect(t) for t in ("trn1", "trn1n", "inf2", "trn2", "TRN2", "trn3", "gpu")] == \
            ["trn1", "trn1", "trn1", "trn2", "trn2", "trn3", None]
        assert detect(types.SimpleNamespace(value="trn2")) == "trn2"  # an enum's value
        assert detect(RuntimeError("Unable to read platform target")) is None
    finally:
        neuron_platform.cache_clear()


@pytest.mark.parametrize("transpose_nki_inputs", [False, True])
def test_off_neuron_falls_back_to_sdpa(transpose_nki_inputs: bool) -> None:
    if nki.load_nki_kernels() is not None:
        pytest.skip("neuronxcc kernels are importable here: the kernel path is taken")
    q, k, v = _qkv(hq=4, hkv=2, seq=24)  # no 2048 constraint on the SDPA path
    inputs = [t.transpose(2, 3) for t in (q, k, v)] if transpose_nki_inputs else [q, k, v]
    out = flash_attention(*inputs, transpose_nki_inputs=transpose_nki_inputs)
    torch.testing.assert_close(out, _sdpa(q, k, v))
    with pytest.raises(ValueError, match="flash attention expects"):
        flash_attention(q, k[:, :, :5], v, transpose_nki_inputs=False)
    # A substitute kernel given explicitly is used instead of SDPA.
    kernels = _kernels()
    q, k, v = _qkv()
    flash_attention(q, k, v, kernels=kernels, lnc=1)
    assert len(kernels.fwd.launches) == 1


@pytest.mark.parametrize("transpose_nki_inputs", [True, False])
def test_attention_dispatch_calls_the_kernel_on_the_xla_path(monkeypatch: pytest.MonkeyPatch,
                                                             transpose_nki_inputs: bool) -> None:
    """The XLA flash branch of the attention dispatch hands q/k/v to the (substitute) kernel in the layout
    ``model.transpose_nki_inputs`` selects, GQA k/v expanded to the query heads, and equals SDPA; packed batches
    fall back to masked SDPA."""
    from nxd_lc.context import local as attention

    kernels = _kernels()
    monkeypatch.setattr(nki, "load_nki_kernels", lambda: kernels)
    attention.set_nki_options(transpose_nki_inputs, lnc=1)
    try:
        q, k, v = _qkv(hq=4, hkv=2)
        out = attention._xla_flash(q, k, v, None, 1.0 / math.sqrt(q.shape[-1]), True)
        (grid, shapes), = kernels.fwd.launches
        assert grid == (1, 4) and shapes[:2] == [(1, 4, 8, S)] * 2 and out.shape == q.shape
        torch.testing.assert_close(out, _sdpa(q, k, v), atol=1e-5, rtol=0)
        seg = torch.zeros(q.shape[0], q.shape[2], dtype=torch.int32)
        seg[:, q.shape[2] // 2:] = 1
        ke, ve = attention.repeat_kv(k, 2), attention.repeat_kv(v, 2)  # as local_attention hands them over
        masked = attention._xla_flash(q, ke, ve, seg, 1.0 / math.sqrt(q.shape[-1]), True)
        assert len(kernels.fwd.launches) == 1
        ref = attention.local_attention(q, k, v, scale=1.0 / math.sqrt(q.shape[-1]), segment_ids=seg)
        torch.testing.assert_close(masked, ref, atol=1e-5, rtol=0)
    finally:
        attention.set_nki_options(True, None)
