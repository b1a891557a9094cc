"""DPO reference log-probabilities: the frozen reference model, and the precomputed per-pair table cached beside
the dataset (``model_alignment_strategy.dpo.precompute_ref_log_probs``).

Table layout: one float32 row per preference pair of a split (``train`` / ``val``), indexed by the data module's
``sample_index`` (the pair's index in its :class:`~nxd_lc.data.alignment_datamodule.PreferenceDataset`), with
the columns of :data:`REFERENCE_COLUMNS`: the reference model's summed log-probability of the chosen response,
its number of labelled tokens, and the same for the rejected response. Sums (not means) are stored so that both
the summed (``sigmoid`` / ``hinge``) and the length-normalised (``ipo``) losses can be served; the values are the
CP-reduced outputs of :func:`nxd_lc.alignment.logprobs.sequence_log_probs`, hence independent of TP and CP
(up to float rounding), and the cache key deliberately leaves the parallel layout out.

Computation (:func:`compute_reference_table`): every DP rank takes a contiguous block of the pairs (padded to a
whole number of micro-batches, so all ranks run the same number of identically shaped forwards), the TP/CP ranks
of one DP rank run the same batches through the same CP sharding and vocab-parallel log-prob path as training,
and the blocks are all-gathered over DP so every rank ends with the whole table.

Cache (:func:`reference_cache_path`, :func:`save_reference_tables`, :func:`load_reference_tables`): a ``.pt`` file
``<name of train_dir>.ref_logps-<key>.pt`` in the run directory (``<log_dir>/ref_logps``, the directory
:func:`nxd_lc.app.run` passes; the data's own directory only when no other is given), written atomically (temporary
file + ``os.replace``) by global rank 0. The key (:func:`reference_fingerprint`) hashes the data files (names,
sizes, mtimes), the data keys that change the pairs, the tokenizer, ``seq_length``, the prompt cap and truncation
mode, the model config, a TP-independent checksum of the base weights (:func:`weights_checksum`),
``model.hf_weights_dir`` and the precision (parameter and autocast dtypes). All ranks decide together whether the
cache is usable, so a rank that cannot see the file (another node) makes every rank recompute instead of
deadlocking. A damaged cache (larger than its tables can be, truncated, random bytes, another run's key or splits,
tables of the wrong shape or dtype, NaN / infinite values, counts that are not whole numbers >= 0) is never used: a
warning names the file and the reason, and the tables are recomputed and the file rewritten
(:func:`load_reference_tables`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from nxd_lc.checkpoint.xser import UnsafeCheckpointError, safe_torch_load
from nxd_lc.config.access import resolve_path
from nxd_lc.config.alignment_schema import resolved_max_prompt_length
from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.layers.lora import lora_disabled, lora_modules
from nxd_lc.layers.param_attrs import move_module, record_parallel_attributes, restore_parallel_attributes
from nxd_lc.runtime import xla as xla_runtime
from nxd_lc.runtime.accel import HOST
from nxd_lc.runtime.xla import is_xla_tensor

log = logging.getLogger(__name__)

__all__ = [
    "REFERENCE_COLUMNS",
    "FrozenReference",
    "compute_reference_table",
    "load_reference_tables",
    "lookup_reference",
    "reference_cache_path",
    "reference_fingerprint",
    "reference_forward",
    "save_reference_tables",
    "weights_checksum",
]

REFERENCE_COLUMNS = ("chosen_sum", "chosen_count", "rejected_sum", "rejected_count")
_CACHE_VERSION = 1
_CACHE_TAG = ".ref_logps-"
_MODULUS = 2_147_483_647  # 2^31 - 1 (prime): additive checksums modulo it are exact and order-independent
_CHUNK = 1 << 22
_INT_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---- the reference forward -------------------------------------------------------------------------------------
@contextlib.contextmanager
def reference_forward(model: nn.Module, autocast_dtype: Optional[torch.dtype] = None) -> Iterator[None]:
    """Run ``model`` as the DPO reference inside the block: ``torch.no_grad``, eval mode (no dropout; every
    module's own ``training`` flag is restored on exit), LoRA adapters disabled when present
    (:func:`nxd_lc.layers.lora.lora_disabled`: the base model is the reference), and ``torch.autocast`` to
    ``autocast_dtype`` when given (pass the precision policy's autocast dtype outside Lightning, whose
    ``bf16-mixed`` plugin already wraps the training step)."""
    flags = [(m, m.training) for m in model.modules()]
    device_type = next(model.parameters()).device.type
    autocast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    adapters = lora_disabled(model) if lora_modules(model) else contextlib.nullcontext()
    try:
        model.eval()
        with torch.no_grad(), adapters, autocast:
            yield
    finally:
        for m, training in flags:
            m.training = training


class FrozenReference:
    """A frozen deep copy of the policy, held OUTSIDE the LightningModule's module tree (a plain object, not an
    ``nn.Module`` attribute), so it is in no ``state_dict()``, no checkpoint, no ``parameters()`` and no
    optimizer.

    Memory: one more copy of this rank's (TP-sharded) weights, ``param_bytes / tp`` per rank in the policy's
    parameter dtype (e.g. 2 bytes x 8.0e9 / tp for an 8B model in bf16), with no gradients and no optimizer
    state; plus, during the step, one forward's activations of the micro-batch under ``no_grad`` (freed layer by
    layer, nothing kept for backward) and its ``[2B, S/cp, V/tp]`` logits. Not used with LoRA, where the base
    model (adapters disabled) is the reference at no extra memory.

    The copy's parameters carry the policy's parallel attributes (``copy.deepcopy`` of a Parameter drops them, as
    a move to an XLA device does; :mod:`nxd_lc.layers.param_attrs`), and so do they after :meth:`to`.

    Args:
        model: the policy at the start of training (weights loaded, precision applied, on its device).
    """

    def __init__(self, model: nn.Module) -> None:
        attrs = record_parallel_attributes(model)
        self.model = copy.deepcopy(model)
        restore_parallel_attributes(self.model, attrs)
        for p in self.model.parameters():
            p.requires_grad_(False)
            p.grad = None
        self.model.eval()

    @property
    def num_bytes(self) -> int:
        """Bytes held by the copy's parameters and buffers on this rank."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device) -> FrozenReference:
        """Move the copy to ``device`` (in place; parallel attributes and ties kept:
        :func:`nxd_lc.layers.param_attrs.move_module`); returns self.

        Raises:
            RuntimeError: a parameter lost a parallel attribute or a tie in the move (names the parameter).
        """
        move_module(self.model, device)
        return self


