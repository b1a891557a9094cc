"""Loading a training checkpoint saved at another TP / PP / DP / ZeRO-1 layout ("re-sharding on load").

A checkpoint in NxD's layout holds one model shard per (TP rank, PP stage) and one optimizer shard per (TP rank,
PP stage) and, under ZeRO-1, per DP x CP rank (:mod:`nxd_lc.checkpoint.sharded`). When a run resumes with other
sizes, every rank rebuilds its own shards from the saved ones, offline (no collective), through full HF-named
tensors:

1. read the saved model shards of every (TP rank, stage) and keep the parameters of this rank's stage;
2. merge the saved TP shards into full tensors (:func:`nxd_lc.models.llama.hf_reshard.merge_tp_shards`: the
   inverse of the loader at the saved TP size and ``kv_replicator``);
3. slice them for this rank with the loader itself (:func:`nxd_lc.models.llama.hf_reshard.shard_full_tensors`).

Optimizer state takes the same path per state tensor: each parameter's moments (``exp_avg``, ``exp_avg_sq``, ...)
and fp32 master weight are parameter-shaped (or, under ZeRO-1, flat slices of the parameter laid end to end over
the DP x CP ranks: :class:`nxd_lc.optim.NxDOptimizer`), so they are first reassembled per saved TP rank, merged,
re-sliced and, under ZeRO-1 in this run, cut into this rank's flat slice. Parameters are matched by name (the
``param_names`` every parameter group records). Scalars (``step``) are copied; hyper-parameters of each group
(``lr``, ``betas``, ...) come from the saved group of the same ``group_name``; the LR-scheduler state is
remapped the same way. The stochastic-rounding generator restarts from the run's seed (its saved state belongs to
a rank that may not exist any more).

Not carried over (a ``ValueError`` says so): LoRA models (adapter shards), state tensors that are not
parameter-shaped (Adafactor's factored moments), a model config that differs from the saved run's.

Cost: every rank reads the saved model and optimizer shards of all TP ranks of the stages it needs (I/O of up to
the whole checkpoint per rank) and holds this stage's full tensors of one kind at a time in host memory: meant
for the one resume after a layout change, not for every start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nxd_lc.checkpoint import sharded
from nxd_lc.checkpoint.layout import ranks_found
from nxd_lc.checkpoint.load import detect_xser, read_shard
from nxd_lc.checkpoint.nxd_format import MODEL_PREFIX, checkpoint_kv_layout, from_nxd_names, stage_layers

log = logging.getLogger(__name__)

_MASTER = "__master_weight__"
_TIED = {"lm_head.weight": "embed_tokens.weight", "embed_tokens.weight": "lm_head.weight"}


@dataclass(frozen=True)
class SavedLayout:
    """Parallel layout a checkpoint was saved with, from its shard file names.

    Attributes:
        tp: tensor_model_parallel_size.
        pp: pipeline_model_parallel_size.
        optim_dp: number of optimizer shards per (TP, PP) position (> 1: ZeRO-1 over that many DP x CP ranks;
            1: unsharded, or ZeRO-1 over one rank; 0: no optimizer state).
        ep: expert_model_parallel_size (1: model files without ``ep_rank``).
    """

    tp: int
    pp: int
    optim_dp: int
    ep: int = 1


def saved_layout(tag_dir: str) -> SavedLayout:
    """The layout of checkpoint ``tag_dir`` (``<root>/<tag>``).

    Raises:
        FileNotFoundError: no model shards, or a (TP, PP) model shard is missing (incomplete checkpoint).
    """
    folder = os.path.join(tag_dir, sharded.MODEL_DIR)
    _, tps, pps = ranks_found(folder)
    if not tps:
        raise FileNotFoundError(f"checkpoint {tag_dir} has no model shards in {sharded.MODEL_DIR}/ "
                                "(dp_rank_00_tp_rank_XX_pp_rank_XX.pt)")
    tp, pp = max(tps) + 1, max(pps) + 1
    eps = sharded.ep_ranks_found(folder)
    ep_ranks: list[int | None] = list(range(max(eps) + 1)) if eps else [None]
    missing = [(t, p) if e is None else (e, t, p) for e in ep_ranks for t in range(tp) for p in range(pp)
               if not os.path.exists(os.path.join(folder, sharded.checkpoint_file_name(0, t, p, e)))]
    if missing:
        what = "(TP rank, PP rank)" if eps == set() else "(EP rank, TP rank, PP rank)"
        raise FileNotFoundError(f"checkpoint {tag_dir} is incomplete: model shards of {what} {missing}"
                                f" (of TP size {tp}, PP size {pp}) are missing")
    dps, _, _ = ranks_found(os.path.join(tag_dir, sharded.OPTIM_DIR))
    return SavedLayout(tp=tp, pp=pp, optim_dp=max(dps) + 1 if dps else 0, ep=len(ep_ranks))


def _read(tag_dir: str, sub: str, dp: int, tp: int, pp: int, xser: bool) -> Any:
    path = os.path.join(tag_dir, sub, sharded.checkpoint_file_name(dp, tp, pp))
    return read_shard(path, tag_dir, xser)


def _strip(state: Mapping[str, Any], where: str) -> dict[str, torch.Tensor]:
    """A model shard's tensors by parameter name (``model.`` dropped; NxD's ``lm_head.*`` read as the head)."""
    state = from_nxd_names(state)
    if not isinstance(state, Mapping) or not any(str(k).startswith(MODEL_PREFIX) for k in state):
        keys = sorted(map(str, state))[:4] if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{where}: model shard has no '{MODEL_PREFIX}*' keys (found {keys}); NxD's and nxd_lc's "
                         f"shards name the decoder's tensors 'model.<name>' and the head 'lm_head.weight': it "
                         f"cannot be re-sharded")
    return {k[len(MODEL_PREFIX):]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}


def reshard_reason(model: Any, tag_dir: str, saved: SavedLayout, use_xser: bool | None = None) -> str | None:
    """Why this rank's model shard of ``tag_dir`` must be rebuilt from the saved ones rather than read as it is
    (None: it can be read): another TP or PP size; at the same PP size another pipeline split (the files hold
    other layers for this rank's stage: NxD's default split puts extra layers on the last stages, nxd_lc before
    this version on the middle ones); with replicated KV heads another KV-replica layout
    (:func:`nxd_lc.checkpoint.nxd_format.checkpoint_kv_layout`). Local: reads file names and, at PP > 1, the
    key names of TP rank 0's shards. ``model`` None (no model to compare with): the sizes only.
    """
    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.distributed.kv_layout import replication

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    if (saved.tp, saved.pp) != (tp, pp):
        return f"saved with TP {saved.tp} x PP {saved.pp}, this run has TP {tp} x PP {pp}"
    if model is None:
        return None
    if pp > 1:
        split = stage_layers(tag_dir, pp, detect_xser(tag_dir, use_xser))
        held, mine = split[ps.get_pipeline_model_parallel_rank()], sorted(i for i, _ in model.local_layers())
        if held != mine:
            return (f"its pipeline rank {ps.get_pipeline_model_parallel_rank()} holds decoder layers {held}, this "
                    f"run's holds {mine} (model.pipeline_cuts; the split of its files: {split})")
    nkv = getattr(getattr(model, "config", None), "num_key_value_heads", None)
    if nkv and replication(saved.tp, nkv) > 1:
        saved_kv, how = checkpoint_kv_layout(tag_dir)
        if saved_kv != ps.get_kv_replica_layout():
            return (f"its KV replicas are laid out {saved_kv} ({how}), this run's "
                    f"{ps.get_kv_replica_layout()} (distributed_strategy.kv_replica_layout)")
    return None


def _model_shards(tag_dir: str, layout: SavedLayout, wanted: set[str], xser: bool) -> list[dict[str, torch.Tensor]]:
    """``out[t]``: parameter name -> TP rank ``t``'s saved tensor, for the names in ``wanted`` (all stages read)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.tp)]
    for t in range(layout.tp):
        for p in range(layout.pp):
            part = _strip(_read(tag_dir, sharded.MODEL_DIR, 0, t, p, xser), tag_dir)
            for k, v in part.items():
                if k in wanted and k not in out[t]:  # a tied lm-head copy on the last stage: stage 0's wins
                    out[t][k] = v
    return out


