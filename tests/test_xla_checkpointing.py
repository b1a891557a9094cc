"""Activation checkpointing on torch-xla (lane 2): torch's non-reentrant checkpoint fails there (it asks ``torch.xla``
for a device module: AttributeError at the first checkpointed forward, found when NxDT's ``hf_llama3_70B_config``
ran shrunk on the XLA test bed), so checkpointed modules on XLA run under torch-xla's reentrant checkpoint
(optimization barriers keep XLA from merging the recomputation with the forward). The scenario runs in a child
process (one device of the test bed): an XLA backward in a pytest worker that already ran a CPU backward trips an
autograd-engine assert.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.xla  # lane 2 (make test-xla)

from xla_testbed import run_on_xla_devices  # noqa: E402


def test_checkpointed_layers_on_xla_give_the_gradients_of_the_plain_model() -> None:
    """``selective`` ([CoreAttention, LlamaMLP], NxDT's 70B choice) on one XLA device: loss and every gradient equal
    the model without checkpointing (1e-5); ``full`` with a frozen embedding (the layers' inputs need no grad, as
    under LoRA): every trainable parameter still gets its gradient, the same as without checkpointing."""
    (r,) = run_on_xla_devices("xla_scenarios:checkpointing_on_xla", 1).results
    for case, d in r.items():
        assert d["same_params"], case
        assert d["loss"] <= 1e-5 and d["grad"] <= 1e-5, (case, d)
