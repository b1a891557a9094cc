"""Convert an nxd_lc (NxD-layout, TP-sharded) training checkpoint into a Hugging Face model directory.

::

    torchrun --nproc_per_node=<TP> -m nxd_lc.checkpoint.convert --config-name cpu_tiny_llama_config \\
        --checkpoint nxd_lc_runs/cpu_tiny_llama/checkpoints/<tag> --output nxd_lc_runs/hf/cpu_tiny_llama

Runs at the checkpoint's tensor-parallel size (one process per TP rank; PP = 1; a checkpoint saved with expert
parallelism, ``dp_rank_00_ep_rank_XX_...`` files, needs TP x EP processes, each loading its EP rank's experts,
gathered over EP on export). Every rank builds the model
of the run's config (sharded at construction, as in training), loads its own model shard
(``<tag>/model/dp_rank_00_tp_rank_XX_pp_rank_00.pt``, xser or plain, via
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
there means *True*; :func:`parse_bool` does not repeat that defect. Trailing ``key=value`` arguments are Hydra
overrides of the run config (e.g. ``model.fuse_qkv=false``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nxd_lc.checkpoint import sharded
from nxd_lc.config.schema import NxdConfig
from nxd_lc.layers.lora import load_lora_state_dict, merge_lora

log = logging.getLogger("nxd_lc.checkpoint.convert")

MODEL_PREFIX = "model."  # the LightningModule holds the decoder as ``self.model``
PROVENANCE_FILE = "nxd_lc_conversion.json"
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


def build_arg_parser() -> argparse.ArgumentParser:
    """The converter's command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m nxd_lc.checkpoint.convert",
                                description="Convert an nxd_lc NxD-layout checkpoint into an HF model directory.")
    p.add_argument("--config-name", required=True, help="run config name in --config-dir (e.g. cpu_tiny_llama_config)")
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
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the run config, key=value")
    return p


def compose_run_config(config_name: str, config_dir: str = "conf", overrides: Sequence[str] = ()) -> NxdConfig:
    """Compose ``<config_dir>/<config_name>.yaml`` with Hydra (+ overrides) and validate it.

    Validated for its own world size (``trainer.devices * trainer.num_nodes``), without path checks.

    Raises:
        FileNotFoundError: the config directory or file does not exist.
        nxd_lc.config.errors.ConfigError: the config is invalid (every problem listed).
    """
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.validation import load_config
    from nxd_lc.config.schema import register_configs

    conf_dir = os.path.abspath(config_dir)
    name = config_name[:-5] if config_name.endswith(".yaml") else config_name
    if not os.path.isfile(os.path.join(conf_dir, f"{name}.yaml")):
        raise FileNotFoundError(f"--config-name: {os.path.join(conf_dir, name + '.yaml')} does not exist; "
                                f"pass --config-dir or a config name from {conf_dir}")
    register_configs()
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        raw = compose(config_name=name, overrides=list(overrides))
    return load_config(raw, world_size=None, check_paths=False)


def resolve_checkpoint(path: str) -> tuple[str, str]:
    """``(ckpt_root, tag)`` of ``path``: a checkpoint dir ``<root>/<tag>``, or a root (its newest complete tag).

    Raises:
        FileNotFoundError: ``path`` does not exist (lists the complete tags next to it), is a root without a
            complete checkpoint, or is a checkpoint without its ``done`` marker (incomplete save).
    """
    path = os.path.abspath(path)
    root, tag = os.path.split(path.rstrip(os.sep))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--checkpoint: {path} does not exist; complete checkpoints in {root}: "
                                f"{sharded.list_checkpoints(root)}")
    if os.path.isdir(os.path.join(path, sharded.MODEL_DIR)) or os.path.isfile(os.path.join(path, sharded.DONE_FILE)):
        if not sharded.is_complete(path):
            raise FileNotFoundError(f"--checkpoint: {path} has no '{sharded.DONE_FILE}' marker: the save was "
                                    f"interrupted; complete checkpoints in {root}: {sharded.list_checkpoints(root)}")
        return root, tag
    newest = sharded.latest_checkpoint(path)
    if newest is None:
        raise FileNotFoundError(f"--checkpoint: {path} is neither a checkpoint (no '{sharded.MODEL_DIR}/' dir) "
                                f"nor a checkpoint root with a complete checkpoint")
    log.info("--checkpoint %s is a checkpoint root; using its newest complete checkpoint %s", path, newest)
    return path, newest