# ---- the cache key ---------------------------------------------------------------------------------------------
def _param_checksum(p: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]``: sums of ``v`` and ``v^2 + 40503 v`` modulo 2^31-1 over the raw bit patterns ``v``."""
    flat = p.detach()
    if is_xla_tensor(flat):  # on the host: no lazy graph for a checksum (a transfer: weights_checksum synced)
        flat = flat.cpu()
    flat = flat.reshape(-1).view(_INT_VIEWS[flat.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for chunk in flat.split(_CHUNK):
        v = chunk.to(torch.int64).remainder(_MODULUS)
        w = (v * v + v * 40503).remainder(_MODULUS)
        total = (total + torch.stack([v.sum(), w.sum()])).remainder(_MODULUS)
    return total


def weights_checksum(model: nn.Module) -> str:
    """A checksum of the model's base weights that is the same at every TP size (hex string).

    Each element's raw bit pattern contributes additively modulo a prime, so the sum over a TP-sharded tensor's
    shards equals the full tensor's (padded vocab rows are zero and add nothing). TP-sharded parameters are
    summed over the TP group, replicated ones counted once (TP rank 0); LoRA adapters (``lora_`` in the name) and
    KV-replicated weights (``kv_replicated``, whose replicas would count twice) are left out. Under pipeline
    parallelism the stages' sums are added over the PP group and the last stage's copy of a tied embedding
    (``pipeline_tied_copy``) is left out, so the checksum is also the same at every PP size. Collective over
    the TP and PP groups; every rank reads each of its candidate weights once (chunked), replicated ones
    included. On XLA one sync first materialises the weights, so the reads are transfers, not graph executions,
    and every rank, whichever stage it holds, cuts its lazy graph the same number of times.
    """
    device = next(model.parameters()).device
    if device.type == "xla":  # one graph execution materialises every weight; the reads below are transfers
        xla_runtime.sync()
        device = HOST
    total = torch.zeros(2, dtype=torch.int64, device=device)
    first_tp_rank = ps.get_tensor_model_parallel_rank() == 0
    for name, p in model.named_parameters():
        if "lora_" in name or getattr(p, "kv_replicated", False) or getattr(p, "pipeline_tied_copy", False):
            continue
        # every TP rank reads every candidate in the same order (on XLA each read is a graph execution, which
        # must be the same on every rank: DESIGN principle 16); only the counting depends on the rank
        summand = _param_checksum(p).to(device)
        if getattr(p, "tensor_model_parallel", False) or first_tp_rank:
            total = (total + summand).remainder(_MODULUS)
    total = _sum_over_model_parallel(total, next(model.parameters()).device)
    return "".join(f"{int(x):08x}" for x in total.tolist())


def _sum_over_model_parallel(total: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The sum modulo :data:`_MODULUS` of every TP x PP rank's ``total`` (int64 ``[2]``, values in
    ``[0, _MODULUS)``, on the host or ``device``); int64 ``[2]`` on the host or ``device``.

    The groups' backend decides where the sum travels: on torch-xla the process groups take XLA tensors only, so
    the values go to ``device`` and come back (one graph of their own, :func:`collectives.stage_isolated`, since
    the PP group's ranks run different stages). They travel as 16-bit limbs in int32 (``[4]``), which sum exactly
    over up to 2^15 ranks whatever integer width the device keeps (Neuron may narrow int64).
    """
    limbs = torch.stack([total & 0xFFFF, total >> 16]).reshape(-1).to(torch.int32)  # [lo_a, lo_b, hi_a, hi_b]
    if device.type == "xla":
        limbs = limbs.to(device)
    with collectives.stage_isolated(device):
        limbs = collectives.all_reduce(limbs, ps.get_tensor_model_parallel_group())
        limbs = collectives.all_reduce(limbs, ps.get_pipeline_model_parallel_group())
    limbs = limbs.cpu().to(torch.int64) if device.type == "xla" else limbs.to(torch.int64)
    return (limbs[:2] + (limbs[2:] << 16)).remainder(_MODULUS)


