"""Pipeline stage split: which decoder layers each pipeline stage holds.

A model of ``L`` decoder layers is cut into ``num_stages = PP x V`` stages (``V`` =
``virtual_pipeline_model_parallel_size``, interleaved 1F1B). Stage ``s`` holds a contiguous run of layers; the
embedding lives on stage 0 and the final norm, lm head and loss on stage ``num_stages - 1``. Pipeline rank ``r``
holds stages ``r, r + PP, r + 2 PP, ...`` (NxD / Megatron interleaving; the "loop" placement of
``torch.distributed.pipelining``).

* Default, NxD's (``neuronx_distributed.pipeline.partition.create_partitions``): every stage gets
  ``L // num_stages`` layers and the ``L % num_stages`` extra layers go to the last stages, so a checkpoint NxD's
  converter or trainer wrote at an uneven layer count loads without ``pipeline_cuts`` (nxd_lc before this version
  gave them to the middle stages first; such checkpoints are re-sharded on load, their split read from the files).
* ``model.pipeline_cuts`` (NxDT): ``["model.layers.18", ...]`` names the *last* layer of every stage but the
  last, so it has ``num_stages - 1`` entries in increasing order; ``layers.18`` (without ``model.``) is accepted
  too.
"""

from __future__ import annotations

import re
from typing import Sequence

_CUT_RE = re.compile(r"^(?:model\.)?layers\.(\d+)$")


def balanced_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage for the default split (see the module docstring); sums to ``num_layers``.

    Raises:
        ValueError: fewer layers than stages (a stage would be empty).
    """
    if num_stages < 1:
        raise ValueError(f"pipeline: number of stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"model.num_layers ({num_layers}) is smaller than the number of pipeline stages "
                         f"(pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {num_stages}): "
                         "a stage would hold no decoder layer; lower the pipeline sizes or add layers")
    base, extra = divmod(num_layers, num_stages)
    return [base] * (num_stages - extra) + [base + 1] * extra


def parse_pipeline_cuts(cuts: Sequence[str], num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage from NxDT's ``model.pipeline_cuts``.

    Args:
        cuts: names of the last layer of each stage but the last, e.g. ``["model.layers.18", "model.layers.39"]``.
        num_layers: decoder layers of the model (after ``model.num_layers``).
        num_stages: ``PP x V``.

    Raises:
        ValueError: a cut that names no layer, cuts out of order or repeated, the wrong number of cuts, or a
            stage left empty (each message names ``model.pipeline_cuts`` and the fix).
    """
    if len(cuts) != num_stages - 1:
        raise ValueError(f"model.pipeline_cuts: {len(cuts)} cut(s) given for {num_stages} pipeline stages "
                         f"(pipeline_model_parallel_size x virtual_pipeline_model_parallel_size); give "
                         f"{num_stages - 1}, each naming the last layer of a stage, e.g. 'model.layers.3'")
    last_layers: list[int] = []
    for cut in cuts:
        m = _CUT_RE.match(str(cut).strip())
        if m is None or int(m.group(1)) >= num_layers:
            raise ValueError(f"model.pipeline_cuts: {cut!r} names no decoder layer; use 'model.layers.<i>' with "
                             f"0 <= i < {num_layers} - 1")
        last_layers.append(int(m.group(1)))
    bounds = [-1, *last_layers, num_layers - 1]
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    if any(c <= 0 for c in counts):
        stage = next(i for i, c in enumerate(counts) if c <= 0)
        raise ValueError(f"model.pipeline_cuts: {list(cuts)} are out of order or leave pipeline stage {stage} "
                         "empty; list strictly increasing layers, the last one below the model's last layer "
                         f"({num_layers - 1})")
    return counts


def stage_layer_ranges(num_layers: int, pipeline_size: int, virtual_size: int = 1,
                       pipeline_cuts: Sequence[str] | None = None) -> list[range]:
    """Decoder-layer indices of every stage, indexed by stage (``PP x V`` ranges covering ``0..L-1`` in order).

    Raises:
        ValueError: see :func:`balanced_layer_counts` and :func:`parse_pipeline_cuts`.
    """
    num_stages = pipeline_size * virtual_size
    counts = (parse_pipeline_cuts(pipeline_cuts, num_layers, num_stages) if pipeline_cuts
              else balanced_layer_counts(num_layers, num_stages))
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def stages_of_rank(pp_rank: int, pipeline_size: int, virtual_size: int = 1) -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank``: ``pp_rank + k * PP`` for ``k < V`` (loop placement)."""
    return [pp_rank + k * pipeline_size for k in range(virtual_size)]


def split_problems(num_layers: int, pipeline_size: int, virtual_size: int,
                   pipeline_cuts: Sequence[str] | None) -> list[str]:
    """Config problems of the split (empty when it is valid), for the validator."""
    if pipeline_size * virtual_size == 1:
        return [] if not pipeline_cuts else [
            "model.pipeline_cuts: set without pipeline parallelism (pipeline_model_parallel_size 1); remove it"]
    try:
        stage_layer_ranges(num_layers, pipeline_size, virtual_size, pipeline_cuts)
    except ValueError as e:
        return [str(e)]
    return []


def rank_model_part(num_layers: int, pipeline_size: int, pipeline_rank: int, virtual_size: int = 1,
                    pipeline_cuts: Sequence[str] | None = None) -> dict[str, object]:
    """``LlamaForCausalLM`` keyword arguments for pipeline rank ``pipeline_rank``: ``keep_layers`` (the layers of
    all its stages), ``keep_embedding`` (it holds stage 0) and ``keep_head`` (it holds the last stage).

    Raises:
        ValueError: see :func:`stage_layer_ranges`.
    """
    ranges = stage_layer_ranges(num_layers, pipeline_size, virtual_size, pipeline_cuts)
    stages = stages_of_rank(pipeline_rank, pipeline_size, virtual_size)
    return {"keep_layers": sorted(i for s in stages for i in ranges[s]), "keep_embedding": 0 in stages,
            "keep_head": len(ranges) - 1 in stages}
