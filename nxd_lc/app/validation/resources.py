"""Resource keys checked before launch (issue 40): what the dry run accepts must launch, or be refused naming the
key, the bound and the fix.

* ``data.num_workers``: each DataLoader worker is a process; more than this host's CPUs per rank
  (:func:`cpus_per_rank`) only oversubscribes the CPUs, and 100000 forked until the process limit and the launch
  died with a raw ``BlockingIOError``. Bound: the CPUs this process may run on (``os.sched_getaffinity``, else
  ``os.cpu_count``) over the ranks of a node (``trainer.devices``; validation checks the launched world is
  ``trainer.devices x trainer.num_nodes``), at least 1. Judged at launch, where every rank validates on its own
  node (a launch-host check, as the input paths); the dry run, possibly on a smaller login node, lists it.
* the run directory (:func:`run_dir_problems`, at launch and listed by the dry run): ``exp_manager``'s
  ``explicit_log_dir`` (else ``exp_dir/name``) must be a directory this process can create files in (global rank 0
  takes its lock there before anything else is written), or be creatable under its nearest existing parent. The
  probe is an unnamed temporary file (``O_TMPFILE`` where the filesystem has it; else a file removed at once):
  nothing is left behind, and nothing is created for a directory that does not exist yet.
* ``data.global_batch_size`` against the training set where its size is known before anything is built
  (:func:`dataset_size_problems`): Megatron indexed data (``data.data_prefix``) holds at most
  ``(tokens - 1) // seq_length`` samples per prefix of its training blend (``tokens``: the ``.bin`` file's bytes
  over the token width in ``.idx``'s header; no scan), so a global batch above their sum can never be drawn.
  Pretraining text (``data.train_dir`` or ``data.builtin_corpus``; no ``data.mixture`` or ``data.curriculum``),
  whose exact size is known only once it is tokenized (the sampler's refusal names the key then:
  :class:`~nxd_lc.data.sampler.PretrainingSampler`), is bounded from its files' bytes before anything is built
  (:func:`text_samples_bound`): a token stands for at least one byte of text except where a tokenizer's normalizer
  expands characters (NFKC's largest expansion, U+FDFA's 3 bytes to 18 characters, is 12 tokens per byte even with
  byte fallback) and the few special tokens of a document (at most :data:`TOKENS_PER_FILE_BOUND` per file, one
  document per text file; a JSON line or dataset row takes at least 2 bytes of its file), so a stream holds at most
  :data:`TOKENS_PER_BYTE_BOUND` tokens per byte plus :data:`TOKENS_PER_FILE_BOUND` per file, times
  ``length_upsampling.factor`` rounded up; a global batch above ``(tokens - 1) // seq_length`` samples can never be
  drawn (a ``data.global_batch_size`` of 10^12 on a small corpus was accepted by the dry run and refused only after
  the model was built).
"""

from __future__ import annotations

import math
import os
import struct
import tempfile

import numpy as np

from nxd_lc.config.access import data_parallel_size, resolve_path, seq_length
from nxd_lc.config.schema import NxdConfig

__all__ = ["TOKENS_PER_BYTE_BOUND", "TOKENS_PER_FILE_BOUND", "cpus_per_rank", "dataset_size_problems",
           "megatron_tokens", "num_workers_problems", "run_dir_problems", "text_samples_bound", "writable_dir_problem"]

