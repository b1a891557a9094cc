"""The NKI flash-attention adapter's layout, shape and lnc contract, checked against torch SDPA.

The real kernel only runs on Trainium; here a pure-PyTorch substitute with the kernel's signature (grid-indexed
``fwd[grid](q, k, v, seed, ...)`` / ``bwd[grid](q, k, v, o, dout, lse, seed, ...)``, q/k in [B, H, D, S]) stands
in for it, and strictly checks the layouts it receives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from nxd_lc.context.nki import NkiKernels, flash_attention, load_nki_kernels, nki_flash_attention, resolve_lnc

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

S = 2048  # the smallest sequence the kernel takes


@dataclass(frozen=True)
class _Config:
    should_transpose_v: bool = False


class _NC:
    """Stands in for ``nki.language.nc(lnc)``: ``nc(lnc) * n`` -> ("nc", lnc, n)."""

    def __init__(self, lnc: int) -> None:
        self.lnc = lnc

    def __mul__(self, n: int) -> tuple[str, int, int]:
        return ("nc", self.lnc, n)


def _reference(q: torch.Tensor, k: torch.Tensor, v_sd: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, D, S]; v_sd [B, Hkv, S, D] -> (o [B, H, S, D], lse [B, H, S]); explicit softmax in fp32."""
    rep = q.shape[1] // k.shape[1]
    qs, ks, vs = q.transpose(2, 3), k.transpose(2, 3).repeat_interleave(rep, 1), v_sd.repeat_interleave(rep, 1)
    scores = (qs @ ks.transpose(2, 3)).float() * scale
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp().to(q.dtype) @ vs), lse


class _Kernel:
    """Grid-indexable pure-PyTorch kernel; records the grids and input shapes it was launched with."""

    def __init__(self, fn) -> None:
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return self.fn(grid, *args, **kwargs)
        return launch


def _fwd(grid, q, k, v, seed, *, use_causal_mask, mixed_precision, dropout_p, softmax_scale, config):
    assert seed is None and dropout_p == 0.0 and mixed_precision
    b, h, d, s = q.shape
    assert k.shape[2:] == (d, s), "k must be [B, Hkv, D, S]"
    assert v.shape[2:] == ((d, s) if config.should_transpose_v else (s, d)), "v layout disagrees with the config"
    v_sd = v.transpose(2, 3) if config.should_transpose_v else v
    return _reference(q, k, v_sd, use_causal_mask, softmax_scale)


def _bwd(grid, q, k, v, o, dout, lse, seed, *, use_causal_mask, mixed_precision, dropout_p, softmax_scale):
    assert q.shape == o.shape == dout.shape, "bwd takes q, o, dout all in [B, H, D, S]"
    assert k.shape == v.shape and lse.shape == (q.shape[0], q.shape[1], q.shape[3])
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out, _ = _reference(qg, kg, vg.transpose(2, 3), use_causal_mask, softmax_scale)
        torch.testing.assert_close(out.detach().transpose(2, 3), o)
        return torch.autograd.grad(out, (qg, kg, vg), dout.transpose(2, 3))


def _kernels(with_nc: bool = True) -> NkiKernels:
    return NkiKernels(fwd=_Kernel(_fwd), bwd=_Kernel(_bwd), make_config=_Config, nc=_NC if with_nc else None)


def _qkv(hq: int = 2, hkv: int = 1, d: int = 8, b: int = 1, seq: int = S) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, seq, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


def _sdpa(q, k, v, causal=True):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=causal)


@pytest.mark.parametrize("transpose_nki_inputs", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_sdpa_forward_and_backward(transpose_nki_inputs: bool, causal: bool) -> None:
    q, k, v = _qkv()
    ref = _sdpa(q, k, v, causal)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    kernels = _kernels()
    inputs = [t.transpose(2, 3) for t in (q, k, v)] if transpose_nki_inputs else [q, k, v]
    out = nki_flash_attention(*inputs, kernels=kernels, transpose_nki_inputs=transpose_nki_inputs, causal=causal)
    assert out.shape == (1, 2, S, 8)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), ref_grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    (grid, shapes), = kernels.fwd.launches
    assert grid == (1, 2) and shapes == [(1, 2, 8, S), (1, 1, 8, S), (1, 1, 8, S)]
    assert kernels.bwd.launches[0][0] == (1, 2)


