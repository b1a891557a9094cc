"""HF <-> nxd_lc state-dict adapter for :class:`~nxd_lc.models.llama.model.LlamaForCausalLM`.

HF Llama names (``LlamaForCausalLM.state_dict()``; shapes with ``nq``/``nkv`` heads of size ``hd``,
hidden ``H``, intermediate ``I``, vocab ``V``):

    model.embed_tokens.weight                       [V, H]        -> embed_tokens.weight   [Vp/tp, H] rows
    model.layers.N.input_layernorm.weight           [H]           -> layers.N.input_layernorm.weight (replicated)
    model.layers.N.self_attn.{q,k,v}_proj.weight    [n*hd, H]     -> layers.N.self_attn.qkv_proj.weight_qkv
                                                                     (or weight_q/k/v; or q_proj/k_proj/v_proj.weight)
    model.layers.N.self_attn.o_proj.weight          [H, nq*hd]    -> layers.N.self_attn.o_proj.weight [H, nq*hd/tp] cols
    model.layers.N.post_attention_layernorm.weight  [H]           -> layers.N.post_attention_layernorm.weight
    model.layers.N.mlp.{gate,up}_proj.weight        [I, H]        -> layers.N.mlp.gate_up_proj.weight [2I/tp, H]
    model.layers.N.mlp.down_proj.weight             [H, I]        -> layers.N.mlp.down_proj.weight [H, I/tp] cols
    model.norm.weight                               [H]           -> norm.weight
    lm_head.weight                                  [V, H]        -> lm_head.weight [Vp/tp, H] rows (absent if tied)

Biases (``attention_bias`` / ``mlp_bias``) follow their weights' rows; row-parallel biases are replicated.

Mixture-of-experts layers (:class:`~nxd_lc.models.mixtral.MixtralForCausalLM`; HF Mixtral's on-disk names, which
transformers' ``save_pretrained`` writes; ``E`` experts, ``ep`` the EP size):

    model.layers.N.block_sparse_moe.gate.weight           [E, H] -> layers.N.mlp.router.weight (replicated)
    model.layers.N.block_sparse_moe.experts.e.w1.weight   [I, H] -> layers.N.mlp.experts.gate_up_proj [E/ep, 2I/tp, H]
    model.layers.N.block_sparse_moe.experts.e.w3.weight   [I, H]    (gate rows then up rows of this TP rank, for
                                                                     this EP rank's experts)
    model.layers.N.block_sparse_moe.experts.e.w2.weight   [H, I] -> layers.N.mlp.experts.down_proj [E/ep, H, I/tp]

Export (:func:`export_hf_state_dict`) gathers each expert tensor over TP and then over EP, and writes every
expert's ``w1`` / ``w3`` / ``w2`` under the same names.

Loading (:func:`load_hf_weights`) opens the safetensors files with ``safe_open`` and reads each
tensor through ``get_slice``, so a rank reads only its own TP shard (q/k/v: only its heads, the KV
heads it replicates read once). :func:`export_hf_state_dict` all-gathers shards back to full HF
tensors (a collective over TP: every rank must call it). PP > 1 is not supported yet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from typing_extensions import Self

from nxd_lc.config.input_files import parse_json
from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.distributed.gather import gather_pipeline_stages
from nxd_lc.layers import GQAQKVColumnParallelLinear, gather_full_parameter
from nxd_lc.models.common.family import hf_export_config
from nxd_lc.models.common.mlp import GeluMLP
from nxd_lc.models.llama.model import LlamaForCausalLM
from nxd_lc.moe.layer import MoE
from nxd_lc.runtime import xla as xla_runtime
from nxd_lc.runtime.accel import HOST
from nxd_lc.runtime.xla import is_xla_tensor

__all__ = ["FullTensors", "SafetensorsCheckpoint", "check_safetensors_header", "export_hf_state_dict",
           "load_hf_weights", "merge_tp_shards", "save_hf_weights", "shard_full_tensors"]

logger = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
# Tensors some HF checkpoints carry that have no parameter here (RoPE buffers are recomputed).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


#: safetensors dtype names of the floating types an HF decoder checkpoint stores its weights in
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
#: bytes per element of the safetensors dtypes (sub-byte types such as F4 are checked for offsets only)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def _header_entries(file: Path, header: Any, data_bytes: int) -> list[tuple[int, int, str]]:
    """``(begin, end, name)`` of each tensor of a parsed safetensors header, each checked (ValueError names it)."""
    bad = f"safetensors file {file}: "
    fix = "; the file is damaged or not safetensors: download or save it again"
    if not isinstance(header, dict):
        raise ValueError(f"{bad}its header is a JSON {type(header).__name__}, not an object{fix}")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError(f"{bad}__metadata__ must map names to strings{fix}")
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{bad}tensor {name!r} needs exactly 'dtype', 'shape' and 'data_offsets', got "
                             f"{sorted(info) if isinstance(info, dict) else type(info).__name__}{fix}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets) or not isinstance(dtype, str)):
            raise ValueError(f"{bad}tensor {name!r} has dtype {dtype!r}, shape {shape!r}, data_offsets {offsets!r}: "
                             f"expected a dtype name, a list of sizes and two byte offsets{fix}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise ValueError(f"{bad}tensor {name!r} lies at bytes [{begin}, {end}), outside the {data_bytes} data "
                             f"bytes after the header{fix}")
        elements = 1
        for d in shape:
            elements *= d
        if dtype in _DTYPE_BYTES and end - begin != elements * _DTYPE_BYTES[dtype]:
            raise ValueError(f"{bad}tensor {name!r} ({dtype} {shape}) needs {elements * _DTYPE_BYTES[dtype]} bytes, "
                             f"its data_offsets span {end - begin}{fix}")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"{bad}tensors {first!r} and {second!r} overlap (bytes {begin}..{end}){fix}")
    return spans


def check_safetensors_header(file: str | Path) -> None:
    """Check a safetensors file's header against the file before the library maps it.

    Layout: an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON (``{name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}``), then the data; offsets count from the data's start.
    Checked: ``n`` within the file (and the library's 100 MB limit), the JSON, each tensor's fields, its bytes
    inside the data and matching its shape and dtype, and no two tensors overlapping. Reads only the header.

    Raises:
        ValueError: the first problem, naming the file (and the tensor) and the fix.
    """
    file = Path(file)
    size = file.stat().st_size
    fix = "; the file is damaged or not safetensors: download or save it again"
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"safetensors file {file}: {size} bytes, shorter than the 8-byte header length{fix}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise ValueError(f"safetensors file {file}: header length {n} bytes, but the file holds {size - 8} after "
                             f"the length field (limit {_MAX_HEADER_BYTES}){fix}")
        raw = f.read(n)
    try:
        header = parse_json(raw.decode("utf-8"), str(file))  # no NaN / inf / over-long numbers / deep nesting
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"safetensors file {file}: its header is not UTF-8 JSON ({type(e).__name__}: "
                         f"{str(e)[:120]}){fix}") from None
    _header_entries(file, header, size - 8 - n)


def _open(file: Path) -> Any:
    """``safe_open`` of a checked file; an error the library still raises names the file."""
    check_safetensors_header(file)
    try:
        return safe_open(str(file), framework="pt", device=HOST.type)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"safetensors file {file} cannot be read ({e}); download or save it again") from e


class SafetensorsCheckpoint:
    """Read-only view over a safetensors checkpoint: one file, or a directory (sharded with
    ``model.safetensors.index.json``, or any ``*.safetensors`` files). Use as a context manager.

    Raises:
        FileNotFoundError: path missing, or no safetensors file in the directory.
        ValueError: malformed index json, an index entry naming a file outside the directory (absolute, ``..``, a
            symlink leading out) or a missing file, or a damaged safetensors header (each names the file / entry).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.weight_map = self._build_weight_map()
        self._handles: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def _build_weight_map(self) -> dict[str, Path]:
        p = self.path
        if p.is_file():
            return dict.fromkeys(_keys(p), p)
        if not p.is_dir():
            raise FileNotFoundError(f"HF checkpoint {p} does not exist (expected a directory or a .safetensors file)")
        index = p / INDEX_FILE
        if index.is_file():
            return _index_weight_map(index)
        shards = sorted(p.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors files (nor {INDEX_FILE}) in {p}; save the HF model with "
                                    f"save_pretrained(..., safe_serialization=True)")
        return {name: f for f in shards for name in _keys(f)}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} is missing from the HF checkpoint {self.path}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open(file))
        try:
            return self._handles[file].get_slice(name)
        except SafetensorError as e:  # the index names a file that does not hold the tensor
            raise ValueError(f"safetensors file {file}: tensor {name!r} cannot be read ({e}); the checkpoint or "
                             f"its {INDEX_FILE} is damaged: download or save it again") from e

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor ``name`` (read from the header only)."""
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or only indices ``[start, stop)`` of dim ``dim`` (0 or 1), read from disk.

        Raises:
            ValueError: ``name`` is missing, or stored with a non-floating dtype (every decoder weight is a float;
                an integer / bool tensor would be cast silently), naming the tensor, its dtype and file.
        """
        sl = self._slice(name)
        dtype = sl.get_dtype()
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} in {self.file_of(name)} is stored as {dtype}, not a floating type; "
                             "the file is not an HF checkpoint of this model (model.hf_weights_dir)")
        if dim is None:
            return sl[:]
        if dim == 0:
            return sl[start:stop]
        if dim == 1:
            return sl[:, start:stop]
        raise ValueError(f"can only slice dim 0 or 1, got {dim}")

    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self.weight_map[name]


