"""Run-level checkpoint conversions: nxd_lc (NxD-layout, TP-sharded) checkpoint -> Hugging Face directory
(:func:`convert_checkpoint_to_hf`) and back (:func:`convert_hf_to_checkpoint`, NxD's ``--convert_from_full_state``),
with the run's own config (:func:`compose_run_config`), model (:func:`build_model`, the training builder) and
tokenizer (:func:`load_run_tokenizer`). The command line and its flags are :mod:`nxd_lc.cli.convert`; the
checkpoint-level pieces (locating, layout checks, shard loading, atomic publishing) are
:mod:`nxd_lc.checkpoint.model_shards`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from nxd_lc.app.build import build_model as build_run_model
from nxd_lc.app.build import run_kv_layout, set_checkpoint_kv_layout
from nxd_lc.checkpoint import sharded
from nxd_lc.checkpoint.model_shards import (
    MODEL_PREFIX,
    check_layout,
    check_output,
    load_model_shard,
    publish,
    resolve_checkpoint,
    stage_state,
    staging_siblings,
    write_provenance,
)
from nxd_lc.checkpoint.nxd_format import checkpoint_kv_layout
from nxd_lc.checkpoint.xser import set_weights_only
from nxd_lc.config.schema import NxdConfig
from nxd_lc.layers.lora import merge_lora

log = logging.getLogger("nxd_lc.checkpoint.convert")


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


def saved_run_config(tag_dir: str, overrides: Sequence[str] = ()) -> NxdConfig | None:
    """The config of the run that wrote checkpoint ``tag_dir`` (its ``run_config.yaml``,
    :mod:`nxd_lc.config.run_record`), with ``model.model_config`` pointing at the checkpoint's copy of the model's
    config.json, and Hydra ``overrides`` applied; None for a checkpoint without one (NxD's, or nxd_lc's before
    checkpoints carried their config).

    Raises:
        FileNotFoundError / nxd_lc.config.errors.ConfigError: as :func:`compose_run_config` (an override that does
            not apply, an invalid result).
    """
    import tempfile

    from nxd_lc.config.run_record import MODEL_CONFIG_FILE, RUN_CONFIG_FILE

    path = os.path.join(tag_dir, RUN_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    model_json = os.path.join(tag_dir, MODEL_CONFIG_FILE)
    with tempfile.TemporaryDirectory(prefix="nxd_lc_run_config_") as tmp:
        with open(os.path.join(tmp, "run_config.yaml"), "w", encoding="utf-8") as f:
            f.write(text)
        quoted = "'" + model_json.replace("\\", "\\\\").replace("'", "\\'") + "'"  # a tag holds '=' (step=2)
        pinned = [f"model.model_config={quoted}"] if os.path.isfile(model_json) else []
        return compose_run_config("run_config", tmp, [*pinned, *overrides])


#: ``model.*`` keys that shape training, not the weights or the HF config an export writes: an export config may
#: differ from the checkpoint's run config on them (``model.model_config`` is compared by its file's content)
TRAINING_ONLY_MODEL_KEYS = frozenset({
    "model_config", "hf_weights_dir", "hf_conversion_cache", "hf_conversion_cache_dir", "force_reconvert_from_hf",
    "encoder_seq_length", "tiled_loss_chunk_size", "tiled_mlp_chunk_size", "compile", "enable_cuda_graph",
    "weight_init_only", "use_cpu_initialization", "activations_checkpoint_granularity",
    "activations_checkpoint_recompute", "activations_checkpoint_save_attention", "activations_checkpoint_method",
    "activations_checkpoint_num_layers", "activations_offload", "activations_memory_budget", "pipeline_cuts",
    "fusions", "transpose_nki_inputs", "do_layer_norm_weight_decay", "optim", "init_method_std",
    "use_scaled_init_method", "hidden_dropout", "attention_dropout", "ffn_dropout", "persist_layer_norm"})


def _model_defining(cfg: NxdConfig) -> dict[str, Any]:
    """The keys of ``cfg`` that decide the exported model (flat, dotted): ``model.*`` but
    :data:`TRAINING_ONLY_MODEL_KEYS`, ``model_source``, ``distributed_strategy.kv_replicator`` and the LoRA
    adapters' keys."""
    from nxd_lc.config.access import peft_config
    from nxd_lc.config.run_record import flat_keys

    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in TRAINING_ONLY_MODEL_KEYS}
    out = flat_keys("model", model)
    out["model_source"] = cfg.model_source
    out["distributed_strategy.kv_replicator"] = cfg.distributed_strategy.kv_replicator
    peft = peft_config(cfg)
    out.update(flat_keys("model_alignment_strategy.peft", dataclasses.asdict(peft) if peft is not None else None))
    return out


