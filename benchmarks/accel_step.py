"""Accelerator step benchmark: one training step of nxd_lc configurations against transformers (+ Liger-Kernel).

The accelerator twin of the CPU long-context benchmark (``long_context.py``). One point = one training step
(forward + backward + AdamW step, ``zero_grad(set_to_none=True)``) on a single ``[1, L]`` sequence of random tokens,
micro batch 1, on the Llama-3.2-1B shape with untied embeddings (:data:`LLAMA_1B_UNTIED`, 1.50B parameters),
bf16 weights on CUDA (fp32 on CPU, where bf16 is slow and imprecise). Run from the repository root::

    python -m benchmarks.accel_step prepare --hf-dir /tmp/hf1b [--tiny]
    python -m benchmarks.accel_step run --impl nxd_best --hf-dir /tmp/hf1b --lens 4096,16384 --steps 2 --out x.json
    python -m benchmarks.accel_step compare --hf-dir /tmp/hf1b --lens 4096,16384,65536,131072 \\
        --nxd-extra-lens 196608,262144 --time-budget-s 400 --out benchmarks/results/accel_step_<stamp>.json
    python -m benchmarks.accel_step --smoke [--out /tmp/accel_step_smoke.json]   # tiny model, CPU, < 1 min

``prepare`` saves seed-0 HF ``LlamaForCausalLM`` weights (bf16, ``save_pretrained``); the tiny shape
(:data:`TINY`) is for CPU runs and the smoke test.

``run`` measures one implementation in its own process: for each length, in ascending order, one warm-up step
(its wall time is ``warmup_s``: the compile time of compiled configurations, the optimizer state's allocation
for all) and then ``--steps`` timed steps, of which the fastest is reported (``best_step_s``, ``tokens_per_s``,
``model_tflops``). Peak memory is ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the timed
steps (the statistics are reset after the warm-up step; the optimizer state already exists then); on CPU it is
recorded as null. ``loss_first`` is the warm-up step's loss, ``loss_last`` the last timed step's. An out-of-memory
error ends the implementation's list (status ``oom``); so does any other exception (status ``error``, recorded),
and, under ``--deadline-s``, a length whose predicted time would overrun the deadline (status ``skipped_time``;
the prediction scales the last step quadratically in L, an upper bound of a step's growth). A configuration with
``activations_memory_budget`` is built at each length; a length where the budget is below every plan is recorded
as ``no_plan`` and the next length is tried (a fractional budget is infeasible at short lengths first, where the
fixed terms of the estimate weigh most). The result JSON is
rewritten after every point, so a killed process leaves what it finished.

The tokens of length L come from a CPU generator seeded with ``TOKEN_SEED + L`` (moved to the device afterwards):
every implementation sees the same tokens at each length, whatever lengths precede it. Both sides compute the
same next-token loss over the same L - 1 predictions: transformers shifts ``labels=input_ids`` itself and has no
target for the last position, so nxd_lc gets ``labels = tokens[1:L+1]`` with its last entry ignored (-100).

Implementations (:func:`all_impls`): ``hf`` (transformers, sdpa attention), ``hf_gc`` (+
``gradient_checkpointing_enable()``), ``hf_liger`` / ``hf_liger_gc`` (``liger_kernel.transformers.
apply_liger_kernel_to_llama()`` before the model is built: fused RMSNorm, RoPE, SwiGLU and linear
cross-entropy; skipped, with the reason recorded, where ``liger_kernel`` does not import or there is no CUDA
device) and the nxd_lc configurations of :data:`NXD_IMPLS` (overrides of
``benchmarks.nxd_options.NXD_BEST``, built by ``build_nxd_model``: fp32 on CPU, then moved and cast). Those with
``activations_memory_budget`` get the plan nxd_lc chooses for each length (``memory_plan`` in the point): their model
is built again at each length, so its ``loss_first`` there is of the initial weights (``fresh_model``), not of the
weights after the earlier lengths' steps (at lr 1e-5 the difference is ~1e-5, far below the loss check's tolerance).
``nxd_at_baseline`` / ``nxd_at_baseline_compile`` (issue 41's acceptance) plan at each length under the ratio
baseline's measured peak there (``hf_liger_gc``; ``compare`` runs it first and passes its peaks) less their own
parameters, gradients and AdamW moments (:func:`static_bytes`); a length the baseline did not reach is
``no_baseline``, and without a baseline peak (CPU) they are skipped.

``compare`` runs the implementations one after another, each in its own process (``sys.executable -m
benchmarks.accel_step run ...``), under an overall time budget (``--time-budget-s``; an implementation is given
at most the remaining budget, or ``--impl-timeout-s``, and killed 20 s after that; the ones left when the budget
is spent are recorded as skipped), and writes one JSON (every implementation's points, device, dtype, versions,
git commit, the FLOPs formula, the ratios and the loss check) and a markdown table next to it (``.md``). The
ratios compare each nxd_lc configuration with ``hf_liger_gc`` (with ``hf_gc`` where Liger-Kernel did not run) at
each length, with whether nxd_lc's peak is at or below the baseline's. The loss check takes, at each length, the
largest ``|loss_first - loss_first of hf|`` over the implementations and flags it above 1e-2 (bf16) / 1e-3 (fp32).

Model FLOPs (:data:`FLOPS_FORMULA`, :func:`model_flops`): 6 x dense parameters x L (forward 2 + backward 4 per
parameter and token; dense = the matmul weights of the layers and the LM head, not the embedding lookup) + causal
attention 6 x layers x L^2 x H (QK^T and AV: 2 x 2 x L^2 x H forward, x 3 with backward, halved by the causal
mask). Recomputation is not counted: it is the model's work, not the hardware's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BASELINE_PEAK_BUDGET", "FLOPS_FORMULA", "LLAMA_1B_UNTIED", "NXD_IMPLS", "TINY", "all_impls",
           "baseline_budget", "baseline_peaks", "dense_params", "main", "model_flops", "static_bytes"]

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30

#: The Llama-3.2-1B shape with untied embeddings (1.50B parameters), as HF ``LlamaConfig`` keywords.
LLAMA_1B_UNTIED: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 262144,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
#: The tiny shape of CPU runs and the smoke test (everything else as :data:`LLAMA_1B_UNTIED`).
TINY: dict[str, Any] = {**LLAMA_1B_UNTIED, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}

#: transformers implementations: name -> (Liger-Kernel patch, gradient checkpointing). The order is the order
#: ``compare`` runs them in (the baselines first).
HF_IMPLS: dict[str, tuple[bool, bool]] = {
    "hf_liger_gc": (True, True),
    "hf_liger": (True, False),
    "hf_gc": (False, True),
    "hf": (False, False),
}

#: nxd_lc configurations: name -> ``opts`` of ``benchmarks.nxd_options.build_nxd_model`` (overrides of
#: ``NXD_BEST``; keys = ModelConfig field names + ``flash_attention``; ``"compile": True`` compiles each decoder
#: layer). Add entries here; ``compare`` runs them in this order after the transformers baselines.
#: no tiling by hand (the fused loss needs tiled_loss_chunk_size null); recomputation set per entry
_UNPLANNED: dict[str, Any] = {"tiled_mlp_chunk_size": None, "tiled_loss_chunk_size": None}
#: every memory key left to the budget's plan
_PLANNED: dict[str, Any] = {**_UNPLANNED, "activations_checkpoint_granularity": None}
NXD_IMPLS: dict[str, dict[str, Any]] = {
    # full recompute, tiled loss 1024, tiled MLP 4096, flash attention
    "nxd_best": {},
    "nxd_norecompute": {"activations_checkpoint_granularity": None, "tiled_mlp_chunk_size": None},
    "nxd_best_compile": {"compile": True},
    "nxd_norecompute_compile": {"activations_checkpoint_granularity": None, "tiled_mlp_chunk_size": None,
                                "compile": True},
    "nxd_full_untiled": {"tiled_mlp_chunk_size": None},
    "nxd_full_untiled_compile": {"tiled_mlp_chunk_size": None, "compile": True},
    # issue 27: fused kernels (model.fusions auto: Liger-Kernel on CUDA, the loss as its fused linear cross-entropy)
    "nxd_fused": {**_UNPLANNED, "activations_checkpoint_granularity": None},
    "nxd_fused_full": {**_UNPLANNED, "activations_checkpoint_granularity": "full"},
    # compiled layers (inductor fuses the in-layer ops; the loss stays Liger's) with full recomputation
    "nxd_fused_full_compile": {**_UNPLANNED, "activations_checkpoint_granularity": "full", "compile": True},
    # issue 41, item 3: the same, each compiled layer replayed as CUDA graphs (model.enable_cuda_graph)
    "nxd_fused_full_compile_cuda_graphs": {**_UNPLANNED, "activations_checkpoint_granularity": "full", "compile": True,
                                           "enable_cuda_graph": True},
    # memory plans chosen per length from a budget (a fraction of no recomputation's activations)
    "nxd_budget30_compile": {**_PLANNED, "activations_memory_budget": 0.3, "compile": True},
    "nxd_budget15": {**_PLANNED, "activations_memory_budget": 0.15},
    "nxd_budget_1gib": {**_PLANNED, "activations_memory_budget": "1GiB"},  # an absolute budget (also the smoke's)
    # the smallest plan: full recomputation, tiled MLP, layer inputs offloaded to host memory (longest sequence)
    "nxd_offload": {**_UNPLANNED, "activations_checkpoint_granularity": "full", "tiled_mlp_chunk_size": 4096,
                    "activations_offload": True},
    # issue 41, item 2: as nxd_offload, and the attention outputs go to the host too instead of being recomputed
    "nxd_offload_keep_attention": {**_UNPLANNED, "activations_checkpoint_granularity": "full",
                                   "tiled_mlp_chunk_size": 4096, "activations_checkpoint_save_attention": True,
                                   "activations_offload": True},
    # issue 41's acceptance: the plan chosen under the baseline's measured peak at each length, less this model's
    # parameters, gradients and AdamW state (BASELINE_PEAK_BUDGET)
    "nxd_at_baseline": {**_PLANNED, "activations_memory_budget": "baseline_peak"},
    "nxd_at_baseline_compile": {**_PLANNED, "activations_memory_budget": "baseline_peak", "compile": True},
}
#: the ``activations_memory_budget`` of a configuration whose budget at each length is the ratio baseline's
#: (:data:`RATIO_BASELINES`) measured peak there less :func:`static_bytes`; ``compare`` runs the baselines first
#: and passes their peaks (``run --baseline-peaks``)
BASELINE_PEAK_BUDGET = "baseline_peak"
#: Merged under every :data:`NXD_IMPLS` entry: a configuration runs eager unless it says ``"compile": True``
#: (``ModelConfig.compile`` may default to ``"auto"``, which would compile where the trainer would).
NXD_DEFAULTS: dict[str, Any] = {"compile": False}

SMOKE_IMPLS: tuple[str, ...] = ("hf", "hf_gc", "nxd_best", "nxd_norecompute", "nxd_budget_1gib")
SMOKE_LENS: tuple[int, ...] = (64, 128)
#: Device-run lengths (nxd_lc configurations also run :data:`NXD_EXTRA_LENS`).
DEFAULT_LENS: tuple[int, ...] = (4096, 16384, 65536, 131072)
NXD_EXTRA_LENS: tuple[int, ...] = (196608, 262144)
#: The reference of the loss check, first one with a loss at the length (all compute the same function).
LOSS_REFERENCES: tuple[str, ...] = ("hf", "hf_gc", "hf_liger", "hf_liger_gc")
#: The baseline of the ratios, first one that produced points.
RATIO_BASELINES: tuple[str, ...] = ("hf_liger_gc", "hf_gc")
LOSS_TOL: dict[str, float] = {"bfloat16": 1e-2, "float32": 1e-3}
TOKEN_SEED = 1
KILL_GRACE_S = 20.0  # a child is killed this long after its deadline (it stops by itself at the deadline)
MIN_IMPL_S = 15.0  # an implementation is not started with less budget than this left

FLOPS_FORMULA = ("model FLOPs of one [1, L] training step = 6 * dense_params * L + 6 * layers * L^2 * H; "
                 "dense_params = layers * (H*Hq + 2*H*Hkv + Hq*H + 3*H*F) + V*H (layer matmuls + LM head, no "
                 "embedding), Hq = heads*head_dim (= H), Hkv = kv_heads*head_dim; causal attention counts half of "
                 "12 * L^2 * H per layer (QK^T and AV, forward + backward); recomputation not counted; "
                 "model TFLOP/s = model FLOPs / best step seconds / 1e12")


# ------------------------------------------------------------------------------------------------------ FLOPs

def _head_dim(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def dense_params(cfg: Mapping[str, Any]) -> int:
    """Matmul parameters of the model (count): q, k, v, o and the SwiGLU MLP of every layer, plus the LM head;
    not the embedding (a lookup) nor the norms.

    Args:
        cfg: HF Llama config keys (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``, optional ``head_dim``).
    """
    h, f, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q_dim = cfg["num_attention_heads"] * _head_dim(cfg)
    kv_dim = cfg["num_key_value_heads"] * _head_dim(cfg)
    per_layer = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * f
    return layers * per_layer + vocab * h


def model_flops(cfg: Mapping[str, Any], seq_len: int) -> int:
    """Model FLOPs (floating-point operations, exact integer) of one training step on a ``[1, seq_len]``
    sequence: :data:`FLOPS_FORMULA`.

    Args:
        cfg: HF Llama config keys (see :func:`dense_params`).
        seq_len: tokens in the sequence (L).
    """
    q_dim = cfg["num_attention_heads"] * _head_dim(cfg)
    return 6 * dense_params(cfg) * seq_len + 6 * cfg["num_hidden_layers"] * seq_len * seq_len * q_dim


# ------------------------------------------------------------------------------------------- implementations

def all_impls() -> list[str]:
    """Every implementation name, in ``compare``'s default order: the transformers baselines, then nxd_lc's."""
    return [*HF_IMPLS, *NXD_IMPLS]


def nxd_opts(impl: str) -> dict[str, Any]:
    """The ``opts`` passed to ``build_nxd_model`` for the nxd_lc configuration ``impl``."""
    return {**NXD_DEFAULTS, **NXD_IMPLS[impl]}


def _liger_skip_reason(device_type: str) -> str | None:
    """Why Liger-Kernel cannot run here (None: it can)."""
    if device_type != "cuda":
        return "no CUDA device (Liger-Kernel's Triton kernels need one)"
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- any import failure means "not available"
        return f"liger_kernel does not import: {type(e).__name__}: {str(e)[:200]}"
    return None


def static_bytes(cfg: Mapping[str, Any], element_size: int) -> int:
    """Bytes of the parameters, their gradients and AdamW's two moments (all in the parameters' dtype, as the
    benchmark's ``torch.optim.AdamW`` keeps them): 4 x the parameters (the dense ones, the embedding, the norms) x
    ``element_size``: what a step holds besides its activations."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    params = dense_params(cfg) + cfg["vocab_size"] * h + (2 * layers + 1) * h
    return 4 * params * element_size