def _path_identity(path: str) -> list[tuple[str, int, int]]:
    """``(relative name, size, mtime_ns)`` of the file at ``path`` or of every file under it (sorted), without
    reference caches and temporary files.

    Raises:
        FileNotFoundError: nothing at ``path``.
    """
    full = resolve_path(path)
    if os.path.isfile(full):
        st = os.stat(full)
        return [(os.path.basename(full), st.st_size, st.st_mtime_ns)]
    if not os.path.isdir(full):
        raise FileNotFoundError(f"reference log-probs: no such data file or directory: {full}")
    out = []
    for root, dirs, files in os.walk(full):
        dirs.sort()
        for name in sorted(files):
            if _CACHE_TAG in name or ".tmp" in name:
                continue
            st = os.stat(os.path.join(root, name))
            out.append((os.path.relpath(os.path.join(root, name), full), st.st_size, st.st_mtime_ns))
    return out


def _tokenizer_digest(tok: Any) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    extra = json.dumps([str(getattr(tok, "chat_template", None)), tok.eos_token_id, tok.pad_token_id])
    return hashlib.sha256((text + extra).encode()).hexdigest()


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def reference_fingerprint(datamodule: Any, model: nn.Module, *, hf_weights_dir: Optional[str],
                          precision: dict[str, str]) -> str:
    """The cache key (sha256 hex) of a run's reference log-probs; independent of TP, CP, DP and PP.

    Args:
        datamodule: a set-up :class:`~nxd_lc.data.alignment_datamodule.ModelAlignmentDataModule` (its ``cfg``,
            ``alignment_cfg``, ``algorithm``, ``seq_length``, ``tokenizer``, ``train_dataset``, ``val_dataset``).
        model: the reference (the initial policy; LoRA adapters are not part of the key).
        hf_weights_dir: ``model.hf_weights_dir`` (None when the weights come from elsewhere).
        precision: e.g. ``{"param_dtype": "torch.bfloat16", "autocast": "None"}``.
    Collective over the TP and PP groups (:func:`weights_checksum`).
    """
    cfg, sub = datamodule.cfg, getattr(datamodule.alignment_cfg, datamodule.algorithm)
    key = {
        "version": _CACHE_VERSION, "algorithm": datamodule.algorithm,
        "train": _path_identity(cfg.train_dir), "val": _path_identity(cfg.val_dir) if cfg.val_dir else None,
        "data": {k: getattr(cfg, k, None) for k in ("dev_choose_samples", "input_key", "output_key", "file_glob")},
        "chat_template": cfg.tokenizer.chat_template, "tokenizer": _tokenizer_digest(datamodule.tokenizer),
        "seq_length": datamodule.seq_length, "truncation_mode": sub.truncation_mode,
        "max_prompt_length": resolved_max_prompt_length(sub.max_prompt_length, datamodule.seq_length),
        "pairs": [len(datamodule.train_dataset), len(datamodule.val_dataset or [])],
        "model_config": _sha({k: v for k, v in model.config.to_dict().items() if k != "transformers_version"})
        if hasattr(model, "config") else None,
        "weights": weights_checksum(model),
        "hf_weights_dir": resolve_path(hf_weights_dir) if hf_weights_dir else None,
        "precision": precision,
    }
    return _sha(key)