def export_config_differences(saved: NxdConfig, given: NxdConfig) -> list[str]:
    """Where ``given`` (an export's command-line config) would build another model than ``saved`` (the
    checkpoint's run config): one ``"<key>: ..."`` line per differing key, the fields of the model's config.json
    (``model.model_config``, compared by content) included; empty when they agree.

    Raises:
        nxd_lc.config.errors.ConfigError: a ``model.model_config`` file that cannot be read (names it).
    """
    from nxd_lc.models.config_json import read_model_json

    a, b = _model_defining(saved), _model_defining(given)
    lines = [f"{key}: {b.get(key)!r} on the command line, {a.get(key)!r} in the checkpoint's run config"
             for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    ja, jb = read_model_json(saved) or {}, read_model_json(given) or {}
    lines += [f"model.model_config ({given.model.model_config}): {field} is {jb.get(field)!r}, the checkpoint's "
              f"copy has {ja.get(field)!r}" for field in sorted(set(ja) | set(jb)) if ja.get(field) != jb.get(field)]
    return lines


def export_config(tag_dir: str, given: NxdConfig | None, overrides: Sequence[str] = ()) -> NxdConfig:
    """The config an export of checkpoint ``tag_dir`` builds its model with.

    A checkpoint that carries its run's config (:func:`saved_run_config`): that config, with ``overrides`` applied
    when no ``given`` config is passed; a ``given`` config (the command line's ``--config-name``, composed with its
    overrides) is only checked against it: it must agree on every model-defining key
    (:func:`export_config_differences`), and so must the overrides. A checkpoint without one: ``given``.

    Raises:
        ValueError: ``given`` or ``overrides`` disagree with the checkpoint's run config (names every differing key
            and the fix), or the checkpoint carries no run config and ``given`` is None.
    """
    from nxd_lc.config.run_record import RUN_CONFIG_FILE

    saved = saved_run_config(tag_dir)
    if saved is None:
        if given is None:
            raise ValueError(f"checkpoint {tag_dir} carries no {RUN_CONFIG_FILE} (written by NxD, or by nxd_lc "
                             "before checkpoints carried their run config): pass the run's config with "
                             "--config-name (and its overrides)")
        return given
    result = saved
    if given is None and overrides:
        given = result = saved_run_config(tag_dir, overrides)
    if given is not None:
        differ = export_config_differences(saved, given)
        if differ:
            raise ValueError(f"the config given for the export disagrees with the run that wrote {tag_dir} "
                             f"(its {RUN_CONFIG_FILE}) on {len(differ)} key(s), so it would export another model:\n"
                             + "\n".join(f"  - {d}" for d in differ)
                             + "\ndrop --config-name and those overrides (the checkpoint's own config is used)")
    log.info("export of %s: the model is built from the checkpoint's %s (run %r)%s", tag_dir, RUN_CONFIG_FILE,
             saved.name, "; the given config agrees on every model key" if result is saved and given else "")
    return result


def build_model(cfg: NxdConfig, *, load_weights: bool = False) -> torch.nn.Module:
    """The run's decoder, sharded for this rank's TP coordinate (``parallel_state`` must be initialised).

    Uses the training job's own builder so that the model matches the one that wrote the checkpoint. With
    ``load_weights`` it also loads ``model.hf_weights_dir`` (this rank's shard), else the weights are fresh.

    Raises:
        RuntimeError: the builder did not apply ``model.hf_config_overrides.rope_scaling`` (a rope_type other
            than the configured one would silently change the model).
    """
    # the whole model on each TP rank: pipeline stages are gathered (see check_layout)
    ds = dataclasses.replace(cfg.distributed_strategy, pipeline_model_parallel_size=1,
                             virtual_pipeline_model_parallel_size=1)
    cfg = dataclasses.replace(cfg, distributed_strategy=ds, model=dataclasses.replace(cfg.model, pipeline_cuts=None))
    if not load_weights:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_weights_dir=None))
    _, model = build_run_model(cfg)
    rope = (cfg.model.hf_config_overrides or {}).get("rope_scaling")
    wanted = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    built = model.rotary_emb.spec.rope_type if model.rotary_emb is not None else None
    if wanted is not None and built != wanted:
        raise RuntimeError(f"model.hf_config_overrides.rope_scaling.rope_type is {wanted!r} but the model was "
                           f"built with rope_type {built!r}: nxd_lc.app.build.build_model ignores hf_config_overrides")
    return model


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