#: Most tokens any tokenizer makes of one byte of text (module docstring: 12 for NFKC's largest expansion).
TOKENS_PER_BYTE_BOUND = 16
#: Most tokens a document adds beyond its bytes (bos, eos, a prefix space), counted once per file.
TOKENS_PER_FILE_BOUND = 4


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cpus_per_rank(cfg: NxdConfig) -> tuple[int, int, int]:
    """``(bound, CPUs, ranks per node)``: the CPUs this process may run on over ``trainer.devices`` ranks per node,
    at least 1 (the bound of ``data.num_workers``)."""
    cpus, ranks = _available_cpus(), max(1, int(cfg.trainer.devices))
    return max(1, cpus // ranks), cpus, ranks


def num_workers_problems(cfg: NxdConfig) -> list[str]:
    """``data.num_workers`` above :func:`cpus_per_rank` (a negative or non-integer value is reported by
    :func:`nxd_lc.app.validation.training.domain_problems`)."""
    workers = cfg.data.num_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        return []
    bound, cpus, ranks = cpus_per_rank(cfg)
    if workers <= bound:
        return []
    return [f"data.num_workers: {workers} exceeds the CPUs per rank on this host ({cpus} CPUs available over "
            f"trainer.devices={ranks} ranks per node = {bound}); each worker is a process of every rank, and too "
            f"many fork until the process limit: set data.num_workers <= {bound} (0 loads in the training process)"]


def writable_dir_problem(key: str, path: str, what: str = "the run directory") -> str | None:
    """The problem of a directory ``path`` (named by ``key``, described as ``what``) that this process must create
    files in, or None: the directory, or for one that does not exist yet its nearest existing parent, must be a
    directory where a file can be created (probed with an unnamed temporary file; nothing is created or left
    behind)."""
    path = os.path.abspath(path)
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return (f"{key}: {what} {path} cannot be created: {probe} is not a directory; choose a directory "
                "path")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        where = "" if probe == path else f" (its nearest existing parent {probe})"
        return (f"{key}: {what} {path} is not writable{where}: creating a file there fails "
                f"({e.strerror or e}); choose a writable "
                f"directory (the run writes its lock, logs and checkpoints there)")
    return None


def run_dir_problems(cfg: NxdConfig) -> list[str]:
    """The run directory (``exp_manager.explicit_log_dir``, else ``exp_manager.exp_dir``/``name``) and its
    ``checkpoints/`` when it exists, each writable (:func:`writable_dir_problem`)."""
    from nxd_lc.lightning.exp_manager import experiment_paths

    em = cfg.exp_manager
    key = "exp_manager.explicit_log_dir" if em.explicit_log_dir else "exp_manager.exp_dir"
    paths = experiment_paths(cfg)
    problem = writable_dir_problem(key, paths.log_dir)
    if problem is None and os.path.isdir(paths.checkpoint_dir):
        problem = writable_dir_problem(key, paths.checkpoint_dir, "the checkpoint directory")
    return [problem] if problem else []


def megatron_tokens(prefix: str) -> int | None:
    """Tokens of the Megatron indexed data ``prefix`` (``.bin`` bytes over the token width of ``.idx``'s header),
    or None when a file is missing or the header is not a Megatron mmap index (reported elsewhere)."""
    from nxd_lc.data.megatron_indexed import DTYPE_CODES, INDEX_HEADER, data_path, index_path

    try:
        with open(index_path(prefix), "rb") as f:
            head = f.read(len(INDEX_HEADER) + 9)
        size = os.path.getsize(data_path(prefix))
    except OSError:
        return None
    if len(head) < len(INDEX_HEADER) + 9 or head[:len(INDEX_HEADER)] != INDEX_HEADER:
        return None
    code = struct.unpack("<B", head[len(INDEX_HEADER) + 8:])[0]
    return size // np.dtype(DTYPE_CODES[code]).itemsize if code in DTYPE_CODES else None


def _alignment_records_problem(cfg: NxdConfig) -> list[str]:
    """An alignment run (``model_alignment_strategy``) on one ``.jsonl`` file: every training sample holds at least
    one record (one per row / pair; packing only joins them), so a global batch above the file's non-blank lines
    (``data.dev_choose_samples`` at most) can never be drawn. Lines are counted until the batch is reached: the cost
    is bounded by ``data.global_batch_size`` lines, the file read once at most."""
    d = cfg.data
    if cfg.model_alignment_strategy is None or d.train_dir is None:
        return []
    path = resolve_path(d.train_dir)
    if not (path.endswith(".jsonl") and os.path.isfile(path)):
        return []  # a directory, glob or datasets dir: counted once built (the sampler's refusal names the key)
    need, records = d.global_batch_size, 0
    try:
        with open(path, "rb") as f:
            for line in f:
                records += bool(line.strip())
                if records >= need:
                    return []
    except OSError:
        return []  # reported by the path checks
    if d.dev_choose_samples is not None:
        records = min(records, d.dev_choose_samples)
    return [f"data.global_batch_size: {need} exceeds the {records} records of data.train_dir ({path}); every "
            f"training sample holds at least one record: lower data.global_batch_size to at most {records} or add "
            "records"]


def _text_files(cfg: NxdConfig) -> tuple[str, list[str]] | None:
    """``(key, files)`` of the pretraining text source as the data module resolves it
    (:func:`nxd_lc.data.sources.resolve_source`; a ``datasets`` directory: every file under it), or None when it
    cannot be resolved (reported by the path checks at launch)."""
    from nxd_lc.data.sources import builtin_source, resolve_source

    d = cfg.data
    try:
        if d.train_dir is not None:
            src = resolve_source(d.train_dir, file_glob=d.file_glob, text_key=d.resolved().text_key)
        elif d.builtin_corpus is not None:
            src = builtin_source(d.builtin_corpus)
        else:
            return None
    except (OSError, ValueError):
        return None
    key = "data.train_dir" if d.train_dir is not None else "data.builtin_corpus"
    if src.kind != "datasets":
        return key, list(src.files)
    return key, [os.path.join(root, name) for root, _, names in os.walk(src.files[0]) for name in names]


def text_samples_bound(cfg: NxdConfig) -> tuple[int, str] | None:
    """``(samples, what)``: more training samples than pretraining text can ever pack into at the run's
    ``seq_length`` (module docstring), with a description of the files counted; None where it is not bounded here
    (alignment, Megatron data, a mixture or curriculum, no source or length)."""
    d, s = cfg.data, seq_length(cfg)
    if cfg.model_alignment_strategy is not None or d.data_prefix is not None or d.mixture or d.curriculum \
            or not s or s < 1:
        return None
    found = _text_files(cfg)
    if found is None:
        return None
    key, files = found
    try:
        size = sum(os.path.getsize(f) for f in files)
    except OSError:
        return None
    up = dict(d.length_upsampling or {})
    factor = up.get("factor", 1)
    repeat = math.ceil(factor) if isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1 else 1
    tokens = repeat * (TOKENS_PER_BYTE_BOUND * size + TOKENS_PER_FILE_BOUND * len(files))
    what = f"{key}: {size} bytes in {len(files)} file(s)" + (f", length_upsampling x{repeat}" if repeat > 1 else "")
    return max(0, (tokens - 1) // s), what


def _text_size_problem(cfg: NxdConfig) -> list[str]:
    """``data.global_batch_size`` above :func:`text_samples_bound`."""
    bound = text_samples_bound(cfg)
    if bound is None or cfg.data.global_batch_size <= bound[0]:
        return []
    samples, what = bound
    return [f"data.global_batch_size: {cfg.data.global_batch_size} exceeds the samples the training text can hold at "
            f"seq_length {seq_length(cfg)}: fewer than {samples + 1} ({what}; at most {TOKENS_PER_BYTE_BOUND} tokens "
            "per byte, whatever the tokenizer); lower data.global_batch_size (the exact count is known once the text "
            "is tokenized, and a batch above it is refused then), add data or lower data.seq_length"]


def dataset_size_problems(cfg: NxdConfig) -> list[str]:
    """``data.global_batch_size`` above the samples the training set can hold, where that is known before the build
    (module docstring: Megatron indexed data whose files are readable, an alignment ``.jsonl`` file's records, a
    bound on pretraining text; silent otherwise)."""
    d, s = cfg.data, seq_length(cfg)
    if d.data_prefix is None or not s or s < 1:
        return _alignment_records_problem(cfg) + _text_size_problem(cfg)
    from nxd_lc.data.megatron_dataset import parse_data_prefix

    try:
        prefix = parse_data_prefix(d.data_prefix)
    except ValueError:
        return []  # reported by megatron_data_problems
    extra = int(not d.resolved().no_seqlen_plus_one_input_tokens)
    bound, files = 0, []
    for _, p in prefix.blends.get("all" if prefix.by_splits_string else "train", []):
        tokens = megatron_tokens(resolve_path(p))
        if tokens is None:
            return []
        bound += max(0, (tokens - extra) // s)
        files.append(f"{resolve_path(p)}.bin: {tokens} tokens")
    if not files or d.global_batch_size <= bound:
        return []
    step = d.micro_batch_size * max(1, data_parallel_size(cfg))
    fits = bound // step * step
    fix = (f"lower data.global_batch_size to at most {fits}" if fits else
           f"the data holds fewer than micro_batch_size x DP = {step} samples")
    return [f"data.global_batch_size: {d.global_batch_size} exceeds the training samples data.data_prefix holds: "
            f"at most {bound} samples of {s}+{extra} tokens ({'; '.join(files)}); {fix}, add data or lower "
            "data.seq_length"]