def reference_cache_path(train_dir: str, fingerprint: str, cache_dir: Optional[str] = None) -> str:
    """``<dir of train_dir>/<name of train_dir>.ref_logps-<first 16 hex of the key>.pt`` (``cache_dir``
    replaces the directory when given)."""
    full = resolve_path(train_dir).rstrip(os.sep)
    directory = resolve_path(cache_dir) if cache_dir else os.path.dirname(full)
    return os.path.join(directory, f"{os.path.basename(full)}{_CACHE_TAG}{fingerprint[:16]}.pt")


# ---- computation, lookup, save / load --------------------------------------------------------------------------
def _dp_block(num: int, micro_batch_size: int) -> list[int]:
    """This DP rank's pair indices: the contiguous block ``[rank * per_rank, (rank+1) * per_rank)`` cut at
    ``num``, padded (with its first index, or 0) to ``per_rank`` = ceil(num / dp) rounded up to whole
    micro-batches, so every DP rank runs the same number of identically shaped forwards."""
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = math.ceil(math.ceil(num / dp) / micro_batch_size) * micro_batch_size
    start = min(rank * per_rank, num)
    real = list(range(start, min(start + per_rank, num)))
    return real + [real[0] if real else 0] * (per_rank - len(real))


def compute_reference_table(dataset: Any, batch_log_probs: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                            collate: Callable[[list[Any]], dict[str, torch.Tensor]], micro_batch_size: int,
                            step_boundary: Callable[[], None] = lambda: None) -> torch.Tensor:
    """The reference table ``[N, 4]`` float32 (CPU, :data:`REFERENCE_COLUMNS`) of all ``N = len(dataset)``
    pairs, on every rank.

    Args:
        dataset: ``dataset[i]`` is a pair item for ``collate`` (``PreferenceDataset``).
        batch_log_probs: a collated micro-batch (``[2B, S]`` tensors + ``sample_index [B]``, on the CPU) ->
            ``[B, 4]`` float32 in :data:`REFERENCE_COLUMNS` order (moves, shards and runs the reference).
        collate: ``collate_pairs``.
        micro_batch_size: pairs per forward (``data.micro_batch_size``).
        step_boundary: called after each batch (cuts the lazy graph on XLA).
    Collective over DP (all-gather) and, inside ``batch_log_probs``, over TP and CP.
    """
    num = len(dataset)
    indices = _dp_block(num, micro_batch_size)
    rows = []
    for start in range(0, len(indices), micro_batch_size):
        rows.append(batch_log_probs(collate([dataset[i] for i in indices[start:start + micro_batch_size]])))
        step_boundary()
    local = torch.cat(rows).float()  # [per_rank, 4]; the rows after this rank's real pairs are padding
    # rank r's block holds pairs [r * per_rank, (r+1) * per_rank): the real rows are the first num of the gather
    return collectives.all_gather(local, 0, ps.get_data_parallel_group()).cpu()[:num]