def _wanted(model: Any, names: Iterable[str]) -> set[str]:
    """``names`` plus the other name of a tied embedding (saved under either)."""
    out = set(names)
    if getattr(model.config, "tie_word_embeddings", False):
        out |= set(_TIED)
    return out


def _check_supported(model: Any, names: Iterable[str], tag_dir: str) -> None:
    """Raise ValueError unless ``model`` is nxd_lc's Llama and no name to re-shard is a LoRA adapter's."""
    from nxd_lc.layers.lora import is_lora_key
    from nxd_lc.models.llama.model import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"checkpoint {tag_dir}: re-sharding to another layout supports nxd_lc's Llama decoder only, "
                         f"got {type(model).__name__}; resume at the saved TP / PP sizes")
    if any(is_lora_key(n) for n in names):
        raise ValueError(f"checkpoint {tag_dir}: re-sharding a LoRA run (model_alignment_strategy.peft) to another "
                         "TP / PP layout is not supported; resume at the saved TP / PP sizes, or merge the adapters "
                         "(python -m nxd_lc.cli.convert) and start from the merged HF model")


def reshard_model_state(model: Any, template: Mapping[str, torch.Tensor], tag_dir: str, *,
                        use_xser: bool | None = None, prefix: str = MODEL_PREFIX) -> dict[str, torch.Tensor]:
    """This rank's model state of ``tag_dir`` re-sharded to this run's layout (offline; every rank on its own).

    Args:
        model: this rank's :class:`~nxd_lc.models.llama.LlamaForCausalLM` (this run's TP size, ``kv_replicator``
            and pipeline stage; ``parallel_state`` initialised).
        template: the state dict to fill (e.g. the LightningModule's ``state_dict()``): its keys and shapes;
            parameters are ``prefix + <parameter name>``. Entries that are not parameters (buffers) are taken
            from the saved shard of TP rank 0 that holds them.
        tag_dir: ``<root>/<tag>``, saved at any TP / PP size.
        use_xser: checkpoint format; None = auto-detect.
        prefix: key prefix of the model in ``template``.

    Returns:
        ``template``'s keys -> tensors of the saved run, in this rank's shapes (dtype as saved).

    Raises:
        ValueError: a LoRA model, a non-Llama model, or a saved tensor that does not fit this run's model config
            (names the key and the checkpoint).
    """
    from nxd_lc.models.llama.hf_reshard import FullTensors, merge_tp_shards, shard_full_tensors

    names = {k[len(prefix):] for k in template if k.startswith(prefix)}
    _check_supported(model, names, tag_dir)
    layout = saved_layout(tag_dir)
    xser = detect_xser(tag_dir, use_xser)
    shards = _model_shards(tag_dir, layout, _wanted(model, names), xser)
    kv_layout, _ = checkpoint_kv_layout(tag_dir)
    local = shard_full_tensors(model, FullTensors(merge_tp_shards(model, shards, tag_dir, kv_layout), tag_dir))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for key, current in template.items():
        name = key[len(prefix):] if key.startswith(prefix) else None
        value = local.get(name) if name is not None else None
        if value is None and tied and name in ("lm_head.weight", "embed_tokens.weight"):
            value = local.get("embed_tokens.weight" if name == "lm_head.weight" else "lm_head.weight")
        if value is None and name is not None:
            value = shards[0].get(name)  # a buffer / replicated entry outside the HF mapping
        if value is None or tuple(value.shape) != tuple(current.shape):
            got = "missing" if value is None else f"shape {tuple(value.shape)}"
            raise ValueError(f"checkpoint {tag_dir} (TP {layout.tp}, PP {layout.pp}) cannot be re-sharded to this "
                             f"run: {key} is {got}, the model expects {tuple(current.shape)}; model.model_config, "
                             "hf_config_overrides, fuse_qkv and qkv_linear must be those of the run that saved it")
        out[key] = value
    log.warning("re-sharded the model weights of %s from TP %d x PP %d (KV replicas %s) to this run's layout",
                tag_dir, layout.tp, layout.pp, kv_layout)
    return out


