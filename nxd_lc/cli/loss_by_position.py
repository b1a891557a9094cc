"""Held-out loss per token-position bucket of a run config's model (:mod:`nxd_lc.eval.loss_by_position`).

Command line (one process, or torchrun at the config's TP x CP (x DP) layout)::

    python -m nxd_lc.cli.loss_by_position --config-name cpu_tiny_llama_config --hf-dir <hf dir> \\
        --edges 0,2048,8192 --num-samples 8 --json results/lbp.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from nxd_lc.distributed import parallel_state as ps
from nxd_lc.eval.heldout import heldout_batches
from nxd_lc.eval.loss_by_position import format_table, loss_by_position, parse_edges
from nxd_lc.eval.session import eval_layout, eval_session, init_eval_layout


# ---- command line ------------------------------------------------------------------------------------------
def build_arg_parser() -> argparse.ArgumentParser:
    """The evaluation's command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m nxd_lc.cli.loss_by_position",
                                description="Held-out loss per position bucket of a run config's model.")
    p.add_argument("--config-name", required=True, help="run config in --config-dir (model, data, seq_length)")
    p.add_argument("--config-dir", default="conf", help="Hydra config directory (default: ./conf)")
    p.add_argument("--hf-dir", default=None, help="HF weights to evaluate (default: the config's model.hf_weights_dir)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory to evaluate with (default: --hf-dir's, which must be the config's "
                        "data.tokenizer; the config's when --hf-dir has none)")
    p.add_argument("--edges", default="0,2048,8192", help="bucket edges, comma-separated (default 0,2048,8192)")
    p.add_argument("--num-samples", type=int, default=8, help="held-out packed sequences to evaluate (default 8)")
    p.add_argument("--split", choices=("val", "train"), default="val", help="data split (default: val)")
    p.add_argument("--label", default="", help="title printed above the table")
    p.add_argument("--json", default=None, help="also write the result (plus run facts) to this JSON file")
    p.add_argument("--png", default=None, help="also plot the loss per bucket to this PNG (matplotlib: the eval extra)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config, key=value")
    return p


def evaluate_run_config(cfg: Any, hf_dir: str, edges: Sequence[int], num_samples: int,
                        split: str = "val", tokenizer_dir: str | None = None) -> dict[str, Any]:
    """Loss by position of the model of run config ``cfg`` with the HF weights in ``hf_dir``.

    Builds the model exactly as training does (rope scaling from ``model.hf_config_overrides`` included),
    loads ``hf_dir`` (each rank its TP shard) and evaluates ``num_samples`` held-out packed sequences of
    ``data.seq_length``, tokenized with the model's tokenizer (:func:`~nxd_lc.eval.tokenizer.evaluation_tokenizer`:
    ``tokenizer_dir``, else ``hf_dir``'s; recorded in ``meta.tokenizer``). Needs ``torch.distributed`` and
    ``parallel_state`` initialised for ``cfg``'s layout.

    Raises:
        FileNotFoundError: ``hf_dir`` has no safetensors. ValueError: too few samples, bad edges, a tokenizer that
        is not the config's (as :func:`~nxd_lc.eval.tokenizer.evaluation_tokenizer`) or too large for the model.
    """
    import dataclasses

    from nxd_lc.app.convert import build_model
    from nxd_lc.eval.tokenizer import evaluation_tokenizer

    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"--hf-dir: {hf_dir} does not exist; convert a checkpoint with "
                                "python -m nxd_lc.cli.convert first")
    cfg, eval_tok = evaluation_tokenizer(cfg, hf_dir, tokenizer_dir)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_weights_dir=hf_dir))
    model = build_model(cfg, load_weights=True)
    hf_config = model.config
    model.eval()
    eval_tok.check_model_vocab(hf_config.vocab_size, cfg.model.model_config)
    batches = heldout_batches(cfg, hf_config.vocab_size, num_samples, split, ps.get_data_parallel_rank(),
                               ps.get_data_parallel_world_size())
    result = loss_by_position(model, batches, edges,
                              context_parallel_algo=cfg.distributed_strategy.context_parallel_algo)
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    result["meta"] = {"config": cfg.name, "hf_dir": os.path.abspath(hf_dir), "tokenizer": eval_tok.record(),
                      "split": split,
                      "num_samples": num_samples, "seq_length": int(batches[0]["input_ids"].shape[1]),
                      "cross_document_attention": cfg.data.resolved().cross_document_attention, "rope": rope,
                      "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
                      "context_parallel_size": ps.get_context_parallel_world_size()}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point. Returns 0, or 2 after printing a config/input error."""
    from nxd_lc.app.convert import compose_run_config
    from nxd_lc.config.errors import ConfigError
    from nxd_lc.runtime.device import launched_world_size

    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", stream=sys.stdout)
    try:
        with eval_session():
            edges = parse_edges(args.edges)
            if args.num_samples < 1:
                raise ValueError(f"--num-samples: must be >= 1, got {args.num_samples}")
            cfg = eval_layout(compose_run_config(args.config_name, args.config_dir, args.overrides),
                               launched_world_size())
            hf_dir = args.hf_dir or cfg.model.hf_weights_dir
            if not hf_dir:
                raise ValueError("--hf-dir: not given and the config has no model.hf_weights_dir; nothing to evaluate")
            init_eval_layout(cfg)
            result = evaluate_run_config(cfg, hf_dir, edges, args.num_samples, args.split, args.tokenizer)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_table(result, args.label or f"{cfg.name}: loss by position ({args.hf_dir or hf_dir})"))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=str)
        if args.png:
            from nxd_lc.eval.plots import plot_loss_by_position

            label = args.label or f"{cfg.name}: loss by position"
            print(f"wrote {plot_loss_by_position({label: result}, args.png, label)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
