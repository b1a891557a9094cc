"""Shared pieces of the parity tests against transformers models (tests/test_families_parity.py,
tests/test_megatron_model.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nxd_lc.models.llama import LlamaForCausalLM
from nxd_lc.models.llama.hf_adapter import export_hf_state_dict


def hf_reference(hf: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """A transformers causal LM's logits [B, S, V], mean loss over the labelled tokens (-100: none) and the
    gradient of every parameter under its HF name."""
    hf.zero_grad()
    logits = hf(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.detach(),
            "grads": {n: p.grad.detach().clone() for n, p in hf.named_parameters()}}


def grads_as_hf(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our gradients under the adapter's HF names: every parameter's data replaced by its gradient, then the
    exporter (a collective over TP; KV replicas and vocabulary padding dropped as for weights), so every parameter
    is compared, not a hand-picked few. Destroys the model's weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.grad.detach().clone()
    return export_hf_state_dict(model)
