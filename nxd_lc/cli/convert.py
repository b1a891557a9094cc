"""Convert an nxd_lc (NxD-layout, TP-sharded) training checkpoint into a Hugging Face model directory.

::

    torchrun --nproc_per_node=<TP> -m nxd_lc.cli.convert \\
        --checkpoint nxd_lc_runs/cpu_tiny_llama/checkpoints --output nxd_lc_runs/hf/cpu_tiny_llama

The model is the checkpoint's own: every nxd_lc checkpoint carries its run's resolved config
(``<tag>/run_config.yaml``, and ``model_config.json``, the model's config.json as the run read it;
:mod:`nxd_lc.config.run_record`), which the export builds from; ``--config-name`` (needed for NxD's checkpoints,
which carry none) and overrides are checked against it and refused, naming each key, where they would change the
model. ``config.json`` and ``generation_config.json`` carry the run tokenizer's bos / eos / pad ids, so
transformers' ``generate`` stops at the eos the training data was packed with.

Runs at the checkpoint's tensor-parallel size (one process per TP rank; a checkpoint saved with pipeline stages is
gathered: each rank loads its TP shard of every stage; a checkpoint saved with expert parallelism,
``dp_rank_00_ep_rank_XX_...`` files, needs TP x EP processes, each loading its EP rank's experts, gathered over EP
on export). Every rank builds the model of the run's config (sharded at construction, as in training), loads its
own model shard (``<tag>/model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt``, xser or plain, via
:func:`nxd_lc.checkpoint.sharded.load_checkpoint`; keys are the LightningModule's ``model.<name>``), and then
all ranks gather the shards with :func:`nxd_lc.models.llama.hf_adapter.save_hf_weights` (a TP collective);
global rank 0 writes ``model.safetensors`` (+ index when sharded), ``config.json`` (the run's model config,
``hf_config_overrides`` such as ``rope_scaling`` included), the run's tokenizer and ``nxd_lc_conversion.json``
(where the weights came from). The output directory appears atomically: rank 0 writes into a hidden sibling
staging directory and renames it into place. ``transformers.LlamaForCausalLM.from_pretrained(output)`` loads it,
and ``model.hf_weights_dir: <output>`` starts another nxd_lc run from it, at any TP/CP size (the reverse
direction, see :func:`~nxd_lc.models.llama.hf_adapter.load_hf_weights`).

The other direction, NxD's ``--convert_from_full_state``: ``--input_dir <HF dir> --output_dir <root>`` under
``torchrun --nproc_per_node=<TP>`` writes ``<root>/step=0`` (:func:`convert_hf_to_checkpoint`). NxD's
``checkpoint_converter`` flags are accepted with their meaning: ``--input_dir`` / ``--output_dir`` (aliases of
``--checkpoint`` / ``--output``), ``--convert_to_full_state`` / ``--convert_from_full_state``, ``--tp_size`` (must
equal the processes launched), ``--pp_size`` (checked against the checkpoint read; the stages written),
``--load_xser`` / ``--save_xser``, ``--kv_size_multiplier`` (``distributed_strategy.kv_replicator``),
``--qkv_linear`` and ``--fuse_qkv`` (``model.*``; they set the run config's keys).

``--checkpoint`` is a checkpoint directory ``<root>/<tag>`` or a checkpoint root (the newest complete tag of it
is used). Boolean options take an explicit value (``--overwrite true``, ``--save-tokenizer false``) or none
(``--overwrite`` alone means true): NxDT's converter declares booleans with ``type=bool``, so ``--flag False``
there means *True*; :func:`parse_bool` does not repeat that defect. Trailing arguments are Hydra overrides of the
run config in every form Hydra takes (``model.fuse_qkv=false``, ``+key=value``, ``++key=value``, ``~key``).

The tokenizer written with the HF model is the one the run saved in its run directory (``<log_dir>/tokenizer``,
next to ``<log_dir>/checkpoints``), not one rebuilt from the config: without it, a ``bytelevel_bpe`` config is
refused (the export would train a tokenizer that may differ), and an on-disk ``data.tokenizer`` is used with a
warning.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import torch

from nxd_lc.app.convert import (
    compose_run_config,
    convert_checkpoint_to_hf,
    convert_hf_to_checkpoint,
    export_config,
    export_guards,
)
from nxd_lc.checkpoint.model_shards import check_layout, check_output, resolve_checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_TRUE = ("true", "1", "yes", "y", "on")


_FALSE = ("false", "0", "no", "n", "off")


def parse_bool(text: str | bool) -> bool:
    """Strict boolean for argparse: ``true/false, 1/0, yes/no, y/n, on/off`` (any case) -> bool.

    Raises:
        argparse.ArgumentTypeError: any other text (argparse turns it into a usage error naming the option).
    """
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false, 1/0, yes/no), got {text!r}")


def parse_optional_bool(text: str) -> bool | None:
    """:func:`parse_bool`, plus ``auto`` / ``none`` -> None (auto-detect)."""
    if str(text).strip().lower() in ("auto", "none"):
        return None
    return parse_bool(text)


def explicit_bool_values(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``true`` inserted after each bare boolean flag (``--overwrite``, ``--save-xser``, ...) that is
    not followed by a boolean word: argparse would otherwise take the next word, e.g. the first Hydra override
    (``--overwrite model.fuse_qkv=false``), as the flag's value. ``--flag=value`` is left as it is."""
    flags = {opt for action in parser._actions if action.const is True and action.nargs == "?"
             for opt in action.option_strings}
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg in flags and (following is None or str(following).strip().lower() not in _TRUE + _FALSE):
            out.append("true")
    return out


