"""``model.compile`` (issue 13, item 1): every decoder layer compiled with ``fullgraph=True`` (a graph break is
an error) at TP 1, TP 2 with and without sequence parallelism, CP 2 ring and CP 2 Ulysses, on a document-packed
batch (segment ids: the document-masked attention) and a plain one; one training step's loss and every gradient
equal the single-process eager full-sequence reference of tests/test_context_parallel.py. Dynamo's counters show
that the layers were compiled (captured graphs > 0) and that no graph break happened. TP 1 uses the production
CPU backend (inductor); the multi-process layouts use ``aot_eager`` (the same dynamo + AOT-autograd tracing,
without inductor's C++ build, to keep CI time down). The multi-process tests also pass on torch 2.9 (run by hand;
lane 2 runs the two single-process ones).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dist_utils import local_shard, run_distributed
from test_context_parallel import ATOL, _batches, _reference, _step, _tiny_config
from transformers import LlamaConfig

from nxd_lc.app.validation import load_config
from nxd_lc.config.errors import ConfigError
from nxd_lc.context import set_context_parallel_algo
from nxd_lc.distributed import parallel_state
from nxd_lc.models.common.compile import compile_backend, compile_decoder_layers
from nxd_lc.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile missing")


#: memory techniques applied before compiling: (activations_checkpoint_granularity, recompute list, tiled MLP
#: chunk[, activations_checkpoint_save_attention]); the tiled MLP chunk (5 tokens) does not divide the 2 x 12
#: tokens, so chunks are uneven.
NO_MEMORY = (None, None, None)
SAVE_ATTENTION = ("full", None, None, True)  # selective checkpointing's policy inside the traced checkpoint
BLOCK = ("full", None, None, True, "block", 1)  # only the first layer checkpointed: two variants of the layer
MEMORY_LAYOUTS = [("full", None, 5), ("selective", ["CoreAttention", "LlamaMLP"], 5), ("selective", ["RMSNorm"], None),
                  SAVE_ATTENTION]


def _compiled_step_checks(tp: int, algos: list[str], config: LlamaConfig, ref: dict[str, Any], backend: str,
                          atol: float, memory: tuple[Any, ...] = NO_MEMORY, batches: tuple[str, ...] = (),
                          sp_only: bool = False) -> None:
    from torch._dynamo.utils import counters

    from nxd_lc.models.common.checkpointing import apply_activation_checkpointing, apply_tiled_mlp

    sps = [True] if sp_only else [True, False]
    layouts = [(algo, sp) for algo in algos for sp in (sps if tp > 1 else [False])]
    for algo, sp in layouts:  # TP > 1: with sequence parallelism (gather / reduce-scatter) and without (all-reduce)
        set_context_parallel_algo(algo)
        for key, batch in _batches().items():
            if batches and key not in batches:
                continue
            torch._dynamo.reset()
            counters.clear()
            model = LlamaForCausalLM(config, sequence_parallel=sp)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(local_shard(model, name, ref["weights"][name]))
            granularity, recompute, tile, *rest = memory
            save, method, num_layers = (list(rest) + [False, None, None][len(rest):])[:3]
            apply_activation_checkpointing(model, granularity, recompute, save_attention=bool(save), method=method,
                                           num_layers=num_layers)
            apply_tiled_mlp(model, tile)
            assert compile_decoder_layers(model, backend) == config.num_hidden_layers
            loss = _step(model, batch, algo)
            msg = f"compiled ({backend}) {algo} {key} tp={tp} sp={sp} memory={memory}"
            assert counters["stats"]["unique_graphs"] >= 1, f"{msg}: nothing was compiled"
            assert dict(counters["graph_break"]) == {}, f"{msg}: graph breaks {dict(counters['graph_break'])}"
            expected = ref["refs"][key]
            torch.testing.assert_close(loss, expected["loss"], atol=atol, rtol=0, msg=msg)
            for name, param in model.named_parameters():
                want = local_shard(model, name, expected["grads"][name])
                torch.testing.assert_close(param.grad, want, atol=atol, rtol=0, msg=f"{msg} grad {name}")


def _worker(rank: int, world: int, tp: int, algos: list[str], config: LlamaConfig, ref: dict[str, Any],
            backend: str, atol: float, memories: list[tuple[Any, ...]] | None = None,
            batches: tuple[str, ...] = (), sp_only: bool = False) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=world // tp)
    for memory in memories or [NO_MEMORY]:
        _compiled_step_checks(tp, algos, config, ref, backend, atol, memory, batches, sp_only)


@pytest.fixture(scope="module", autouse=True)
def fresh_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One inductor cache for this module's tests, empty at the start: every graph is compiled in this run (no
    artifact of an earlier run on this machine is used), and a graph or C++ kernel compiled once (by another test,
    or by the other rank of a TP 2 run) is reused (CI time). The spawned ranks and train.py inherit it."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor_cache"))
    yield
    if previous is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


@pytest.fixture(scope="module")
def reference() -> tuple[LlamaConfig, dict[str, Any]]:
    config = _tiny_config()
    return config, _reference(config)


@pytest.mark.extended  # make test-extended, not make test (CI time): inductor's plain-batch graph also runs in
@pytest.mark.distributed  # test_train_py_with_model_compile_matches_eager_losses (losses over steps vs eager)
def test_tp1_inductor_compiled_step_equals_eager_reference(reference: Any) -> None:
    config, ref = reference
    # the plain batch (the packed-document one runs under inductor with recomputation below; CI time)
    run_distributed(_worker, 1, 1, ["ring"], config, ref, "inductor", 2e-5, None, ("plain",))


@pytest.mark.distributed
def test_tp2_with_and_without_sequence_parallel_compiled_step_equals_reference(reference: Any) -> None:
    config, ref = reference
    run_distributed(_worker, 2, 2, ["ring"], config, ref, "aot_eager", ATOL)


@pytest.mark.distributed
def test_cp2_ring_and_ulysses_compiled_step_equals_reference(reference: Any) -> None:
    config, ref = reference
    run_distributed(_worker, 2, 1, ["ring", "ulysses"], config, ref, "aot_eager", ATOL)


@pytest.mark.distributed
def test_compiled_layers_with_activation_checkpointing_and_tiled_mlp_equal_reference(reference: Any) -> None:
    """model.compile composes with the memory techniques: full and selective recomputation (torch's checkpoint
    higher-order op) and the tiled MLP (per-chunk checkpoints when traced); TP 2 + SP exercises the collectives
    inside recomputed regions (TP 2 without SP is compiled without recomputation above; CI time). The packed-document
    batch only (the document mask inside the recomputed attention; the plain batch is compiled at TP 2 + SP above,
    CI time)."""
    config, ref = reference
    run_distributed(_worker, 2, 2, ["ring"], config, ref, "aot_eager", ATOL, MEMORY_LAYOUTS + [BLOCK], ("packed",),
                    True)


@pytest.mark.distributed
def test_tp1_inductor_with_checkpointing_and_tiled_mlp_equals_reference(reference: Any) -> None:
    config, ref = reference
    # full recomputation + the uneven tiled MLP on the packed-document batch only (CI time: the C++ build of every
    # graph is the cost); inductor with save_attention (full recomputation keeping the attention outputs) is
    # checked against eager's gradients by tests/test_compiled_memory.py, the BLOCK layout (a checkpointed and a
    # plain variant of the layer) and every other memory layout under aot_eager above
    run_distributed(_worker, 1, 1, ["ring"], config, ref, "inductor", 2e-5, [MEMORY_LAYOUTS[0]], ("packed",))


@pytest.mark.compat
def test_identical_layers_share_one_compiled_graph() -> None:
    """Regional compilation pays the trace once: four identical layers, one captured forward graph."""
    from torch._dynamo.utils import counters

    config = _tiny_config()
    config.num_hidden_layers = 4
    model = LlamaForCausalLM(config)
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(model, "aot_eager") == 4
    ids = torch.randint(0, config.vocab_size, (2, 16))
    model.loss(ids, ids)[0].backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.compat
def test_backend_follows_the_device_and_xla_is_refused() -> None:
    assert compile_backend("cpu") == "inductor" and compile_backend("gpu") == "inductor"
    assert compile_backend("neuron_native") == "neuron"
    for lazy in ("xla", "neuron"):
        with pytest.raises(ValueError, match="model.compile: not available on trainer.accelerator"):
            compile_backend(lazy)
    raw = {"trainer": {"devices": 1, "num_nodes": 1, "max_steps": 2, "accelerator": "xla"},
           "data": {"micro_batch_size": 1, "global_batch_size": 1},
           "model": {"model_config": "conf/tiny_llama_config.json", "encoder_seq_length": 64, "compile": True}}
    with pytest.raises(ConfigError, match="model.compile: not available on trainer.accelerator xla"):
        load_config(raw, world_size=None, check_paths=False)
    raw["trainer"]["accelerator"] = "cpu"
    assert load_config(raw, world_size=None, check_paths=False).model.compile is True
    lora = {"trainer": {"devices": 1}, "data": {"train_dir": "records.jsonl"},
            "model": {"model_config": "conf/tiny_llama_config.json", "encoder_seq_length": 64, "compile": True},
            "model_alignment_strategy": {"sft": {}, "peft": {"lora_rank": 4, "lora_alpha": 8,
                                                             "target_modules": ["qkv_proj"]}}}
    with pytest.raises(ConfigError, match="model.compile: not supported yet with model_alignment_strategy.peft"):
        load_config(lora, world_size=None, check_paths=False)
    lora["model"]["compile"] = False
    assert load_config(lora, world_size=None, check_paths=False).model.compile is False


@pytest.mark.lane1_only  # end-to-end; the torch-2.9 lane runs the layer-level tests above
@pytest.mark.distributed
@pytest.mark.slow
def test_train_py_with_model_compile_matches_eager_losses(tmp_path: Any) -> None:
    """``+model.compile=true`` through train.py (TP 2 + sequence parallel, packed documents, inductor): the same
    per-step losses and gradient norms as the eager run (4 decimals, as logged)."""
    import re

    from test_e2e import _run, _small_corpus, _train_cmd

    corpus = _small_corpus(str(tmp_path))
    logged = {}
    for compiled in (False, True):
        cmd = _train_cmd(str(tmp_path / f"run_{compiled}"), corpus, str(tmp_path / "cache"), max_steps=3) + [
            f"+model.compile={str(compiled).lower()}", "exp_manager.create_checkpoint_callback=false"]
        out = _run(cmd)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        logged[compiled] = re.findall(r"step (\d+)/3 \| loss ([\d.]+) .*?grad_norm ([\d.]+)", out.stdout)
        assert ("model.compile: 4 decoder layers compiled" in out.stdout + out.stderr) is compiled
    assert len(logged[False]) == 3 and logged[True] == logged[False], logged