def run_tokenizer_source(cfg: NxdConfig, checkpoint_root: str) -> str | None:
    """Where the HF export of a checkpoint in ``checkpoint_root`` takes its tokenizer from: the tokenizer the run
    saved (``<log_dir>/tokenizer``, :mod:`nxd_lc.lightning.run_tokenizer`), or None to load the on-disk tokenizer
    that ``data.tokenizer`` names (a run from before tokenizers were saved with it; logged as unverifiable).

    Raises:
        ValueError: the run saved no tokenizer and ``data.tokenizer`` would train one (``bytelevel_bpe``): the
            export would train a tokenizer that may differ from the run's (another corpus or vocabulary size).
    """
    from nxd_lc.data.tokenizer import BYTELEVEL_BPE
    from nxd_lc.lightning.run_tokenizer import run_tokenizer_dir

    saved = run_tokenizer_dir(checkpoint_root)
    if os.path.isdir(saved) and os.listdir(saved):
        return saved
    tok = cfg.data.tokenizer
    if tok.type == BYTELEVEL_BPE and tok.library is None:
        raise ValueError(f"the run's tokenizer is not saved with the checkpoint (no {saved}; training runs save it "
                         "there at start) and data.tokenizer.type is 'bytelevel_bpe', which would train a new "
                         "tokenizer that may differ from the run's; copy the run's tokenizer files into that "
                         "directory, or export without a tokenizer (--save-tokenizer false)")
    log.warning("the run's tokenizer is not saved with the checkpoint (no %s): saving data.tokenizer (%s) as "
                "configured, which cannot be checked against the run's", saved, tok.type)
    return None


def export_guards(checkpoint_root: str) -> dict[str, list[str]]:
    """:func:`~nxd_lc.checkpoint.model_shards.check_output`'s directories for an export of a checkpoint in
    ``checkpoint_root``: the root is sealed, and a run's directory (``<log_dir>`` of ``<log_dir>/checkpoints``)
    protected."""
    root = os.path.abspath(checkpoint_root)
    run_dir = [os.path.dirname(root)] if os.path.basename(root) == "checkpoints" else []
    return {"protected": run_dir, "sealed": [root]}


def export_tokenizer(cfg: NxdConfig, checkpoint_root: str, save_tokenizer: bool = True) -> tuple[str | None, Any]:
    """``(directory, tokenizer)``: the tokenizer an export of a checkpoint in ``checkpoint_root`` takes its files
    (``directory``: the run's saved one, None to save the loaded ``tokenizer``) and special token ids from.

    The run's saved tokenizer (``<log_dir>/tokenizer``) is loaded and checked (a damaged or truncated file is an
    error here, not a directory that transformers cannot load later); without one,
    :func:`run_tokenizer_source` decides (the configured on-disk tokenizer, with a warning, or an error for a
    ``bytelevel_bpe`` config when its files are to be saved). With ``save_tokenizer`` false and no saved
    tokenizer, ``(None, None)``: the export keeps the source config.json's token ids (warned).

    Raises:
        ValueError: a saved tokenizer that does not load (names its directory and file), or as
            :func:`run_tokenizer_source` / :func:`load_run_tokenizer`.
    """
    from nxd_lc.data.tokenizer import load_saved_tokenizer
    from nxd_lc.lightning.run_tokenizer import run_tokenizer_dir

    saved = run_tokenizer_dir(checkpoint_root)
    if os.path.isdir(saved) and os.listdir(saved):
        return saved, load_saved_tokenizer(saved, f"the run's tokenizer {saved}")
    if not save_tokenizer:
        log.warning("the run's tokenizer is not saved with the checkpoint (no %s) and --save-tokenizer is false: "
                    "config.json keeps the special token ids of %s, which may not be the tokenizer's", saved,
                    cfg.model.model_config)
        return None, None
    tokenizer_dir = run_tokenizer_source(cfg, checkpoint_root)
    return tokenizer_dir, load_run_tokenizer(cfg)


