"""Cross-field rules of the ``data`` section: batch sizes and lengths, mixtures, curricula, Megatron indexed
data and tokenizer keys, and the input paths that must exist at launch."""

from __future__ import annotations

import os
from collections.abc import Mapping

from nxd_lc.app.validation.parallel import length_divisibility_problems
from nxd_lc.config.access import data_parallel_size, microbatch_problem, model_seq_length, resolve_path, seq_length
from nxd_lc.config.input_files import glob_files
from nxd_lc.config.schema import NxdConfig
from nxd_lc.data.megatron_dataset import megatron_data_problems
from nxd_lc.data.retrieval_tasks import TASKS
from nxd_lc.data.tokenizer import (
    check_tokenizer_files,
    refuse_remote_code,
    tokenizer_paths,
    tokenizer_problems,
    tokenizer_unsupported,
)
from nxd_lc.models.common.rope import rope_scaling_problems


def batch_problems(cfg: NxdConfig) -> list[str]:
    p: list[str] = []
    d = cfg.data
    if d.micro_batch_size < 1 or d.global_batch_size < 1:
        p.append("data.micro_batch_size / data.global_batch_size: must be >= 1")
        return p
    dp = data_parallel_size(cfg)
    problem = microbatch_problem(d.global_batch_size, d.micro_batch_size, dp)
    if problem is not None:
        p.append(problem)
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
        p += length_divisibility_problems(cfg, s, "data.seq_length", context_parallel=False)
    if d.val_fraction is not None and not 0.0 <= d.val_fraction < 1.0:
        p.append(f"data.val_fraction: must be in [0, 1), got {d.val_fraction}")
    if d.builtin_corpus not in (None, "python_stdlib"):
        p.append(f"data.builtin_corpus: unknown corpus {d.builtin_corpus!r}; the built-in one is 'python_stdlib'")
    return p


_MIXTURE_KEYS = {"corpus": {"source", "weight"}, "path": {"source", "weight"},
                 "synthetic": {"source", "weight", "tasks", "num_samples", "min_length"}}


def mixture_problems(cfg: NxdConfig) -> list[str]:
    """``data.mixture`` entries (source kind, positive weight, known keys and tasks) and ``data.length_upsampling``
    (``min_tokens >= 1``, ``factor >= 1``)."""
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


def curriculum_problems(cfg: NxdConfig) -> list[str]:
    """``data.curriculum`` (:mod:`nxd_lc.data.curriculum`): known keys; ``until_step`` increasing ints, only the
    last stage without one (or >= ``trainer.max_steps``); each ``seq_length`` within the model's length and
    divisible as the layout needs; ``micro_batch_size`` >= 1; ``rope_scaling`` valid (HF's requirements) and not
    on the last stage; no pipeline parallelism."""
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
            p += length_divisibility_problems(cfg, s, f"{key}.seq_length")
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


def data_source_problems(cfg: NxdConfig) -> list[str]:
    """Megatron indexed data (``data.data_prefix`` and its keys, :mod:`nxd_lc.data.megatron_dataset`) and the
    ``data.tokenizer`` library keys (:mod:`nxd_lc.data.tokenizer`)."""
    return (megatron_data_problems(cfg.data, alignment=cfg.model_alignment_strategy is not None)
            + tokenizer_problems(cfg.data.tokenizer))


def sft_style_problems(cfg: NxdConfig) -> list[str]:
    """``data.use_sft_style_data_module`` / ``data.packing`` (NxDT's older SFT layout) are read as
    ``model_alignment_strategy.sft`` when a config is loaded (:mod:`nxd_lc.config.sft_style_layout`), which leaves
    them unset; a typed config built in code with them set would have them ignored, so they are refused."""
    return [f"data.{key}: NxDT's older SFT layout, read as model_alignment_strategy.sft when a YAML / dict config is "
            "loaded (nxd_lc.config.structure.typed_config); in a typed config set model_alignment_strategy.sft "
            "instead" for key in ("use_sft_style_data_module", "packing") if getattr(cfg.data, key) is not None]


def path_problems(cfg: NxdConfig) -> list[str]:
    """Input paths that must exist at launch: data dirs (a glob must match a file; a directory link loop is
    skipped with a warning, never followed), tokenizer dir (its files readable, no ``AutoTokenizer`` mapped to code:
    :func:`~nxd_lc.data.tokenizer.refuse_remote_code`), resume_from_checkpoint."""
    p: list[str] = []
    d = cfg.data
    if d.data_prefix is not None:
        from nxd_lc.data.megatron_dataset import megatron_path_problems

        p += megatron_path_problems(d)
    elif d.train_dir is None and d.builtin_corpus is None:
        p.append("data.train_dir: not set; point it at text files/jsonl/a datasets dir, or set "
                 "data.builtin_corpus: python_stdlib")
    for key, path in (("data.train_dir", d.train_dir), ("data.val_dir", d.val_dir)):
        if path is not None and not (os.path.exists(resolve_path(path)) or glob_files(resolve_path(path), key=key)):
            p.append(f"{key}: no such file, directory or glob match: {resolve_path(path)}")
    for key, path, is_dir in tokenizer_paths(d.tokenizer):
        if not (os.path.isdir if is_dir else os.path.isfile)(resolve_path(path)):
            what = "an existing tokenizer directory" + ("" if d.tokenizer.library else " (nor 'bytelevel_bpe')")
            p.append(f"{key}: {path!r} is not {what if is_dir else 'an existing file'}")
        elif is_dir:  # the launch's own file checks, so the dry run lists what loading the tokenizer would refuse
            try:
                refuse_remote_code(resolve_path(path), key, check_tokenizer_files(resolve_path(path), key))
            except ValueError as e:
                p.append(str(e))
    w = cfg.model.hf_weights_dir
    if w is not None and not os.path.isdir(resolve_path(w)):
        p.append(f"model.hf_weights_dir: no such directory: {resolve_path(w)} (expected HF safetensors files)")
    r = cfg.exp_manager.resume_from_checkpoint
    if r is not None and not os.path.isdir(resolve_path(r)):
        p.append(f"exp_manager.resume_from_checkpoint: no such checkpoint directory: {resolve_path(r)}")
    return p


def data_unsupported(cfg: NxdConfig) -> list[str]:
    """``data.tokenizer`` keys nxd_lc cannot honour (:func:`nxd_lc.data.tokenizer.tokenizer_unsupported`) and NxD's
    MoE token shuffling (``distributed_strategy.token_shuffle_group_size`` other than 1)."""
    size = cfg.distributed_strategy.token_shuffle_group_size
    shuffle = [] if size == 1 else [f"not supported yet: distributed_strategy.token_shuffle_group_size={size!r} "
                                    "(NxD's MoE token shuffling across DP ranks; only 1, no shuffling)"]
    return tokenizer_unsupported(cfg.data.tokenizer) + shuffle
