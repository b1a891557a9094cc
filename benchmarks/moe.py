"""Mixture-of-experts benchmark: tokens/s and memory of dropless vs capacity-factor dispatch, EP 2 vs EP 1.

Run from the repository root::

    .venv/bin/python -m benchmarks.moe              # the tiny Mixtral of conf/, L = 1024, 3 rounds (~4 min, 2 cores)
    .venv/bin/python -m benchmarks.moe --smoke      # 2 layers, L = 128, 1 round (~30 s)

Model: ``conf/tiny_mixtral_config.json`` (4 layers, hidden 256, 8 experts of intermediate size 344, top-2 routing,
vocab 8192, load-balancing loss on), fp32, the same seed-0 weights in every configuration. Every configuration runs
on 2 gloo processes (world 2 = DP 2): EP 1 keeps all 8 experts on both ranks and all-reduces their gradients; EP 2
gives each rank 4 experts and exchanges tokens with all-to-all. Dispatch: ``dropless`` (no token dropped; slots per
expert = the largest expert load in the EP group) or ``capacity`` (``capacity_factor`` 2.0, NxDT's example value:
ceil(2.0 x tokens x 2 / 8) slots per expert, later tokens dropped).

One **step** (per rank, micro batch ``--batch`` of ``--seq-len`` random tokens, different on each rank) = forward +
loss (cross-entropy + 0.02 x aux) + backward + the DP / expert-DP gradient all-reduce
(:func:`nxd_lc.distributed.grads.allreduce_data_parallel_gradients`) + AdamW step. Per configuration and round one
pair of processes runs ``--warmup`` steps, then ``--steps`` timed steps, and reports per rank:

* ``step_s``: wall time of each timed step (s; the slower rank's); tokens/s = global tokens / median step time;
* ``peak_rss_train``: peak resident set over the steps only (``/proc/self/clear_refs`` = 5 after the model and
  optimizer were built), bytes, the larger rank's;
* ``state_bytes``: bytes of this rank's parameters, gradients and AdamW state after a step (deterministic);
* ``dropped``: share of (token, expert) assignments dropped by the capacity limit over the timed steps.

Rounds alternate the configuration order, so a linear drift of the shared machine's speed hits every configuration
alike; ratios are against ``ep1_dropless`` of the same run (tokens/s over the pooled timed steps, memory of the median
round).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "conf" / "tiny_mixtral_config.json"

#: (label, expert_model_parallel_size, capacity_factor or None for dropless)
CONFIGS: tuple[tuple[str, int, float | None], ...] = (
    ("ep1_dropless", 1, None), ("ep1_capacity", 1, 2.0), ("ep2_dropless", 2, None), ("ep2_capacity", 2, 2.0))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, out_dir: str, args: dict[str, Any]) -> None:
    """One rank of one configuration: build, warm up, time, write ``rank<r>.json`` into ``out_dir``."""
    import torch
    import torch.distributed as dist

    from nxd_lc.config.schema import OptimConfig
    from nxd_lc.distributed import grads
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.models.hf_config import build_llama_config
    from nxd_lc.models.mixtral import MixtralForCausalLM
    from nxd_lc.moe import layer as moe_layer
    from nxd_lc.moe.config import MoEOptions
    from nxd_lc.optim import build_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ps.initialize_model_parallel(expert_model_parallel_size=args["ep"])
        config = build_llama_config(str(CONFIG), {"num_layers": args["layers"]})
        torch.manual_seed(0)
        cf = args["capacity_factor"]
        model = MixtralForCausalLM(config, moe=MoEOptions(capacity_factor=cf, dropless=cf is None))
        opt = build_optimizer(model.named_parameters(), OptimConfig(name="adamw", lr=1e-4, weight_decay=0.01), False)
        gen = torch.Generator().manual_seed(1000 + rank)
        batches = [torch.randint(0, config.vocab_size, (args["batch"], args["seq_len"] + 1), generator=gen)
                   for _ in range(args["warmup"] + args["steps"])]
        counts = {"assigned": 0, "dropped": 0}
        real_capacity = moe_layer.MoE._capacity

        def counting_capacity(self: Any, load: torch.Tensor, tokens: int) -> int:  # observes, changes nothing
            capacity = real_capacity(self, load, tokens)
            counts["assigned"] += int(load.sum())
            counts["dropped"] += int((load - capacity).clamp_min(0).sum())
            return capacity

        def step(tokens: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            loss_sum, count = model.loss(tokens[:, :-1], tokens[:, 1:])
            (loss_sum / count).backward()
            grads.allreduce_data_parallel_gradients(list(model.parameters()))
            opt.step()

        for tokens in batches[:args["warmup"]]:
            step(tokens)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        moe_layer.MoE._capacity = counting_capacity  # type: ignore[method-assign]  # our own class, for the count
        times = []
        for tokens in batches[args["warmup"]:]:
            dist.barrier()
            t0 = time.perf_counter()
            step(tokens)
            times.append(time.perf_counter() - t0)
        moe_layer.MoE._capacity = real_capacity  # type: ignore[method-assign]
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        state = sum(p.numel() * p.element_size() for p in model.parameters())
        state += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                     if torch.is_tensor(t) and t.dim() > 0)
        result = {"step_s": times, "peak_rss_train": hwm, "state_bytes": state,
                  "dropped": counts["dropped"] / max(counts["assigned"], 1)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def measure(label: str, ep: int, capacity_factor: float | None, opts: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration on 2 processes; the per-step maximum over ranks and the larger rank's memory."""
    import torch.multiprocessing as mp

    args = {"ep": ep, "capacity_factor": capacity_factor, "layers": opts.layers, "batch": opts.batch,
            "seq_len": opts.seq_len, "warmup": opts.warmup, "steps": opts.steps}
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(2, _free_port(), out_dir, args), nprocs=2, join=True, start_method="spawn")
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]
    return {"label": label, "ep": ep, "capacity_factor": capacity_factor,
            "step_s": [max(a, b) for a, b in zip(ranks[0]["step_s"], ranks[1]["step_s"])],
            "peak_rss_train": max(r["peak_rss_train"] for r in ranks),
            "state_bytes": max(r["state_bytes"] for r in ranks),
            "dropped": statistics.mean(r["dropped"] for r in ranks)}