def convert_checkpoint_to_hf(cfg: NxdConfig | None, checkpoint: str, output: str, *,
                             dtype: torch.dtype | None = None, overwrite: bool = False, use_xser: bool | None = None,
                             save_tokenizer: bool = True, overrides: Sequence[str] = ()) -> str:
    """Write checkpoint ``checkpoint`` of the run ``cfg`` as an HF model directory ``output``.

    Collective: every rank of the default process group calls it (a group of one, or no group, for TP = 1).
    World size must equal the checkpoint's TP size. Initialises ``parallel_state`` (TP = the checkpoint's, CP =
    PP = 1) when it is not initialised, and tears it down again afterwards.

    The model is built from the checkpoint's own run config when it carries one (:func:`export_config`: ``cfg``
    and ``overrides`` are then checked against it and must agree on the model); ``config.json`` and
    ``generation_config.json`` carry the special token ids of the run's tokenizer (:func:`export_tokenizer`).

    Args:
        cfg: the config of the run that wrote the checkpoint (its model, ``hf_config_overrides`` included, and its
            tokenizer), as the command line gives it; None: the checkpoint's own (it must carry one).
        checkpoint: ``<root>/<tag>`` or a checkpoint root (newest complete tag).
        output: HF directory to create (``model.safetensors``, ``config.json``, tokenizer files,
            ``nxd_lc_conversion.json``).
        dtype: dtype of the saved tensors (default: the parameters' dtype).
        overwrite: replace an existing non-empty ``output``.
        use_xser: checkpoint format, None = auto-detect.
        save_tokenizer: also save the run's tokenizer (:func:`run_tokenizer_source`: the one the run saved, else
            the configured on-disk one via :func:`load_run_tokenizer`).
        overrides: Hydra overrides of the checkpoint's run config (with ``cfg`` None).

    Returns:
        The absolute output directory.

    Raises:
        FileNotFoundError: missing / incomplete checkpoint, missing shard.
        ValueError: TP mismatch between checkpoint, config and launch; existing output without ``overwrite``;
            shard that does not fit the config's model; the run's tokenizer is not saved and would be trained
            (:func:`run_tokenizer_source`).
        nxd_lc.checkpoint.xser.UnsafeCheckpointError: a shard names a global outside the allowed set (nothing run).
    """
    from nxd_lc.config.access import peft_config
    from nxd_lc.data.tokenizer import special_token_ids
    from nxd_lc.distributed import collectives
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.lightning.run_tokenizer import copy_tokenizer_files
    from nxd_lc.models.llama.hf_adapter import save_hf_weights

    root, tag = resolve_checkpoint(checkpoint)
    tag_dir = os.path.join(root, tag)
    cfg = export_config(tag_dir, cfg, overrides)
    set_weights_only(cfg.exp_manager.checkpoint_weights_only)  # the run's policy for reading its checkpoint
    set_checkpoint_kv_layout(cfg)
    tp, ep = check_layout(cfg, tag_dir, collectives.get_global_world_size())
    # the model is built in the checkpoint's own KV-replica layout: its shards are read as they are
    kv_layout, how = checkpoint_kv_layout(tag_dir, run_kv_layout(cfg))
    log.info("checkpoint %s: KV replicas laid out %s (%s)", tag_dir, kv_layout, how)
    output = os.path.abspath(output)
    check_output(output, overwrite, **export_guards(root))
    # every rank, before any collective: a problem raises everywhere
    tokenizer_dir, tokenizer = export_tokenizer(cfg, root, save_tokenizer)
    own_state = not ps.model_parallel_is_initialized()
    if own_state:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     kv_replicator=cfg.distributed_strategy.kv_replicator,
                                     kv_replica_layout=kv_layout)
    elif ps.get_tensor_model_parallel_world_size() != tp or (
            ps.get_kv_replicator() > 1 and ps.get_kv_replica_layout() != kv_layout):
        raise ValueError(f"parallel_state has TP size {ps.get_tensor_model_parallel_world_size()} (KV replicas "
                         f"{ps.get_kv_replica_layout()}) but checkpoint {tag_dir} has TP size {tp} (KV replicas "
                         f"{kv_layout})")
    try:
        rank0 = collectives.get_global_rank() == 0
        peft = peft_config(cfg)
        lora_only = peft is not None and not peft.save_lora_base  # base weights from model.hf_weights_dir
        model = build_model(cfg, load_weights=lora_only)
        load_model_shard(model, root, tag, tp_rank=ps.get_tensor_model_parallel_rank(), use_xser=use_xser,
                         adapters_only=lora_only, ep_rank=ps.get_expert_model_parallel_rank() if ep > 1 else None)
        if peft is not None:
            merge_lora(model)  # the HF directory holds plain weights: base + scale * B @ A
        parent, name = os.path.split(output)
        staging = os.path.join(parent, f".{name}.partial-{uuid.uuid4().hex[:8]}")
        if rank0:
            os.makedirs(parent, exist_ok=True)
            for stale in staging_siblings(output):  # an earlier export to `output` killed before publishing
                log.warning("removing %s, left by an export to %s that did not finish", stale, output)
                shutil.rmtree(stale, ignore_errors=True)
        collectives.barrier()  # no rank's staging directory exists before the stale ones are gone
        save_hf_weights(model, staging, dtype=dtype,  # collective; rank 0 writes
                        token_ids=special_token_ids(tokenizer) if tokenizer is not None else None)
        if rank0:
            if tokenizer_dir is not None and save_tokenizer:  # the run's own files, as saved
                copy_tokenizer_files(tokenizer_dir, staging)
            elif tokenizer is not None and save_tokenizer:
                tokenizer.save_pretrained(staging)
            write_provenance(staging, tag_dir, tp, cfg)
            publish(staging, output)
        collectives.barrier()
    finally:
        if own_state:
            ps.destroy_model_parallel()
    return output


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
                                     kv_replicator=cfg.distributed_strategy.kv_replicator,
                                     kv_replica_layout=run_kv_layout(cfg))
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


