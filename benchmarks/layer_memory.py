"""Bytes a decoder layer keeps from forward to backward, and the step's peak, eager against ``model.compile``, on CPU.

Issue 41, item 1: on the H200 the compiled layers with full recomputation peaked at 26.2 GiB at 64k where the same
configuration in eager peaked at 20.0 GiB (``docs/experiments/accel_step.md``). This measures, without a GPU, what
inductor's partitioner makes a compiled, checkpointed layer keep, against eager nxd_lc with the same weights:

* **kept per layer**: the host bytes alive after the forward (loss computed, backward not started) with 4 decoder
  layers minus those with 2, halved, so that the embedding, the head, the loss and the batch cancel out;
* **peak**: the highest bytes alive during forward + backward, above those alive before the step (parameters and
  their gradients already allocated by a warm-up step), with 4 layers;
* the loss and every gradient of the compiled model against the eager one (the same seed-0 weights).

Memory is counted by ``benchmarks/malloc_peak.c``, an ``LD_PRELOAD`` interposer of the C allocator (built here with
``cc``): every tensor storage of torch's CPU allocator and of inductor's generated kernels goes through it; blocks
under 64 KiB (the interpreter's objects) are left out, which is why the layer shape is chosen so that a
``[S, H]`` activation is 2 MiB. Each measured step follows two warm-up steps (compilation; one-off allocations of
the math libraries). The command re-executes itself with the interposer loaded when it is not.

Plans measured (:mod:`nxd_lc.models.common.memory_plan`'s names): ``full`` (each layer recomputed),
``full_save_attention`` (the attention kernel's outputs kept), ``full_tiled_mlp`` (tiled MLP, 512 tokens),
``none``. Expected by hand for the fp32 layer below (``[S, H]`` = S x H x 4 bytes): ``full`` keeps the layer input,
1.00 ``[S, H]``; ``full_save_attention`` the input, the attention output (``Hq = H``) and its log-sum-exp
(``heads x S x 4`` bytes = 0.03 ``[S, H]``), 2.03 ``[S, H]``.

``--device cuda`` (run by ``benchmarks/device/accel_step.sh`` on a lent GPU) measures the same on CUDA, with
``torch.cuda.memory_allocated`` / ``max_memory_allocated`` as the counters, in bf16, the Llama-3.2-1B layer
shape (:data:`CUDA_SHAPE`) and the kernels the accelerator step uses: eager layers with Liger-Kernel's fused
norm, RoPE and SwiGLU (``model.fusions`` auto on ``gpu``), compiled layers with plain torch ops for inductor. That
is the comparison the H200 gap is between (``nxd_fused_full`` against ``nxd_fused_full_compile``); the unit
``[S, H]`` is then S x H x 2 bytes.

Usage::

    .venv/bin/python -m benchmarks.layer_memory                      # S 2048, every plan, writes results/
    .venv/bin/python -m benchmarks.layer_memory --plans full --out x.json
    python -m benchmarks.layer_memory --device cuda --seq 16384 --plans full,full_save_attention
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(__file__).with_name("malloc_peak.c")
PLANS = ("full", "full_save_attention", "full_tiled_mlp", "none")
#: the layer: hidden 256, 8 query / 2 KV heads, SwiGLU 688, vocabulary 512, fp32
SHAPE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
         "num_key_value_heads": 2, "tie_word_embeddings": False}
#: --device cuda: the Llama-3.2-1B layer (hidden 2048, 32 / 8 heads, SwiGLU 8192), a small vocabulary, bf16
CUDA_SHAPE = {"vocab_size": 512, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
              "num_key_value_heads": 8, "tie_word_embeddings": False}
_PRELOADED = "NXD_LC_LAYER_MEMORY_PRELOADED"


def _shape(device: str) -> dict[str, Any]:
    """The layer shape measured on ``device``: :data:`CUDA_SHAPE` on ``cuda``, else :data:`SHAPE`."""
    return CUDA_SHAPE if device == "cuda" else SHAPE


def interposer_path() -> Path:
    """Build ``malloc_peak.c`` into a shared library (once per source content) and return its path.

    Raises:
        RuntimeError: no C compiler (``cc``) on PATH, or the build failed (its output in the message).
    """
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("benchmarks.layer_memory: needs a C compiler (cc) to build benchmarks/malloc_peak.c")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"nxd_lc_malloc_peak_{digest}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.so")
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"benchmarks.layer_memory: building {SOURCE} failed:\n{done.stderr}")
        os.replace(tmp, out)  # atomic: concurrent builders leave one complete library
    return out


def _counters(device: str = "cpu") -> tuple[Any, Any, Any]:
    """The ``(current, reset_peak, peak)`` byte counters: the interposer's on CPU, the CUDA caching allocator's
    (``memory_allocated``; ``reset_peak`` returns the bytes allocated then) on ``cuda``.

    Raises:
        RuntimeError: on CPU, the interposer is not loaded.
    """
    if device == "cuda":
        import torch

        def reset_peak() -> int:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()

        def current() -> int:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()

        return current, reset_peak, torch.cuda.max_memory_allocated
    lib = ctypes.CDLL(None)
    try:
        counters = lib.memtrack_current, lib.memtrack_reset_peak, lib.memtrack_peak
    except AttributeError as e:
        raise RuntimeError("benchmarks.layer_memory: the malloc interposer is not loaded (run through main(), "
                           "which sets LD_PRELOAD)") from e
    for f in counters:
        f.restype = ctypes.c_longlong
    return counters


def _build(layers: int, plan: str, compiled: bool, seq: int, device: str = "cpu") -> Any:
    import torch
    from transformers import LlamaConfig

    from nxd_lc.layers.fusions import resolve_fusions
    from nxd_lc.models.common.checkpointing import apply_activation_checkpointing, apply_tiled_mlp
    from nxd_lc.models.common.compile import compile_decoder_layers
    from nxd_lc.models.common.fusions import apply_fusions
    from nxd_lc.models.llama import LlamaForCausalLM

    shape = _shape(device)
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=seq, **shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if device == "cuda":  # the accelerator step's kernels: Liger's in eager layers, torch ops for inductor
        apply_fusions(model, resolve_fusions({}, "gpu", compiled=compiled))
        model = model.to(device="cuda", dtype=torch.bfloat16)
    if plan != "none":
        apply_activation_checkpointing(model, "full", save_attention=plan == "full_save_attention")
    apply_tiled_mlp(model, 512 if plan == "full_tiled_mlp" else None)
    if compiled:
        compile_decoder_layers(model, "inductor")
    return model


def _measure(layers: int, plan: str, compiled: bool, seq: int, device: str = "cpu") -> dict[str, Any]:
    """One model: two warm-up steps, then the measured one."""
    import torch

    current, reset_peak, peak = _counters(device)
    model = _build(layers, plan, compiled, seq, device)
    shape = _shape(device)
    ids = torch.randint(0, shape["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(2):
        total, count = model.loss(ids, ids)
        (total / count).backward()
        del total, count
    start = reset_peak()
    total, count = model.loss(ids, ids)
    kept = current() - start
    loss = total / count
    loss.backward()
    step_peak = peak() - start
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    return {"kept": kept, "peak": step_peak, "loss": float(loss.detach()), "grads": grads}


def measure(plans: tuple[str, ...] = PLANS, seq: int = 2048, device: str = "cpu") -> list[dict[str, Any]]:
    """Per plan and mode (eager, compiled): kept bytes per layer, the 4-layer step's peak, both also in ``[S, H]``
    units, and the compiled run's largest gradient difference to eager's (module docstring). On CPU it needs the
    interposer loaded (:func:`main` re-executes with it).

    Raises:
        RuntimeError: on CPU, the interposer is not loaded.
    """
    import torch

    from nxd_lc.distributed import parallel_state

    _counters(device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1)
    shape = _shape(device)
    unit = seq * shape["hidden_size"] * (2 if device == "cuda" else 4)
    rows = []
    for plan in plans:
        eager_grads = None
        for compiled in (False, True):
            two, four = _measure(2, plan, compiled, seq, device), _measure(4, plan, compiled, seq, device)
            row = {"plan": plan, "mode": "compiled (inductor)" if compiled else "eager",
                   "kept_per_layer_bytes": (four["kept"] - two["kept"]) // 2, "peak_bytes": four["peak"],
                   "loss": four["loss"]}
            row["kept_per_layer_sh"] = row["kept_per_layer_bytes"] / unit
            row["peak_sh"] = row["peak_bytes"] / unit
            if compiled:
                row["max_grad_diff"] = max(float((g - eager_grads[n]).abs().max()) for n, g in four["grads"].items())
            else:
                eager_grads = four["grads"]
            rows.append(row)
            torch._dynamo.reset()
    return rows


def _table(rows: list[dict[str, Any]], seq: int, device: str = "cpu") -> str:
    where = (f"CUDA, S {seq}, H {CUDA_SHAPE['hidden_size']}, bf16, eager with Liger's kernels; unit [S, H] = S x H x 2"
             if device == "cuda" else f"CPU, S {seq}, H {SHAPE['hidden_size']}, fp32; unit [S, H] = S x H x 4")
    lines = [f"# Bytes kept per decoder layer and step peak, eager vs compiled ({where} bytes)", "",
             "| plan | mode | kept per layer ([S, H]) | 4-layer step peak ([S, H]) | compiled / eager peak | "
             "max grad diff vs eager |", "|---|---|---|---|---|---|"]
    eager = {r["plan"]: r for r in rows if r["mode"] == "eager"}
    for r in rows:
        ratio = r["peak_bytes"] / eager[r["plan"]]["peak_bytes"] if r["mode"] != "eager" else 1.0
        diff = f"{r['max_grad_diff']:.1e}" if "max_grad_diff" in r else "-"
        lines.append(f"| {r['plan']} | {r['mode']} | {r['kept_per_layer_sh']:.2f} | {r['peak_sh']:.2f} | "
                     f"{ratio:.2f} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run :func:`measure` under the interposer (re-executing this module with ``LD_PRELOAD`` when needed) and
    write the JSON and the Markdown table."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_memory", description=__doc__.split("\n")[0])
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {', '.join(PLANS)}")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (one sequence)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/layer_memory_<stamp>.json)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: host bytes through the malloc interposer; cuda: the CUDA allocator's counters")
    args = p.parse_args(argv)
    plans = tuple(x for x in args.plans.split(",") if x)
    unknown = [x for x in plans if x not in PLANS]
    if unknown:
        p.error(f"--plans: unknown {unknown}; choose from {list(PLANS)}")
    if args.device == "cpu" and os.environ.get(_PRELOADED) != "1":
        env = {**os.environ, "LD_PRELOAD": str(interposer_path()), _PRELOADED: "1"}
        cmd = [sys.executable, "-m", "benchmarks.layer_memory", *(argv if argv is not None else sys.argv[1:])]
        return subprocess.run(cmd, env=env, cwd=str(ROOT), check=False).returncode
    import time

    rows = measure(plans, args.seq, args.device)
    import torch

    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"layer_memory_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = _shape(args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out.write_text(json.dumps({"seq": args.seq, "shape": shape, "device": device, "torch": torch.__version__,
                               "rows": rows, "stamp": stamp}, indent=1))
    table = _table(rows, args.seq, args.device)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