# ---------------------------------------------------------------------------------------------- optimizer state
def _names_by_index(sd: Mapping[str, Any], where: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for g in sd.get("param_groups", []):
        names = g.get("param_names")
        if names is None or len(names) != len(g["params"]):
            raise ValueError(f"{where}: the optimizer state records no parameter names (param_groups[].param_names);"
                             " it cannot be re-sharded: resume at the saved layout, or load the weights only "
                             "(model.weight_init_only: true, a fresh optimizer)")
        out.update(zip(g["params"], names))
    return out


def _optim_sd(shard: Any, where: str) -> dict[str, Any]:
    states = shard.get("optimizer_states") if isinstance(shard, Mapping) else None
    if not states:
        raise ValueError(f"{where}: no optimizer_states in the optimizer shard")
    if len(states) != 1:
        raise ValueError(f"{where}: {len(states)} optimizers saved; re-sharding supports one")
    return states[0]


def _saved_optimizer(tag_dir: str, layout: SavedLayout, wanted: set[str], xser: bool
                     ) -> tuple[list[dict[str, dict[str, torch.Tensor]]], dict[str, Any], dict[str, Any], Any]:
    """Per saved TP rank: name -> {state key (and ``_MASTER``) -> tensor in the saved local parameter shape}; plus
    per name its scalar state (``step``), the saved param groups by ``group_name`` and a saved LR-scheduler state."""
    per_tp: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(layout.tp)]
    scalars: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    schedulers: Any = None
    for t in range(layout.tp):
        for p in range(layout.pp):
            where = os.path.join(tag_dir, sharded.OPTIM_DIR, sharded.checkpoint_file_name(0, t, p))
            shapes = {k: v.shape for k, v in _strip(_read(tag_dir, sharded.MODEL_DIR, 0, t, p, xser), where).items()}
            parts = [_read(tag_dir, sharded.OPTIM_DIR, d, t, p, xser) for d in range(layout.optim_dp)]
            sds = [_optim_sd(part, where) for part in parts]
            if schedulers is None:
                schedulers = parts[0].get("lr_schedulers")
            for g in sds[0].get("param_groups", []):
                groups.setdefault(g.get("group_name"), g)
            zero1 = int((sds[0].get("nxd") or {}).get("zero1_world", 0))
            if zero1 and zero1 != len(sds):
                raise ValueError(f"{where}: saved with zero1 over {zero1} ranks but {len(sds)} optimizer shards exist")
            for idx, name in _names_by_index(sds[0], where).items():
                if name not in wanted or name in per_tp[t]:
                    continue
                if name not in shapes:
                    raise ValueError(f"{where}: optimizer state of {name} but no such model weight in the shard")
                per_tp[t][name] = _param_state(sds, idx, name, shapes[name], zero1 > 0, scalars, where)
    return per_tp, scalars, groups, schedulers


