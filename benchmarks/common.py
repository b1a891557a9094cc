"""Shared pieces of the long-context benchmark: the reference model, its weights, the token data, the batch.

Reference config (issue 3, item 5): Llama, 4 layers, hidden 512, 8 attention heads, 2 KV heads (head_dim 64),
vocab 32000, fp32, micro batch 1. The intermediate size is 1376 = 512 x 11008 / 4096 (Llama-2-7B's MLP ratio,
2.6875). ``max_position_embeddings`` is set far beyond any measured length; plain RoPE (theta 10000) ignores it.

Both implementations start from the same weights: an HF ``LlamaForCausalLM`` initialised with seed 0 is saved with
``save_pretrained`` (safetensors) once per run; transformers loads it with ``from_pretrained`` and nxd_lc with
:func:`nxd_lc.models.llama.hf_adapter.load_hf_weights`.

Data: real text, the running interpreter's standard library (``nxd_lc.data.sources.builtin_source``), files in
sorted order joined by ``<|endoftext|>``, tokenized with a byte-level BPE of 32000 tokens trained on its first
8 MB (``nxd_lc.data.tokenizer``, cached under ``.cache/nxd_lc/tokenizers``). ``--tokens bytes`` (the smoke test)
uses UTF-8 bytes instead (ids 0..255, EOS = 256), which needs no training.

Batch (shapes ``[1, L]``): ``input_ids = tokens[:L]``; transformers gets ``labels = input_ids`` and shifts them
itself; nxd_lc gets the already-shifted ``labels = tokens[1:L] + [-100]`` (the nxd_lc batch contract), so both
compute the loss of exactly the same L-1 (position, target) pairs. ``position_ids = 0..L-1`` for both, and
attention is causal over the whole row (no document masking: transformers' sdpa path cannot mask documents
without an L x L mask).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "REFERENCE_MODEL",
    "SMOKE_MODEL",
    "Assets",
    "hf_llama_config",
    "make_batch",
    "prepare_assets",
    "rss_bytes",
]

#: The reference model of issue 3 item 5 (HF LlamaConfig fields).
REFERENCE_MODEL: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1 << 22,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

#: A tiny model for the smoke test (same architecture, seconds per step).
SMOKE_MODEL: dict[str, Any] = {**REFERENCE_MODEL, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 172,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}

_BPE_TRAIN_BYTES = 8_000_000


@dataclasses.dataclass(frozen=True)
class Assets:
    """Files shared by every measurement of a run: ``hf_dir`` (config.json + model.safetensors) and
    ``tokens`` (a torch.save'd int64 [N] tensor of token ids, N >= the longest real length + 1)."""

    hf_dir: str
    tokens: str


def hf_llama_config(model: dict[str, Any]) -> Any:
    """``transformers.LlamaConfig`` for the field dict ``model`` (e.g. :data:`REFERENCE_MODEL`), sdpa attention."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**model)
    cfg._attn_implementation = "sdpa"
    return cfg


def _bpe_tokens(num_tokens: int) -> torch.Tensor:
    """First ``num_tokens`` BPE-32000 ids of the stdlib corpus, documents separated by the EOS id."""
    from nxd_lc.config.schema import TokenizerConfig
    from nxd_lc.data.sources import builtin_source, iter_documents
    from nxd_lc.data.tokenizer import load_tokenizer

    src = builtin_source("python_stdlib")
    tok_cfg = TokenizerConfig(type="bytelevel_bpe", vocab_size=32000, train_max_bytes=_BPE_TRAIN_BYTES)
    tok = load_tokenizer(tok_cfg, lambda: iter_documents(src), corpus_fingerprint=src.fingerprint(),
                         is_builder=True)
    ids: list[int] = []
    for doc in iter_documents(src):
        ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise ValueError(f"the stdlib corpus has only {len(ids)} BPE tokens; ask for at most that many")
    return torch.tensor(ids[:num_tokens], dtype=torch.int64)


def _byte_tokens(num_tokens: int, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes of the stdlib corpus (EOS = 256 between files), reduced modulo ``vocab_size``."""
    from nxd_lc.data.sources import builtin_source, iter_documents

    chunks: list[torch.Tensor] = []
    total = 0
    for doc in iter_documents(builtin_source("python_stdlib")):
        data = torch.frombuffer(bytearray(doc.encode("utf-8") + b"\0"), dtype=torch.uint8).to(torch.int64)
        data[-1] = 256
        chunks.append(data)
        total += data.numel()
        if total >= num_tokens:
            break
    return torch.cat(chunks)[:num_tokens] % vocab_size


def prepare_assets(workdir: str | os.PathLike[str], model: dict[str, Any], num_tokens: int,
                   tokens: str = "bpe") -> Assets:
    """Write the seed-0 HF checkpoint of ``model`` and ``num_tokens`` token ids under ``workdir``.

    Args:
        workdir: an existing, writable directory (a per-run temporary directory).
        model: LlamaConfig fields (:data:`REFERENCE_MODEL` or :data:`SMOKE_MODEL`).
        num_tokens: how many ids to write (the longest real sequence length + 1).
        tokens: ``bpe`` (BPE-32000 over the stdlib; ids < 32000) or ``bytes`` (UTF-8 bytes mod vocab).

    Raises:
        ValueError: an unknown ``tokens`` kind, or BPE ids that do not fit ``model['vocab_size']``.
        FileNotFoundError: ``workdir`` does not exist.
    """
    from transformers import LlamaForCausalLM

    work = Path(workdir)
    if not work.is_dir():
        raise FileNotFoundError(f"benchmark work directory {work} does not exist")
    if tokens == "bpe":
        if model["vocab_size"] < 32000:
            raise ValueError(f"--tokens bpe needs vocab_size >= 32000, the model has {model['vocab_size']}; "
                             "use --tokens bytes")
        ids = _bpe_tokens(num_tokens)
    elif tokens == "bytes":
        ids = _byte_tokens(num_tokens, model["vocab_size"])
    else:
        raise ValueError(f"--tokens must be 'bpe' or 'bytes', got {tokens!r}")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_llama_config(model))
    hf_dir = work / "hf"
    hf.save_pretrained(hf_dir, safe_serialization=True)
    tokens_path = work / "tokens.pt"
    torch.save(ids, tokens_path)
    return Assets(str(hf_dir), str(tokens_path))


