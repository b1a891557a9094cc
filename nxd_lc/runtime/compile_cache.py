"""Compile cache location and the graph manifest: which lazy graphs a prewarm saw, checked by the next run.

On torch-xla every distinct graph of the training step is compiled once (on Trainium a Neuron compile:
minutes). ``compiler_cache_url`` (default ``./compiler_cache``, exported as ``NEURON_COMPILE_CACHE_URL`` by
:mod:`nxd_lc.runtime.env`) is where the Neuron compiler keeps its artifacts. The prewarm run
(``python train.py --config-name X +prewarm=true``, :mod:`nxd_lc.runtime.prewarm`) writes beside them a
manifest of the graph hashes it compiled; the next training run compares its own graphs with it, reports
hits and misses, and warns on every graph the prewarm did not see (each is a compile at training time).

Graph hashes: torch-xla's persistent compilation cache (``torch_xla.runtime.initialize_cache``) stores one
file per compiled graph, named by the graph's hash (torch-xla's ``torch::lazy::hash_t`` of the lowered
computation, printed as a decimal integer). :func:`start_graph_recording` points that cache at an empty
per-process directory, so after the run the directory's file names are exactly the graphs this process
compiled. A fresh directory per run is required on XLA-CPU, whose persistent cache cannot deserialize
executables ("Deserializing serialized executable not supported"): nothing is ever read back from it.

Where the recording goes and why it does not disturb the real cache (decided for issue 4): a training or prewarm
run on xla / neuron records on global rank 0 into a fresh ``<compiler_cache_url>/nxd_lc_graphs/run-<time>-<pid>``
(:func:`nxd_lc.runtime.prewarm.begin_graph_recording`), deleted once its file names are read. On Neuron the
real persistent compile cache is the Neuron compiler's NEFF cache at ``NEURON_COMPILE_CACHE_URL``
(``compiler_cache_url``; libneuronxla's ``neuronxcc-<ver>/MODULE_<hash>/model.neff`` entries), a separate layer
that torch-xla's persistent cache does not replace, so recording leaves it working; torch-xla 2.9 cannot load
its own serialized executables back through a PJRT plugin (CPU, TPU, Neuron: pytorch/xla#9094), so a per-run
torch-xla cache loses nothing. A user who set ``XLA_PERSISTENT_CACHE_PATH`` keeps it: recording is then off
(one info line). On Neuron recording is off (one info line; issue 39) until it is verified there: nothing has run
through Neuron's PJRT plugin with torch-xla's persistent cache on. Under ``neuron_parallel_compile`` it is off too
(:mod:`nxd_lc.runtime.prewarm`).

Manifest file ``<compiler_cache_url>/nxd_lc_graph_manifest.json``::

    {"version": 1, "graphs": ["<hash>", ...], "steps": <int>, "config_name": "<name>"}
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)

__all__ = ["MANIFEST_NAME", "ManifestCheck", "check_manifest", "compare_graphs", "manifest_path",
           "read_manifest", "recorded_graphs", "start_graph_recording", "write_manifest"]

MANIFEST_NAME = "nxd_lc_graph_manifest.json"
_VERSION = 1


def manifest_path(compiler_cache_url: str) -> str:
    """``<compiler_cache_url>/nxd_lc_graph_manifest.json`` (the manifest lives beside the compile cache).

    Raises:
        ValueError: ``compiler_cache_url`` is empty or a remote URL (``s3://...``): the manifest needs a local
            directory.
    """
    if not compiler_cache_url or "://" in compiler_cache_url:
        raise ValueError(f"compiler_cache_url={compiler_cache_url!r}: the graph manifest needs a local directory "
                         "(the default is ./compiler_cache)")
    return os.path.join(os.path.abspath(compiler_cache_url), MANIFEST_NAME)


def start_graph_recording(record_dir: Optional[str] = None) -> str:
    """Make torch-xla record every graph this process compiles as a file in ``record_dir``; return the directory.

    Must be called before the first graph is compiled (torch-xla initialises its cache once).

    Args:
        record_dir: an empty directory (created if missing); None -> a new temporary directory.

    Raises:
        ValueError: ``record_dir`` exists and is not empty (old entries would be deserialized, which XLA-CPU
            cannot do, and would blur which graphs this run compiled).
        ModuleNotFoundError: torch-xla is not installed.
    """
    from nxd_lc.runtime.xla import require_torch_xla

    require_torch_xla("graph recording for the prewarm manifest")
    import torch_xla.runtime as xr

    if record_dir is None:
        record_dir = tempfile.mkdtemp(prefix="nxd_lc_graphs_")
    elif os.path.isdir(record_dir) and os.listdir(record_dir):
        raise ValueError(f"graph record directory {record_dir!r} is not empty; give an empty or new directory")
    os.makedirs(record_dir, exist_ok=True)
    xr.initialize_cache(record_dir, readonly=False)
    return record_dir


def recorded_graphs(record_dir: str) -> list[str]:
    """Sorted graph hashes recorded in ``record_dir`` by :func:`start_graph_recording` (one file per graph).

    Raises:
        FileNotFoundError: ``record_dir`` does not exist.
    """
    if not os.path.isdir(record_dir):
        raise FileNotFoundError(f"graph record directory {record_dir!r} does not exist")
    return sorted(n for n in os.listdir(record_dir) if n.isdigit())


def write_manifest(path: str, graphs: Sequence[str], *, steps: int, config_name: str = "") -> None:
    """Write the manifest JSON at ``path`` (directory created; atomic replace of an existing manifest)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    body = {"version": _VERSION, "graphs": sorted(set(graphs)), "steps": steps, "config_name": config_name}
    tmp = f"{path}.{os.getpid()}.tmp"  # per process: concurrent writers never share a temporary file
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
    os.replace(tmp, path)


def read_manifest(path: str) -> list[str]:
    """Graph hashes of the manifest at ``path``.

    Raises:
        FileNotFoundError: no manifest (message says how to create one).
        ValueError: not a manifest of this version (names the file and the fix: rerun the prewarm).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no graph manifest at {path!r}: run the prewarm first "
                                "(python train.py --config-name <X> +prewarm=true)")
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"graph manifest {path!r} is not valid JSON ({e}); delete it and rerun the prewarm") from e
    if not isinstance(body, dict) or body.get("version") != _VERSION or not isinstance(body.get("graphs"), list):
        raise ValueError(f"graph manifest {path!r} is not a version-{_VERSION} nxd_lc manifest; rerun the prewarm")
    return [str(g) for g in body["graphs"]]


@dataclass(frozen=True)
class ManifestCheck:
    """Result of comparing a run's graphs with the prewarm manifest."""

    hits: tuple[str, ...]  # graphs of this run that the prewarm compiled
    misses: tuple[str, ...]  # graphs of this run the prewarm did not see (compiled at training time)
    unused: tuple[str, ...]  # graphs in the manifest this run did not produce

    @property
    def matches(self) -> bool:
        """True when the run's graph set equals the prewarm's."""
        return not self.misses and not self.unused


def compare_graphs(run_graphs: Sequence[str], manifest_graphs: Sequence[str]) -> ManifestCheck:
    """Split ``run_graphs`` into hits and misses against ``manifest_graphs`` (set semantics, sorted output)."""
    run, seen = set(run_graphs), set(manifest_graphs)
    return ManifestCheck(tuple(sorted(run & seen)), tuple(sorted(run - seen)), tuple(sorted(seen - run)))


def check_manifest(path: str, run_graphs: Sequence[str]) -> Optional[ManifestCheck]:
    """Compare ``run_graphs`` with the manifest at ``path``, log hits/misses and warn per unseen graph.

    Returns None (with one info line saying how to prewarm) when there is no manifest: a run without a prewarm is
    normal, not a problem.

    Raises:
        ValueError: the manifest is malformed (see :func:`read_manifest`).
    """
    try:
        seen = read_manifest(path)
    except FileNotFoundError as e:
        log.info("%s", e)
        return None
    result = compare_graphs(run_graphs, seen)
    log.info("graph manifest %s: %d hit(s), %d miss(es), %d prewarmed graph(s) unused", path, len(result.hits),
             len(result.misses), len(result.unused))
    for g in result.misses:
        log.warning("graph %s was not seen by the prewarm: it was compiled during training; rerun the prewarm "
                    "with this config (python train.py --config-name <X> +prewarm=true)", g)
    return result
