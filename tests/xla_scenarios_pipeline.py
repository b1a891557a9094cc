"""Pipeline scenarios for the multi-device XLA test bed (:mod:`xla_testbed`), one thread per device.

:func:`activation_peaks` runs one training call of nxd_lc's :class:`~nxd_lc.pipeline.PipelineEngine` (the lockstep
schedule of :mod:`nxd_lc.pipeline.lockstep` on XLA) over a tiny Llama and measures, per pipeline stage, the
micro-batches whose saved activations were alive at once (saved-tensor hooks, ``tests/activation_probe.py``) and
the graph cuts the call took; :func:`phase_compiles` counts the graphs the first call compiles (issue 52: they must
not grow with the number of micro-batches). Used by ``tests/test_xla_pipeline.py``.
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
    from activation_probe import ActivationProbe

    engine, batch = _engine_and_batch(pp, vpp, micro, layers)
    probe = ActivationProbe()
    for stage in engine.stage_modules:
        probe.watch(stage)
    import torch_xla
    from xla_testbed import current_bed

    torch_xla.sync()
    bed = current_bed()
    before = bed.local.cuts
    loss = engine.train_step(batch)
    cuts = bed.local.cuts - before
    torch_xla.sync()
    from nxd_lc.distributed import parallel_state as ps

    return {"pp_rank": ps.get_pipeline_model_parallel_rank(), "peaks": {str(k): v for k, v in probe.peak.items()},
            "leaked": probe.leaked(), "cuts": cuts, "loss": float(loss)}


def phase_compiles(rank: int, world: int, pp: int = 2, vpp: int = 1, micro: int = 4, layers: int = 4,
                   steps: int = 2) -> dict[str, Any]:
    """``steps`` ``PipelineEngine.train_step`` calls of ``micro`` micro-batches at ``PP = pp`` x ``V = vpp`` on
    ``world = pp`` devices (a new batch each, gradients reset to None before each as the trainer does); returns the
    graphs this device thread compiled in each call (the test bed's ordered cuts: only the first rank of a pipeline
    stage compiles, so the sum over ranks is the process's compile count) and the cuts of each call."""
    import torch
    import torch_xla
    from xla_testbed import current_bed

    from nxd_lc.distributed import parallel_state as ps

    engine, _ = _engine_and_batch(pp, vpp, micro, layers)
    bed = current_bed()
    compiled, cuts = [], []
    for step in range(steps):
        _, batch = _engine_and_batch(pp, vpp, micro, layers, engine=engine, seed=7 + step)
        for p in engine.parameters():  # as the trainer's zero_grad(set_to_none=True) before a step
            p.grad = None
        torch_xla.sync()
        before, before_cuts = bed.local.compiled, bed.local.cuts
        loss = engine.train_step(batch)
        torch_xla.sync()
        compiled.append(bed.local.compiled - before)
        cuts.append(bed.local.cuts - before_cuts)
        assert torch.isfinite(loss.cpu()).item()
    return {"pp_rank": ps.get_pipeline_model_parallel_rank(), "compiled": compiled, "cuts": cuts}


def _engine_and_batch(pp: int, vpp: int, micro: int, layers: int, engine: Any = None, seed: int = 7
                      ) -> tuple[Any, dict[str, Any]]:
    """A :class:`~nxd_lc.pipeline.PipelineEngine` over a ``layers``-layer Llama (built once: pass ``engine`` to
    reuse it) and a batch of ``micro`` micro-batches of 2 rows on this thread's XLA device."""
    import torch
    import torch_xla

    from nxd_lc.distributed import parallel_state as ps
    from nxd_lc.layers.param_attrs import move_module
    from nxd_lc.models.llama import LlamaForCausalLM
    from nxd_lc.pipeline import PipelineEngine, rank_model_part, stage_layer_ranges

    rows = 2
    device = torch_xla.device()
    if engine is None:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
        part = rank_model_part(layers, pp, ps.get_pipeline_model_parallel_rank(), vpp)
        with xla_scenarios._BUILD_LOCK:
            torch.manual_seed(0)
            model = LlamaForCausalLM(xla_scenarios._llama_config(layers), **part)
        model = move_module(model, device)
        engine = PipelineEngine(model, stage_layer_ranges(layers, pp, vpp), virtual_size=vpp,
                                micro_batch_size=rows, sequence_parallel=False)
    ids = torch.randint(0, xla_scenarios.VOCAB, (micro * rows, xla_scenarios.SEQ + 1),
                        generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].to(device)}
    return engine, batch
