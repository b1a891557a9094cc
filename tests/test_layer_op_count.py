"""Issue 41, item 3 (CPU proxy): the ATen ops one decoder layer's training step dispatches, nxd_lc against
transformers.

On CUDA every dispatched ATen op of an eager step is (at most) one kernel launch; the H200 profile of nxd_lc's eager
step found twice the launches of transformers + Liger-Kernel. Here a dispatch mode (``tests/test_fusions.py``'s
``_OpCounter``) counts the ops of one forward + backward of a causal-LM loss with 2 and with 4 decoder layers (the
difference, halved, is one layer's: embedding, head and loss cancel) for nxd_lc's Llama and for transformers'
``LlamaForCausalLM`` (SDPA attention), both eager with the same shape, without recomputation and with every layer
recomputed (nxd_lc's ``full``, transformers' gradient checkpointing). nxd_lc's layer must dispatch no more ops than
transformers' in either mode; the counts measured when this was written are in the assertion messages' context below
(2026-11-28, torch 2.13: 176 vs 219 without recomputation, 277 vs 338 with it). Liger's kernels replace norm / RoPE
/ SwiGLU op groups on CUDA only and are not counted here.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import pytest
import torch
from test_fusions import _OpCounter
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from nxd_lc.distributed import parallel_state
from nxd_lc.models.common.checkpointing import apply_activation_checkpointing
from nxd_lc.models.llama import LlamaForCausalLM

S = 256


def _config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S,
                       tie_word_embeddings=False)


def _nxd_ops(layers: int, recompute: bool) -> collections.Counter[str]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(layers))
    if recompute:
        apply_activation_checkpointing(model, "full")
    ids = torch.randint(0, 256, (1, S))
    with _OpCounter() as count:
        total, n = model.loss(ids, ids)
        (total / n).backward()
    return count.ops


def _hf_ops(layers: int, recompute: bool) -> collections.Counter[str]:
    torch.manual_seed(0)
    config = _config(layers)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    model = HFLlamaForCausalLM(config).train()
    if recompute:
        with warnings.catch_warnings():  # transformers 5 renames it (a FutureWarning); the pinned name still works
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 256, (1, S))
    with _OpCounter() as count:
        model(input_ids=ids, labels=ids).loss.backward()
    return count.ops


def _per_layer(counter: Any, recompute: bool) -> tuple[float, dict[str, float]]:
    diff = counter(4, recompute) - counter(2, recompute)
    return sum(diff.values()) / 2, {k: v / 2 for k, v in diff.most_common(8)}


@pytest.fixture(autouse=True)
def _one_rank() -> Any:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1)
    yield
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("recompute", [False, True], ids=["no_recompute", "full_recompute"])
def test_layer_dispatches_no_more_ops_than_transformers(recompute: bool) -> None:
    nxd, nxd_top = _per_layer(_nxd_ops, recompute)
    hf, hf_top = _per_layer(_hf_ops, recompute)
    assert nxd > 50 and hf > 50, (nxd, hf)  # the counter sees a layer's ops at all
    assert nxd <= hf, f"nxd_lc {nxd} ops per layer step > transformers {hf}; nxd_lc {nxd_top}, transformers {hf_top}"
