"""A checkpoint's model shards for conversion and evaluation: find a complete checkpoint (a tag or the newest of
a root), check a config and a launch against its saved layout, load this rank's model shard (every pipeline stage
of it) into a model, stage a whole model's state as pipeline-stage parts, and publish a converted directory
atomically with its provenance file. The run-level converters that build the model are
:mod:`nxd_lc.app.convert`; the command line is :mod:`nxd_lc.cli.convert`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nxd_lc.checkpoint import sharded
from nxd_lc.checkpoint.nxd_format import MODEL_PREFIX, key_mismatch_message
from nxd_lc.checkpoint.reshard import saved_layout
from nxd_lc.config.schema import NxdConfig
from nxd_lc.layers.lora import load_lora_state_dict

log = logging.getLogger("nxd_lc.checkpoint.convert")




PROVENANCE_FILE = "nxd_lc_conversion.json"


def resolve_checkpoint(path: str) -> tuple[str, str]:
    """``(ckpt_root, tag)`` of ``path``: a checkpoint dir ``<root>/<tag>``, or a root (its newest complete tag).

    Raises:
        FileNotFoundError: ``path`` does not exist (lists the complete tags next to it), is a root without a
            complete checkpoint, or is a checkpoint without its ``done`` marker (incomplete save; a tag NxD's
            converter wrote without markers is accepted with a warning when named).
    """
    path = os.path.abspath(path)
    root, tag = os.path.split(path.rstrip(os.sep))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--checkpoint: {path} does not exist; complete checkpoints in {root}: "
                                f"{sharded.list_checkpoints(root)}")
    if os.path.isdir(os.path.join(path, sharded.MODEL_DIR)) or os.path.isfile(os.path.join(path, sharded.DONE_FILE)):
        if not sharded.is_complete(path) and not sharded.is_unmarked_nxd_checkpoint(path):
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
        raise ValueError(key_mismatch_message(os.path.join(ckpt_root, tag), model.state_dict(), local, e)) from e


def check_output(output: str, overwrite: bool, protected: Sequence[str] = (), sealed: Sequence[str] = ()) -> None:
    """Check the export directory ``output`` before anything is built.

    Args:
        overwrite: an existing non-empty ``output`` may be replaced (``--overwrite true``).
        protected: directories the export must never replace: ``output`` may be none of them nor one of their
            parents (the run directory ``<log_dir>``: every checkpoint, the run's tokenizer, its logs).
        sealed: directories the export may not replace nor write into (the checkpoint root: a directory there
            would be taken for a checkpoint).

    Raises:
        ValueError: ``output`` is a file, a non-empty directory without ``overwrite``, a protected or sealed
            directory or one of their parents, or lies inside a sealed one (names both and the fix).
    """
    out = os.path.realpath(output)

    def within(child: str, parent: str) -> bool:
        return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)

    for path in [*protected, *sealed]:
        real = os.path.realpath(path)
        if within(real, out) or (path in sealed and within(out, real)):
            raise ValueError(f"--output: {output} would replace or write into {path}, which the export reads (a "
                             "run's checkpoints, tokenizer and logs); choose a directory outside it")
    if os.path.isfile(output):
        raise ValueError(f"--output: {output} is a file; give a directory path")
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise ValueError(f"--output: {output} exists and is not empty; pass --overwrite true to replace it")


def staging_siblings(output: str) -> list[str]:
    """The hidden staging directories of exports to ``output`` (``.<name>.partial-<id>`` beside it) that an
    earlier export left when it was killed before publishing; newest last."""
    parent, name = os.path.split(os.path.abspath(output))
    if not os.path.isdir(parent):
        return []
    pattern = re.compile(rf"^\.{re.escape(name)}\.partial-[0-9a-f]{{8}}$")
    found = [os.path.join(parent, n) for n in os.listdir(parent) if pattern.match(n)]
    return sorted(found, key=os.path.getmtime)


def publish(staging: str, output: str) -> None:
    """Rank 0: move ``staging`` to ``output``, replacing an existing ``output`` only once staging is complete."""
    trash = None
    if os.path.lexists(output):
        trash = f"{output}.old-{uuid.uuid4().hex[:8]}"
        os.replace(output, trash)
    os.replace(staging, output)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


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


def write_provenance(directory: str, tag_dir: str, tp: int, cfg: NxdConfig) -> None:
    done: Any = None
    try:
        done = json.loads(Path(tag_dir, sharded.DONE_FILE).read_text())
    except (OSError, ValueError):
        pass
    record = {"source_checkpoint": tag_dir, "step": done.get("step") if isinstance(done, dict) else None,
              "tensor_model_parallel_size": tp, "run_name": cfg.name, "model_config": cfg.model.model_config,
              "hf_config_overrides": cfg.model.hf_config_overrides, "converter": "nxd_lc.cli.convert"}
    Path(directory, PROVENANCE_FILE).write_text(json.dumps(record, indent=2, default=str))