def baseline_budget(baseline_peak_gib: float, cfg: Mapping[str, Any], element_size: int) -> str | None:
    """The activation budget (``"<N>MiB"``) that puts a step at the baseline's peak: the peak less
    :func:`static_bytes`; None when that leaves nothing."""
    budget = baseline_peak_gib * GIB - static_bytes(cfg, element_size)
    return f"{int(budget // 2**20)}MiB" if budget >= 2**20 else None


def _at_baseline(impl: str) -> bool:
    """The implementation's budget is the baseline's peak (:data:`BASELINE_PEAK_BUDGET`)."""
    return impl in NXD_IMPLS and nxd_opts(impl).get("activations_memory_budget") == BASELINE_PEAK_BUDGET


def _planned(impl: str) -> bool:
    """The implementation's memory keys come from a budget: its model is built again for each length."""
    return impl in NXD_IMPLS and nxd_opts(impl).get("activations_memory_budget") is not None


def _build(impl: str, hf_dir: str, device: Any, dtype: Any, seq_len: int | None = None,
           budget: str | None = None) -> Any:
    """The model of ``impl`` on ``device`` in ``dtype``, in train mode (``seq_len``: the length a budget plans
    for; ``budget``: the ``activations_memory_budget`` of a :data:`BASELINE_PEAK_BUDGET` configuration there)."""
    if impl in HF_IMPLS:
        liger, checkpointing = HF_IMPLS[impl]
        from transformers import LlamaForCausalLM

        if liger:
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama()
        model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=dtype)
        model.config.use_cache = False
        if checkpointing:
            model.gradient_checkpointing_enable()
        return model.to(device).train()
    from benchmarks.nxd_options import build_nxd_model

    opts = nxd_opts(impl)
    if _at_baseline(impl):
        if budget is None:
            raise ValueError(f"{impl}: its budget is the baseline's peak less the static bytes, and none was given")
        opts = {**opts, "activations_memory_budget": budget}
    model = build_nxd_model(hf_dir, opts, accelerator="gpu" if device.type == "cuda" else "cpu",
                            tokens=seq_len, element_size=dtype.itemsize)  # fp32 on CPU
    model = model.to(device=device, dtype=dtype)
    return model.train()