def _param_state(sds: list[dict[str, Any]], idx: int, name: str, shape: torch.Size, zero1: bool,
                 scalars: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """One parameter's saved state tensors reassembled into its saved local shape (ZeRO-1 slices concatenated)."""
    numel = int(torch.Size(shape).numel())
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[torch.Tensor]] = {}
    for sd in sds:
        entries = dict(sd.get("state", {}).get(idx, {}))
        masters = (sd.get("nxd") or {}).get("master_weights")
        if masters is not None:
            entries[_MASTER] = masters[idx]
        for key, value in entries.items():
            if not torch.is_tensor(value) or value.ndim == 0 or key == "step":
                scalars.setdefault(name, {}).setdefault(key, value)
                continue
            pieces.setdefault(key, []).append(value.reshape(-1))
    for key, flat in pieces.items():
        whole = torch.cat(flat) if zero1 else flat[0]
        if whole.numel() < numel or (not zero1 and whole.numel() != numel):
            raise ValueError(f"{where}: optimizer state {key!r} of {name} has {whole.numel()} elements, the parameter "
                             f"{numel}: only parameter-shaped state can be re-sharded (not factored moments); resume "
                             "at the saved layout or with model.weight_init_only: true")
        out[key] = whole[:numel].reshape(shape)
    return out


def _targets(optimizer: Any) -> dict[int, tuple[torch.Size, int, int, bool, int]]:
    """Index in this run's optimizer state dict -> (local parameter shape, ZeRO-1 slice start, stop, sharded,
    shard size with its zero padding)."""
    from nxd_lc.optim import NxDOptimizer

    if isinstance(optimizer, NxDOptimizer):
        return {i: (s.param.shape, s.start, s.stop, optimizer.zero1, s.shard_numel)
                for i, s in enumerate(optimizer.slots)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: (p.shape, 0, p.numel(), False, p.numel()) for i, p in enumerate(params)}


def _remap_groups(value: Any, saved_names: list[Any], names: list[Any]) -> Any:
    """A per-group list of a scheduler state (``base_lrs``, ``_last_lr``) reordered from the saved groups to ours."""
    if isinstance(value, list) and len(value) == len(saved_names) and saved_names != names:
        by_name = dict(zip(saved_names, value))
        return [by_name.get(n, value[0]) for n in names]
    return value