def _keys(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


def _index_weight_map(index: Path) -> dict[str, Path]:
    """``{tensor name: file}`` of ``model.safetensors.index.json``; every file must be a file inside its directory.

    Raises:
        ValueError: not UTF-8 JSON with a ``weight_map`` object of names to relative file names, an entry whose
            file is absolute or resolves (``..``, symlinks) outside the directory, or names a missing file.
    """
    root = index.parent
    try:
        weight_map = parse_json(index.read_bytes().decode("utf-8"), str(index))["weight_map"]
    except (UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a valid safetensors index (needs UTF-8 JSON with a 'weight_map' object): "
                         f"{type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, not an object of tensor names to "
                         "file names")
    real_root = root.resolve()
    files: dict[str, Path] = {}
    checked: dict[str, Path] = {}
    for name, fname in weight_map.items():
        if isinstance(fname, str) and fname in checked:  # a list / object is unhashable: refused below
            files[name] = checked[fname]
            continue
        entry = f"{index}: weight_map entry {name!r} -> {fname!r}"
        if not isinstance(fname, str) or not fname or os.path.isabs(fname) or not fname.isprintable():
            raise ValueError(f"{entry}: the file must be a name relative to {root} (printable text)")
        target = root / fname
        if not target.resolve().is_relative_to(real_root):
            raise ValueError(f"{entry} leads outside the model directory {root} (to {target.resolve()}); an index "
                             "may only name files inside its directory: copy the file in, or fix the index")
        if not target.is_file():
            raise ValueError(f"{entry}: no such file in {root}; the checkpoint is incomplete: download or save it "
                             "again")
        checked[fname] = files[name] = target
    return files


@dataclass
class _Entry:
    """One HF <-> nxd mapping. kinds: vocab (rows, padded), column (rows), row (cols), replicated,
    gate_up (rows of gate and up, stride 2), qkv (GQA heads; ``params`` maps local names)."""

    kind: str
    hf_names: list[str]
    params: dict[str, nn.Parameter]
    module: nn.Module | None = None
    qkv_part: str = "weight"


def _linear_entries(prefix: str, hf: str, module: nn.Module, kind: str) -> list[_Entry]:
    """Entries for a Column/RowParallelLinear: weight as ``kind``; bias follows (row bias replicated)."""
    out = [_Entry(kind, [f"{hf}.weight"], {f"{prefix}.weight": module.weight})]
    if getattr(module, "bias", None) is not None:
        bias_kind = "replicated" if kind == "row" else kind
        out.append(_Entry(bias_kind, [f"{hf}.bias"], {f"{prefix}.bias": module.bias}))
    return out


def _attention_entries(p: str, hp: str, attn: nn.Module) -> list[_Entry]:
    out: list[_Entry] = []
    if attn.qkv_linear:
        qkv: GQAQKVColumnParallelLinear = attn.qkv_proj
        for part in ("weight", "bias"):
            names = ["qkv"] if qkv.fuse_qkv else ["q", "k", "v"]
            params = {f"{p}.qkv_proj.{part}_{n}": getattr(qkv, f"{part}_{n}") for n in names}
            if all(v is not None for v in params.values()):
                hf = [f"{hp}.{n}_proj.{part}" for n in "qkv"]
                out.append(_Entry("qkv", hf, params, module=qkv, qkv_part=part))
    else:
        for n in "qkv":
            out += _linear_entries(f"{p}.{n}_proj", f"{hp}.{n}_proj", getattr(attn, f"{n}_proj"), "column")
    for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms
        if getattr(attn, name) is not None:
            out += _norm_entries(f"{p}.{name}", f"{hp}.{name}", getattr(attn, name))
    out += _linear_entries(f"{p}.o_proj", f"{hp}.o_proj", attn.o_proj, "row")
    return out


def _entries(model: LlamaForCausalLM) -> list[_Entry]:
    """All mappings of ``model``, in a fixed order (identical on every rank)."""
    out = []
    if model.embed_tokens is not None:  # None on pipeline stages other than the first
        out.append(_Entry("vocab", ["model.embed_tokens.weight"], {"embed_tokens.weight": model.embed_tokens.weight}))
    if model.embed_positions is not None:  # learned absolute positions (Megatron-source GPT)
        out.append(_Entry("replicated", ["model.embed_positions.weight"],
                          {"embed_positions.weight": model.embed_positions.weight}))
    for i, layer in model.local_layers():
        p, hp = f"layers.{i}", f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out += _norm_entries(f"{p}.{norm}", f"{hp}.{norm}", getattr(layer, norm))
        out += _attention_entries(f"{p}.self_attn", f"{hp}.self_attn", layer.self_attn)
        if isinstance(layer.mlp, MoE):
            out += _moe_entries(f"{p}.mlp", f"{hp}.block_sparse_moe", layer.mlp)
            continue
        if isinstance(layer.mlp, GeluMLP):
            out += _linear_entries(f"{p}.mlp.up_proj", f"{hp}.mlp.up_proj", layer.mlp.up_proj, "column")
            out += _linear_entries(f"{p}.mlp.down_proj", f"{hp}.mlp.down_proj", layer.mlp.down_proj, "row")
            continue
        gate_up = layer.mlp.gate_up_proj
        for part in ("weight", "bias"):
            if getattr(gate_up, part, None) is not None:
                hf = [f"{hp}.mlp.gate_proj.{part}", f"{hp}.mlp.up_proj.{part}"]
                out.append(_Entry("gate_up", hf, {f"{p}.mlp.gate_up_proj.{part}": getattr(gate_up, part)}))
        out += _linear_entries(f"{p}.mlp.down_proj", f"{hp}.mlp.down_proj", layer.mlp.down_proj, "row")
    if model.norm is not None:  # None on pipeline stages other than the last
        out += _norm_entries("norm", "model.norm", model.norm)
    if model.lm_head is not None and not model.config.tie_word_embeddings:
        out.append(_Entry("vocab", ["lm_head.weight"], {"lm_head.weight": model.lm_head.weight}))
    elif model.lm_head is not None and model.embed_tokens is None:  # tied, embedding on the first stage
        out.append(_Entry("vocab", ["model.embed_tokens.weight"], {"lm_head.weight": model.lm_head.weight}))
    _check_coverage(model, out)
    return out


def _norm_entries(p: str, hp: str, norm: nn.Module) -> list[_Entry]:
    """A norm's weight (and a LayerNorm's bias), replicated."""
    return [_Entry("replicated", [f"{hp}.{part}"], {f"{p}.{part}": getattr(norm, part)})
            for part in ("weight", "bias") if getattr(norm, part, None) is not None]


def _moe_entries(p: str, hp: str, moe: MoE) -> list[_Entry]:
    """Router (replicated) and this EP rank's experts (HF per-expert w1 / w3 / w2, module docstring)."""
    experts = range(moe.experts.first_expert, moe.experts.first_expert + moe.experts.num_local_experts)
    gate_up = [f"{hp}.experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3")]
    return [_Entry("replicated", [f"{hp}.gate.weight"], {f"{p}.router.weight": moe.router.weight}),
            _Entry("experts_gate_up", gate_up, {f"{p}.experts.gate_up_proj": moe.experts.gate_up_proj}),
            _Entry("experts_down", [f"{hp}.experts.{e}.w2.weight" for e in experts],
                   {f"{p}.experts.down_proj": moe.experts.down_proj})]