def checkpoint_parallel_sizes(tag_dir: str) -> tuple[int, int]:
    """``(TP, PP)`` sizes a checkpoint was saved with, from its model shard file names.

    Raises:
        FileNotFoundError: no model shards, or the shard of a (TP, PP) rank is missing (incomplete checkpoint).
    """
    from nxd_lc.checkpoint.reshard import saved_layout

    saved = saved_layout(tag_dir)
    return saved.tp, saved.pp


def checkpoint_tp_size(tag_dir: str) -> int:
    """Tensor-parallel size a checkpoint was saved with (see :func:`checkpoint_parallel_sizes`)."""
    return checkpoint_parallel_sizes(tag_dir)[0]


def check_layout(cfg: NxdConfig, tag_dir: str, world_size: int) -> tuple[int, int]:
    """Check that ``cfg`` and the launch match the checkpoint's layout; returns its ``(TP, EP)`` sizes.

    Pipeline stages are gathered: the converter runs one process per (EP, TP) rank, each loading that rank's shard
    of every pipeline stage.

    Raises:
        ValueError: the config's ``tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` /
            ``expert_model_parallel_size`` or the number of launched processes differs from the checkpoint's (each
            names the fix).
        FileNotFoundError: see :func:`nxd_lc.checkpoint.reshard.saved_layout`.
    """
    from nxd_lc.checkpoint.reshard import saved_layout

    saved = saved_layout(tag_dir)
    tp, pp, ep = saved.tp, saved.pp, saved.ep
    ds = cfg.distributed_strategy
    if ds.pipeline_model_parallel_size != pp:
        raise ValueError(f"PP mismatch: checkpoint {tag_dir} was saved with pipeline_model_parallel_size {pp} but "
                         f"the config has distributed_strategy.pipeline_model_parallel_size="
                         f"{ds.pipeline_model_parallel_size}; pass the override "
                         f"distributed_strategy.pipeline_model_parallel_size={pp} (the run's own config)")
    if ds.tensor_model_parallel_size != tp:
        raise ValueError(f"TP mismatch: checkpoint {tag_dir} was saved with tensor_model_parallel_size {tp} but "
                         f"the config has distributed_strategy.tensor_model_parallel_size="
                         f"{ds.tensor_model_parallel_size}; pass the override "
                         f"distributed_strategy.tensor_model_parallel_size={tp}")
    if ds.expert_model_parallel_size != ep:
        raise ValueError(f"EP mismatch: checkpoint {tag_dir} was saved with expert_model_parallel_size {ep} but the "
                         f"config has distributed_strategy.expert_model_parallel_size="
                         f"{ds.expert_model_parallel_size}; pass the override "
                         f"distributed_strategy.expert_model_parallel_size={ep}")
    if world_size != tp * ep:
        raise ValueError(f"TP mismatch: checkpoint {tag_dir} has {tp} TP x {ep} EP shard(s) but {world_size} "
                         f"process(es) were launched; run with torchrun --nproc_per_node={tp * ep}")
    return tp, ep


def build_model(cfg: NxdConfig, *, load_weights: bool = False) -> torch.nn.Module:
    """The run's decoder, sharded for this rank's TP coordinate (``parallel_state`` must be initialised).

    Uses the training job's own builder so that the model matches the one that wrote the checkpoint. With
    ``load_weights`` it also loads ``model.hf_weights_dir`` (this rank's shard), else the weights are fresh.

    Raises:
        RuntimeError: the builder did not apply ``model.hf_config_overrides.rope_scaling`` (a rope_type other
            than the configured one would silently change the model).
    """
    from nxd_lc.train import build_model as _build_run_model

    # the whole model on each TP rank: pipeline stages are gathered (see check_layout)
    ds = dataclasses.replace(cfg.distributed_strategy, pipeline_model_parallel_size=1,
                             virtual_pipeline_model_parallel_size=1)
    cfg = dataclasses.replace(cfg, distributed_strategy=ds, model=dataclasses.replace(cfg.model, pipeline_cuts=None))
    if not load_weights:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_weights_dir=None))
    _, model = _build_run_model(cfg)
    rope = (cfg.model.hf_config_overrides or {}).get("rope_scaling")
    wanted = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    built = model.rotary_emb.spec.rope_type if model.rotary_emb is not None else None
    if wanted is not None and built != wanted:
        raise RuntimeError(f"model.hf_config_overrides.rope_scaling.rope_type is {wanted!r} but the model was "
                           f"built with rope_type {built!r}: nxd_lc.train.build_model ignores hf_config_overrides")
    return model