def analyse(runs: list[dict[str, Any]], tokens_per_step: int) -> list[dict[str, Any]]:
    """Rows per configuration: tokens/s over the pooled timed steps, median-round memory, ratios to the first
    configuration (``ep1_dropless``)."""
    rows = []
    for label, ep, cf in CONFIGS:  # the first configuration run is the reference
        mine = [r for r in runs if r["label"] == label]
        if not mine:
            continue
        steps = [s for r in mine for s in r["step_s"]]
        rss = statistics.median(r["peak_rss_train"] for r in mine)
        rows.append({"label": label, "ep": ep, "capacity_factor": cf, "median_step_s": statistics.median(steps),
                     "tok_s": tokens_per_step / statistics.median(steps), "peak_rss_train": rss,
                     "state_bytes": mine[0]["state_bytes"], "dropped": statistics.mean(r["dropped"] for r in mine)})
    base = rows[0]
    for row in rows:
        row["tok_s_ratio"] = row["tok_s"] / base["tok_s"]
        row["rss_ratio"] = row["peak_rss_train"] / base["peak_rss_train"]
        row["state_ratio"] = row["state_bytes"] / base["state_bytes"]
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The README table of :func:`analyse`'s rows."""
    mib = float(1 << 20)
    lines = ["| config | EP | dispatch | step s (median) | tok/s | tok/s vs ep1_dropless | peak RSS MiB (vs) "
             "| state MiB per rank (vs) | dropped |", "|" + "---|" * 9]
    for r in rows:
        dispatch = "dropless" if r["capacity_factor"] is None else f"capacity {r['capacity_factor']}"
        lines.append(f"| {r['label']} | {r['ep']} | {dispatch} | {r['median_step_s']:.3f} | {r['tok_s']:.0f} | "
                     f"{r['tok_s_ratio']:.3f} | {r['peak_rss_train'] / mib:.0f} ({r['rss_ratio']:.3f}) | "
                     f"{r['state_bytes'] / mib:.1f} ({r['state_ratio']:.3f}) | {100 * r['dropped']:.2f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and write ``benchmarks/results/moe.json`` / ``.md`` (``--out``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="2 layers, L = 128, 1 round, 1 + 2 steps")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--configs", nargs="+", choices=[c[0] for c in CONFIGS], default=[c[0] for c in CONFIGS],
                   help="configurations to run (the first is the reference of the ratios)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe.json"))
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.seq_len, opts.layers, opts.rounds, opts.warmup, opts.steps = 128, 2, 1, 1, 2
    runs = []
    chosen = tuple(c for c in CONFIGS if c[0] in opts.configs)
    for rnd in range(opts.rounds):
        order = chosen if rnd % 2 == 0 else tuple(reversed(chosen))
        for label, ep, cf in order:
            runs.append({**measure(label, ep, cf, opts), "round": rnd})
            print(f"round {rnd} {label}: median step {statistics.median(runs[-1]['step_s']):.3f} s", flush=True)
    rows = analyse(runs, 2 * opts.batch * opts.seq_len)
    table = markdown(rows)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()},
              "settings": {k: v for k, v in vars(opts).items() if k != "out"}, "runs": runs, "rows": rows,
              "table": table}
    import torch

    result["machine"]["torch"] = torch.__version__
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=1))
    Path(opts.out).with_suffix(".md").write_text(table + "\n")
    print(table)
    return result


if __name__ == "__main__":
    main()