def test_lnc2_uses_the_sharded_grid() -> None:
    q, k, v = _qkv(hq=4, hkv=2, b=2)
    kernels = _kernels()
    out = nki_flash_attention(q, k, v, kernels=kernels, transpose_nki_inputs=False, lnc=2)
    torch.testing.assert_close(out, _sdpa(q, k, v), atol=2e-5, rtol=1e-4)
    assert kernels.fwd.launches[0][0] == (2, ("nc", 2, 2))


def test_bad_inputs_raise_clear_errors() -> None:
    q, k, v = _qkv(seq=1024)
    with pytest.raises(ValueError, match="multiple of 2048.*data.seq_length"):
        nki_flash_attention(q, k, v, kernels=_kernels(), transpose_nki_inputs=False)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple of 2048"):  # [B,H,S,D] given where [B,H,D,S] is declared
        nki_flash_attention(q, k, v, kernels=_kernels(), transpose_nki_inputs=True)
    with pytest.raises(ValueError, match="trainer.lnc must be 1"):
        nki_flash_attention(q, k, v, kernels=_kernels(), transpose_nki_inputs=False, lnc=3)
    with pytest.raises(ValueError, match="sharded NKI kernel"):
        nki_flash_attention(q, k, v, kernels=_kernels(with_nc=False), transpose_nki_inputs=False, lnc=2)
    q3, k3, v3 = _qkv(hq=3, hkv=1)
    with pytest.raises(ValueError, match="divisible by lnc"):
        nki_flash_attention(q3, k3, v3, kernels=_kernels(), transpose_nki_inputs=False, lnc=2)
    with pytest.raises(ValueError, match="4-D"):
        nki_flash_attention(q[0], k[0], v[0], kernels=_kernels(), transpose_nki_inputs=False)


def test_resolve_lnc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert resolve_lnc(None) == 1 and resolve_lnc(2) == 2
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    assert resolve_lnc(None) == 2
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "x")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG"):
        resolve_lnc(None)


@pytest.mark.parametrize("transpose_nki_inputs", [False, True])
def test_off_neuron_falls_back_to_sdpa(transpose_nki_inputs: bool) -> None:
    if load_nki_kernels() is not None:
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
    ``model.transpose_nki_inputs`` selects and equals SDPA; packed batches fall back to masked SDPA."""
    from nxd_lc.context import local as attention
    from nxd_lc.context import nki

    calls: list[int] = []
    kernels = _kernels()
    counting = NkiKernels(fwd=_Kernel(lambda *a, **kw: (calls.append(1), _fwd(*a, **kw))[1]), bwd=kernels.bwd,
                          make_config=kernels.make_config, nc=kernels.nc)
    monkeypatch.setattr(nki, "load_nki_kernels", lambda: counting)
    attention.set_nki_options(transpose_nki_inputs, lnc=1)
    q, k, v = _qkv(hq=2, hkv=2)
    out = attention._xla_flash(q, k, v, None, 1.0 / math.sqrt(q.shape[-1]), True)
    assert calls and out.shape == q.shape
    torch.testing.assert_close(out, _sdpa(q, k, v), atol=1e-5, rtol=0)
    seg = torch.zeros(q.shape[0], q.shape[2], dtype=torch.int32)
    seg[:, q.shape[2] // 2:] = 1
    calls.clear()
    masked = attention._xla_flash(q, k, v, seg, 1.0 / math.sqrt(q.shape[-1]), True)
    assert not calls
    ref = attention.local_attention(q, k, v, scale=1.0 / math.sqrt(q.shape[-1]), segment_ids=seg)
    torch.testing.assert_close(masked, ref, atol=1e-5, rtol=0)
    attention.set_nki_options(True, None)