def reshard_optimizer_state(model: Any, optimizer: Any, tag_dir: str, *, use_xser: bool | None = None
                            ) -> tuple[dict[str, Any], Any]:
    """This rank's optimizer state of ``tag_dir`` re-sharded to this run's layout (offline; every rank on its own).

    Args:
        model: this rank's Llama model (names and the TP mapping, as in :func:`reshard_model_state`).
        optimizer: this run's optimizer (:class:`~nxd_lc.optim.NxDOptimizer`, ZeRO-1 or not, or a torch optimizer)
            built over ``model``'s parameters with ``param_names`` in its groups; its current ``state_dict()`` is
            the template.
        tag_dir: ``<root>/<tag>`` saved at any TP / PP / DP / ZeRO-1 layout.
        use_xser: checkpoint format; None = auto-detect.

    Returns:
        ``(optimizer state dict for optimizer.load_state_dict, LR-scheduler states or None)``.

    Raises:
        ValueError: no optimizer shards; a state that is not parameter-shaped; no parameter names recorded; a
            parameter of this run without saved state while others have some (config differs).
    """
    from nxd_lc.models.llama.hf_reshard import FullTensors, merge_tp_shards, shard_full_tensors

    layout = saved_layout(tag_dir)
    if layout.optim_dp == 0:
        raise ValueError(f"checkpoint {tag_dir} has no optimizer state ({sharded.OPTIM_DIR}/); load it with "
                         "model.weight_init_only: true")
    xser = detect_xser(tag_dir, use_xser)
    template = optimizer.state_dict()
    names = _names_by_index(template, "this run's optimizer")
    _check_supported(model, names.values(), tag_dir)
    per_tp, scalars, saved_groups, schedulers = _saved_optimizer(tag_dir, layout, _wanted(model, names.values()), xser)
    keys = sorted({k for shard in per_tp for st in shard.values() for k in st})
    kv_layout, _ = checkpoint_kv_layout(tag_dir)
    local: dict[str, dict[str, torch.Tensor]] = {}
    for key in keys:
        shards = [{n: st[key] for n, st in shard.items() if key in st} for shard in per_tp]
        merged = merge_tp_shards(model, shards, tag_dir, kv_layout)
        for n, v in shard_full_tensors(model, FullTensors(merged, tag_dir)).items():
            local.setdefault(n, {})[key] = v
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state: dict[int, dict[str, Any]] = {}
    masters: list[torch.Tensor] = []
    no_masters = 0
    template_masters = (template.get("nxd") or {}).get("master_weights")
    for idx, (shape, start, stop, zero1, padded) in sorted(_targets(optimizer).items()):
        name = names[idx]
        found = local.get(name)
        if found is None and tied and name in _TIED:
            found = local.get(_TIED[name])
        if found is None and scalars.get(name) is None:
            if local:
                raise ValueError(f"checkpoint {tag_dir}: no saved optimizer state for {name} although other "
                                 "parameters have some; the model config must be that of the saved run")
            found = {}
        entry: dict[str, Any] = {}
        for key, value in (found or {}).items():
            # a ZeRO-1 shard is zero-padded to the same size on every rank (NxDOptimizer._rank_slice)
            flat = F.pad(value.reshape(-1)[start:stop], (0, padded - (stop - start))) if zero1 else value.reshape(shape)
            if key == _MASTER:
                masters.append(flat.to(torch.float32).clone())
            else:
                entry[key] = flat.clone()
        entry.update(scalars.get(name) or (scalars.get(_TIED[name]) if tied and name in _TIED else None) or {})
        if template_masters is not None and (found is None or _MASTER not in found):
            # saved without master weights (fp32 parameters are their own; a bf16 run without them has none):
            # this run's are built from the loaded weights, as at a fresh start
            masters.append(template_masters[idx])
            no_masters += 1
        if entry:
            state[idx] = entry
    out = dict(template)
    out["state"] = state
    out["param_groups"] = [_with_saved_hyperparameters(g, saved_groups.get(g.get("group_name")))
                           for g in template["param_groups"]]
    if "nxd" in template:
        out["nxd"] = {**template["nxd"], "master_weights": masters if template_masters is not None else None}
    saved_names = [g.get("group_name") for g in saved_groups.values()]
    names_now = [g.get("group_name") for g in template["param_groups"]]
    if schedulers:
        schedulers = [{k: _remap_groups(v, saved_names, names_now) for k, v in s.items()} if isinstance(s, dict)
                      else s for s in schedulers]
    if no_masters:
        log.info("%s holds no fp32 master weights for %d parameters: this run's start from the loaded weights",
                 tag_dir, no_masters)
    log.warning("re-sharded the optimizer state of %s from TP %d x PP %d x %d optimizer shard(s) to this run's "
                "layout", tag_dir, layout.tp, layout.pp, layout.optim_dp)
    return out, schedulers


def _with_saved_hyperparameters(group: dict[str, Any], saved: Any) -> dict[str, Any]:
    """This run's group (its ``params`` / ``param_names``) with the saved group's hyper-parameters."""
    if not isinstance(saved, Mapping):
        return dict(group)
    out = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
    out["params"], out["param_names"] = group["params"], group.get("param_names")
    return out
