"""Turn a raw Hydra/OmegaConf config into a validated :class:`NxdConfig`.

All problems are collected and raised together in one :class:`ConfigError` (a ``ValueError``), each line naming
the dotted key and the fix. Order of checks: interpolation -> key aliases -> unknown keys ("did you mean") ->
per-key types -> cross-field rules. Features that are accepted by the schema but land in a later issue are
reported by :func:`unsupported_features` ("not supported yet: <key>"), which the trainer raises at launch and the
dry run prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import typing
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nxd_lc.config.alignment_schema import pretraining_data_problems, validate_alignment
from nxd_lc.config.peft_schema import PEFT_KEY, PeftConfig, peft_problems
from nxd_lc.config.resolvers import register_resolvers
from nxd_lc.config.schema import (
    CHECKPOINT_METHODS,
    KEY_ALIASES,
    MOVED_KEYS,
    NxdConfig,
    checkpoint_method_problems,
)

log = logging.getLogger(__name__)

PRECISION_TYPES = ("bf16SR", "fp32", "autocast", "mixed_precision", "mixed_precisionSR", "manual")
PRECISION_ALIASES = {"mixed_precision_SR": "mixed_precisionSR"}  # NxDT spells it both ways
OPTIMIZERS = ("adamw", "adamw_fp32OptState", "adam", "sgd", "adadelta", "adamax", "adagrad", "rmsprop",
              "rprop", "novograd", "adafactor")
IMPLEMENTED_OPTIMIZERS = ("adamw", "adamw_fp32OptState", "adam", "sgd", "adadelta", "adamax", "adagrad",
                          "rmsprop", "rprop", "novograd", "adafactor")
SCHEDULERS = ("LinearAnnealingWithWarmUp", "CosineAnnealing", "Constant", "WarmupPolicy", "WarmupHoldPolicy",
              "SquareAnnealing", "NoamAnnealing", "WarmupAnnealing", "StepLR", "ExponentialLR")
IMPLEMENTED_SCHEDULERS = ("LinearAnnealingWithWarmUp", "CosineAnnealing", "Constant", "WarmupPolicy",
                          "WarmupHoldPolicy", "SquareAnnealing", "NoamAnnealing", "WarmupAnnealing", "StepLR",
                          "ExponentialLR")
ACCELERATORS = ("auto", "cpu", "gpu", "xla", "neuron")


class ConfigError(ValueError):
    """Raised with every problem found in a config, one per line, each naming its key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid nxd_lc config ({len(problems)} problem(s)):\n{lines}")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _nested_type(cls: type, name: str) -> type | None:
    """The dataclass type of field ``name`` of ``cls`` if it is a nested section (also an optional one,
    ``Optional[Section] = None`` such as ``model_alignment_strategy.peft``), else None."""
    default = _fields(cls)[name].default_factory  # type: ignore[misc]
    if default is not dataclasses.MISSING:
        value = default()
        if dataclasses.is_dataclass(value):
            return type(value)
    hint = typing.get_type_hints(cls).get(name)
    if typing.get_origin(hint) is typing.Union:
        sections = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        if len(sections) == 1:
            return sections[0]
    return None


_SCHEMA_LEAVES: list[str] = []


def _schema_leaves(cls: type = NxdConfig, prefix: str = "") -> list[str]:
    out = []
    for name in _fields(cls):
        sub = _nested_type(cls, name)
        if sub is not None:
            out.extend(_schema_leaves(sub, f"{prefix}{name}."))
        else:
            out.append(f"{prefix}{name}")
    return out


def _suggest(key: str, cls: type, prefix: str) -> str:
    """'did you mean ...' hint: nearest sibling name, else nearest dotted key anywhere in the schema."""
    siblings = list(_fields(cls))
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{prefix}{close[0]}'?"
    if not _SCHEMA_LEAVES:
        _SCHEMA_LEAVES.extend(_schema_leaves())
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in _SCHEMA_LEAVES}
    close = difflib.get_close_matches(key, list(by_leaf), n=1, cutoff=0.75)
    if close:
        return f"did you mean '{by_leaf[close[0]]}'?"
    return f"valid keys here: {', '.join(siblings)}"


def _check_keys(data: dict[str, Any], cls: type, prefix: str, problems: list[str]) -> None:
    fields = _fields(cls)
    empty_sections = []
    for key, value in data.items():
        if key not in fields:
            problems.append(f"{prefix}{key}: unknown key; {_suggest(str(key), cls, prefix)}")
            continue
        sub = _nested_type(cls, key)
        if sub is not None:
            if value is None:  # an empty section (`exp_manager:`) takes its defaults
                empty_sections.append(key)
                continue
            if not isinstance(value, Mapping):
                problems.append(f"{prefix}{key}: must be a mapping (section), got {type(value).__name__}")
                continue
            _check_keys(value, sub, f"{prefix}{key}.", problems)  # type: ignore[arg-type]
    for key in empty_sections:
        data.pop(key)


def _check_types(data: Mapping[str, Any], cls: type, prefix: str, problems: list[str]) -> None:
    """Assign each known leaf to a structured node of ``cls`` one by one, so every bad value is reported."""
    node = OmegaConf.structured(cls)
    for key, value in data.items():
        if key not in _fields(cls):
            continue
        sub = _nested_type(cls, key)
        if sub is not None:
            if isinstance(value, Mapping):
                _check_types(value, sub, f"{prefix}{key}.", problems)
            continue
        try:
            node[key] = value
        except OmegaConfBaseException as e:
            expected = _fields(cls)[key].type
            problems.append(f"{prefix}{key}: invalid value {value!r} (expected {expected}): "
                            f"{str(e).splitlines()[0]}")


