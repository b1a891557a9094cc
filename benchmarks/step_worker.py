"""One measurement, in its own process (launched by :mod:`benchmarks.procs`): ``python -m benchmarks.step_worker``.

Subcommands (all write one JSON object to ``--out`` and set ``RLIMIT_AS`` to ``--as-limit`` before importing
torch):

``run``       real training steps of one implementation at one sequence length L: a warm-up step at
              ``min(L, --warmup-len)`` tokens, then ``--timed-steps`` steps at L, each = forward + backward +
              AdamW step (+ ``zero_grad(set_to_none=True)``). Reports the step times (s), the losses, the RSS after
              the imports and after building the model and optimizer, and the process's peak RSS (``VmHWM``) at the
              end. With ``--cp N`` the process is one rank of an N-process gloo group (env ``RANK``,
              ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): the batch is sharded once with
              :func:`nxd_lc.context.sharding.shard_batch_for_context_parallel`, the loss is
              :func:`~nxd_lc.context.sharding.context_parallel_loss` and the gradients are averaged over CP before
              the optimizer step (what ``nxd_lc.lightning.module`` does).
``estimate``  the same steps under FakeTensorMode (:mod:`benchmarks.memory_estimate`) for a list of lengths: peak
              live tensor bytes per length, no FLOPs. ``--real`` runs the same accounting on real tensors and real
              steps (to validate the fake run at a small length).
``gemm``      the fp32 GEMM peak: best time of ``torch.mm`` of two n x n fp32 matrices on ``--threads`` threads,
              as FLOP/s = 2 n^3 / t.

Implementations: ``hf`` = transformers ``LlamaForCausalLM`` with ``attn_implementation="sdpa"`` and its built-in
loss; ``nxd`` = :class:`nxd_lc.models.llama.model.LlamaForCausalLM` with its memory options
(:mod:`benchmarks.nxd_options`) and :meth:`~nxd_lc.models.llama.model.LlamaForCausalLM.loss`. Both use
``torch.optim.AdamW(lr=1e-4, weight_decay=0.01)`` with torch's default (per-parameter, CPU) implementation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

_LR, _WD = 1e-4, 0.01


def _set_as_limit(limit: int | None) -> None:
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _fake_safe_sdpa() -> str:
    """Name of transformers' own sdpa attention registered without a mask builder (``AttentionInterface``).

    With real tensors, transformers' "sdpa" mask builder finds that a causal, unpadded, unpacked batch needs no
    mask and passes ``attn_mask=None, is_causal=True`` to SDPA. On fake tensors it cannot read the position ids
    (``masking_utils.find_packed_sequence_indices`` treats them as traced), so it would build an [L, L] mask the
    real run never builds. An implementation name without a registered mask function skips mask building, so the
    fake run executes the same ops as the real one (the harness's ``--check-trace`` compares both op traces).
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa_unmasked", sdpa_attention_forward)
    return "sdpa_unmasked"


def _build_hf(hf_dir: str, fake: bool) -> Any:
    """transformers LlamaForCausalLM (sdpa, fp32, train mode, no KV cache); random init under fake mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if fake:
        cfg = LlamaConfig.from_pretrained(hf_dir)
        cfg._attn_implementation = _fake_safe_sdpa()
        model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def _build_nxd(hf_dir: str, fake: bool, opts: dict[str, Any]) -> Any:
    """nxd_lc LlamaForCausalLM from the same config.json and weights, with the memory options ``opts``."""
    from benchmarks.nxd_options import build_nxd_model

    return build_nxd_model(hf_dir, opts, load_weights=not fake).train()


def _hf_step(model: Any, batch: dict[str, Any]) -> float:
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["hf_labels"])
    loss = out.loss
    del out  # the logits must not outlive the step (they would inflate the next step's peak)
    loss.backward()
    return loss.detach()


def _nxd_step(model: Any, batch: dict[str, Any]) -> Any:
    from benchmarks.nxd_options import nxd_loss

    loss = nxd_loss(model, batch)
    loss.backward()
    return loss.detach()


def _make_step(impl: str, model: Any, opt: Any, cp: int, algo: str) -> Callable[[dict[str, Any]], Any]:
    """step(batch) -> detached loss: forward + backward (+ CP gradient average) + AdamW step + zero_grad."""
    fwd_bwd = _hf_step if impl == "hf" else _nxd_step
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch: dict[str, Any]) -> Any:
        if cp > 1:
            from nxd_lc.context.sharding import shard_batch_for_context_parallel
            from nxd_lc.distributed import parallel_state

            batch = shard_batch_for_context_parallel(batch, parallel_state.get_context_parallel_rank(), cp, algo)
        loss = fwd_bwd(model, batch)
        if cp > 1:
            from nxd_lc.distributed import grads

            grads.allreduce_data_parallel_gradients(params, with_context_parallel=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _init_cp(cp: int, algo: str) -> None:
    """Join the gloo group (env RANK/WORLD_SIZE/MASTER_*) and make every rank one CP rank."""
    import torch.distributed as dist

    from nxd_lc.context.attention import set_context_parallel_algo
    from nxd_lc.distributed import parallel_state

    dist.init_process_group("gloo")
    if dist.get_world_size() != cp:
        raise ValueError(f"--cp {cp} needs WORLD_SIZE={cp}, got {dist.get_world_size()}")
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    set_context_parallel_algo(algo)


def _build(args: argparse.Namespace, fake: bool) -> tuple[Any, Any]:
    import torch

    model = _build_hf(args.hf_dir, fake) if args.impl == "hf" else _build_nxd(args.hf_dir, fake,
                                                                              json.loads(args.nxd_opts))
    opt = torch.optim.AdamW(model.parameters(), lr=_LR, weight_decay=_WD)
    return model, opt


def _import_all() -> int:
    """Import everything either implementation uses; return the RSS afterwards (the process's fixed baseline)."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    import nxd_lc.context.attention  # noqa: F401
    import nxd_lc.models.llama.hf_adapter  # noqa: F401
    from benchmarks.common import rss_bytes

    return rss_bytes("VmRSS")


def _cmd_run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.common import make_batch, rss_bytes

    rss_import = _import_all()
    if args.cp > 1:
        _init_cp(args.cp, args.cp_algo)
    tokens = torch.load(args.tokens)
    model, opt = _build(args, fake=False)
    step = _make_step(args.impl, model, opt, args.cp, args.cp_algo)
    rss_built = rss_bytes("VmRSS")
    warm = min(args.seq_len, args.warmup_len)
    t0 = time.perf_counter()
    losses = [float(step(make_batch(tokens, warm)))]
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(args.timed_steps):
        t0 = time.perf_counter()
        losses.append(float(step(make_batch(tokens, args.seq_len))))
        times.append(time.perf_counter() - t0)
    return {"status": "ok", "impl": args.impl, "seq_len": args.seq_len, "cp": args.cp, "warmup_len": warm,
            "warmup_s": warm_s, "step_s": times, "losses": losses, "rss_after_import": rss_import,
            "rss_after_build": rss_built, "peak_rss": rss_bytes("VmHWM"), "threads": torch.get_num_threads(),
            "num_params": sum(p.numel() for p in model.parameters())}


def _cmd_estimate(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.common import make_batch
    from benchmarks.memory_estimate import estimate_peak_bytes

    rss_import = _import_all()
    lengths = [int(x) for x in args.seq_lens.split(",")]
    out: dict[str, Any] = {"status": "ok", "impl": args.impl, "rss_after_import": rss_import, "points": []}
    tokens = torch.load(args.tokens) if args.real else None
    for seq_len in lengths:
        state: dict[str, Any] = {}

        def build(state: dict[str, Any] = state) -> dict[str, Any]:
            state["model"], state["opt"] = _build(args, fake=not args.real)
            state["step"] = _make_step(args.impl, state["model"], state["opt"], 1, args.cp_algo)
            return state

        def step(st: dict[str, Any], length: int) -> None:
            ids = tokens if tokens is not None else torch.zeros(length + 1, dtype=torch.int64)
            st["step"](make_batch(ids, length))

        t0 = time.perf_counter()
        built, peaks = estimate_peak_bytes(build, step, [min(seq_len, args.warmup_len), seq_len],
                                           fake=not args.real)
        out["points"].append({"seq_len": seq_len, "bytes_after_build": built, "peak_bytes": max(peaks),
                              "estimate_s": time.perf_counter() - t0})
    return out


def _cmd_gemm(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    n = args.size
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return {"status": "ok", "size": n, "threads": torch.get_num_threads(), "best_s": best,
            "flops_per_s": 2.0 * n**3 / best}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_worker", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "estimate", "gemm"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True, help="JSON result file")
        s.add_argument("--as-limit", type=int, default=0, help="RLIMIT_AS in bytes (0: none)")
        s.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
        if name == "gemm":
            s.add_argument("--size", type=int, default=4096)
            s.add_argument("--repeats", type=int, default=5)
            continue
        s.add_argument("--impl", choices=("hf", "nxd"), required=True)
        s.add_argument("--hf-dir", required=True, help="HF checkpoint dir (config.json + safetensors)")
        s.add_argument("--nxd-opts", default="{}", help="JSON dict of nxd_lc memory options")
        s.add_argument("--warmup-len", type=int, default=16384)
        s.add_argument("--cp-algo", default="ring", choices=("ring", "ulysses"))
        if name == "run":
            s.add_argument("--seq-len", type=int, required=True)
            s.add_argument("--tokens", required=True, help="torch.save'd int64 [N] token ids")
            s.add_argument("--timed-steps", type=int, default=1)
            s.add_argument("--cp", type=int, default=1, help="context-parallel degree (= WORLD_SIZE)")
        else:
            s.add_argument("--seq-lens", required=True, help="comma-separated lengths")
            s.add_argument("--real", action="store_true",
                           help="track real tensors (the steps run; validates the fake estimate)")
            s.add_argument("--tokens", help="token ids for --real")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the subcommand, write its JSON to ``--out``; a failed allocation writes ``oom``."""
    args = _parser().parse_args(argv)
    _set_as_limit(args.as_limit)
    import torch

    torch.set_num_threads(args.threads)
    cmds = {"run": _cmd_run, "estimate": _cmd_estimate, "gemm": _cmd_gemm}
    try:
        result = cmds[args.cmd](args)
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError) and "alloc" not in str(e).lower():
            raise
        result = {"status": "oom", "error": str(e)[:500]}
    with open(args.out, "w") as f:
        json.dump(result, f)
    if os.environ.get("RANK") is not None and getattr(args, "cp", 1) > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
