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
  Tokenized text's size is known only once it is built: there the sampler's refusal names the key
  (:class:`~nxd_lc.data.sampler.PretrainingSampler`).
"""

from __future__ import annotations

import os
import struct
import tempfile

import numpy as np

from nxd_lc.config.access import data_parallel_size, resolve_path, seq_length
from nxd_lc.config.schema import NxdConfig

__all__ = ["cpus_per_rank", "dataset_size_problems", "megatron_tokens", "num_workers_problems", "run_dir_problems",
           "writable_dir_problem"]


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


def dataset_size_problems(cfg: NxdConfig) -> list[str]:
    """``data.global_batch_size`` above the samples the training set can hold, where that is known before the build
    (module docstring: Megatron indexed data whose files are readable, an alignment ``.jsonl`` file's records;
    silent otherwise)."""
    d, s = cfg.data, seq_length(cfg)
    if d.data_prefix is None or not s or s < 1:
        return _alignment_records_problem(cfg)
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