def override_problem(overrides: Sequence[str]) -> str | None:
    """The first override Hydra's own parser refuses, as a message naming it and the accepted forms; None when all
    parse (``key=value``, ``+key=value``, ``++key=value``, ``~key``, ``~key=value``, as on ``train.py``'s command
    line)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as e:
            reason = str(e).splitlines()[1:2] or [""]
            return (f"override {override!r} is not a Hydra override ({reason[0].strip()}); use key=value, "
                    "+key=value (add), ++key=value (add or set) or ~key (delete)")
    return None


def build_arg_parser() -> argparse.ArgumentParser:
    """The converter's command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m nxd_lc.cli.convert",
                                description="Convert an nxd_lc NxD-layout checkpoint into an HF model directory.")
    p.add_argument("--config-name", default=None,
                   help="run config name in --config-dir (e.g. cpu_tiny_llama_config): needed for a checkpoint "
                        "without run_config.yaml (NxD's) and with --convert_from_full_state; for an nxd_lc "
                        "checkpoint, which carries its run's config, only checked against it")
    p.add_argument("--config-dir", default="conf", help="Hydra config directory (default: ./conf)")
    p.add_argument("--checkpoint", "--input_dir", dest="checkpoint", required=True,
                   help="checkpoint dir <root>/<tag>, or a root (newest tag); with --convert_from_full_state the HF "
                        "model directory")
    p.add_argument("--output", "--output_dir", dest="output", required=True,
                   help="HF output directory; with --convert_from_full_state the checkpoint root (<output>/<tag>)")
    p.add_argument("--convert_to_full_state", "--convert-to-full-state", type=parse_bool, nargs="?", const=True,
                   default=None, help="NxD checkpoint -> full (HF) state: the default direction")
    p.add_argument("--convert_from_full_state", "--convert-from-full-state", type=parse_bool, nargs="?", const=True,
                   default=False, help="full (HF) state -> NxD checkpoint at --tp_size (= processes) / --pp_size")
    p.add_argument("--tp_size", "--tp-size", type=int, default=None,
                   help="TP size: of the checkpoint read, or of the one written; must equal the processes launched")
    p.add_argument("--pp_size", "--pp-size", type=int, default=None,
                   help="PP size: of the checkpoint read (checked), or the stages to write (default 1)")
    p.add_argument("--kv_size_multiplier", "--kv-size-multiplier", type=int, default=None,
                   help="distributed_strategy.kv_replicator of the model (NxD's name)")
    p.add_argument("--qkv_linear", "--qkv-linear", type=parse_bool, default=None, help="model.qkv_linear")
    p.add_argument("--fuse_qkv", "--fuse-qkv", type=parse_bool, default=None, help="model.fuse_qkv")
    p.add_argument("--save-xser", "--save_xser", dest="save_xser", type=parse_bool, nargs="?", const=True,
                   default=True, help="--convert_from_full_state: write xser shards (true) or torch.save (false)")
    p.add_argument("--tag", default="step=0", help="--convert_from_full_state: the checkpoint tag (default step=0)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="dtype of the saved tensors (default: the model parameters' dtype)")
    p.add_argument("--overwrite", type=parse_bool, nargs="?", const=True, default=False,
                   help="replace an existing non-empty --output (true/false; bare flag = true)")
    p.add_argument("--save-tokenizer", "--save_tokenizer", dest="save_tokenizer", type=parse_bool, nargs="?",
                   const=True, default=True, help="copy the run's tokenizer into --output (default true)")
    p.add_argument("--load-xser", "--load_xser", dest="load_xser", type=parse_optional_bool, default=None,
                   help="checkpoint format: true (xser), false (torch.save) or auto (default: detect)")
    p.add_argument("overrides", nargs="*",
                   help="Hydra overrides of the run config (of --config-name, else of the checkpoint's own): "
                        "key=value, +key=value, ++key=value, ~key; they may not change the checkpoint's model")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (module docstring). Returns 0, or 2 after printing a config/input error."""
    import torch.distributed as dist

    from nxd_lc.checkpoint.integrity import CheckpointIntegrityError
    from nxd_lc.checkpoint.xser import UnsafeCheckpointError
    from nxd_lc.config.errors import ConfigError
    from nxd_lc.runtime.device import init_distributed, launched_world_size

    parser = build_arg_parser()
    args = parser.parse_args(explicit_bool_values(sys.argv[1:] if argv is None else argv, parser))
    problem = override_problem(args.overrides)
    if problem:
        parser.error(problem)
    if args.convert_from_full_state and args.convert_to_full_state:
        parser.error("--convert_to_full_state and --convert_from_full_state: choose one direction")
    if args.convert_to_full_state is False and not args.convert_from_full_state:
        parser.error("--convert_to_full_state false needs --convert_from_full_state true (there are two directions)")
    world = launched_world_size()
    if args.tp_size is not None and args.tp_size != world:
        parser.error(f"--tp_size {args.tp_size}: launch one process per TP rank (torchrun --nproc_per_node="
                     f"{args.tp_size}); {world} launched")
    # "++": set the key whether or not the run's YAML has it
    model_overrides = [f"++distributed_strategy.tensor_model_parallel_size={world}"] if args.tp_size else []
    for flag, key in (("kv_size_multiplier", "distributed_strategy.kv_replicator"),
                      ("qkv_linear", "model.qkv_linear"), ("fuse_qkv", "model.fuse_qkv")):
        if getattr(args, flag) is not None:
            model_overrides.append(f"++{key}={str(getattr(args, flag)).lower()}")
    if args.pp_size is not None and not args.convert_from_full_state:
        model_overrides.append(f"++distributed_strategy.pipeline_model_parallel_size={args.pp_size}")
    args.overrides = model_overrides + list(args.overrides)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", stream=sys.stdout)
    created_group = False
    if args.convert_from_full_state and not args.config_name:
        parser.error("--convert_from_full_state needs --config-name: the run config of the checkpoint to write")
    try:
        given = compose_run_config(args.config_name, args.config_dir, args.overrides) if args.config_name else None
        if args.convert_from_full_state:
            assert given is not None
            cfg = given
            created_group = not dist.is_initialized()
            init_distributed("cpu")
            out = convert_hf_to_checkpoint(cfg, args.checkpoint, args.output, tag=args.tag, pp_size=args.pp_size or 1,
                                           use_xser=args.save_xser)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"wrote checkpoint {out} (TP {world}, PP {args.pp_size or 1}) from HF model {args.checkpoint}")
            return 0
        root, tag = resolve_checkpoint(args.checkpoint)  # cheap checks before any process group exists
        ckpt_overrides = args.overrides if given is None else ()  # without --config-name: of the saved config
        cfg = export_config(os.path.join(root, tag), given, ckpt_overrides)
        check_layout(cfg, os.path.join(root, tag), launched_world_size())
        check_output(os.path.abspath(args.output), args.overwrite, **export_guards(root))
        created_group = not dist.is_initialized()
        init_distributed("cpu")
        out = convert_checkpoint_to_hf(given, os.path.join(root, tag), args.output,
                                       dtype=_DTYPES[args.dtype] if args.dtype else None, overwrite=args.overwrite,
                                       use_xser=args.load_xser, save_tokenizer=args.save_tokenizer,
                                       overrides=ckpt_overrides)
    except (ConfigError, FileNotFoundError, ValueError, CheckpointIntegrityError, UnsafeCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)  # one line naming the key, file or flag: no traceback
        return 2
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote HF model {out} from checkpoint {os.path.join(root, tag)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