def _step_fn(impl: str, model: Any, opt: Any) -> Callable[[Any], Any]:
    """One training step on ``tokens`` [L + 1] (int64, on the model's device); returns the detached loss."""
    import torch

    cuda_graphs = impl in NXD_IMPLS and bool(nxd_opts(impl).get("enable_cuda_graph"))

    def step(tokens: torch.Tensor) -> torch.Tensor:
        if cuda_graphs:  # as the trainer's training_step: the last step's replayed outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        seq_len = tokens.numel() - 1
        ids = tokens[:seq_len].unsqueeze(0)
        pos = torch.arange(seq_len, device=ids.device).unsqueeze(0)
        if impl in HF_IMPLS:  # transformers shifts the labels itself (no target at the last position)
            loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
        else:
            labels = tokens[1:].unsqueeze(0).clone()
            labels[:, -1] = -100  # the same L - 1 targets as transformers
            loss_sum, num_tokens = model.loss(ids, labels, pos)
            loss = loss_sum / num_tokens
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def tokens_for(seq_len: int, vocab_size: int) -> Any:
    """The ``[seq_len + 1]`` int64 CPU tokens of length ``seq_len`` (the same for every implementation)."""
    import torch

    gen = torch.Generator().manual_seed(TOKEN_SEED + seq_len)
    return torch.randint(0, vocab_size, (seq_len + 1,), generator=gen, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------- prepare

def prepare(hf_dir: str, tiny: bool = False) -> dict[str, Any]:
    """Save seed-0 HF ``LlamaForCausalLM`` weights (bf16) of :data:`LLAMA_1B_UNTIED` (or :data:`TINY`) to
    ``hf_dir``; initialised on CUDA when there is a device (fast), else on CPU.

    Returns:
        ``{"hf_dir", "params" (count), "init_device", "seconds"}``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    init_device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(init_device):
        model = LlamaForCausalLM(LlamaConfig(**(TINY if tiny else LLAMA_1B_UNTIED))).to(torch.bfloat16)
    model.save_pretrained(hf_dir)
    info = {"hf_dir": hf_dir, "params": sum(p.numel() for p in model.parameters()), "init_device": init_device,
            "seconds": time.perf_counter() - t0}
    print(f"prepare: {info['params']:,} parameters saved to {hf_dir} in {info['seconds']:.1f} s", flush=True)
    return info


# -------------------------------------------------------------------------------------------------------- run

def _versions() -> dict[str, str | None]:
    """Package versions from their metadata (nothing imported)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "liger-kernel", "triton"):
        try:
            out[name.replace("-", "_")] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name.replace("-", "_")] = None
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _predicted_s(last: Mapping[str, Any], seq_len: int, steps: int) -> float:
    """Seconds the next length's warm-up + timed steps should take at most: the last length's best step scaled
    quadratically in L, plus its one-off warm-up overhead (compilation)."""
    scale = (seq_len / last["seq_len"]) ** 2
    return (steps + 1) * last["best_step_s"] * scale + max(0.0, last["warmup_s"] - last["best_step_s"])