def load_model_shard(model: torch.nn.Module, ckpt_root: str, tag: str, *, tp_rank: int,
                     use_xser: bool | None = None, adapters_only: bool = False, ep_rank: int | None = None) -> None:
    """Copy this TP rank's model shard of ``<ckpt_root>/<tag>`` into ``model`` (strict: every parameter; with
    ``adapters_only`` every LoRA adapter, the checkpoint of ``model_alignment_strategy.peft.save_lora_base: false``);
    ``ep_rank``: this rank's EP rank for a checkpoint saved with expert parallelism.

    Raises:
        FileNotFoundError: see :func:`nxd_lc.checkpoint.sharded.load_checkpoint`.
        ValueError: the shard is not an nxd_lc LightningModule state dict, or its names/shapes do not match the
            model built from the config (the message names the checkpoint).
    """
    _, pp = checkpoint_parallel_sizes(os.path.join(ckpt_root, tag))
    state: Any = {}
    for pp_rank in range(pp):  # pipeline stages hold disjoint parameters, named as in the whole model
        part, _, _ = sharded.load_checkpoint(ckpt_root, tag, dp_rank=0, tp_rank=tp_rank, pp_rank=pp_rank,
                                             load_optim=False, use_xser=use_xser, ep_rank=ep_rank)
        if not isinstance(part, dict):
            state = part
            break
        state.update({k: v for k, v in part.items() if k not in state})  # a tied lm-head copy: stage 0's wins
    if not isinstance(state, dict) or not any(str(k).startswith(MODEL_PREFIX) for k in state):
        keys = list(state)[:3] if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"checkpoint {os.path.join(ckpt_root, tag)}: model shard has no '{MODEL_PREFIX}*' keys "
                         f"(got {keys}); it was not written by nxd_lc's training module")
    local = {k[len(MODEL_PREFIX):]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
    if pp > 1 and getattr(getattr(model, "config", None), "tie_word_embeddings", False) and \
            "embed_tokens.weight" in local:
        local["lm_head.weight"] = local["embed_tokens.weight"]  # the last stage's copy of the tied weight
    try:
        if adapters_only:
            load_lora_state_dict(model, local)
        else:
            model.load_state_dict(local, strict=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"checkpoint {os.path.join(ckpt_root, tag)} does not match the model of the config "
                         f"(model.model_config, hf_config_overrides, fuse_qkv, qkv_linear, kv_replicator must "
                         f"be those of the run that saved it): {e}") from e


def load_run_tokenizer(cfg: NxdConfig) -> Any:
    """The tokenizer the run trained with (``data.tokenizer``: an HF directory, or the cached byte-level BPE of
    its corpus, trained now if the cache is missing).

    Raises:
        ValueError: as :func:`nxd_lc.data.tokenizer.load_tokenizer` (names ``data.tokenizer.type``).
    """
    from nxd_lc.data.datamodule import PretrainingDataModule
    from nxd_lc.data.sources import iter_documents
    from nxd_lc.data.tokenizer import DEFAULT_CACHE_DIR, load_tokenizer

    d = cfg.data
    if d.data_prefix is not None:  # Megatron indexed data: an on-disk tokenizer, nothing trained
        return load_tokenizer(d.tokenizer, None, require_fast=False)
    dm = PretrainingDataModule(d, seq_length=1, seed=cfg.seed, model_vocab_size=1, data_parallel_rank=0,
                               data_parallel_size=1, global_batch_size=d.micro_batch_size)
    train_src, _ = dm._sources()  # the same (train split) source the run fingerprinted its BPE with
    texts = None if train_src.pretokenized else (lambda: iter_documents(train_src))
    return load_tokenizer(d.tokenizer, texts, d.tokenizer.cache_dir or DEFAULT_CACHE_DIR,
                          corpus_fingerprint=train_src.fingerprint(), is_builder=True)


def _check_output(output: str, overwrite: bool) -> None:
    if os.path.isfile(output):
        raise ValueError(f"--output: {output} is a file; give a directory path")
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise ValueError(f"--output: {output} exists and is not empty; pass --overwrite true to replace it")


def _publish(staging: str, output: str) -> None:
    """Rank 0: move ``staging`` to ``output``, replacing an existing ``output`` only once staging is complete."""
    trash = None
    if os.path.lexists(output):
        trash = f"{output}.old-{uuid.uuid4().hex[:8]}"
        os.replace(output, trash)
    os.replace(staging, output)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def convert_checkpoint_to_hf(cfg: NxdConfig, checkpoint: str, output: str, *, dtype: torch.dtype | None = None,
                             overwrite: bool = False, use_xser: bool | None = None,
                             save_tokenizer: bool = True) -> str:
    """Write checkpoint ``checkpoint`` of the run ``cfg`` as an HF model directory ``output``.

    Collective: every rank of the default process group calls it (a group of one, or no group, for TP = 1).
    World size must equal the checkpoint's TP size. Initialises ``parallel_state`` (TP = the checkpoint's, CP =
    PP = 1) when it is not initialised, and tears it down again afterwards.

    Args:
        cfg: the validated config of the run that wrote the checkpoint (its model, ``hf_config_overrides``
            included, and its tokenizer).
        checkpoint: ``<root>/<tag>`` or a checkpoint root (newest complete tag).
        output: HF directory to create (``model.safetensors``, ``config.json``, tokenizer files,
            ``nxd_lc_conversion.json``).
        dtype: dtype of the saved tensors (default: the parameters' dtype).
        overwrite: replace an existing non-empty ``output``.
        use_xser: checkpoint format, None = auto-detect.
        save_tokenizer: also save the run's tokenizer (:func:`load_run_tokenizer`).

    Returns:
        The absolute output directory.

    Raises:
        FileNotFoundError: missing / incomplete checkpoint, missing shard.
        ValueError: TP mismatch between checkpoint, config and launch; existing output without ``overwrite``;
            shard that does not fit the config's model.
    """
    from nxd_lc.config.access import peft_config
    from nxd_lc.distributed import collectives
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.models.llama.hf_adapter import save_hf_weights

    root, tag = resolve_checkpoint(checkpoint)
    tag_dir = os.path.join(root, tag)
    tp, ep = check_layout(cfg, tag_dir, collectives.get_global_world_size())
    output = os.path.abspath(output)
    _check_output(output, overwrite)
    own_state = not ps.model_parallel_is_initialized()
    if own_state:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     kv_replicator=cfg.distributed_strategy.kv_replicator)
    elif ps.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(f"parallel_state has TP size {ps.get_tensor_model_parallel_world_size()} but checkpoint "
                         f"{tag_dir} has TP size {tp}")
    try:
        rank0 = collectives.get_global_rank() == 0
        peft = peft_config(cfg)
        lora_only = peft is not None and not peft.save_lora_base  # base weights from model.hf_weights_dir
        model = build_model(cfg, load_weights=lora_only)
        load_model_shard(model, root, tag, tp_rank=ps.get_tensor_model_parallel_rank(), use_xser=use_xser,
                         adapters_only=lora_only, ep_rank=ps.get_expert_model_parallel_rank() if ep > 1 else None)
        if peft is not None:
            merge_lora(model)  # the HF directory holds plain weights: base + scale * B @ A
        tokenizer = load_run_tokenizer(cfg) if save_tokenizer and rank0 else None
        parent, name = os.path.split(output)
        staging = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:8]}")
        if rank0:
            os.makedirs(parent, exist_ok=True)
        save_hf_weights(model, staging, dtype=dtype)  # collective; rank 0 writes
        if rank0:
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            _write_provenance(staging, tag_dir, tp, cfg)
            _publish(staging, output)
        collectives.barrier()
    finally:
        if own_state:
            ps.destroy_model_parallel()
    return output


