"""A cache of the HF -> NxD weight conversion: ``model.hf_weights_dir`` converted once per layout.

Every start of a run with ``model.hf_weights_dir`` reads each rank's slices of the HF safetensors and rebuilds the
NxD layout (fused QKV, ``kv_replicator`` copies of KV heads, padded vocabulary, this rank's TP shard and pipeline
stage). With the cache (``model.hf_conversion_cache: true``; off by default: it stores a full copy of every rank's
weights, and on one CPU process it does not pay, see ``benchmarks/hf_cache_startup.py``) the first start also writes
this rank's
converted state to ``<cache dir>/<key>/tp<TT>_pp<PP>.safetensors`` (``safetensors.torch.save_model``: tied weights
stored once) and later starts load it instead (``load_model``). ``model.force_reconvert_from_hf: true`` rebuilds it.

The key is a SHA-256 over

* the HF files' identity: relative name, size and ``mtime_ns`` of every ``*.safetensors`` / ``*.json`` file of
  ``hf_weights_dir`` (not their content: hashing a 16 GB checkpoint on every start would cost as much as the
  conversion saved; a file replaced in place changes its mtime);
* the model config that shapes the converted tensors: the ``model.model_config`` file's content, the YAML overrides
  (num_layers, hidden_size, rope_theta, max_position_embeddings, encoder_seq_length), ``hf_config_overrides``,
  ``fuse_qkv``, ``qkv_linear``;
* the layout: TP and PP sizes, virtual stages, ``pipeline_cuts``, ``kv_replicator`` and the KV-replica layout; and a
  format version.

Writes are atomic per rank (temporary file, then ``os.replace``), with a SHA-256 sidecar ``<file>.sha256`` replaced
last; an entry whose file is missing, truncated or differs from its sidecar is rebuilt, never loaded. No collective
is issued, so it works inside ``trainer.sequential_move_factor`` waves. Default location: ``<log_dir>/hf_converted``
(``model.hf_conversion_cache_dir`` to share it between runs).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from typing import Any

import torch

from nxd_lc.distributed import parallel_state as ps
from nxd_lc.runtime.files import file_digest

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: the KV-replica layout in the key, NxD's default pipeline split
_MODEL_KEYS = ("num_layers", "hidden_size", "rope_theta", "max_position_embeddings", "encoder_seq_length",
               "hf_config_overrides", "fuse_qkv", "qkv_linear", "pipeline_cuts")


def hf_identity(hf_dir: str) -> list[tuple[str, int, int]]:
    """``(relative name, size, mtime_ns)`` of every ``*.safetensors`` / ``*.json`` file under ``hf_dir`` (sorted)."""
    out = []
    for dirpath, dirnames, names in os.walk(hf_dir):
        dirnames.sort()
        for n in sorted(names):
            if n.endswith((".safetensors", ".json")):
                st = os.stat(os.path.join(dirpath, n))
                out.append((os.path.relpath(os.path.join(dirpath, n), hf_dir), st.st_size, st.st_mtime_ns))
    return out


def cache_key(cfg: Any, hf_dir: str, tp: int, pp: int) -> str:
    """The cache key of ``cfg``'s conversion of ``hf_dir`` at TP ``tp`` x PP ``pp`` (and the config's EP size; see
    the module docstring)."""
    m, ds = cfg.model, cfg.distributed_strategy
    model_config = ""
    if m.model_config:
        path = os.path.abspath(os.path.expanduser(m.model_config))
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        model_config = file_digest(path)[1] if os.path.isfile(path) else path
    parts = {"format": FORMAT_VERSION, "hf": hf_identity(hf_dir), "model_config": model_config,
             "model": {k: getattr(m, k, None) for k in _MODEL_KEYS},
             "layout": {"tp": tp, "pp": pp, "vpp": ds.virtual_pipeline_model_parallel_size,
                        "kv_replicator": ds.kv_replicator, "kv_replica_layout": ps.get_kv_replica_layout(),
                        "ep": getattr(ds, "expert_model_parallel_size", 1)}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _valid(path: str) -> bool:
    try:
        with open(path + ".sha256") as f:
            recorded = f.read().strip()
        return file_digest(path)[1] == recorded
    except OSError:
        return False


def load_or_convert(model: torch.nn.Module, hf_dir: str, cache_dir: str, key: str, tp_rank: int, pp_rank: int,
                    *, force: bool, convert: Any, ep_rank: int | None = None) -> bool:
    """Load this rank's converted weights from the cache, or ``convert(model, hf_dir)`` and cache the result.

    Args:
        model: the freshly built (sharded) model.
        cache_dir: the cache root; entries are ``<cache_dir>/<key>/tp<TT>_pp<PP>.safetensors``
            (``ep<EE>_tp<TT>_pp<PP>.safetensors`` with an ``ep_rank``: each EP rank holds other experts).
        force: ``model.force_reconvert_from_hf``: convert and overwrite the entry even if it is valid.
        convert: the uncached loader (:func:`nxd_lc.models.llama.hf_adapter.load_hf_weights`).

    Returns:
        True when the weights came from the cache.
    Raises:
        ValueError: an entry that matches its sidecar but is not a loadable safetensors file (names it and the fix;
            never unpickled, no code runs).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_model, save_model

    ep = f"ep{ep_rank:02d}_" if ep_rank is not None else ""
    path = os.path.join(cache_dir, key, f"{ep}tp{tp_rank:02d}_pp{pp_rank:02d}.safetensors")
    if not force and os.path.isfile(path):
        if _valid(path):
            start = time.perf_counter()
            try:
                missing, unexpected = load_model(model, path, strict=False)
            except (SafetensorError, RuntimeError, ValueError, OSError) as e:
                # its sidecar matches, so it was written this way (or replaced with its sidecar): not a torn write
                raise ValueError(f"model.hf_conversion_cache: the cache entry {path} matches its .sha256 sidecar but "
                                 f"cannot be loaded ({type(e).__name__}: {str(e)[:200]}); delete "
                                 f"{os.path.dirname(path)} or set model.force_reconvert_from_hf: true") from e
            if not missing and not unexpected:
                log.info("loaded the converted HF weights from the cache %s (%.2f s)", path,
                         time.perf_counter() - start)
                return True
            log.warning("the HF conversion cache %s does not fit the model (missing %s, unexpected %s): "
                        "converting again", path, sorted(missing)[:3], sorted(unexpected)[:3])
        else:
            log.warning("the HF conversion cache %s is damaged (its sha256 differs): converting again", path)
    convert(model, hf_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    save_model(model, tmp)
    digest = file_digest(tmp)[1]
    with open(tmp + ".sha256", "w") as f:
        f.write(digest)
    os.replace(tmp, path)
    os.replace(tmp + ".sha256", path + ".sha256")
    log.info("cached the converted HF weights as %s", path)
    return False
