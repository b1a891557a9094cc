"""Pipeline parallelism: stage split (layer counts or NxDT ``pipeline_cuts``), stage modules over the plain
model, and 1F1B / interleaved 1F1B schedules on ``torch.distributed.pipelining``."""

from nxd_lc.pipeline.engine import PipelineEngine, PipelineOutput, build_engine
from nxd_lc.pipeline.split import (
    balanced_layer_counts,
    parse_pipeline_cuts,
    rank_model_part,
    split_problems,
    stage_layer_ranges,
    stages_of_rank,
)
from nxd_lc.pipeline.stage import ObjectiveFn, PipelineStageModule, StageObjective

__all__ = [
    "ObjectiveFn",
    "PipelineEngine",
    "PipelineOutput",
    "PipelineStageModule",
    "StageObjective",
    "balanced_layer_counts",
    "build_engine",
    "parse_pipeline_cuts",
    "rank_model_part",
    "split_problems",
    "stage_layer_ranges",
    "stages_of_rank",
]