def stage_state(state: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """The entries of a whole-model LightningModule state dict (``model.<name>``) that pipeline rank ``part``
    holds (``part``: :func:`nxd_lc.pipeline.rank_model_part`): its ``layers.<i>``, the embedding (and a learned
    position table) on the first stage, the final norm and lm head on the last; other entries (buffers) go to every
    stage."""
    keep = {f"{MODEL_PREFIX}layers.{i}." for i in part["keep_layers"]}
    out = {}
    for k, v in state.items():
        if k.startswith(f"{MODEL_PREFIX}layers."):
            take = any(k.startswith(prefix) for prefix in keep)
        elif k.startswith((f"{MODEL_PREFIX}embed_tokens.", f"{MODEL_PREFIX}embed_positions.")):
            take = bool(part["keep_embedding"])
        elif k.startswith((f"{MODEL_PREFIX}norm.", f"{MODEL_PREFIX}lm_head.")):
            take = bool(part["keep_head"])
        else:
            take = True
        if take:
            out[k] = v
    return out


def convert_hf_to_checkpoint(cfg: NxdConfig, hf_dir: str, output: str, *, tag: str = "step=0",
                             pp_size: int = 1, use_xser: bool = True) -> str:
    """Write the HF model ``hf_dir`` as an NxD-layout checkpoint ``<output>/<tag>`` at this launch's TP size and
    ``pp_size`` stages (NxD's ``--convert_from_full_state``); collective, one process per TP rank.

    Every TP rank builds the whole model of ``cfg`` with ``model.hf_weights_dir: hf_dir`` (the training loader:
    fused QKV, ``kv_replicator`` and ``qkv_linear`` as configured), splits it into the stages a run with
    ``pipeline_model_parallel_size: pp_size`` (and ``model.pipeline_cuts``) builds, and writes one model shard per
    (TP rank, stage), with the manifest and ``done`` of a training checkpoint. It holds weights only (no optimizer
    state or trainer loops): start a run from it with ``exp_manager.resume_from_checkpoint: <output>/<tag>`` and
    ``model.weight_init_only: true``, as NxDT does with converted checkpoints.

    Returns:
        The checkpoint directory ``<output>/<tag>``.

    Raises:
        ValueError: ``pp_size`` < 1 or more stages than layers (see :func:`nxd_lc.pipeline.rank_model_part`).
        FileNotFoundError: ``hf_dir`` has no weights.
    """
    from nxd_lc.distributed import collectives
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.pipeline import rank_model_part

    if pp_size < 1:
        raise ValueError(f"--pp_size must be >= 1, got {pp_size}")
    tp = collectives.get_global_world_size()
    own_state = not ps.model_parallel_is_initialized()
    if own_state:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     kv_replicator=cfg.distributed_strategy.kv_replicator)
    try:
        model = build_model(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_weights_dir=hf_dir)),
                            load_weights=True)
        state = {MODEL_PREFIX + k: v for k, v in model.state_dict().items()}
        layers = model.config.num_hidden_layers
        parts = [stage_state(state, rank_model_part(layers, pp_size, r, 1, cfg.model.pipeline_cuts))
                 for r in range(pp_size)]
        tp_rank = ps.get_tensor_model_parallel_rank()
        rank0 = collectives.get_global_rank() == 0
        staged = sharded.stage_checkpoint(os.path.abspath(output), tag, model_state=parts[0], optim_state=None,
                                          user_content={"global_step": 0, "converted_from": os.path.abspath(hf_dir)},
                                          dp_rank=0, tp_rank=tp_rank, pp_rank=0, is_global_zero=rank0,
                                          write_model=True, write_optim=False, use_xser=use_xser, step=0)
        for pp_rank in range(1, pp_size):  # the other stages' shards of this TP rank
            staged.files.append((f"{sharded.MODEL_DIR}/{sharded.checkpoint_file_name(0, tp_rank, pp_rank)}",
                                 parts[pp_rank], use_xser))
        staged.write()
        return staged.publish()
    finally:
        if own_state:
            ps.destroy_model_parallel()