def lookup_reference(table: torch.Tensor, sample_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``(sums [2B], counts [2B])`` of a micro-batch, chosen rows first (the batch layout), from the
    table ``[N, 4]`` (on the batch's device) by ``sample_index [B]`` int64. No host synchronisation."""
    rows = table.index_select(0, sample_index.to(table.device))  # [B, 4]
    sums = torch.cat([rows[:, 0], rows[:, 2]])
    counts = torch.cat([rows[:, 1], rows[:, 3]]).round().long()
    return sums, counts


def _world_group() -> Optional[dist.ProcessGroup]:
    return dist.group.WORLD if collectives.is_initialized() else None


def _all_ranks_true(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` holds on every rank of the world (MIN all-reduce)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    return bool(collectives.all_reduce(t, _world_group(), op="min").item())


def save_reference_tables(path: str, fingerprint: str, tables: dict[str, torch.Tensor]) -> bool:
    """Write ``tables`` (``{"train": [N, 4], "val": [M, 4]}``) and the key to ``path`` atomically; on global rank
    0 only (other ranks return at once). Returns whether this rank wrote the file; a write error (read-only data
    directory) is logged as a warning and the run goes on with the tables in memory."""
    if collectives.get_global_rank() != 0:
        return False
    tmp = f"{path}.tmp.{os.getpid()}"
    payload = {"fingerprint": fingerprint, "columns": list(REFERENCE_COLUMNS), "version": _CACHE_VERSION,
               "tables": {k: v.detach().cpu().float() for k, v in tables.items()}}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("reference log-probs: could not write the cache %s (%s); they will be recomputed next run",
                    path, e)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return False
    log.info("reference log-probs: cached %s", path)
    return True


#: Bytes a cache file may hold beyond its tables' ``16 * rows`` (zip directory, pickle, alignment padding; a
#: two-table cache of our own is ~1.5 KB of it).
_CACHE_SLACK_BYTES = 1 << 20


def _table_problem(name: str, table: Any, rows: int) -> Optional[str]:
    """What is wrong with cached table ``name`` (None: usable): not a float tensor ``[rows, 4]`` (checked on the
    shape first, so nothing is read from a tensor of another size), non-finite values, or counts (columns 1 and
    3) that are not whole numbers >= 0."""
    width = len(REFERENCE_COLUMNS)
    if not isinstance(table, torch.Tensor) or not table.is_floating_point():
        what = f"a {table.dtype} tensor" if isinstance(table, torch.Tensor) else f"a {type(table).__name__}"
        return f"table {name!r} is {what}, not float32"
    if tuple(table.shape) != (rows, width):
        return f"table {name!r} has shape {tuple(table.shape)}, this run has {rows} pairs ([{rows}, {width}])"
    bad = ~torch.isfinite(table)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        return (f"table {name!r} holds {int(bad.sum())} NaN / infinite values (first: row {row}, "
                f"{REFERENCE_COLUMNS[col]})")
    counts = table[:, 1::2]
    if not bool(((counts >= 0) & (counts == counts.round())).all()):
        return f"table {name!r} has token counts that are not whole numbers >= 0"
    return None


def _read_cache(path: str, fingerprint: str, sizes: dict[str, int]) -> tuple[Optional[dict[str, torch.Tensor]], str]:
    """``(tables, "")`` when the cache file at ``path`` holds this run's tables, else ``(None, why not)``.

    Raises:
        UnsafeCheckpointError: the file names a global (code) outside the allowed set; nothing in it was run.
    """
    size = os.path.getsize(path)
    limit = 4 * len(REFERENCE_COLUMNS) * sum(sizes.values()) + _CACHE_SLACK_BYTES
    if size > limit:  # before anything is read: a cache of these sizes is never larger
        return None, f"it is damaged: it is {size} bytes, a cache of {sum(sizes.values())} pairs is at most {limit}"
    try:
        payload = safe_torch_load(path)
    except UnsafeCheckpointError as e:
        if e.refused:  # a named global: code planted in the file, not damage; stop and say so
            raise
        # no global named: bytes the unpickler cannot read, i.e. damage; the error's own advice (full unpickling)
        # is for trusted files of other types and never fits a damaged cache, so only its detail is kept
        detail = str(e).rpartition("Detail: ")[2]
        return None, f"it is damaged: it cannot be read as a cache ({detail[:200]})"
    except Exception as e:  # noqa: BLE001 - torch.load raises RuntimeError / UnpicklingError / EOFError / KeyError
        return None, f"it is damaged: it cannot be read ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(payload, dict) or not isinstance(payload.get("tables"), dict):
        return None, "it is damaged: it does not hold a dict with a 'tables' dict"
    got = payload["tables"]
    if payload.get("fingerprint") != fingerprint or set(got) != set(sizes):
        return None, (f"it is from another run: it does not match this run (key, or splits "
                      f"{sorted(map(str, got))} vs {sorted(sizes)})")
    for name, rows in sizes.items():
        problem = _table_problem(name, got[name], rows)
        if problem:
            return None, f"it is damaged: {problem}"
    return {k: got[k].float() for k in sizes}, ""


def load_reference_tables(path: str, fingerprint: str, sizes: dict[str, int],
                          device: torch.device) -> Optional[dict[str, torch.Tensor]]:
    """The cached tables at ``path`` if EVERY rank can read them and they match ``fingerprint`` and ``sizes``
    (``{"train": N, "val": M}``), else None (then all ranks recompute). Collective over the world group.

    A damaged cache is never used and never stops the run: larger than a cache of these sizes can be (checked
    before reading), unreadable (truncated, random bytes), not this run's (key, splits), a table of the wrong
    shape or dtype, NaN / infinite values, or counts that are not whole numbers >= 0: a warning names the file
    and the reason, and the tables are recomputed (and the file rewritten).

    Raises:
        UnsafeCheckpointError: the file names a global outside the allowed set (code planted in it; nothing ran).
    """
    tables = None
    if os.path.isfile(path):
        try:
            tables, why = _read_cache(path, fingerprint, sizes)
        except OSError as e:
            tables, why = None, f"it is damaged: it cannot be read ({e})"
        if tables is None:
            log.warning("reference log-probs: the cache %s is not used: %s; the reference log-probs will be "
                        "recomputed and the file rewritten", path, why)
    if not _all_ranks_true(tables is not None, device):
        return None
    return tables