def run_impl(impl: str, hf_dir: str, lens: Sequence[int], steps: int, out: str, device_choice: str = "auto",
             dtype_choice: str = "auto", deadline_s: float | None = None,
             baseline_peaks: Mapping[int, float] | None = None) -> dict[str, Any]:
    """Measure ``impl`` at ``lens`` (ascending) in this process; the result is rewritten to ``out`` after each
    point (see the module docstring for what a point holds).

    Args:
        impl: a name of :func:`all_impls`.
        hf_dir: the ``prepare`` directory.
        lens: sequence lengths in tokens.
        steps: timed steps per length (after one warm-up step).
        out: result JSON path.
        device_choice: ``auto`` (CUDA when available), ``cuda`` or ``cpu``.
        dtype_choice: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16`` or ``fp32``.
        deadline_s: seconds from the start of this call after which no length is started whose predicted time
            would overrun it (None: no deadline).
        baseline_peaks: for a :data:`BASELINE_PEAK_BUDGET` configuration, the baseline's peak allocated GiB per
            length; a length without one is recorded as ``no_baseline`` (the baseline did not run it: out of
            memory, or no CUDA), one whose peak leaves no activation budget as ``no_plan``.

    Returns:
        The result dict (also in ``out``).
    """
    t_start = time.monotonic()
    if impl not in HF_IMPLS and impl not in NXD_IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(all_impls())}")
    import torch

    device = torch.device("cuda" if device_choice == "auto" and torch.cuda.is_available() else
                          "cpu" if device_choice == "auto" else device_choice)
    if dtype_choice == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_choice]
    cuda = device.type == "cuda"
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    result: dict[str, Any] = {
        "impl": impl, "kind": "hf" if impl in HF_IMPLS else "nxd_lc",
        "options": ({"liger": HF_IMPLS[impl][0], "gradient_checkpointing": HF_IMPLS[impl][1]} if impl in HF_IMPLS
                    else {"nxd_opts": nxd_opts(impl)}),
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({_cpu_name()}, {os.cpu_count()} cores)",
        "device_type": device.type, "cuda": torch.version.cuda, "dtype": str(dtype).removeprefix("torch."),
        "steps": steps, "lens": list(lens), "versions": _versions(), "flops_formula": FLOPS_FORMULA,
        "dense_params": dense_params(cfg), "points": [],
    }
    if impl in HF_IMPLS and HF_IMPLS[impl][0]:
        reason = _liger_skip_reason(device.type)
        if reason:
            result["skipped"] = reason
            _write_json(out, result)
            print(f"{impl}: skipped: {reason}", flush=True)
            return result

    t0 = time.perf_counter()
    model: Any = None
    opt: Any = None
    step: Any = None
    try:
        if not _planned(impl):  # a planned configuration is built at each length, in the loop below
            model = _build(impl, hf_dir, device, dtype, None)
    except Exception as e:  # noqa: BLE001 -- recorded, not raised: the comparison goes on
        result["build_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        result["traceback"] = traceback.format_exc()[-3000:]
        _write_json(out, result)
        print(f"{impl}: build failed: {result['build_error']}", flush=True)
        return result
    if model is not None:
        result["build_s"] = time.perf_counter() - t0
        result["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=cuda)
        step = _step_fn(impl, model, opt)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    last_ok: dict[str, Any] | None = None
    for seq_len in sorted(lens):
        point: dict[str, Any] = {"seq_len": seq_len}
        if deadline_s is not None and last_ok is not None:
            predicted = _predicted_s(last_ok, seq_len, steps)
            if time.monotonic() - t_start + predicted > deadline_s:
                point.update(status="skipped_time", predicted_s=predicted)
                result["points"].append(point)
                _write_json(out, result)
                print(json.dumps(point), flush=True)
                break
        budget = None
        if _at_baseline(impl):
            peak = (baseline_peaks or {}).get(seq_len)
            budget = None if peak is None else baseline_budget(peak, cfg, dtype.itemsize)
            if budget is None:
                point.update(status="no_baseline" if peak is None else "no_plan", baseline_peak_gib=peak)
                result["points"].append(point)
                _write_json(out, result)
                print(json.dumps(point), flush=True)
                continue
            point.update(baseline_peak_gib=peak, budget=budget)
        if _planned(impl):  # the plan of this length: a new model
            model = opt = step = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            try:
                t0 = time.perf_counter()
                model = _build(impl, hf_dir, device, dtype, seq_len, budget)
            except Exception as e:  # noqa: BLE001 -- recorded, not raised: the comparison goes on
                # a fractional budget can be below every plan at one length and above one at a longer length
                # (the fixed terms weigh less there): that length is recorded as no_plan and the next one tried
                no_plan = isinstance(e, ValueError) and "below the smallest plan" in str(e)
                point.update(status="no_plan" if no_plan else "error", error=f"{type(e).__name__}: {str(e)[:500]}")
                result["points"].append(point)
                _write_json(out, result)
                print(json.dumps(point), flush=True)
                if no_plan:
                    continue
                break
            result.setdefault("build_s", time.perf_counter() - t0)
            result.setdefault("params", sum(p.numel() for p in model.parameters()))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=cuda)
            step = _step_fn(impl, model, opt)
            point["fresh_model"] = True  # its loss is of the initial weights, not after the earlier lengths' steps
        try:
            plan = getattr(model, "memory_plan", None)
            if plan is not None:
                point["memory_plan"] = plan.name
                point["memory_plan_estimate_gib"] = plan.estimate_bytes / GIB
            tokens = tokens_for(seq_len, cfg["vocab_size"]).to(device)
            sync()
            t0 = time.perf_counter()
            loss = step(tokens)
            sync()
            point["warmup_s"] = time.perf_counter() - t0
            point["loss_first"] = float(loss)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(steps):
                sync()
                t0 = time.perf_counter()
                loss = step(tokens)
                sync()
                times.append(time.perf_counter() - t0)
            point["loss_last"] = float(loss)
            point["step_s"] = times
            best = min(times) if times else point["warmup_s"]
            flops = model_flops(cfg, seq_len)
            point.update(best_step_s=best, tokens_per_s=seq_len / best, model_flops=flops,
                         model_tflops=flops / best / 1e12)
            point["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
            point["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB if cuda else None
            point["status"] = "ok"
        except (torch.OutOfMemoryError, MemoryError) as e:
            point["status"] = "oom"
            point["error"] = (str(e).splitlines() or [type(e).__name__])[0][:300]
        except Exception as e:  # noqa: BLE001 -- recorded; ends this implementation's list
            point["status"] = "error"
            point["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            point["traceback"] = traceback.format_exc()[-3000:]
        result["points"].append(point)
        _write_json(out, result)
        print(json.dumps({k: v for k, v in point.items() if k != "traceback"}), flush=True)
        if point["status"] != "ok":
            break
        last_ok = point
        del tokens
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    result["wall_s"] = time.monotonic() - t_start
    _write_json(out, result)
    return result


# ------------------------------------------------------------------------------------------------ compare

def git_commit(root: Path = ROOT) -> str | None:
    """The checked-out commit, read from ``.git`` (no git process); None outside a git checkout."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        common = git / (git / "commondir").read_text().strip() if (git / "commondir").is_file() else git
        for base in (git, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        return None
    return None


def _run_child(argv: list[str], timeout_s: float | None) -> tuple[int | None, str]:
    """Run ``python -m benchmarks.accel_step <argv>`` from the repository root (its stdout shared with ours, its
    stderr captured), killing its process group ``timeout_s`` seconds in (None: no limit).

    Returns:
        (return code, None when killed; stderr).
    """
    sys.stdout.flush()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.accel_step", *argv], cwd=str(ROOT),
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return None, stderr


def _impl_status(entry: Mapping[str, Any]) -> str:
    """One word for an implementation's outcome."""
    if entry.get("skipped"):
        return "skipped"
    if entry.get("build_error"):
        return "build_error"
    if entry.get("killed"):
        return "timeout"
    if entry.get("returncode") not in (0, None):
        return "crashed"
    return _ending_status(entry) or "ok"


def _ending_status(entry: Mapping[str, Any]) -> str | None:
    """The status of the point that ended an implementation's lengths early (oom, error, skipped_time, ...), or
    None when its last point is ``ok``, ``no_plan`` or ``no_baseline`` (after which the next length is tried) or it
    has none."""
    points = entry.get("points", [])
    status = points[-1]["status"] if points else None
    return None if status in (None, "ok", "no_plan", "no_baseline") else status


def compare(hf_dir: str, lens: Sequence[int], impls: Sequence[str], out: str, steps: int = 2,
            nxd_extra_lens: Sequence[int] = (), time_budget_s: float | None = None,
            impl_timeout_s: float | None = None, device_choice: str = "auto",
            dtype_choice: str = "auto") -> dict[str, Any]:
    """Run every implementation of ``impls`` in its own process, one after another, and write the combined JSON
    to ``out`` and its markdown table to ``out`` with suffix ``.md``.

    Args:
        hf_dir: the ``prepare`` directory.
        lens: sequence lengths (tokens) of every implementation.
        impls: implementation names, in run order.
        out: result JSON path.
        steps: timed steps per length.
        nxd_extra_lens: further lengths (tokens) for the nxd_lc configurations only.
        time_budget_s: overall budget in seconds (None: unlimited); implementations that would start with less
            than :data:`MIN_IMPL_S` + :data:`KILL_GRACE_S` left are skipped and recorded.
        impl_timeout_s: at most this many seconds per implementation (None: the remaining budget).
        device_choice, dtype_choice: as :func:`run_impl`.

    Returns:
        The combined result.
    """
    unknown = [i for i in impls if i not in HF_IMPLS and i not in NXD_IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {', '.join(all_impls())}")
    t_start = time.monotonic()
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    result: dict[str, Any] = {
        "benchmark": "accel_step", "created": stamp, "hf_dir": hf_dir, "device": None, "dtype": None,
        "model": {k: cfg[k] for k in (*LLAMA_1B_UNTIED, "head_dim", "rope_parameters") if k in cfg},
        "dense_params": dense_params(cfg),
        "lens": list(lens), "nxd_extra_lens": list(nxd_extra_lens), "steps": steps, "impl_order": list(impls),
        "time_budget_s": time_budget_s, "impl_timeout_s": impl_timeout_s, "versions": _versions(),
        "git_commit": git_commit(), "hostname": platform.node(), "flops_formula": FLOPS_FORMULA,
        "token_seed": f"torch.Generator().manual_seed({TOKEN_SEED} + L), CPU", "impls": {},
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="accel_step_") as tmp:
        for impl in impls:
            impl_lens = sorted(set(lens) | (set(nxd_extra_lens) if impl in NXD_IMPLS else set()))
            elapsed = time.monotonic() - t_start
            remaining = None if time_budget_s is None else time_budget_s - elapsed
            if remaining is not None and remaining < MIN_IMPL_S + KILL_GRACE_S:
                result["impls"][impl] = {"points": [], "skipped": (
                    f"time budget spent: {remaining:.0f} s of {time_budget_s:.0f} s left, less than the "
                    f"{MIN_IMPL_S + KILL_GRACE_S:.0f} s an implementation is started with")}
                print(f"== {impl}: skipped (time budget spent)", flush=True)
                continue
            if impl in HF_IMPLS and HF_IMPLS[impl][0] and importlib.util.find_spec("liger_kernel") is None:
                result["impls"][impl] = {"skipped": "liger_kernel is not installed", "points": []}
                print(f"== {impl}: skipped (liger_kernel is not installed)", flush=True)
                continue
            limits = [x for x in (None if remaining is None else remaining - KILL_GRACE_S, impl_timeout_s)
                      if x is not None]
            allotted = min(limits) if limits else None
            child_out = os.path.join(tmp, f"{impl}.json")
            argv = ["run", "--impl", impl, "--hf-dir", hf_dir, "--lens", ",".join(map(str, impl_lens)),
                    "--steps", str(steps), "--out", child_out, "--device", device_choice, "--dtype", dtype_choice]
            if allotted is not None:
                argv += ["--deadline-s", f"{allotted:.1f}"]
            if _at_baseline(impl):
                peaks = baseline_peaks(result)
                if not peaks:
                    result["impls"][impl] = {"points": [], "skipped": (
                        f"no baseline peak to plan under: none of {', '.join(RATIO_BASELINES)} ran before it with a "
                        "measured peak (CUDA only)")}
                    print(f"== {impl}: skipped (no baseline peak)", flush=True)
                    continue
                argv += ["--baseline-peaks", ",".join(f"{n}:{g:.4f}" for n, g in sorted(peaks.items()))]
            print(f"== {impl}: lengths {impl_lens}" + (f", {allotted:.0f} s allotted" if allotted else ""),
                  flush=True)
            t0 = time.monotonic()
            rc, stderr = _run_child(argv, allotted + KILL_GRACE_S if allotted is not None else None)
            sys.stderr.write(stderr[-3000:])
            entry: dict[str, Any] = {"points": []}
            if os.path.exists(child_out):
                with open(child_out) as f:
                    entry = json.load(f)
            entry["returncode"] = rc
            entry["process_s"] = time.monotonic() - t0
            if rc is None:
                entry["killed"] = f"killed after {allotted + KILL_GRACE_S:.0f} s"
                done = {p["seq_len"] for p in entry.get("points", [])}
                pending = [n for n in impl_lens if n not in done]
                if pending and _ending_status(entry) is None:
                    entry["points"].append({"seq_len": pending[0], "status": "timeout"})
            if rc != 0:
                entry["stderr_tail"] = stderr[-3000:]
            entry["status"] = _impl_status(entry)
            result["impls"][impl] = entry
            for key in ("device", "dtype"):
                if result[key] is None and entry.get(key):
                    result[key] = entry[key]
            _write_json(out, result)
    result["wall_s"] = time.monotonic() - t_start
    result["ratio_baseline"], result["ratios"] = ratios(result)
    result["loss_agreement"] = loss_agreement(result)
    _write_json(out, result)
    md = markdown(result)
    Path(out).with_suffix(".md").write_text(md)
    print(md, flush=True)
    return result


# -------------------------------------------------------------------------------------------------- analysis

def _ok_points(result: Mapping[str, Any], impl: str) -> dict[int, dict[str, Any]]:
    entry = result["impls"].get(impl, {})
    return {p["seq_len"]: p for p in entry.get("points", []) if p.get("status") == "ok"}


def baseline_peaks(result: Mapping[str, Any]) -> dict[int, float]:
    """``{length: peak allocated GiB}`` of the ratio baseline (:data:`RATIO_BASELINES`, the first with points that
    have a measured peak) in a comparison so far; empty when none has."""
    for name in RATIO_BASELINES:
        peaks = {n: p["peak_allocated_gib"] for n, p in _ok_points(result, name).items()
                 if p.get("peak_allocated_gib") is not None}
        if peaks:
            return peaks
    return {}


def ratios(result: Mapping[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
    """(baseline name, rows): each nxd_lc configuration against the baseline (:data:`RATIO_BASELINES`, the
    first with points) at each length both ran; ``at_or_below_baseline_peak`` is None where there is no peak
    (CPU). A length the baseline did not reach is listed with its status."""
    baseline = next((b for b in RATIO_BASELINES if _ok_points(result, b)), None)
    if baseline is None:
        return None, []
    base = _ok_points(result, baseline)
    base_all = {p["seq_len"]: p for p in result["impls"][baseline].get("points", [])}
    rows = []
    for impl in result["impls"]:
        if impl not in NXD_IMPLS:
            continue
        for seq_len, p in sorted(_ok_points(result, impl).items()):
            row: dict[str, Any] = {"impl": impl, "seq_len": seq_len, "baseline": baseline}
            b = base.get(seq_len)
            if b is None:
                row["baseline_status"] = base_all.get(seq_len, {}).get("status", "not run")
                rows.append(row)
                continue
            row["tokens_per_s_ratio"] = p["tokens_per_s"] / b["tokens_per_s"]
            if p.get("peak_allocated_gib") is not None and b.get("peak_allocated_gib"):
                row["peak_ratio"] = p["peak_allocated_gib"] / b["peak_allocated_gib"]
                row["at_or_below_baseline_peak"] = p["peak_allocated_gib"] <= b["peak_allocated_gib"]
            else:
                row["peak_ratio"] = row["at_or_below_baseline_peak"] = None
            rows.append(row)
    return baseline, rows


def loss_agreement(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """At each length: the largest ``|loss_first - reference loss_first|`` over the implementations with a
    loss there (the reference: the first of :data:`LOSS_REFERENCES` with one), flagged above the dtype's
    tolerance (:data:`LOSS_TOL`)."""
    tol = LOSS_TOL.get(result.get("dtype") or "bfloat16", 1e-2)
    lengths = sorted({n for impl in result["impls"] for n in _ok_points(result, impl)})
    rows = []
    for seq_len in lengths:
        losses = {impl: _ok_points(result, impl)[seq_len]["loss_first"] for impl in result["impls"]
                  if seq_len in _ok_points(result, impl)}
        ref = next((r for r in LOSS_REFERENCES if r in losses), None)
        if ref is None or len(losses) < 2:
            rows.append({"seq_len": seq_len, "reference": ref, "max_abs_diff": None, "worst_impl": None,
                         "tol": tol, "flagged": False, "n_impls": len(losses)})
            continue
        worst = max((i for i in losses if i != ref), key=lambda i: abs(losses[i] - losses[ref]))
        diff = abs(losses[worst] - losses[ref])
        rows.append({"seq_len": seq_len, "reference": ref, "reference_loss": losses[ref], "max_abs_diff": diff,
                     "worst_impl": worst, "tol": tol, "flagged": diff > tol, "n_impls": len(losses)})
    return rows


def _cell(entry: Mapping[str, Any], seq_len: int, fmt: Callable[[dict[str, Any]], str]) -> str:
    for p in entry.get("points", []):
        if p["seq_len"] == seq_len:
            if p["status"] == "ok":
                return fmt(p)
            return {"oom": "OOM", "error": "error", "skipped_time": "time", "timeout": "timeout",
                    "no_plan": "no plan", "no_baseline": "no baseline"}.get(
                p["status"], p["status"])
    return "-"


def _shape(model: Mapping[str, Any]) -> str:
    """A config's shape in one line."""
    rope = (model.get("rope_parameters") or {}).get("rope_theta", model.get("rope_theta"))
    return (f"vocab {model.get('vocab_size')}, hidden {model.get('hidden_size')}, FFN {model.get('intermediate_size')}"
            f", {model.get('num_hidden_layers')} layers, {model.get('num_attention_heads')}/"
            f"{model.get('num_key_value_heads')} heads, rope_theta {rope}, tied embeddings "
            f"{model.get('tie_word_embeddings')}")


def _len_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def markdown(result: Mapping[str, Any]) -> str:
    """The report: tokens/s, model TFLOP/s, peak GiB and warm-up seconds per length and implementation; nxd_lc's
    ratios to the baseline; the loss check; what was skipped."""
    impls = list(result["impls"])
    lengths = sorted({p["seq_len"] for e in result["impls"].values() for p in e.get("points", [])}
                     | set(result["lens"]))
    v = result["versions"]
    lines = [f"# accel_step: one training step, nxd_lc vs transformers ({result['created']})", "",
             f"- device: {result.get('device')}, dtype {result.get('dtype')}, {result['steps']} timed step(s) "
             f"after one warm-up step per length, best reported",
             f"- torch {v.get('torch')}, transformers {v.get('transformers')}, liger-kernel "
             f"{v.get('liger_kernel') or 'not installed'}, git commit {result.get('git_commit') or 'unknown'}",
             f"- model: {_shape(result['model'])}; {result['dense_params']:,} dense parameters",
             f"- {result['flops_formula']}",
             "- cells: OOM = out of memory; time = skipped, predicted to overrun the time budget; timeout = "
             "killed at the budget; error = see the JSON; - = not run", ""]

    def table(title: str, fmt: Callable[[dict[str, Any]], str]) -> None:
        lines.extend([f"## {title}", "", "| impl | " + " | ".join(_len_label(n) for n in lengths) + " |",
                      "|---|" + "---|" * len(lengths)])
        for impl in impls:
            entry = result["impls"][impl]
            cells = [_cell(entry, n, fmt) for n in lengths]
            if entry.get("skipped") or entry.get("build_error"):
                cells = [f"skipped: {entry.get('skipped') or entry.get('build_error')}"] + [""] * (len(lengths) - 1)
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        lines.append("")

    table("tokens/s", lambda p: f"{p['tokens_per_s']:,.0f}")
    table("model TFLOP/s", lambda p: f"{p['model_tflops']:.3g}")
    table("peak allocated GiB (reserved)", lambda p: "n/a" if p.get("peak_allocated_gib") is None
          else f"{p['peak_allocated_gib']:.1f} ({p['peak_reserved_gib']:.1f})")
    table("warm-up step s (compile time for compiled configurations)", lambda p: f"{p['warmup_s']:.2f}")

    baseline = result.get("ratio_baseline")
    lines.append(f"## nxd_lc vs {baseline or '(no baseline ran)'}")
    lines.append("")
    if baseline:
        lines += ["| impl | L | tokens/s ratio | peak ratio | at <= baseline peak memory |", "|---|---|---|---|---|"]
        for r in result["ratios"]:
            if "tokens_per_s_ratio" not in r:
                lines.append(f"| {r['impl']} | {_len_label(r['seq_len'])} | baseline {r['baseline_status']} | - | "
                             f"{'yes' if r['baseline_status'] == 'oom' else '-'} |")
                continue
            peak = "n/a" if r["peak_ratio"] is None else f"{r['peak_ratio']:.2f}"
            at = "n/a" if r["at_or_below_baseline_peak"] is None else (
                "yes" if r["at_or_below_baseline_peak"] else "no")
            lines.append(f"| {r['impl']} | {_len_label(r['seq_len'])} | {r['tokens_per_s_ratio']:.2f}x | {peak} | "
                         f"{at} |")
        lines.append("")
    lines += ["## loss agreement (loss of the first step at each length)", "",
              "| L | reference | reference loss | max abs diff | implementation | flagged |",
              "|---|---|---|---|---|---|"]
    for r in result["loss_agreement"]:
        if r["max_abs_diff"] is None:
            lines.append(f"| {_len_label(r['seq_len'])} | {r['reference'] or '-'} | - | - | - | - |")
            continue
        flag = f"**yes** (> {r['tol']:g})" if r["flagged"] else f"no (<= {r['tol']:g})"
        lines.append(f"| {_len_label(r['seq_len'])} | {r['reference']} | {r['reference_loss']:.5f} | "
                     f"{r['max_abs_diff']:.2e} | {r['worst_impl']} | {flag} |")
    lines.append("")
    notes = [f"- {impl}: {entry.get('status') or _impl_status(entry)}"
             + (f" ({entry['skipped']})" if entry.get("skipped") else "")
             + (f" ({entry['killed']})" if entry.get("killed") else "")
             + (f" ({entry['build_error']})" if entry.get("build_error") else "")
             for impl, entry in result["impls"].items()]
    lines += ["## implementations", "", *notes, ""]
    if result.get("wall_s") is not None:
        lines.append(f"Comparison wall time: {result['wall_s']:.0f} s.")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------- main

def _lens(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accel_step", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: hf, hf_gc, nxd_best, nxd_norecompute "
                   "at 64, 128 tokens (< 1 min)")
    p.add_argument("--out", dest="smoke_out", help="--smoke: result JSON path (default: a temporary directory)")
    sub = p.add_subparsers(dest="cmd")
    pp = sub.add_parser("prepare", help="save seed-0 bf16 HF weights")
    pp.add_argument("--hf-dir", required=True)
    pp.add_argument("--tiny", action="store_true", help="the tiny shape (CPU runs)")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--hf-dir", required=True)
        sp.add_argument("--lens", default=",".join(map(str, DEFAULT_LENS)), help="comma-separated tokens")
        sp.add_argument("--steps", type=int, default=2, help="timed steps per length (after one warm-up step)")
        sp.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
        sp.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: bf16 on CUDA, fp32 on CPU")

    rp = sub.add_parser("run", help="one implementation in this process")
    common(rp)
    rp.add_argument("--impl", required=True, choices=all_impls())
    rp.add_argument("--out", required=True, help="result JSON path")
    rp.add_argument("--deadline-s", type=float, help="start no length predicted to end after this many seconds")
    rp.add_argument("--baseline-peaks", default="", help="L:GiB,... the baseline's peaks (nxd_at_baseline*)")
    cp = sub.add_parser("compare", help="every implementation, each in its own process")
    common(cp)
    cp.add_argument("--impls", default=",".join(all_impls()), help="comma-separated, in run order")
    cp.add_argument("--nxd-extra-lens", default="", help="further lengths for the nxd_lc configurations only")
    cp.add_argument("--time-budget-s", type=float, help="overall seconds; the implementations left are skipped")
    cp.add_argument("--impl-timeout-s", type=float, help="at most this many seconds per implementation")
    cp.add_argument("--out", help="result JSON (default benchmarks/results/accel_step_<timestamp>.json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point (see the module docstring). Returns the exit status."""
    args = _parser().parse_args(argv)
    if args.smoke:
        out = args.smoke_out or os.path.join(tempfile.mkdtemp(prefix="accel_step_smoke_"), "accel_step_smoke.json")
        with tempfile.TemporaryDirectory(prefix="accel_step_hf_") as hf_dir:
            prepare(hf_dir, tiny=True)
            compare(hf_dir, SMOKE_LENS, SMOKE_IMPLS, out, steps=1, device_choice="cpu", dtype_choice="fp32")
        print(f"written {out} and {Path(out).with_suffix('.md')}")
        return 0
    if args.cmd == "prepare":
        prepare(args.hf_dir, tiny=args.tiny)
    elif args.cmd == "run":
        peaks = {int(n): float(g) for n, g in (x.split(":") for x in args.baseline_peaks.split(",") if x.strip())}
        run_impl(args.impl, args.hf_dir, _lens(args.lens), args.steps, args.out, args.device, args.dtype,
                 args.deadline_s, peaks)
    elif args.cmd == "compare":
        stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
        out = args.out or str(ROOT / "benchmarks" / "results" / f"accel_step_{stamp}.json")
        compare(args.hf_dir, _lens(args.lens), [i for i in args.impls.split(",") if i], out, steps=args.steps,
                nxd_extra_lens=_lens(args.nxd_extra_lens), time_budget_s=args.time_budget_s,
                impl_timeout_s=args.impl_timeout_s, device_choice=args.device, dtype_choice=args.dtype)
        print(f"written {out} and {Path(out).with_suffix('.md')}")
    else:
        _parser().print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
