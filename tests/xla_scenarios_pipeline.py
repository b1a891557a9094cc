"""Pipeline scenarios for the multi-device XLA test bed (:mod:`xla_testbed`), one thread per device.

:func:`activation_peaks` runs one training call of nxd_lc's :class:`~nxd_lc.pipeline.PipelineEngine` (the lockstep
schedule of :mod:`nxd_lc.pipeline.lockstep` on XLA) over a tiny Llama and measures, per pipeline stage, the
micro-batches whose saved activations were alive at once (saved-tensor hooks, ``tests/activation_probe.py``) and
the graph cuts the call took. Used by ``tests/test_xla_pipeline.py``.
"""

from __future__ import annotations

from typing import Any

import xla_scenarios


def activation_peaks(rank: int, world: int, pp: int = 2, vpp: int = 1, micro: int = 4,
                     layers: int = 4) -> dict[str, Any]:
    """One ``PipelineEngine.train_step`` of ``micro`` micro-batches (2 rows of :data:`xla_scenarios.SEQ` tokens
    each) at ``PP = pp`` x ``V = vpp`` on ``world = pp`` devices; returns this rank's peak in-flight micro-batches
    per stage (``{stage: count}``), the stages still holding saved tensors afterwards, the ordered cuts the call
    took, and the step loss."""
    import torch
    import torch_xla
    from activation_probe import ActivationProbe
    from xla_testbed import current_bed

    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.models.llama import LlamaForCausalLM
    from nxd_lc.pipeline import PipelineEngine, rank_model_part, stage_layer_ranges

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    part = rank_model_part(layers, pp, ps.get_pipeline_model_parallel_rank(), vpp)
    with xla_scenarios._BUILD_LOCK:
        torch.manual_seed(0)
        model = LlamaForCausalLM(xla_scenarios._llama_config(layers), **part)
    device = torch_xla.device()
    model = move_module(model, device)
    rows = 2
    engine = PipelineEngine(model, stage_layer_ranges(layers, pp, vpp), virtual_size=vpp, micro_batch_size=rows,
                            sequence_parallel=False)
    probe = ActivationProbe()
    for stage in engine.stage_modules:
        probe.watch(stage)
    ids = torch.randint(0, xla_scenarios.VOCAB, (micro * rows, xla_scenarios.SEQ + 1),
                        generator=torch.Generator().manual_seed(7))
    batch = {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}
    torch_xla.sync()
    bed = current_bed()
    before = bed.local.cuts
    loss = engine.train_step(batch)
    cuts = bed.local.cuts - before
    torch_xla.sync()
    return {"pp_rank": ps.get_pipeline_model_parallel_rank(), "peaks": {str(k): v for k, v in probe.peak.items()},
            "leaked": probe.leaked(), "cuts": cuts, "loss": float(loss)}