def make_batch(tokens: torch.Tensor, seq_len: int) -> dict[str, torch.Tensor]:
    """The [1, L] batch of the module docstring from the int64 [N] ``tokens`` (N > L).

    Returns ``input_ids``, ``hf_labels`` (= input_ids, shifted inside transformers), ``labels`` (shifted, last
    position -100) and ``position_ids`` (0..L-1), all int64 [1, L].

    Raises:
        ValueError: fewer than L + 1 tokens.
    """
    if tokens.numel() < seq_len + 1:
        raise ValueError(f"need {seq_len + 1} tokens for sequence length {seq_len}, have {tokens.numel()}")
    input_ids = tokens[:seq_len].clone().unsqueeze(0)
    labels = torch.full_like(input_ids, -100)
    labels[0, :-1] = tokens[1:seq_len]
    return {"input_ids": input_ids, "hf_labels": input_ids.clone(), "labels": labels,
            "position_ids": torch.arange(seq_len).unsqueeze(0)}


def rss_bytes(field: str = "VmHWM", pid: int | str = "self") -> int:
    """A memory field of ``/proc/<pid>/status`` in bytes (``VmHWM``: peak resident set; ``VmRSS``: current).

    Raises:
        FileNotFoundError: the process is gone; ValueError: the field is absent (not Linux?).
    """
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/{pid}/status has no {field} line")