def _write_provenance(directory: str, tag_dir: str, tp: int, cfg: NxdConfig) -> None:
    done: Any = None
    try:
        done = json.loads(Path(tag_dir, sharded.DONE_FILE).read_text())
    except (OSError, ValueError):
        pass
    record = {"source_checkpoint": tag_dir, "step": done.get("step") if isinstance(done, dict) else None,
              "tensor_model_parallel_size": tp, "run_name": cfg.name, "model_config": cfg.model.model_config,
              "hf_config_overrides": cfg.model.hf_config_overrides, "converter": "nxd_lc.checkpoint.convert"}
    Path(directory, PROVENANCE_FILE).write_text(json.dumps(record, indent=2, default=str))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (module docstring). Returns 0, or 2 after printing a config/input error."""
    import torch.distributed as dist

    from nxd_lc.config.errors import ConfigError
    from nxd_lc.runtime.device import init_distributed, launched_world_size

    parser = build_arg_parser()
    args = parser.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must be key=value, got {bad}")
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
    try:
        cfg = compose_run_config(args.config_name, args.config_dir, args.overrides)
        if args.convert_from_full_state:
            created_group = not dist.is_initialized()
            init_distributed("cpu")
            out = convert_hf_to_checkpoint(cfg, args.checkpoint, args.output, tag=args.tag, pp_size=args.pp_size or 1,
                                           use_xser=args.save_xser)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"wrote checkpoint {out} (TP {world}, PP {args.pp_size or 1}) from HF model {args.checkpoint}")
            return 0
        root, tag = resolve_checkpoint(args.checkpoint)  # cheap checks before any process group exists
        check_layout(cfg, os.path.join(root, tag), launched_world_size())
        _check_output(os.path.abspath(args.output), args.overwrite)
        created_group = not dist.is_initialized()
        init_distributed("cpu")
        out = convert_checkpoint_to_hf(cfg, os.path.join(root, tag), args.output,
                                       dtype=_DTYPES[args.dtype] if args.dtype else None, overwrite=args.overwrite,
                                       use_xser=args.load_xser, save_tokenizer=args.save_tokenizer)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote HF model {out} from checkpoint {os.path.join(root, tag)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