def _read_experts(ckpt: SafetensorsCheckpoint, e: _Entry, param: torch.Tensor) -> torch.Tensor:
    """``[E/ep, 2I/tp, H]`` (each expert's gate rows then up rows of this TP rank) or ``[E/ep, H, I/tp]``
    (each expert's down-projection columns of this TP rank), stacked over this EP rank's experts."""
    if e.kind == "experts_gate_up":
        half = torch.Size([param.shape[1] // 2, param.shape[2]])
        pairs = zip(e.hf_names[0::2], e.hf_names[1::2])
        return torch.stack([torch.cat([_read_shard(ckpt, w1, half, 0), _read_shard(ckpt, w3, half, 0)])
                            for w1, w3 in pairs])
    return torch.stack([_read_shard(ckpt, w2, param.shape[1:], 1) for w2 in e.hf_names])


def _check_coverage(model: nn.Module, entries: list[_Entry]) -> None:
    """Internal invariant: the mappings cover exactly the model's parameters."""
    mapped = {name for e in entries for name in e.params}
    actual = {name for name, _ in model.named_parameters()}
    if mapped != actual:
        raise RuntimeError(f"hf_adapter mapping out of date: unmapped {sorted(actual - mapped)}, "
                           f"unknown {sorted(mapped - actual)}")


def _tp() -> tuple[int, int]:
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _expect_shape(ckpt: SafetensorsCheckpoint, name: str, expected: tuple[int, ...]) -> None:
    """Raise ValueError naming file and tensor when the checkpoint's full shape is not ``expected``."""
    shape = ckpt.shape(name)
    if shape != tuple(expected):
        raise ValueError(
            f"tensor {name!r} in {ckpt.file_of(name)} has shape {shape}, but the model config expects "
            f"{tuple(expected)}; the checkpoint does not match model.model_config (or its overrides)"
        )


def _read_shard(ckpt: SafetensorsCheckpoint, name: str, local_shape: torch.Size, dim: int) -> torch.Tensor:
    """This rank's contiguous block of ``name`` along ``dim`` (column: 0, row: 1)."""
    rank, tp = _tp()
    full = list(local_shape)
    full[dim] *= tp
    _expect_shape(ckpt, name, tuple(full))
    n = local_shape[dim]
    return ckpt.read(name, dim, rank * n, (rank + 1) * n)


def _read_vocab(ckpt: SafetensorsCheckpoint, name: str, param: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rows of the padded vocab this rank owns; rows >= vocab_size are zero."""
    rank, _ = _tp()
    _expect_shape(ckpt, name, (vocab_size, *param.shape[1:]))
    n = param.shape[0]
    start, stop = rank * n, min((rank + 1) * n, vocab_size)
    rows = ckpt.read(name, 0, start, max(stop, start))  # 0 rows on a rank holding padding only (for the dtype)
    out = torch.zeros(param.shape, dtype=rows.dtype)
    out[: rows.shape[0]] = rows
    return out


def _read_gate_up(ckpt: SafetensorsCheckpoint, e: _Entry, param: torch.Tensor) -> torch.Tensor:
    """``[gate rows of this rank; up rows of this rank]`` (stride-2 layout of ``gate_up_proj``)."""
    half = param.shape[0] // 2
    local_shape = torch.Size([half, *param.shape[1:]])
    return torch.cat([_read_shard(ckpt, name, local_shape, 0) for name in e.hf_names], dim=0)


def _read_qkv(ckpt: SafetensorsCheckpoint, e: _Entry) -> list[torch.Tensor]:
    """Local q (this rank's query heads) and k, v (its KV heads, replicas of HF head ``(r*nkv_l+j)//K``),
    reading only those heads' rows; returns ``[qkv]`` (fused) or ``[q, k, v]``, like the params."""
    layer = e.module
    assert isinstance(layer, GQAQKVColumnParallelLinear)
    rank, _ = _tp()
    hd, nq_l, nkv_l, k_rep = layer.head_dim, layer.num_heads_local, layer.num_kv_heads_local, layer.kv_replicator
    rest = (layer.hidden_size,) if e.qkv_part == "weight" else ()
    q_name, k_name, v_name = e.hf_names
    _expect_shape(ckpt, q_name, (layer.num_attention_heads * hd, *rest))
    q = ckpt.read(q_name, 0, rank * nq_l * hd, (rank + 1) * nq_l * hd)
    heads = [(rank * nkv_l + j) // k_rep for j in range(nkv_l)]
    lo, hi = heads[0], heads[-1] + 1

    def read_kv(name: str) -> torch.Tensor:
        _expect_shape(ckpt, name, (layer.num_key_value_heads * hd, *rest))
        block = ckpt.read(name, 0, lo * hd, hi * hd).reshape(hi - lo, hd, *rest)
        return block[[h - lo for h in heads]].reshape(nkv_l * hd, *rest)

    k, v = read_kv(k_name), read_kv(v_name)
    return [torch.cat([q, k, v], dim=0)] if layer.fuse_qkv else [q, k, v]


def _read_entry(ckpt: SafetensorsCheckpoint, e: _Entry, vocab_size: int) -> list[torch.Tensor]:
    """Local tensors for ``e.params`` (same order), read from the checkpoint."""
    params = list(e.params.values())
    if e.kind == "qkv":
        return _read_qkv(ckpt, e)
    p = params[0]
    if e.kind == "vocab":
        return [_read_vocab(ckpt, e.hf_names[0], p, vocab_size)]
    if e.kind == "gate_up":
        return [_read_gate_up(ckpt, e, p)]
    if e.kind in ("experts_gate_up", "experts_down"):
        return [_read_experts(ckpt, e, p)]
    if e.kind == "replicated":
        _expect_shape(ckpt, e.hf_names[0], tuple(p.shape))
        return [ckpt.read(e.hf_names[0])]
    return [_read_shard(ckpt, e.hf_names[0], p.shape, 0 if e.kind == "column" else 1)]


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Copy an HF Llama safetensors checkpoint into ``model``'s (TP-sharded) parameters.

    Every TP rank calls it and reads only its shard of each tensor (``safe_open(...).get_slice``);
    no collective is issued. Tensors are cast to each parameter's dtype and device. Checkpoint
    tensors without a parameter (e.g. layers beyond ``num_layers``) are logged and skipped.

    Args:
        path: a directory with ``model.safetensors`` or sharded files + ``model.safetensors.index.json``,
            or a single ``.safetensors`` file.

    Raises:
        FileNotFoundError: missing path / files.
        ValueError: a tensor is missing or its shape does not match the model config (names file and tensor).
    """
    entries = _entries(model)
    used: set[str] = set()
    with SafetensorsCheckpoint(path) as ckpt:
        for e in entries:
            for (name, param), value in zip(e.params.items(), _read_entry(ckpt, e, model.vocab_size)):
                assert tuple(value.shape) == tuple(param.shape), (name, value.shape, param.shape)
                param.copy_(value)
            used.update(e.hf_names)
        unused = sorted(n for n in ckpt.weight_map
                        if n not in used and not n.endswith(_IGNORED_SUFFIXES) and not _on_other_stage(model, n))
    if unused:
        logger.warning("load_hf_weights: %d tensors of %s have no parameter and were skipped, e.g. %s",
                       len(unused), path, unused[:5])


def _on_other_stage(model: LlamaForCausalLM, hf_name: str) -> bool:
    """Whether HF tensor ``hf_name`` belongs to a module held by another pipeline stage."""
    parts = hf_name.split(".")
    if hf_name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) < len(model.layers):
        return int(parts[2]) not in dict(model.local_layers())
    if hf_name.startswith("model.embed_tokens."):
        return model.embed_tokens is None and (model.lm_head is None or not model.config.tie_word_embeddings)
    if hf_name.startswith(("model.norm.", "lm_head.")):
        return model.norm is None
    return False


def _export_experts(e: _Entry) -> dict[str, torch.Tensor]:
    """Every expert's HF tensors of a MoE layer's ``gate_up_proj`` (``experts.<e>.w1`` / ``w3`` [I, H]) or
    ``down_proj`` (``experts.<e>.w2`` [H, I]): gathered over TP, then over EP (all E experts on every rank).
    Collective over the TP and EP groups."""
    param = next(iter(e.params.values()))
    full = collectives.all_gather(gather_full_parameter(param).contiguous(), 0,
                                  parallel_state.get_expert_model_parallel_group())  # [E, 2I, H] / [E, H, I]
    prefix = e.hf_names[0].split(".experts.")[0]
    if e.kind == "experts_down":
        return {f"{prefix}.experts.{i}.w2.weight": full[i] for i in range(full.shape[0])}
    half = full.shape[1] // 2
    out = {}
    for i in range(full.shape[0]):
        out[f"{prefix}.experts.{i}.w1.weight"] = full[i, :half]
        out[f"{prefix}.experts.{i}.w3.weight"] = full[i, half:]
    return out


def _export_entry(e: _Entry, model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Full HF tensors for ``e.hf_names`` (collective over TP for sharded kinds; experts:
    :func:`_export_experts`)."""
    if e.kind == "qkv":
        layer = e.module
        assert isinstance(layer, GQAQKVColumnParallelLinear)
        full = layer.gather_full_qkv_weights() if e.qkv_part == "weight" else layer.gather_full_qkv_biases()
        assert full is not None
        return list(full)
    full = gather_full_parameter(next(iter(e.params.values())))
    if e.kind == "vocab":
        return [full[: model.vocab_size]]
    if e.kind == "gate_up":
        return list(full.chunk(2, dim=0))
    return [full]


@torch.no_grad()
def export_hf_state_dict(model: LlamaForCausalLM, *, rank0_only: bool = False,
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Gather ``model``'s shards into a full HF-named state dict of CPU tensors (fresh copies).

    Collective over the TP group (and the EP group for mixture-of-experts layers, whose experts are gathered from
    every EP rank): every rank must call it. KV replicas are dropped, the vocab is
    cut back to ``config.vocab_size``, and ``lm_head.weight`` is omitted when embeddings are tied.

    Args:
        rank0_only: keep the tensors only on global rank 0 (other ranks return ``{}``), so only one
            full copy stays in host memory.
        dtype: cast to this dtype (default: each parameter's dtype).
    """
    tied_copy = model.config.tie_word_embeddings and model.embed_tokens is None  # the first stage exports it
    entries = [e for e in _entries(model) if not (tied_copy and "lm_head.weight" in e.params)]
    # one full copy per pipeline stage, on the stage's first rank (global rank 0 for the first stage)
    keep = not rank0_only or (parallel_state.get_tensor_model_parallel_rank() == 0
                              and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
    lazy = is_xla_tensor(next(model.parameters()))
    # on XLA each entry's gathers run as one graph (a sync), then its reads are transfers; every rank syncs as
    # often as the stage with the most entries, so all ranks cut their graphs alike (DESIGN principle 16)
    rounds = collectives.world_max([len(entries)], tag="nxd_lc_hf_export")[0] if lazy else len(entries)
    out: dict[str, torch.Tensor] = {}
    for i in range(rounds):
        e = entries[i] if i < len(entries) else None
        named = {} if e is None else _export_experts(e) if e.kind.startswith("experts") \
            else dict(zip(e.hf_names, _export_entry(e, model)))
        if lazy:
            xla_runtime.sync()
        for name, t in named.items():  # every rank reads (a transfer on XLA); the keeping ranks keep
            host = t.to(device=HOST, dtype=dtype or t.dtype, copy=True).contiguous()
            if keep:
                out[name] = host
    return gather_pipeline_stages(out, rank0_only)


def _split_shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in insertion order into dicts of at most ``max_bytes`` (a bigger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def save_hf_weights(model: LlamaForCausalLM, path: str | Path, *, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``model`` as an HF checkpoint: safetensors (+ index when sharded) and ``config.json``.

    Collective: every rank calls it; global rank 0 writes, then all ranks meet at a barrier. Files:
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    when the weights exceed ``max_shard_bytes``. ``config.json`` is ``model.config`` (unpadded vocab)
    with its dtype set to the saved tensors' dtype, loadable with ``transformers.AutoModelForCausalLM.from_pretrained``.

    Raises:
        ValueError: a Megatron-source architecture HF has no class for (:func:`hf_export_config`), on every rank.
    """
    config = hf_export_config(model.config)  # on every rank, before any collective: fails everywhere or nowhere
    state = export_hf_state_dict(model, rank0_only=True, dtype=dtype)
    if collectives.get_global_rank() == 0:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        shards = _split_shards(state, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards, start=1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(out / fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        saved_dtype = dtype or next(iter(state.values())).dtype
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", saved_dtype)
        config.save_pretrained(str(out))
    collectives.barrier()


# ---------------------------------------------------------------- offline re-sharding (no collectives)
_TIED_ALIAS = {"lm_head.weight": "embed_tokens.weight", "embed_tokens.weight": "lm_head.weight"}


class FullTensors:
    """Full HF-named tensors held in memory, read like a :class:`SafetensorsCheckpoint` (``shape``, ``read`` of a
    row / column range), so that the loader's slicing (:func:`load_hf_weights`) shards them for this rank.

    Args:
        tensors: HF name -> full tensor (any dtype; slices keep it).
        origin: what the tensors came from, named in shape errors (e.g. the checkpoint directory).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], origin: str) -> None:
        self.tensors = tensors
        self.origin = origin

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"tensor {name!r} is missing from {self.origin}")
        return self.tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor ``name``."""
        return tuple(self._get(name).shape)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or indices ``[start, stop)`` of dim ``dim`` (0 or 1)."""
        t = self._get(name)
        if dim is None:
            return t
        if dim not in (0, 1):
            raise ValueError(f"can only slice dim 0 or 1, got {dim}")
        return t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)

    def file_of(self, name: str) -> str:
        """Where tensor ``name`` came from (for messages)."""
        return self.origin


def _lookup(shard: dict[str, torch.Tensor], name: str, tied: bool) -> torch.Tensor | None:
    """``shard[name]``; with tied embeddings the other copy of the tied weight when ``name`` is absent."""
    if name in shard:
        return shard[name]
    alias = _TIED_ALIAS.get(name) if tied else None
    return shard.get(alias) if alias is not None else None


def _merge_qkv(layer: GQAQKVColumnParallelLinear, locals_: list[list[torch.Tensor]], fused: bool,
               where: str) -> list[torch.Tensor]:
    """Full HF ``[q, k, v]`` from every old TP rank's local q/k/v (fused ``[qkv]`` or ``[q, k, v]``).

    Old layout (:mod:`nxd_lc.layers.qkv`): TP rank ``r`` holds query heads ``[r*nq_l, (r+1)*nq_l)`` and KV heads
    ``(r*nkv_l + j) // K`` for ``j < nkv_l`` (``K`` = that run's ``kv_replicator``, recovered from the shapes).
    """
    tp, hd = len(locals_), layer.head_dim
    nq, nkv = layer.num_attention_heads, layer.num_key_value_heads
    nq_l = nq // tp
    q_parts, k_parts, v_parts = [], [], []
    for parts in locals_:
        if fused:
            rows = parts[0].shape[0] // hd
            nkv_l = (rows - nq_l) // 2
            q, k, v = parts[0].split([nq_l * hd, nkv_l * hd, nkv_l * hd])
        else:
            q, k, v = parts
        q_parts.append(q)
        k_parts.append(k)
        v_parts.append(v)
    nkv_l = k_parts[0].shape[0] // hd
    k_rep = nkv_l * tp // nkv
    if nq % tp or k_rep < 1 or nkv_l * tp != nkv * k_rep:
        raise ValueError(f"{where}: q/k/v shards of {tp} TP ranks with {nkv_l} KV heads each do not fit "
                         f"{nq} query / {nkv} KV heads; model.model_config must be that of the saved run")
    rest = k_parts[0].shape[1:]
    full = []
    for parts in (k_parts, v_parts):
        out = parts[0].new_empty((nkv * hd, *rest))
        for r, t in enumerate(parts):
            for j in range(nkv_l):
                h = (r * nkv_l + j) // k_rep
                out[h * hd:(h + 1) * hd] = t[j * hd:(j + 1) * hd]
        full.append(out)
    return [torch.cat(q_parts, dim=0), *full]


def merge_tp_shards(model: LlamaForCausalLM, shards: list[dict[str, torch.Tensor]],
                    where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Full HF-named tensors from the TP shards of a run with another TP size (offline; no collective).

    The inverse of this rank's loader for any TP size: column shards are concatenated along rows, row shards along
    columns, the padded vocabulary is concatenated and cut back to ``vocab_size``, ``gate_up_proj`` is split into
    its gate and up halves per rank, and GQA q/k/v shards are reassembled head by head with that run's
    ``kv_replicator`` (KV replicas dropped). Used for model weights and, with the same layout, for parameter-shaped
    optimizer state (Adam moments, master weights).

    Args:
        model: this run's model (any TP / PP layout): it gives the mapping (:func:`_entries`, this pipeline
            stage's parameters only), head counts and ``fuse_qkv``; the saved run must have the same config.
        shards: ``shards[r]``: parameter name (``layers.0.mlp.down_proj.weight``) -> TP rank ``r``'s local tensor;
            ``len(shards)`` is the saved TP size. An entry whose tensors are not all present is skipped (e.g.
            frozen parameters without optimizer state).
        where: what the shards came from, for error messages.

    Returns:
        HF name -> full tensor (dtype of the shards).

    Raises:
        ValueError: shards whose shapes do not fit the model's config.
    """
    tied = bool(model.config.tie_word_embeddings)
    full: dict[str, torch.Tensor] = {}
    for e in _entries(model):
        locals_ = [[_lookup(s, name, tied) for name in e.params] for s in shards]
        if any(t is None for parts in locals_ for t in parts):
            continue
        firsts = [parts[0] for parts in locals_]
        if e.kind == "qkv":
            assert isinstance(e.module, GQAQKVColumnParallelLinear)
            merged = _merge_qkv(e.module, locals_, e.module.fuse_qkv, where)
        elif e.kind == "replicated":
            merged = [firsts[0]]
        elif e.kind in ("column", "row"):
            merged = [torch.cat(firsts, dim=0 if e.kind == "column" else 1)]
        elif e.kind == "vocab":
            merged = [torch.cat(firsts, dim=0)[: model.vocab_size]]
        else:  # gate_up: [gate rows of rank r; up rows of rank r]
            halves = [t.chunk(2, dim=0) for t in firsts]
            merged = [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
        full.update(zip(e.hf_names, merged))
    return full


def shard_full_tensors(model: LlamaForCausalLM, full: FullTensors) -> dict[str, torch.Tensor]:
    """This rank's local tensors (parameter name -> tensor in the parameter's shape, the full tensors' dtype) of the
    entries of ``model`` whose HF tensors are all in ``full``; the loader's own slicing (TP rank and size, KV
    replication and vocab padding of this run). Offline: no collective.

    Raises:
        ValueError: a full tensor's shape does not fit the model config (names it and ``full.origin``).
    """
    out: dict[str, torch.Tensor] = {}
    for e in _entries(model):
        if not all(n in full.tensors for n in e.hf_names):
            continue
        for (name, param), value in zip(e.params.items(), _read_entry(full, e, model.vocab_size)):  # type: ignore[arg-type]
            out[name] = value.reshape(param.shape)
    return out
