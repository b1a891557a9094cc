"""Weights holding NaN / inf are refused where they are imported (issue 40, item 4), naming the file and the
tensor: float8 HF weights (``all_finite``) and GGUF tensors. The safetensors loader's own cases are in
``test_hf_adapter.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nxd_lc.models.llama.hf_safetensors import all_finite


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
def test_all_finite_takes_every_float_dtype_of_a_checkpoint(dtype: torch.dtype) -> None:
    good = torch.linspace(-2, 2, 9).to(dtype)
    assert all_finite(good)
    bad = good.clone()
    bad[3] = float("nan")
    assert not all_finite(bad)


def test_a_gguf_tensor_holding_nan_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """A NaN in a GGUF tensor stops the conversion naming the GGUF tensor (and its HF name), before anything is
    written."""
    gguf = pytest.importorskip("gguf")
    from transformers import LlamaConfig

    from nxd_lc.models.llama.gguf_import import gguf_llama_state_dict

    path = tmp_path / "nan.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    data[1, 2] = np.nan
    writer.add_tensor("token_embd.weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = LlamaConfig(vocab_size=2, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"GGUF tensor 'token_embd\.weight' \(model\.embed_tokens\.weight\) holds "
                                         r"NaN or infinite values"):
        gguf_llama_state_dict(gguf.GGUFReader(str(path)), config)
