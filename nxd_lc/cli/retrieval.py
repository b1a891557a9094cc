"""The retrieval evaluation's command line, shared by ``python -m nxd_lc.cli.niah`` and
``python -m nxd_lc.cli.passkey``: the run config's model with HF weights, scored over a length x depth grid
(:mod:`nxd_lc.eval.retrieval`), a table, JSON and heatmaps. The haystack is the config's held-out text tokenized
with the evaluated model's tokenizer (:mod:`nxd_lc.eval.tokenizer`: ``--hf-dir``'s, recorded in the JSON)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from nxd_lc.data.retrieval_tasks import TASKS
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.eval.heldout import heldout_haystack
from nxd_lc.eval.retrieval import SCORINGS, evaluate_grid, format_table


def build_arg_parser(prog: str, default_tasks: Sequence[str]) -> Any:
    """The command line of ``python -m nxd_lc.cli.passkey`` / ``nxd_lc.cli.niah``."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description="Retrieval accuracy of a run config's model over a context "
                                                        "length x needle depth grid (JSON + heatmap PNGs).")
    p.add_argument("--config-name", required=True, help="run config in --config-dir (model, tokenizer, data)")
    p.add_argument("--config-dir", default="conf", help="Hydra config directory (default: ./conf)")
    p.add_argument("--hf-dir", default=None, help="HF weights to evaluate (default: the config's model.hf_weights_dir)")
    p.add_argument("--tasks", default=",".join(default_tasks), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--lengths", default="512,1024,2048", help="context lengths in tokens, comma-separated")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1], comma-separated")
    p.add_argument("--num-samples", type=int, default=5, help="samples per (length, depth) cell (default 5)")
    p.add_argument("--scoring", default="generate,rank", help="generate, rank or both (default both)")
    p.add_argument("--num-candidates", type=int, default=10, help="candidates ranked per sample (default 10)")
    p.add_argument("--seed", type=int, default=0, help="sample seed (default 0)")
    p.add_argument("--kv-cache", choices=("auto", "on", "off"), default="auto",
                   help="KV cache for generation and ranking: auto (where the layout allows: not SP or PP; under CP "
                        "each rank runs the unsharded sequence), on (an error where it cannot), off (re-run the "
                        "whole sequence per token / candidate, sharded under CP)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory to evaluate with (default: --hf-dir's, which must be the config's "
                        "data.tokenizer; the config's when --hf-dir has none)")
    p.add_argument("--progress-interval", type=float, default=10.0,
                   help="seconds between progress lines (samples done, time left); 0: after every sample")
    p.add_argument("--out", required=True, help="output directory: retrieval.json and one heatmap PNG per task")
    p.add_argument("--label", default="", help="title of the table and plots")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config, key=value")
    return p


def _numbers(text: str, key: str, cast: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> list[Any]:
    """Comma-separated ``cast`` values of flag ``key``; ValueError naming the flag unless all are ``ok``."""
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"{key}: expected comma-separated {what}, got {text!r}") from e
    if not values or not all(ok(v) for v in values):
        raise ValueError(f"{key}: need {what}, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m nxd_lc.cli.niah",
         default_tasks: Sequence[str] = TASKS[1:]) -> int:
    """Command-line entry point (one process, or torchrun at the config's TP x CP (x DP) layout). Returns 0, or 2
    after printing a config / input error."""
    import dataclasses
    import json
    import logging
    import os
    import sys

    from nxd_lc.app.convert import build_model, compose_run_config
    from nxd_lc.config.errors import ConfigError
    from nxd_lc.eval.plots import plot_retrieval_heatmaps
    from nxd_lc.eval.session import eval_layout, eval_session, init_eval_layout
    from nxd_lc.eval.tokenizer import evaluation_tokenizer
    from nxd_lc.runtime.device import launched_world_size

    args = build_arg_parser(prog, default_tasks).parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", stream=sys.stdout)
    try:
        with eval_session():
            tasks = [t for t in args.tasks.split(",") if t]
            unknown = [t for t in tasks if t not in TASKS]
            if unknown or not tasks:
                raise ValueError(f"--tasks: unknown {unknown or 'none given'}; choose from {', '.join(TASKS)}")
            scorings = [s for s in args.scoring.split(",") if s]
            if not scorings or any(s not in SCORINGS for s in scorings):
                raise ValueError(f"--scoring: {args.scoring!r}; use generate, rank or generate,rank")
            lengths = _numbers(args.lengths, "--lengths", int, lambda v: v >= 1, "positive integers")
            depths = _numbers(args.depths, "--depths", float, lambda v: 0 <= v <= 1, "numbers in [0, 1]")
            if args.num_samples < 1:
                raise ValueError(f"--num-samples: must be >= 1, got {args.num_samples}")
            cfg = eval_layout(compose_run_config(args.config_name, args.config_dir, args.overrides),
                               launched_world_size())
            hf_dir = args.hf_dir or cfg.model.hf_weights_dir
            if not hf_dir or not os.path.isdir(hf_dir):
                raise ValueError(f"--hf-dir: {hf_dir!r} is not a directory (nor the config's model.hf_weights_dir); "
                                 "convert a checkpoint with python -m nxd_lc.cli.convert first")
            if args.progress_interval < 0:
                raise ValueError(f"--progress-interval: must be >= 0 seconds, got {args.progress_interval}")
            cfg, eval_tok = evaluation_tokenizer(cfg, hf_dir, args.tokenizer)
            init_eval_layout(cfg)
            ds = cfg.distributed_strategy
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_weights_dir=hf_dir))
            model = build_model(cfg, load_weights=True)
            model.eval()
            eval_tok.check_model_vocab(model.config.vocab_size, cfg.model.model_config)
            tokenizer, haystack = heldout_haystack(cfg, model.config.vocab_size, 2 * max(lengths))
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
            result = evaluate_grid(model, tokenizer, haystack, tasks=tasks, lengths=lengths, depths=depths,
                                   num_samples=args.num_samples, vocab_size=model.config.vocab_size, seed=args.seed,
                                   scorings=scorings, pad_id=pad, algo=ds.context_parallel_algo,
                                   sample_kwargs={"num_candidates": args.num_candidates},
                                   kv_cache={"auto": None, "on": True, "off": False}[args.kv_cache],
                                   progress_interval_s=args.progress_interval)
            result["meta"].update(config=cfg.name, hf_dir=os.path.abspath(hf_dir), tokenizer=eval_tok.record(),
                                  tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                  context_parallel_size=ps.get_context_parallel_world_size(),
                                  rope=getattr(model.config, "rope_scaling", None))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        label = args.label or f"{cfg.name} ({hf_dir})"
        print(label)
        print(format_table(result))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "retrieval.json"), "w") as f:
            json.dump(result, f, indent=2, default=str)
        for path in plot_retrieval_heatmaps(result, args.out, label):
            print(f"wrote {path}")
    return 0