def _parent(data: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """(the dict holding the last component of ``dotted``, that component); None when a parent is missing."""
    *path, leaf = dotted.split(".")
    node: Any = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _move_keys(data: dict[str, Any], problems: list[str]) -> None:
    """Move each key of :data:`MOVED_KEYS` from its old place to its canonical one (a null there is dropped)."""
    for old, canonical in MOVED_KEYS:
        node, leaf = _parent(data, old)
        if node is None or leaf not in node:
            continue
        value = node.pop(leaf)
        if value is None:
            continue
        *path, target = canonical.split(".")
        parent: Any = data
        for part in path:
            if not isinstance(parent.get(part), dict):
                parent[part] = {}
            parent = parent[part]
        if parent.get(target) is not None:
            problems.append(f"{old}: also given as '{canonical}' (its canonical place); give only one of them")
            continue
        log.info("config: '%s' is read as '%s'", old, canonical)
        parent[target] = value


def _apply_aliases(data: dict[str, Any], problems: list[str]) -> None:
    _move_keys(data, problems)
    for alias, canonical in KEY_ALIASES:
        node, leaf = _parent(data, alias)
        target = canonical.rsplit(".", 1)[-1]
        if node is not None and leaf in node:
            if target in node and node[target] is not None:
                problems.append(f"{alias}: NxDT alias of '{canonical}'; give only one of them")
                node.pop(leaf)
                continue
            log.info("config: '%s' (NxDT spelling) is read as '%s'", alias, canonical)
            node[target] = node.pop(leaf)
    prec = data.get("precision")
    if isinstance(prec, dict) and prec.get("type") in PRECISION_ALIASES:
        canonical = PRECISION_ALIASES[prec["type"]]
        log.info("config: precision.type '%s' is read as '%s'", prec["type"], canonical)
        prec["type"] = canonical


def to_container(raw: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Resolve interpolations (``${multiply:...}``, ``${trainer.max_steps}``) into a plain dict.

    Raises:
        ConfigError: an interpolation cannot be resolved (names the key).
    """
    register_resolvers()
    cfg = raw if isinstance(raw, DictConfig) else OmegaConf.create(dict(raw))
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError([f"{key}: cannot resolve interpolation: {str(e).splitlines()[0]}"]) from e


def load_config(raw: DictConfig | Mapping[str, Any], world_size: int | None = None,
                check_paths: bool = False) -> NxdConfig:
    """Validate ``raw`` and return the typed config.

    Args:
        raw: the composed Hydra config (or a plain nested dict).
        world_size: the launched world size; when given it must equal ``trainer.devices * trainer.num_nodes``.
        check_paths: also require data paths and ``resume_from_checkpoint`` to exist (true at launch).

    Raises:
        ConfigError: with every problem found, each naming its dotted key.
    """
    data = to_container(raw)
    data.pop("hydra", None)
    problems: list[str] = []
    _apply_aliases(data, problems)
    _check_keys(data, NxdConfig, "", problems)
    _check_types(data, NxdConfig, "", problems)
    if problems:
        raise ConfigError(problems)
    merged = OmegaConf.merge(OmegaConf.structured(NxdConfig), data)
    cfg: NxdConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    problems.extend(cross_field_problems(cfg, world_size))
    if check_paths:
        problems.extend(path_problems(cfg))
    if problems:
        raise ConfigError(problems)
    log_precision_overrides(cfg)
    return cfg


def resolve_path(path: str) -> str:
    """Absolute path of ``path``; relative paths are taken from the launch directory (Hydra keeps the cwd)."""
    return os.path.abspath(os.path.expanduser(path))


def read_model_json(cfg: NxdConfig) -> dict[str, Any] | None:
    """The HF config.json named by ``model.model_config`` as a dict, or None when unset/missing; with
    ``model_source: megatron`` the equivalent dict of the ``model:`` keys (None while they have problems).

    Raises:
        ConfigError: the file is not valid JSON (names the file, line and column) or not a JSON object.
    """
    if cfg.model_source == "megatron":  # the architecture is the model: keys (nxd_lc.models.megatron)
        from nxd_lc.models.megatron import megatron_config_dict, megatron_problems

        return None if megatron_problems(cfg.model, "megatron") else megatron_config_dict(cfg.model)
    if not cfg.model.model_config:
        return None
    path = resolve_path(cfg.model.model_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError([f"model.model_config: {path} is not valid JSON (line {e.lineno}, column {e.colno}: "
                           f"{e.msg}); fix the file or point model.model_config at a valid HF config.json"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"model.model_config: {path} must hold a JSON object (an HF config.json), got a JSON "
                           f"{type(raw).__name__}"])
    return raw


def seq_length(cfg: NxdConfig) -> int | None:
    """The training sequence length: ``data.seq_length``, else ``model.encoder_seq_length``."""
    return cfg.data.seq_length if cfg.data.seq_length is not None else cfg.model.encoder_seq_length


def model_seq_length(cfg: NxdConfig) -> int | None:
    """The model's sequence length (what its RoPE scaling is judged by): ``model.encoder_seq_length``, else
    ``data.seq_length``. Training may use shorter sequences (``data.seq_length <= model.encoder_seq_length``)."""
    return cfg.model.encoder_seq_length if cfg.model.encoder_seq_length is not None else cfg.data.seq_length


def gradient_bucket_size_mb(cfg: NxdConfig) -> float:
    """MiB per bucket of the DP (x CP) gradient all-reduce: ``bucket_size_collectives``, else nxd_lc's default
    (:data:`nxd_lc.distributed.grads.DEFAULT_BUCKET_SIZE_MB`, 64)."""
    from nxd_lc.distributed.grads import DEFAULT_BUCKET_SIZE_MB

    return float(cfg.bucket_size_collectives) if cfg.bucket_size_collectives is not None else DEFAULT_BUCKET_SIZE_MB


def peft_config(cfg: NxdConfig) -> PeftConfig | None:
    """The LoRA settings, ``model_alignment_strategy.peft`` (None: no LoRA)."""
    return None if cfg.model_alignment_strategy is None else cfg.model_alignment_strategy.peft


def data_parallel_size(cfg: NxdConfig) -> int:
    """DP = world / (TP * PP * CP), with world = trainer.devices * trainer.num_nodes."""
    ds = cfg.distributed_strategy
    mp = ds.tensor_model_parallel_size * ds.pipeline_model_parallel_size * ds.context_parallel_size
    return max(1, (cfg.trainer.devices * cfg.trainer.num_nodes) // max(mp, 1))


def _parallel_problems(cfg: NxdConfig, world_size: int | None) -> list[str]:
    p: list[str] = []
    ds, tr = cfg.distributed_strategy, cfg.trainer
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "kv_replicator", "virtual_pipeline_model_parallel_size"):
        if getattr(ds, key) < 1:
            p.append(f"distributed_strategy.{key}: must be >= 1, got {getattr(ds, key)}")
    if tr.devices < 1 or tr.num_nodes < 1:
        p.append("trainer.devices / trainer.num_nodes: must be >= 1")
        return p
    world = tr.devices * tr.num_nodes
    if world_size is not None and world_size != world:
        p.append(f"trainer.devices: launched world size is {world_size} but trainer.devices * trainer.num_nodes"
                 f" = {tr.devices} * {tr.num_nodes} = {world}; set trainer.devices to the processes per node "
                 f"(torchrun --nproc_per_node) and trainer.num_nodes to the node count")
    mp = ds.tensor_model_parallel_size * ds.pipeline_model_parallel_size * ds.context_parallel_size
    if mp >= 1 and world % mp != 0:
        p.append(f"distributed_strategy.tensor_model_parallel_size: world size {world} is not divisible by "
                 f"TP * PP * CP = {ds.tensor_model_parallel_size} * {ds.pipeline_model_parallel_size} * "
                 f"{ds.context_parallel_size} = {mp}; world = TP x PP x CP x DP")
    cb = cfg.exp_manager.checkpoint_callback_params
    expected_mp = ds.tensor_model_parallel_size * ds.pipeline_model_parallel_size
    if cb.model_parallel_size is not None and cb.model_parallel_size != expected_mp:
        p.append(f"exp_manager.checkpoint_callback_params.model_parallel_size: {cb.model_parallel_size} != TP * PP"
                 f" = {expected_mp}; use ${{multiply:${{distributed_strategy.tensor_model_parallel_size}}, "
                 f"${{distributed_strategy.pipeline_model_parallel_size}}}}")
    return p


def _trainer_problems(cfg: NxdConfig) -> list[str]:
    """``trainer.val_check_interval``: an int >= 1 (optimizer steps) or a float in (0, 1] (fraction of an epoch)."""
    v = cfg.trainer.val_check_interval
    ok = (isinstance(v, int) and not isinstance(v, bool) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0)
    if v is not None and not ok:
        return [f"trainer.val_check_interval: {v!r} is not valid; give an int >= 1 (validate every N optimizer "
                f"steps) or a float in (0, 1] (a fraction of an epoch); to skip validation set "
                f"trainer.limit_val_batches: 0"]
    return []


def _batch_problems(cfg: NxdConfig) -> list[str]:
    p: list[str] = []
    d = cfg.data
    if d.micro_batch_size < 1 or d.global_batch_size < 1:
        p.append("data.micro_batch_size / data.global_batch_size: must be >= 1")
        return p
    dp = data_parallel_size(cfg)
    if d.global_batch_size % (d.micro_batch_size * dp) != 0:
        p.append(f"data.global_batch_size: {d.global_batch_size} is not divisible by micro_batch_size x DP = "
                 f"{d.micro_batch_size} x {dp}; gradient accumulation = global / (micro x DP) must be an integer")
    s = seq_length(cfg)
    if s is None:
        p.append("data.seq_length: not set and model.encoder_seq_length is not set either; set one of them")
    elif s < 1 or (cfg.model.encoder_seq_length is not None and cfg.model.encoder_seq_length < 1):
        key = "data.seq_length" if cfg.data.seq_length is not None and cfg.data.seq_length < 1 else \
            "model.encoder_seq_length"
        p.append(f"{key}: must be >= 1 token, got {s if key == 'data.seq_length' else cfg.model.encoder_seq_length}")
    else:
        if cfg.data.seq_length is not None and cfg.model.encoder_seq_length is not None \
                and cfg.data.seq_length > cfg.model.encoder_seq_length:
            p.append(f"data.seq_length: {cfg.data.seq_length} exceeds model.encoder_seq_length "
                     f"{cfg.model.encoder_seq_length} (the model's length; NxDT allows shorter data); lower it or "
                     f"raise model.encoder_seq_length")
        p += _length_divisibility_problems(cfg, s, "data.seq_length", context_parallel=False)
    if d.val_fraction is not None and not 0.0 <= d.val_fraction < 1.0:
        p.append(f"data.val_fraction: must be in [0, 1), got {d.val_fraction}")
    if d.builtin_corpus not in (None, "python_stdlib"):
        p.append(f"data.builtin_corpus: unknown corpus {d.builtin_corpus!r}; the built-in one is 'python_stdlib'")
    return p


def _ring_attention_problems(cfg: NxdConfig) -> list[str]:
    """CP > 1: NxDT's ``model.fusions.ring_attention`` (its CP switch) must agree with ``context_parallel_algo``:
    true selects ring (the default algorithm), false leaves only ulysses."""
    ring, algo = cfg.model.fusions.ring_attention, cfg.distributed_strategy.context_parallel_algo
    if ring is True and algo != "ring":
        return [f"model.fusions.ring_attention: true selects ring attention but distributed_strategy."
                f"context_parallel_algo is {algo!r}; remove one of them (ulysses: set ring_attention: false)"]
    if ring is False and algo == "ring":
        return ["model.fusions.ring_attention: false but distributed_strategy.context_parallel_algo is 'ring' (the "
                "default) with context_parallel_size > 1; set ring_attention: true, or context_parallel_algo: "
                "ulysses"]
    return []


def _lazy_neuron_or_xla(accelerator: str) -> bool:
    """``trainer.accelerator`` 'xla', or 'neuron' unless this host has the native (PrivateUse1) Neuron device,
    which is eager and has point-to-point send/recv (:func:`nxd_lc.runtime.device.is_lazy_config_accelerator`)."""
    if accelerator not in ("xla", "neuron"):
        return False
    from nxd_lc.runtime.device import is_lazy_config_accelerator  # runtime.device imports this module

    return is_lazy_config_accelerator(accelerator)


def _ring_on_xla_problems(cfg: NxdConfig, accelerator: str) -> list[str]:
    """Ring context parallelism needs point-to-point send/recv, which the torch-xla process group does not offer
    (:func:`nxd_lc.distributed.collectives.ring_exchange`): reject it on xla / neuron before anything is built."""
    ds = cfg.distributed_strategy
    if ds.context_parallel_size <= 1 or ds.context_parallel_algo != "ring" or not _lazy_neuron_or_xla(accelerator):
        return []
    return [f"distributed_strategy.context_parallel_algo: ring attention (context_parallel_size "
            f"{ds.context_parallel_size}) is not available on trainer.accelerator {accelerator} (the XLA process "
            "group has no point-to-point send/recv for the K/V ring); set context_parallel_algo: ulysses (and "
            "model.fusions.ring_attention: false), or run on trainer.accelerator cpu / gpu"]


def _length_divisibility_problems(cfg: NxdConfig, s: int, key: str, *, sequence_parallel: bool = True,
                                  context_parallel: bool = True) -> list[str]:
    """A training length ``s`` (named ``key``) against the layout: divisible by TP under sequence parallelism, by
    the CP chunks (ring: 2 x CP load-balanced chunks; ulysses: CP), and per CP rank by TP under sequence
    parallelism."""
    ds, p = cfg.distributed_strategy, []
    cp, tp = ds.context_parallel_size, ds.tensor_model_parallel_size
    if sequence_parallel and ds.sequence_parallel and tp >= 1 and s % tp != 0:
        p.append(f"{key}: {s} must be divisible by tensor_model_parallel_size {tp} when "
                 f"distributed_strategy.sequence_parallel is true")
    if not context_parallel or cp <= 1 or tp < 1 or ds.context_parallel_algo not in ("ring", "ulysses"):
        return p
    chunks = 2 * cp if ds.context_parallel_algo == "ring" else cp
    if s % chunks != 0:
        p.append(f"{key}: {s} must be divisible by {chunks} for context_parallel_size {cp} with "
                 f"context_parallel_algo {ds.context_parallel_algo}"
                 + (" (load-balanced ring: 2 x CP chunks)" if ds.context_parallel_algo == "ring" else ""))
    elif ds.sequence_parallel and (s // cp) % tp != 0:
        p.append(f"{key}: the per-CP-rank sequence {s // cp} must be divisible by "
                 f"tensor_model_parallel_size {tp} under sequence_parallel")
    return p


def _context_parallel_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    """CP layout rules: ring needs 2*cp chunks, Ulysses needs heads divisible by cp, SP splits the CP shard."""
    p: list[str] = []
    ds, s = cfg.distributed_strategy, seq_length(cfg)
    cp, tp = ds.context_parallel_size, ds.tensor_model_parallel_size
    if ds.context_parallel_algo not in ("ring", "ulysses"):
        near = difflib.get_close_matches(ds.context_parallel_algo, ["ring", "ulysses"], n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        p.append(f"distributed_strategy.context_parallel_algo: unknown value {ds.context_parallel_algo!r}; "
                 f"{hint}choose ring or ulysses")
        return p
    if cp > 1:
        p += _ring_attention_problems(cfg) + _ring_on_xla_problems(cfg, cfg.trainer.accelerator)
    if cp <= 1 or s is None or tp < 1:
        return p
    p += _length_divisibility_problems(cfg, s, "data.seq_length", sequence_parallel=False)
    if hf and ds.context_parallel_algo == "ulysses":
        heads = int(hf.get("num_attention_heads", 0))
        if tp >= 1 and heads % tp == 0 and (heads // tp) % cp != 0:
            p.append(f"distributed_strategy.context_parallel_size: Ulysses needs the query heads per TP rank "
                     f"({heads} / TP {tp} = {heads // tp}) divisible by context_parallel_size {cp}; use ring or "
                     f"change the degrees")
    return p


def _memory_problems(cfg: NxdConfig) -> list[str]:
    p: list[str] = []
    m = cfg.model
    overrides = m.hf_config_overrides or {}
    if not isinstance(overrides, Mapping):
        p.append("model.hf_config_overrides: must be a mapping of config.json keys to values")
    elif isinstance(overrides.get("rope_scaling"), Mapping):
        from nxd_lc.models.common.rope import rope_scaling_problems

        rs = dict(overrides["rope_scaling"])
        orig, s = rs.get("original_max_position_embeddings"), model_seq_length(cfg)
        if rs.get("rope_type") == "yarn" and isinstance(orig, int) and s is not None and s <= orig:
            # a no-op (unscaled RoPE, with a warning at build time): a ${div:seq,orig} factor < 1 is fine
            rs["factor"] = max(1.0, float(rs.get("factor") or 1.0))
        p.extend(rope_scaling_problems(rs))
    for key in ("tiled_loss_chunk_size", "tiled_mlp_chunk_size"):
        v = getattr(m, key)
        if v is not None and v < 1:
            p.append(f"model.{key}: must be >= 1 tokens (or null to disable), got {v}")
    if m.activations_checkpoint_granularity == "selective" and not m.activations_checkpoint_recompute:
        p.append("model.activations_checkpoint_recompute: 'selective' granularity needs module names to "
                 "recompute, e.g. [CoreAttention]")
    if m.activations_checkpoint_save_attention and m.activations_checkpoint_granularity is None:
        p.append("model.activations_checkpoint_save_attention: true keeps attention outputs inside checkpointed "
                 "modules, but model.activations_checkpoint_granularity is null (nothing is checkpointed); set "
                 "the granularity to full (or selective) or the key to false")
    if m.activations_checkpoint_method in CHECKPOINT_METHODS:
        p.extend(checkpoint_method_problems(m.activations_checkpoint_granularity, m.activations_checkpoint_method,
                                            m.activations_checkpoint_num_layers))
    if m.weight_init_only and not cfg.exp_manager.resume_from_checkpoint:
        p.append("model.weight_init_only: needs exp_manager.resume_from_checkpoint (the checkpoint whose model "
                 "weights initialise this run)")
    return p


def _head_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    p: list[str] = []
    m, ds = cfg.model, cfg.distributed_strategy
    if cfg.model_source == "megatron" and hf is None:
        return p  # the model: keys' own problems are reported by _megatron_problems
    if not m.model_config and cfg.model_source != "megatron":
        return ["model.model_config: required; path to an HF config.json (e.g. conf/tiny_llama_config.json)"]
    if hf is None:
        return [f"model.model_config: file not found: {resolve_path(m.model_config)}"]
    tp, rep = ds.tensor_model_parallel_size, ds.kv_replicator
    if tp < 1 or rep < 1:
        return p  # reported by _parallel_problems
    heads = int(hf.get("num_attention_heads", 0))
    kv = int(hf.get("num_key_value_heads") or heads)
    hidden = m.hidden_size or int(hf.get("hidden_size", 0))
    if heads <= 0 or hidden <= 0:
        return [f"model.model_config: {m.model_config} lacks num_attention_heads / hidden_size"]
    if heads % tp != 0:
        p.append(f"distributed_strategy.tensor_model_parallel_size: {tp} must divide num_attention_heads {heads}"
                 f" (from {m.model_config})")
    if hidden % heads != 0 and "head_dim" not in hf:
        p.append(f"model.hidden_size: {hidden} is not divisible by num_attention_heads {heads}")
    if heads % kv != 0:
        p.append(f"model.model_config: num_attention_heads {heads} not divisible by num_key_value_heads {kv}")
    if not m.qkv_linear:
        if kv % tp != 0:
            p.append(f"model.qkv_linear: false needs num_key_value_heads {kv} divisible by TP {tp}; set "
                     f"model.qkv_linear: true and distributed_strategy.kv_replicator: {max(1, tp // kv)}")
        if rep != 1:
            p.append("distributed_strategy.kv_replicator: only used with model.qkv_linear: true; set it to 1")
    elif (kv * rep) % tp != 0:
        fix = tp // kv if tp % kv == 0 else None
        p.append(f"distributed_strategy.kv_replicator: num_key_value_heads {kv} x kv_replicator {rep} must be "
                 f"divisible by tensor_model_parallel_size {tp}" + (f"; use kv_replicator: {fix}" if fix else ""))
    elif kv >= tp and rep != 1 and kv % tp == 0:
        p.append(f"distributed_strategy.kv_replicator: {rep} replicates KV heads needlessly ({kv} KV heads already"
                 f" divide TP {tp}); set it to 1")
    return p


def _choice_problems(cfg: NxdConfig) -> list[str]:
    p: list[str] = []
    choices = [
        ("model_source", cfg.model_source, ("hf", "megatron")),
        ("trainer.accelerator", cfg.trainer.accelerator, ACCELERATORS),
        ("precision.type", cfg.precision.type, PRECISION_TYPES),
        ("model.optim.name", cfg.model.optim.name, OPTIMIZERS),
        ("model.optim.sched.name", cfg.model.optim.sched.name, SCHEDULERS),
        ("exp_manager.checkpoint_callback_params.mode", cfg.exp_manager.checkpoint_callback_params.mode,
         ("max", "min")),
        ("model.activations_checkpoint_granularity", cfg.model.activations_checkpoint_granularity,
         (None, "selective", "full")),
        ("model.activations_checkpoint_method", cfg.model.activations_checkpoint_method, CHECKPOINT_METHODS),
        ("trainer.lnc", cfg.trainer.lnc, (None, 1, 2)),  # Trainium2 logical NeuronCore config
    ]
    for key, value, allowed in choices:
        if value not in allowed:
            near = difflib.get_close_matches(str(value), [str(a) for a in allowed if a], n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            p.append(f"{key}: unknown value {value!r}; {hint}choose one of {', '.join(map(str, allowed))}")
    if cfg.trainer.max_steps < 1:
        p.append(f"trainer.max_steps: must be >= 1, got {cfg.trainer.max_steps}")
    if cfg.bucket_size_collectives is not None and cfg.bucket_size_collectives < 1:
        p.append(f"bucket_size_collectives: must be >= 1 MiB (or null for 64), got {cfg.bucket_size_collectives}")
    if cfg.trainer.log_every_n_steps < 1:
        p.append(f"trainer.log_every_n_steps: must be >= 1, got {cfg.trainer.log_every_n_steps}")
    sched = cfg.model.optim.sched
    if sched.max_steps is not None and sched.warmup_steps + sched.constant_steps + sched.hold_steps > sched.max_steps:
        p.append(f"model.optim.sched.warmup_steps: warmup {sched.warmup_steps} + constant {sched.constant_steps} + "
                 f"hold {sched.hold_steps} exceeds sched.max_steps {sched.max_steps}")
    if len(cfg.model.optim.betas) != 2:
        p.append(f"model.optim.betas: needs two values, got {cfg.model.optim.betas}")
    return p + _precision_problems(cfg) + _alignment_problems(cfg)


def _alignment_problems(cfg: NxdConfig) -> list[str]:
    """``model_alignment_strategy`` (with its ``peft``: LoRA) and the alignment ``data.*`` keys."""
    peft = peft_config(cfg)
    p = validate_alignment(cfg.model_alignment_strategy, cfg.data, seq_length(cfg)) + peft_problems(peft)
    if cfg.model_alignment_strategy is None:
        p += pretraining_data_problems(cfg.data)
    strategy = cfg.model_alignment_strategy
    if strategy is not None and (strategy.dpo is not None or strategy.orpo is not None):
        if cfg.model.tiled_loss_chunk_size:
            p.append("model.tiled_loss_chunk_size: DPO / ORPO compute sequence log-probs, not the tiled causal-LM "
                     "loss; unset it")
    if peft is not None and cfg.model.tiled_mlp_chunk_size and {"gate_up_proj", "down_proj"} & set(
            peft.target_modules or []):
        p.append("model.tiled_mlp_chunk_size: the tiled MLP reads the base weights and would skip LoRA adapters on "
                 f"gate_up_proj / down_proj; unset it or drop those from {PEFT_KEY}.target_modules")
    return p


def _policy_flag(cfg: NxdConfig, flag: str) -> bool:
    """A boolean of the precision mode's policy (``master_weights``, ``fp32_grad_acc``: the policy's own rule);
    False for an unknown type or reduce dtype, which are reported by their own checks."""
    from nxd_lc.precision.policy import resolve_precision

    try:
        return bool(getattr(resolve_precision(cfg), flag))
    except ValueError:
        return False


#: The ``precision`` keys that set XLA / Neuron environment variables themselves only with ``type: manual``.
PRECISION_ENV_KEYS = ("xla_use_bf16", "xla_downcast_bf16", "neuron_rt_stochastic_rounding_en")


def _precision_env_overrides(cfg: NxdConfig) -> list[tuple[str, str, str]]:
    """``(key, configured value, value the type uses)`` for each of :data:`PRECISION_ENV_KEYS` whose value a
    non-manual ``precision.type`` replaces (as NxDT does); a type that leaves a variable unset uses '0'."""
    from nxd_lc.runtime.env import PRECISION_ENV

    prec = cfg.precision
    if prec.type not in PRECISION_ENV:
        return []
    by_type = dict(zip(PRECISION_ENV_KEYS, PRECISION_ENV[prec.type][:3]))
    out = []
    for key in PRECISION_ENV_KEYS:
        value, used = str(getattr(prec, key)), by_type[key] or "0"
        if value in ("0", "1") and value != used:
            out.append((key, value, used))
    return out


def log_precision_overrides(cfg: NxdConfig) -> list[str]:
    """Log (info, global rank 0 only) each precision key a non-manual ``precision.type`` overrides; returns the
    lines (every rank). NxDT's examples set all three to '0' beside ``mixed_precision``, which uses '1' for
    ``xla_downcast_bf16``: that is overridden, not an error (a '1' the type turns off is, see validation)."""
    lines = [f"precision.{key} '{value}' is overridden by precision.type {cfg.precision.type}, which uses '{used}' "
             f"(these keys are read only with precision.type manual)" for key, value, used in
             _precision_env_overrides(cfg)]
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            log.info("config: %s", line)
    return lines


def _precision_problems(cfg: NxdConfig) -> list[str]:
    """Precision keys that cannot be honoured together (modes -> dtypes: :mod:`nxd_lc.precision.policy`)."""
    p: list[str] = []
    prec, ckpt = cfg.precision, cfg.exp_manager.checkpoint_callback_params
    reduce = prec.parallel_layers_reduce_dtype
    if reduce not in (None, "fp32", "float32", "bf16", "bfloat16"):
        p.append(f"precision.parallel_layers_reduce_dtype: unknown value {reduce!r}; choose fp32 or bf16")
    for key in PRECISION_ENV_KEYS:
        if str(getattr(prec, key)) not in ("0", "1"):
            p.append(f"precision.{key}: must be '0' or '1', got {getattr(prec, key)!r}")
    for key, value, used in _precision_env_overrides(cfg):
        if value == "1":  # NxDT's default is '0': a '1' the type turns off was set on purpose
            p.append(f"precision.{key}: '1' contradicts precision.type {prec.type}, which uses '{used}' (the type "
                     f"sets it); remove it, or use precision.type manual to set it yourself")
    if prec.type != "manual" and prec.type in PRECISION_TYPES:
        for key in ("master_weights", "fp32_grad_acc"):
            if getattr(prec, key) and not _policy_flag(cfg, key):  # true where the type has none: set on purpose
                p.append(f"precision.{key}: true contradicts precision.type {prec.type}, which has none (only read "
                         f"with precision.type manual; the type fixes it, see the README precision table); set it "
                         "false or use precision.type manual")
    if ckpt.use_master_weights_in_ckpt and not _policy_flag(cfg, "master_weights"):
        p.append(f"exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt: precision.type {prec.type} "
                 "keeps no fp32 master weights; use mixed_precision / mixed_precisionSR (or manual with "
                 "master_weights and bf16) or set it false")
    if ckpt.use_master_weights_in_ckpt and cfg.exp_manager.save_bf16:
        p.append("exp_manager.save_bf16: contradicts checkpoint_callback_params.use_master_weights_in_ckpt "
                 "(fp32 master weights); set one of them false")
    return p


def _checkpoint_problems(cfg: NxdConfig) -> list[str]:
    """``exp_manager.ckpt_ptl_version`` must parse as a version (it is compared with the checkpoint's own);
    ``exp_manager.preemption_signals`` must name signals nxd_lc handles."""
    from packaging.version import InvalidVersion, Version

    version = cfg.exp_manager.ckpt_ptl_version
    try:
        if version is not None:
            Version(version)
    except InvalidVersion:
        return [f"exp_manager.ckpt_ptl_version: {version!r} is not a version; give the pytorch-lightning version "
                f"the checkpoint was saved with, e.g. '1.8.6', or remove it"]
    from nxd_lc.lightning.preemption import signal_numbers

    try:
        signal_numbers(list(cfg.exp_manager.preemption_signals))
    except ValueError as e:
        return [str(e)]
    return _retrieval_eval_problems(cfg)


_MIXTURE_KEYS = {"corpus": {"source", "weight"}, "path": {"source", "weight"},
                 "synthetic": {"source", "weight", "tasks", "num_samples", "min_length"}}


def _mixture_problems(cfg: NxdConfig) -> list[str]:
    """``data.mixture`` entries (source kind, positive weight, known keys and tasks) and ``data.length_upsampling``
    (``min_tokens >= 1``, ``factor >= 1``)."""
    from nxd_lc.eval.retrieval import TASKS

    d, p = cfg.data, []
    if d.length_upsampling is not None:
        up = dict(d.length_upsampling)
        extra = set(up) - {"min_tokens", "factor"}
        if extra or not isinstance(up.get("min_tokens"), int) or up["min_tokens"] < 1 \
                or not isinstance(up.get("factor"), (int, float)) or up["factor"] < 1:
            p.append(f"data.length_upsampling: needs {{min_tokens: int >= 1, factor: number >= 1}} and nothing else, "
                     f"got {up}")
    if d.mixture is None:
        return p
    if not d.mixture:
        return p + ["data.mixture: empty; give at least one {source, weight} entry or remove it"]
    for i, raw in enumerate(d.mixture):
        key = f"data.mixture[{i}]"
        entry = dict(raw) if isinstance(raw, Mapping) else None
        if entry is None or not isinstance(entry.get("source"), str):
            p.append(f"{key}: needs {{source: corpus | <path> | synthetic, weight: <number > 0>}}, got {raw!r}")
            continue
        kind = entry["source"] if entry["source"] in ("corpus", "synthetic") else "path"
        unknown = sorted(set(entry) - _MIXTURE_KEYS[kind])
        if unknown:
            p.append(f"{key}: unknown keys {unknown} for a {kind} source (allowed: {sorted(_MIXTURE_KEYS[kind])})")
        weight = entry.get("weight")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            p.append(f"{key}.weight: must be a number > 0, got {weight!r}")
        if kind == "synthetic":
            tasks = entry.get("tasks", ["passkey"])
            bad = [t for t in tasks if t not in TASKS] if isinstance(tasks, list) else [tasks]
            if bad or not tasks:
                p.append(f"{key}.tasks: unknown {bad or 'none given'}; choose from {', '.join(TASKS)}")
            for name, low in (("num_samples", 1), ("min_length", 1)):
                v = entry.get(name, low)
                if not isinstance(v, int) or v < low:
                    p.append(f"{key}.{name}: must be an int >= {low}, got {v!r}")
    return p


_CURRICULUM_KEYS = {"until_step", "seq_length", "micro_batch_size", "rope_scaling"}


def _curriculum_problems(cfg: NxdConfig) -> list[str]:
    """``data.curriculum`` (:mod:`nxd_lc.data.curriculum`): known keys; ``until_step`` increasing ints, only the
    last stage without one (or >= ``trainer.max_steps``); each ``seq_length`` within the model's length and
    divisible as the layout needs; ``micro_batch_size`` >= 1; ``rope_scaling`` valid (HF's requirements) and not
    on the last stage; no pipeline parallelism."""
    from nxd_lc.models.common.rope import rope_scaling_problems

    stages = cfg.data.curriculum
    if stages is None:
        return []
    if not stages:
        return ["data.curriculum: empty; give at least one {until_step, seq_length} stage or remove it"]
    p: list[str] = []
    if cfg.distributed_strategy.pipeline_model_parallel_size > 1:
        p.append("data.curriculum: not supported with distributed_strategy.pipeline_model_parallel_size > 1 yet; "
                 "run the stages as chained runs (README 'Long-context data') or set pipeline_model_parallel_size: 1")
    vci = cfg.trainer.val_check_interval
    if isinstance(vci, float) and vci != 1.0:
        p.append(f"trainer.val_check_interval: {vci} is a fraction of an epoch, which has no fixed length under "
                 "data.curriculum (an epoch crosses stages); give an int (optimizer steps)")
    model_len, start, max_steps = model_seq_length(cfg), 0, cfg.trainer.max_steps
    for i, raw in enumerate(stages):
        key = f"data.curriculum[{i}]"
        last = i == len(stages) - 1
        if not isinstance(raw, Mapping):
            p.append(f"{key}: needs {{until_step, seq_length, micro_batch_size?, rope_scaling?}}, got {raw!r}")
            continue
        e = dict(raw)
        unknown = sorted(set(e) - _CURRICULUM_KEYS)
        if unknown:
            p.append(f"{key}: unknown keys {unknown} (allowed: {sorted(_CURRICULUM_KEYS)})")
        s = e.get("seq_length")
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            p.append(f"{key}.seq_length: must be an int >= 1, got {s!r}")
        else:
            if model_len is not None and s > model_len:
                p.append(f"{key}.seq_length: {s} exceeds the model's length {model_len} (model.encoder_seq_length); "
                         "raise model.encoder_seq_length / max_position_embeddings to the longest stage")
            p += _length_divisibility_problems(cfg, s, f"{key}.seq_length")
        until = e.get("until_step")
        if until is None and not last:
            p.append(f"{key}.until_step: missing; only the last stage may omit it (it runs to trainer.max_steps)")
        elif until is not None and (not isinstance(until, int) or isinstance(until, bool) or until <= start):
            p.append(f"{key}.until_step: must be an int > {start} (the stage's first step), got {until!r}")
        elif last and until is not None and max_steps > 0 and until < max_steps:
            p.append(f"{key}.until_step: {until} < trainer.max_steps {max_steps}; the last stage runs to the end of "
                     "training: set it to null (or >= max_steps), or add a stage")
        start = until if isinstance(until, int) and not isinstance(until, bool) and until > start else start
        mbs = e.get("micro_batch_size")
        if mbs is not None and (not isinstance(mbs, int) or isinstance(mbs, bool) or mbs < 1):
            p.append(f"{key}.micro_batch_size: must be an int >= 1, got {mbs!r}")
        rope = e.get("rope_scaling")
        if rope is not None and last:
            p.append(f"{key}.rope_scaling: the last stage trains with the model's own RoPE (what its checkpoint and "
                     "HF conversion carry); move it to model.hf_config_overrides.rope_scaling")
        elif rope is not None and not isinstance(rope, Mapping):
            p.append(f"{key}.rope_scaling: must be a mapping of HF rope_scaling fields, got {rope!r}")
        elif rope is not None:
            fields = dict(rope)
            fields.setdefault("rope_type", fields.pop("type", None) or "default")
            if fields["rope_type"] in ("llama3", "yarn", "longrope") and model_len is not None:
                fields.setdefault("original_max_position_embeddings", model_len)
            p += rope_scaling_problems(fields, f"{key}.rope_scaling", strict=False)
    return p


def _retrieval_eval_problems(cfg: NxdConfig) -> list[str]:
    """``exp_manager.retrieval_eval``: known tasks / scorings, depths in [0, 1], positive counts; pretraining data
    (its held-out split is the haystack) and one pipeline stage."""
    from nxd_lc.eval.retrieval import SCORINGS, TASKS

    r, key = cfg.exp_manager.retrieval_eval, "exp_manager.retrieval_eval"
    if r.every_n_steps == 0:
        return []
    p: list[str] = []
    if r.every_n_steps < 0:
        p.append(f"{key}.every_n_steps: must be >= 0 (0 = off), got {r.every_n_steps}")
    bad = [t for t in r.tasks if t not in TASKS]
    if bad or not r.tasks:
        p.append(f"{key}.tasks: unknown {bad or 'none given'}; choose from {', '.join(TASKS)}")
    bad = [s for s in r.scorings if s not in SCORINGS]
    if bad or not r.scorings:
        p.append(f"{key}.scorings: unknown {bad or 'none given'}; choose from {', '.join(SCORINGS)}")
    if any(not 0 <= d <= 1 for d in r.depths) or not r.depths:
        p.append(f"{key}.depths: need numbers in [0, 1], got {list(r.depths)}")
    if any(L < 1 for L in r.lengths):
        p.append(f"{key}.lengths: need positive token counts, got {list(r.lengths)}")
    for name in ("num_samples", "num_candidates"):
        if getattr(r, name) < 1:
            p.append(f"{key}.{name}: must be >= 1, got {getattr(r, name)}")
    if cfg.distributed_strategy.pipeline_model_parallel_size > 1:
        p.append(f"{key}: not supported with pipeline_model_parallel_size > 1 (the evaluation runs the whole model "
                 "on each rank); set every_n_steps: 0 and evaluate the converted checkpoint with "
                 "python -m nxd_lc.eval.passkey")
    if cfg.model_alignment_strategy is not None:
        p.append(f"{key}: needs the pretraining data module (its held-out split is the haystack); for fine-tuning "
                 "runs evaluate the converted checkpoint with python -m nxd_lc.eval.niah")
    return p


def _pipeline_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    """Pipeline rules (NxD): a valid stage split; V > 1 needs PP > 1 and ``num_microbatches % PP == 0``."""
    from nxd_lc.pipeline.split import split_problems

    ds, d = cfg.distributed_strategy, cfg.data
    pp, vpp = ds.pipeline_model_parallel_size, ds.virtual_pipeline_model_parallel_size
    p: list[str] = []
    if pp < 1 or vpp < 1:
        return p
    smf = cfg.trainer.sequential_move_factor
    if smf is not None and smf < 1:
        p.append(f"trainer.sequential_move_factor: must be >= 1 (ranks per node that build / move the model at a "
                 f"time) or null, got {smf}")
    if vpp > 1 and pp == 1:
        p.append(f"distributed_strategy.virtual_pipeline_model_parallel_size: {vpp} needs "
                 "pipeline_model_parallel_size > 1; set it to 1 or raise pipeline_model_parallel_size")
    dp = data_parallel_size(cfg)
    if vpp > 1 and pp > 1 and d.micro_batch_size > 0 and d.global_batch_size % (d.micro_batch_size * dp) == 0:
        n = d.global_batch_size // (d.micro_batch_size * dp)
        if n % pp:
            p.append(f"data.global_batch_size: interleaved pipeline (virtual_pipeline_model_parallel_size {vpp}) "
                     f"needs num_microbatches = global_batch_size / (micro_batch_size x DP) = {n} divisible by "
                     f"pipeline_model_parallel_size {pp}; change global_batch_size or the parallel sizes")
    layers = cfg.model.num_layers if cfg.model.num_layers not in (None, -1) else (hf or {}).get("num_hidden_layers")
    if isinstance(layers, int) and layers > 0:
        p += split_problems(layers, pp, vpp, cfg.model.pipeline_cuts)
    return p + _pipeline_dpo_reference_problems(cfg) + _pipeline_on_xla_problems(cfg, cfg.trainer.accelerator) \
        + _compile_on_xla_problems(cfg)


def _compile_on_xla_problems(cfg: NxdConfig) -> list[str]:
    """``model.compile`` is torch.compile of eager devices (CPU, CUDA, TorchNeuron's native device); torch-xla
    records and compiles lazy graphs itself (:mod:`nxd_lc.models.common.compile`). LoRA adapters have not been
    traced and checked: refused until they are."""
    if not cfg.model.compile:
        return []
    p = []
    if peft_config(cfg) is not None:
        p.append("model.compile: not supported yet with model_alignment_strategy.peft (LoRA adapters are not "
                 "checked under torch.compile); set model.compile: false")
    acc = cfg.trainer.accelerator
    if acc not in ("xla", "neuron") or not _lazy_neuron_or_xla(acc):
        return p
    return p + [f"model.compile: not available on trainer.accelerator {acc} (torch-xla compiles its lazy graphs "
            "itself); set model.compile: false, or use the native neuron device (torch-neuronx >= 2.10)"]


def _pipeline_dpo_reference_problems(cfg: NxdConfig) -> list[str]:
    """DPO under PP takes its reference log-probs from the table precomputed through the pipeline: the per-step
    reference forward (frozen copy / LoRA base) does not run through the pipeline stages."""
    pp = cfg.distributed_strategy.pipeline_model_parallel_size
    strategy = cfg.model_alignment_strategy
    dpo = strategy.dpo if strategy is not None else None
    if pp <= 1 or dpo is None or dpo.precompute_ref_log_probs:
        return []
    return [f"model_alignment_strategy.dpo.precompute_ref_log_probs: false (a reference forward every step) is not "
            f"available with distributed_strategy.pipeline_model_parallel_size {pp}; set it true (the reference "
            "log-probs are then computed once, through the pipeline, before training)"]


def _pipeline_on_xla_problems(cfg: NxdConfig, accelerator: str) -> list[str]:
    """The pipeline schedule sends activations point to point, which the torch-xla process group does not offer
    (as for ring attention): reject PP > 1 on xla / neuron before anything is built."""
    pp = cfg.distributed_strategy.pipeline_model_parallel_size
    if pp <= 1 or not _lazy_neuron_or_xla(accelerator):
        return []
    return [f"distributed_strategy.pipeline_model_parallel_size: pipeline parallelism ({pp} stages) is not "
            f"available on trainer.accelerator {accelerator} (the XLA process group has no point-to-point "
            "send/recv for the activations between stages); set it to 1, or run on trainer.accelerator cpu / gpu"]


def cross_field_problems(cfg: NxdConfig, world_size: int | None = None) -> list[str]:
    """All cross-field rule violations of a typed config (empty when valid)."""
    hf = read_model_json(cfg)  # read once; both head and CP rules need it
    return (_parallel_problems(cfg, world_size) + _trainer_problems(cfg) + _batch_problems(cfg)
            + _head_problems(cfg, hf) + _context_parallel_problems(cfg, hf) + _memory_problems(cfg)
            + _choice_problems(cfg) + _pipeline_problems(cfg, hf)
            + _checkpoint_problems(cfg) + _mixture_problems(cfg) + _curriculum_problems(cfg)
            + _moe_problems(cfg, hf) + _data_source_problems(cfg) + _megatron_problems(cfg)
            + _family_problems(cfg, hf))


def _family_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    """Decoder-family parts not supported yet: sliding-window attention shorter than the sequence (mistral's
    ``sliding_window``, qwen2 / qwen3 ``use_sliding_window``, Megatron ``sliding_window_size``) with context
    parallelism (the ring / Ulysses kernels have no window); attention dropout (a config.json's, or Megatron's
    ``attention_dropout``) with context or pipeline parallelism (shared masks) or with ``model.compile`` (its
    per-rank seed is a host read)."""
    if hf is None:
        return []
    kind, p, ds = hf.get("model_type", "llama"), [], cfg.distributed_strategy
    window = hf.get("sliding_window") if kind == "mistral" or (
        kind in ("qwen2", "qwen3") and hf.get("use_sliding_window")) else None
    seq = model_seq_length(cfg)
    source = "model.sliding_window_size" if cfg.model_source == "megatron" else f"sliding_window of {kind} config.json"
    if window and ds.context_parallel_size > 1 and (seq is None or window < seq):
        p.append(f"not supported yet: sliding-window attention ({source} {window} < sequence {seq}) with "
                 "distributed_strategy.context_parallel_size > 1; set context_parallel_size: 1")
    dropout = float(hf.get("attention_dropout") or 0.0)
    key = "model.attention_dropout" if cfg.model_source == "megatron" else f"attention_dropout of {kind} config.json"
    if dropout > 0 and cfg.model_source != "megatron" and (ds.context_parallel_size > 1
                                                           or ds.pipeline_model_parallel_size > 1):
        p.append(f"not supported yet: attention dropout ({key} {dropout}) with context_parallel_size > 1 or "
                 "pipeline_model_parallel_size > 1; set it to 0")  # megatron: _megatron_problems covers every dropout
    if dropout > 0 and cfg.model.compile:
        p.append(f"not supported yet: attention dropout ({key} {dropout}) with model.compile; set one of them off")
    return p


def _megatron_problems(cfg: NxdConfig) -> list[str]:
    """The ``model_source: megatron`` architecture keys (:func:`nxd_lc.models.megatron.megatron_problems`), and
    dropout (those keys', or an HF config.json's attention_dropout) with pipeline or context parallelism."""
    from nxd_lc.models.megatron import MEGATRON_KEYS, megatron_problems

    p = megatron_problems(cfg.model, cfg.model_source)
    tok = cfg.data.tokenizer
    if cfg.model_source == "megatron" and (cfg.model.position_embedding_type or MEGATRON_KEYS[
            "position_embedding_type"]) != "rope":
        for i, stage in enumerate(cfg.data.curriculum or []):
            if isinstance(stage, Mapping) and stage.get("rope_scaling") is not None:
                p.append(f"data.curriculum[{i}].rope_scaling: the model has learned absolute positions "
                         "(model.position_embedding_type), no RoPE to scale; remove it")
    if cfg.model_source == "megatron" and tok.type == "bytelevel_bpe" and tok.library is None:
        p.append("data.tokenizer.type: bytelevel_bpe is trained from the corpus at data setup, but model_source: "
                 "megatron sizes its vocabulary from the tokenizer before; give an HF tokenizer directory or GPT-2 "
                 "vocab_file / merge_file (library: megatron, type: GPT2BPETokenizer)")
    ds = cfg.distributed_strategy
    if cfg.model_source == "megatron" and (ds.pipeline_model_parallel_size > 1 or ds.context_parallel_size > 1):
        for key in ("hidden_dropout", "attention_dropout", "ffn_dropout"):
            value = getattr(cfg.model, key)
            if (MEGATRON_KEYS[key] if value is None else value) > 0:
                p.append(f"not supported yet: model.{key} > 0 with pipeline_model_parallel_size > 1 or "
                         "context_parallel_size > 1 (every stage / CP rank would draw the same dropout masks); "
                         f"set model.{key}: 0")
    return p


def _data_source_problems(cfg: NxdConfig) -> list[str]:
    """Megatron indexed data (``data.data_prefix`` and its keys, :mod:`nxd_lc.data.megatron_dataset`) and the
    ``data.tokenizer`` library keys (:mod:`nxd_lc.data.tokenizer`)."""
    from nxd_lc.data.megatron_dataset import megatron_data_problems
    from nxd_lc.data.tokenizer import tokenizer_problems

    return (megatron_data_problems(cfg.data, alignment=cfg.model_alignment_strategy is not None)
            + tokenizer_problems(cfg.data.tokenizer))


def _moe_problems(cfg: NxdConfig, hf: dict[str, Any] | None) -> list[str]:
    """``model.moe`` and ``distributed_strategy.expert_model_parallel_size`` (:mod:`nxd_lc.moe.config`)."""
    from nxd_lc.moe.config import expert_parallel_problems, moe_problems

    return moe_problems(cfg, hf) + expert_parallel_problems(cfg, hf, data_parallel_size(cfg))


def path_problems(cfg: NxdConfig) -> list[str]:
    """Input paths that must exist at launch: data dirs, tokenizer dir, resume_from_checkpoint."""
    import glob

    p: list[str] = []
    d = cfg.data
    if d.data_prefix is not None:
        from nxd_lc.data.megatron_dataset import megatron_path_problems

        p += megatron_path_problems(d)
    elif d.train_dir is None and d.builtin_corpus is None:
        p.append("data.train_dir: not set; point it at text files/jsonl/a datasets dir, or set "
                 "data.builtin_corpus: python_stdlib")
    for key, path in (("data.train_dir", d.train_dir), ("data.val_dir", d.val_dir)):
        if path is not None and not (os.path.exists(resolve_path(path))
                                     or glob.glob(resolve_path(path), recursive=True)):
            p.append(f"{key}: no such file, directory or glob match: {resolve_path(path)}")
    from nxd_lc.data.tokenizer import tokenizer_paths

    for key, path, is_dir in tokenizer_paths(d.tokenizer):
        if not (os.path.isdir if is_dir else os.path.isfile)(resolve_path(path)):
            what = "an existing tokenizer directory" + ("" if d.tokenizer.library else " (nor 'bytelevel_bpe')")
            p.append(f"{key}: {path!r} is not {what if is_dir else 'an existing file'}")
    w = cfg.model.hf_weights_dir
    if w is not None and not os.path.isdir(resolve_path(w)):
        p.append(f"model.hf_weights_dir: no such directory: {resolve_path(w)} (expected HF safetensors files)")
    r = cfg.exp_manager.resume_from_checkpoint
    if r is not None and not os.path.isdir(resolve_path(r)):
        p.append(f"exp_manager.resume_from_checkpoint: no such checkpoint directory: {resolve_path(r)}")
    return p


def unsupported_features(cfg: NxdConfig) -> list[str]:
    """Keys set to values whose feature lands in a later issue: ``not supported yet: <key>=<value>``."""
    m = cfg.model
    checks: list[tuple[bool, str, Any]] = [
        (m.optim.name not in IMPLEMENTED_OPTIMIZERS, "model.optim.name", m.optim.name),
        (m.optim.sched.name not in IMPLEMENTED_SCHEDULERS, "model.optim.sched.name", m.optim.sched.name),
    ]
    return [f"not supported yet: {key}={value!r}" for bad, key, value in checks if bad] + _auto_ring_on_xla(cfg) \
        + _data_unsupported(cfg)


def _data_unsupported(cfg: NxdConfig) -> list[str]:
    """``data.tokenizer`` keys nxd_lc cannot honour (:func:`nxd_lc.data.tokenizer.tokenizer_unsupported`) and NxD's
    MoE token shuffling (``distributed_strategy.token_shuffle_group_size`` other than 1)."""
    from nxd_lc.data.tokenizer import tokenizer_unsupported

    size = cfg.distributed_strategy.token_shuffle_group_size
    shuffle = [] if size == 1 else [f"not supported yet: distributed_strategy.token_shuffle_group_size={size!r} "
                                    "(NxD's MoE token shuffling across DP ranks; only 1, no shuffling)"]
    return tokenizer_unsupported(cfg.data.tokenizer) + shuffle


def _auto_ring_on_xla(cfg: NxdConfig) -> list[str]:
    """``trainer.accelerator: auto`` resolves to neuron on a Trainium host: ring CP and pipeline parallelism are
    then not available either (explicit xla / neuron are rejected by validation, :func:`_ring_on_xla_problems`,
    :func:`_pipeline_on_xla_problems`)."""
    ds = cfg.distributed_strategy
    ring = ds.context_parallel_size > 1 and ds.context_parallel_algo == "ring"
    if cfg.trainer.accelerator != "auto" or not (ring or ds.pipeline_model_parallel_size > 1):
        return []
    from nxd_lc.runtime.device import neuron_resolution  # auto picks neuron first (nxd_lc.runtime.device)

    return ["not supported yet: " + p.replace("trainer.accelerator neuron", "trainer.accelerator auto (= neuron here)")
            for p in _ring_on_xla_problems(cfg, "neuron") + _pipeline_on_xla_problems(cfg, "neuron")] \
        if neuron_resolution() == "neuron" else []


def check_supported(cfg: NxdConfig) -> None:
    """Raise :class:`ConfigError` listing every key whose feature is not implemented yet."""
    problems = unsupported_features(cfg)
    if problems:
        raise ConfigError(problems)
