"""Acceptance (issue 49): checkpoints written by NxD's own tools load, re-shard and convert in nxd_lc, and what nxd_lc
writes reads back with NxD's format.

Inputs, used as they are: ``../shared/reference/nxd_checkpoints/`` (its README says how each was written: NxDT
2.26's converter over NxD 2.29's ``CheckpointConverterBase``, ``--hw_backend trn1``, and NxD 2.29's trainer writer),
with transformers' logits of the source models in ``hf/<model>/ref.pt``. Independent references: those logits, and
transformers' gradients of the same batch (every parameter, after the KV-replica gradient sum: the training step,
not only the forward).

* Every checkpoint loads the way ``model.weight_init_only`` loads one (``nxd_lc.app.build.load_model_weights``) at
  its own layout and re-sharded to other TP / PP sizes and KV-replica layouts: logits within 1e-4 of
  transformers', every gradient within 1e-5 of transformers', and every parameter bit-identical to the HF start
  (``load_hf_weights`` of the source model at the same layout).
* TP 4 / ``kv_replicator`` 2, NxD's Trn1 layout (KV heads K0 K1 K0 K1, query heads reordered, KV groups {0, 2}
  {1, 3}): at its own layout the parameters are the HF start's bit for bit, loaded into the adjacent (Trn2) layout
  they are converted, and the gradients of both are transformers'.
* The 3-layer PP 2 checkpoint (NxD's default split: layer 0 on stage 0) loads at PP 2 without ``pipeline_cuts``;
  with cuts that split otherwise it is re-sharded and the reason names ``model.pipeline_cuts`` and the files' split.
* ``nxd_lc.cli.convert`` turns each into an HF directory that transformers loads with the reference logits, and
  whose tensors are the source model's bit for bit.
* The way back: nxd_lc's TP 2, TP 2 x PP 2 and TP 4 / ``kv_replicator`` 2 checkpoints, plain and xser, read by
  :func:`_nxd_read` (written here from NxD's format facts: ``lm_head.weight`` and ``model.*`` keys, xser references
  resolved through the ``.info.pt`` NxD's reader indexes for every tensor, the Trn1 replica layout undone as NxD's
  converter's ``merge_tp_checkpoints`` undoes it) give the source HF tensors bit for bit.
* ``train.py`` started from the NxD TP 4 / kv 2 checkpoint (``weight_init_only``, no ``done`` marker: one warning)
  trains with the losses of the same run started from the HF weights.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from dist_utils import run_distributed
from hf_parity import grads_as_hf, hf_reference
from safetensors.torch import load_file
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.app.build import load_model_weights
from nxd_lc.checkpoint import load as load_module
from nxd_lc.checkpoint import nxd_format, sharded
from nxd_lc.checkpoint.reshard import reshard_reason, saved_layout
from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.distributed.grads import allreduce_kv_replica_gradients
from nxd_lc.distributed.kv_layout import replication
from nxd_lc.layers.param_attrs import move_module, record_parallel_attributes
from nxd_lc.models.common.loss import causal_lm_loss
from nxd_lc.models.hf_config import build_llama_config
from nxd_lc.models.llama import LlamaForCausalLM, load_hf_weights
from nxd_lc.pipeline import rank_model_part

REPO = Path(__file__).resolve().parents[1]
REF = REPO.parent / "shared" / "reference" / "nxd_checkpoints"
pytestmark = pytest.mark.skipif(not REF.is_dir(), reason=f"NxD's reference checkpoints are not here ({REF})")

#: name -> (writer dir, HF source model, TP, PP, fused qkv, qkv_linear): the README's table
CASES = {
    "gqa_tp2_fused_xser": ("nxd_converter", "gqa", 2, 1, True, True),
    "gqa_tp4_kv2_fused_xser": ("nxd_converter", "gqa", 4, 1, True, True),
    "gqa_tp2pp2_fused_xser": ("nxd_converter", "gqa", 2, 2, True, True),
    "l3_tp1pp2_noqkvlinear_plain": ("nxd_converter", "l3", 1, 2, False, False),
    "kv1_tp1_xser_step_0": ("nxd_trainer", "kv1", 1, 1, True, True),
}
#: world size -> the loads run there: (case, KV-replica layout of the loading run); the run's TP is the world size
LOADS = {
    1: [(c, "interleaved") for c in CASES],
    2: [("gqa_tp2_fused_xser", "interleaved"), ("gqa_tp4_kv2_fused_xser", "interleaved"),
        ("gqa_tp2pp2_fused_xser", "interleaved"), ("l3_tp1pp2_noqkvlinear_plain", "interleaved"),
        ("kv1_tp1_xser_step_0", "adjacent")],
    4: [("gqa_tp4_kv2_fused_xser", "interleaved"), ("gqa_tp4_kv2_fused_xser", "adjacent"),
        ("gqa_tp2_fused_xser", "interleaved"), ("gqa_tp2pp2_fused_xser", "adjacent"),
        ("kv1_tp1_xser_step_0", "interleaved")],
}
ATOL_LOGITS, ATOL_GRAD = 1e-4, 1e-5


def _tag_dir(case: str) -> str:
    return str(REF / CASES[case][0] / case)


def _hf_dir(case: str) -> str:
    return str(REF / "hf" / CASES[case][1])


def _labels(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    """Per source model: ``ref.pt``'s input ids and logits, and transformers' loss and gradients of that batch."""
    out = {}
    for model in ("gqa", "l3", "kv1"):
        ref = torch.load(REF / "hf" / model / "ref.pt", weights_only=True)
        hf = HFLlama.from_pretrained(str(REF / "hf" / model), attn_implementation="eager").float()
        r = hf_reference(hf, ref["input_ids"], _labels(ref["input_ids"]))
        torch.testing.assert_close(r["logits"], ref["logits"], atol=1e-5, rtol=0)  # the file is transformers'
        out[model] = {"ids": ref["input_ids"], "logits": ref["logits"], "loss": r["loss"], "grads": r["grads"]}
    return out


def _build(case: str, kv_layout: str, pp: int = 1, cuts: list[str] | None = None) -> LlamaForCausalLM:
    """This rank's model of ``case``'s source config at the current TP size (``parallel_state`` initialised here)."""
    _, _, _, _, fuse, qkv_linear = CASES[case]
    config = build_llama_config(os.path.join(_hf_dir(case), "config.json"))
    tp = collectives.get_global_world_size() // pp
    k = replication(tp, config.num_key_value_heads) if qkv_linear else 1
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, kv_replicator=k,
                                 kv_replica_layout=kv_layout)
    part = rank_model_part(config.num_hidden_layers, pp, ps.get_pipeline_model_parallel_rank(), 1, cuts)
    torch.manual_seed(1234)  # not the source weights: only the checkpoint can explain them
    return LlamaForCausalLM(config, kv_replicator=k, fuse_qkv=fuse, qkv_linear=qkv_linear,
                            flash_attention=False, **part)


def _check_load(case: str, kv_layout: str, refs: dict[str, Any]) -> None:
    """Load ``case`` as ``model.weight_init_only`` does at this run's layout; logits, gradients, HF-start params."""
    model = _build(case, kv_layout)
    load_module._warned_unmarked.clear()  # once per process and checkpoint: this load's own
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model_weights(model, _tag_dir(case))
    unmarked = [w for w in caught if "no 'done' marker" in str(w.message)]
    assert len(unmarked) == (0 if CASES[case][0] == "nxd_trainer" else 1), [str(w.message) for w in caught]
    start = _build_again(case, kv_layout)
    load_hf_weights(start, _hf_dir(case))
    for (name, p), q in zip(model.named_parameters(), start.parameters()):
        assert torch.equal(p, q), f"{case} at TP {ps.get_tensor_model_parallel_world_size()} {kv_layout}: {name}"
    ref = refs[CASES[case][1]]
    logits = model(ref["ids"])
    full = collectives.all_gather(logits.detach().contiguous(), -1, ps.get_tensor_model_parallel_group())
    where = f"{case} -> TP {ps.get_tensor_model_parallel_world_size()} {kv_layout}"
    torch.testing.assert_close(full[..., : model.vocab_size], ref["logits"], atol=ATOL_LOGITS, rtol=0, msg=where)
    loss_sum, num = causal_lm_loss(logits, _labels(ref["ids"]))
    (loss_sum / num).backward()
    torch.testing.assert_close(loss_sum / num, ref["loss"], atol=1e-5, rtol=0, msg=where)
    allreduce_kv_replica_gradients(model)  # summed over the ranks that really share each KV head
    for name, grad in grads_as_hf(model).items():
        torch.testing.assert_close(grad, ref["grads"][name], atol=ATOL_GRAD, rtol=0, msg=f"{where}: {name}")
    ps.destroy_model_parallel()


def _build_again(case: str, kv_layout: str) -> LlamaForCausalLM:
    """A second model at the current layout (parallel state kept)."""
    _, _, _, _, fuse, qkv_linear = CASES[case]
    config = build_llama_config(os.path.join(_hf_dir(case), "config.json"))
    return LlamaForCausalLM(config, kv_replicator=ps.get_kv_replicator(), fuse_qkv=fuse, qkv_linear=qkv_linear,
                            flash_attention=False)


def _load_worker(rank: int, world: int, refs: dict[str, Any]) -> None:
    for case, kv_layout in LOADS[world]:
        # NxD's files record no layout: they are read in the loading run's (as NxD's loader reads them) unless
        # exp_manager.checkpoint_kv_replica_layout names theirs; a Trn2-layout run loading Trn1 files names it
        nxd_format.set_unrecorded_kv_layout("interleaved" if kv_layout == "adjacent" else None)
        _check_load(case, kv_layout, refs)
    nxd_format.set_unrecorded_kv_layout(None)
    if world == 4:  # the Trn1 files read as Trn2's: each rank's q / kv / o_proj stay consistent (the logits are
        # right), but the KV gradients are summed over ranks holding different heads and the HF names are wrong
        model = _build("gqa_tp4_kv2_fused_xser", "adjacent")
        load_model_weights(model, _tag_dir("gqa_tp4_kv2_fused_xser"))
        ref = refs["gqa"]
        logits = model(ref["ids"])
        full = collectives.all_gather(logits.detach().contiguous(), -1, ps.get_tensor_model_parallel_group())
        torch.testing.assert_close(full, ref["logits"], atol=ATOL_LOGITS, rtol=0)
        loss_sum, num = causal_lm_loss(logits, _labels(ref["ids"]))
        (loss_sum / num).backward()
        allreduce_kv_replica_gradients(model)
        name = "model.layers.0.self_attn.k_proj.weight"
        assert (grads_as_hf(model)[name] - ref["grads"][name]).abs().max() > 1e-3
        ps.destroy_model_parallel()
        # o_proj's column order of the interleaved layout survives a device move
        model = _build("gqa_tp4_kv2_fused_xser", "interleaved")
        before = record_parallel_attributes(model)
        assert before["layers.0.self_attn.o_proj.weight"]["partition_order"] == (0, 2, 1, 3)
        move_module(model, dtype=torch.float64)
        assert record_parallel_attributes(model) == before
        ps.destroy_model_parallel()
    if world == 2:
        _check_pipeline_split()


def _check_pipeline_split() -> None:
    """l3 (3 layers) at PP 2: NxD's default split is the files' (stage 0: layer 0), so the shards load as they are;
    cuts that split otherwise re-shard, the reason naming model.pipeline_cuts and the files' split."""
    case = "l3_tp1pp2_noqkvlinear_plain"
    tag_dir = _tag_dir(case)
    model = _build(case, "interleaved", pp=2)
    assert sorted(i for i, _ in model.local_layers()) == [[0], [1, 2]][ps.get_pipeline_model_parallel_rank()]
    assert reshard_reason(model, tag_dir, saved_layout(tag_dir)) is None
    load_model_weights(model, tag_dir)
    start = _build_stage_again(case)
    load_hf_weights(start, _hf_dir(case))
    for (name, p), q in zip(model.named_parameters(), start.parameters()):
        assert torch.equal(p, q), name
    ps.destroy_model_parallel()
    other = _build(case, "interleaved", pp=2, cuts=["model.layers.1"])
    reason = reshard_reason(other, tag_dir, saved_layout(tag_dir))
    assert reason is not None and "model.pipeline_cuts" in reason and "[[0], [1, 2]]" in reason, reason
    load_model_weights(other, tag_dir)  # re-sharded: stage 0 gets layers 0-1 from both stage files
    start = LlamaForCausalLM(other.config, fuse_qkv=False, qkv_linear=False, flash_attention=False,
                             **rank_model_part(3, 2, ps.get_pipeline_model_parallel_rank(), 1, ["model.layers.1"]))
    load_hf_weights(start, _hf_dir(case))
    for (name, p), q in zip(other.named_parameters(), start.parameters()):
        assert torch.equal(p, q), name
    ps.destroy_model_parallel()


def _build_stage_again(case: str) -> LlamaForCausalLM:
    config = build_llama_config(os.path.join(_hf_dir(case), "config.json"))
    part = rank_model_part(config.num_hidden_layers, 2, ps.get_pipeline_model_parallel_rank())
    return LlamaForCausalLM(config, fuse_qkv=False, qkv_linear=False, flash_attention=False, **part)


@pytest.mark.compat
@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
def test_nxd_checkpoints_load_and_reshard_with_transformers_outputs(world: int, references: dict) -> None:
    run_distributed(_load_worker, world, references)


# ------------------------------------------------------------------------------------------- conversion to HF
def _conf(tmp: Path, case: str) -> str:
    """A run config of ``case``'s model at the checkpoint's layout (conf/<case>.yaml under ``tmp``)."""
    _, model, tp, pp, fuse, qkv_linear = CASES[case]
    k = replication(tp, json.loads(Path(_hf_dir(case), "config.json").read_text())["num_key_value_heads"])
    raw = {"name": case, "trainer": {"devices": tp * pp, "num_nodes": 1, "max_steps": 1},
           "exp_manager": {"checkpoint_callback_params": {"model_parallel_size": tp * pp}},
           "distributed_strategy": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                    "kv_replicator": k if qkv_linear else 1},
           "data": {"micro_batch_size": 1, "global_batch_size": 2 if pp > 1 else 1, "seq_length": 32,
                    "train_dir": str(tmp), "val_fraction": 0.0},
           "model": {"model_config": os.path.join(_hf_dir(case), "config.json"), "encoder_seq_length": 32,
                     "fuse_qkv": fuse, "qkv_linear": qkv_linear},
           "precision": {"type": "fp32"}}
    (tmp / "conf").mkdir(exist_ok=True)
    (tmp / "conf" / f"{case}.yaml").write_text(yaml.safe_dump(raw))
    return str(tmp / "conf")


def _convert_worker(rank: int, world: int, tmp: str, cases: list[str]) -> None:
    from nxd_lc.cli import convert as convert_cli

    conf = str(Path(tmp) / "conf")  # written by the test before the ranks start (one writer, no torn reads)
    for case in cases:
        assert convert_cli.main(["--config-name", case, "--config-dir", conf, "--checkpoint", _tag_dir(case),
                                 "--output", os.path.join(tmp, "hf", case), "--save-tokenizer", "false"]) == 0
        collectives.barrier()


@pytest.mark.distributed
def test_nxd_checkpoints_convert_to_hf_with_transformers_logits(tmp_path: Path, references: dict) -> None:
    by_tp: dict[int, list[str]] = {}
    for case, (_, _, tp, _, _, _) in CASES.items():
        by_tp.setdefault(tp, []).append(case)
        _conf(tmp_path, case)
    for tp, cases in sorted(by_tp.items()):
        run_distributed(_convert_worker, tp, str(tmp_path), cases)
    for case in CASES:
        out = tmp_path / "hf" / case
        source = load_file(os.path.join(_hf_dir(case), "model.safetensors"))
        converted = load_file(str(out / "model.safetensors"))
        assert sorted(converted) == sorted(source), case
        for name, value in source.items():
            assert torch.equal(converted[name], value), f"{case}: {name}"  # bit for bit
        hf = HFLlama.from_pretrained(str(out), attn_implementation="eager").float().eval()
        ref = references[CASES[case][1]]
        with torch.no_grad():
            torch.testing.assert_close(hf(ref["ids"]).logits, ref["logits"], atol=ATOL_LOGITS, rtol=0, msg=case)


# ------------------------------------------------------------------ the way back: NxD's format read independently
class _XlaTensorReference:
    """torch-xla's ``TensorReference`` as NxD's reader meets it: ``TensorReference(tid)``, or rebuilt from its
    ``{"tid": i}`` state."""

    def __init__(self, tid: int | None = None) -> None:
        self.tid = tid

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


class _NxdUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch_xla.utils.serialization", "TensorReference"):
            return _XlaTensorReference
        return super().find_class(module, name)


_PICKLE = types.ModuleType("nxd_reader_pickle")  # torch.load's pickle_module: pickle with the reader's Unpickler
_PICKLE.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
_PICKLE.Unpickler = _NxdUnpickler  # type: ignore[attr-defined]


def _nxd_load_shard(path: str) -> dict[str, torch.Tensor]:
    """One model shard as NxD's ``trainer/checkpoint.py`` loads it: a plain file as it is; an xser structure file's
    references through ``<path>.info.pt`` (indexed for every tensor: ``ref_info[t.tid]``) and
    ``<path>.tensors/tensor_<tid>.pt``."""
    state = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    if not any(isinstance(v, _XlaTensorReference) for v in state.values()):
        return state
    info = torch.load(path + ".info.pt", weights_only=True)
    out = {}
    for key, ref in state.items():
        meta = info[ref.tid]
        tensor = torch.load(os.path.join(path + ".tensors", f"tensor_{ref.tid}.pt"), weights_only=True)
        assert meta["dtype"] == tensor.dtype and tuple(meta["shape"]) == tuple(tensor.shape), (path, key, meta)
        assert meta["expert_model_parallel"] is False
        out[key] = tensor
    return out


def _nxd_read(tag_dir: str, tp: int, pp: int, config: dict) -> dict[str, torch.Tensor]:
    """Full HF tensors from an NxD-layout checkpoint, merged as NxD's converter (``merge_tp_checkpoints``,
    ``--hw_backend trn1``, ``--qkv_linear --fuse_qkv``) merges: fused qkv split per rank into q / k / v; k / v
    concatenated over TP and the first of ``kv_size_multiplier`` chunks kept (replicas were ``repeat``-ed); q and
    o_proj's columns concatenated and the Trn1 query reordering undone; gate_up split per rank into gate and up;
    the vocabulary and row / column shards concatenated; pipeline stages' keys joined."""
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["hidden_size"] // nq
    k = max(1, tp // nkv)
    npr = nq // (nkv * k) if k > 1 else nq // tp  # query heads per TP rank
    ranks = [{} for _ in range(tp)]
    for t in range(tp):
        for p in range(pp):
            ranks[t].update(_nxd_load_shard(os.path.join(tag_dir, "model", f"dp_rank_00_tp_rank_{t:02d}_pp_rank_"
                                                                         f"{p:02d}.pt")))
    full: dict[str, torch.Tensor] = {}
    for name in ranks[0]:
        parts = [r[name] for r in ranks]
        if name.endswith("qkv_proj.weight_qkv"):
            base = name.replace("qkv_proj.weight_qkv", "")
            q, kk, v = zip(*(x.split([npr * hd, (x.shape[0] - npr * hd) // 2, (x.shape[0] - npr * hd) // 2])
                             for x in parts))
            full[base + "q_proj.weight"] = _undo_trn1_query_order(torch.cat(q), nq, nkv, k, tp, hd)
            full[base + "k_proj.weight"] = torch.chunk(torch.cat(kk), k)[0]
            full[base + "v_proj.weight"] = torch.chunk(torch.cat(v), k)[0]
        elif name.endswith("o_proj.weight"):
            full[name] = _undo_trn1_query_order(torch.cat(parts, 1).t(), nq, nkv, k, tp, hd).t().contiguous()
        elif name.endswith("gate_up_proj.weight"):
            gate, up = zip(*(x.chunk(2) for x in parts))
            full[name.replace("gate_up_proj", "gate_proj")] = torch.cat(gate)
            full[name.replace("gate_up_proj", "up_proj")] = torch.cat(up)
        elif name.endswith("down_proj.weight"):
            full[name] = torch.cat(parts, 1)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            full[name] = torch.cat(parts)[: config["vocab_size"]]
        else:
            full[name] = parts[0]
    return full


def _undo_trn1_query_order(rows: torch.Tensor, nq: int, nkv: int, k: int, tp: int, hd: int) -> torch.Tensor:
    """The converter's Trn1 branch: rank r's query block was block ``(r % nkv) * K + r // nkv`` (blocks of
    ``nq / tp`` heads); ``rows`` [nq*hd, H] in rank order -> HF order."""
    if k == 1:
        return rows
    weights = rows.reshape(-1, nq // (nkv * k), hd, rows.shape[-1])  # [tp, per-rank heads, hd, H]
    indices = torch.arange(0, tp // nkv) * nkv
    return torch.cat([weights[indices + i] for i in range(nkv)]).reshape(nq * hd, -1)


def _write_worker(rank: int, world: int, tmp: str, pp: int, xser: bool) -> None:
    """nxd_lc's writer (NxD's --convert_from_full_state vocabulary: nxd_lc.cli.convert) at TP ``world`` x PP."""
    from nxd_lc.cli import convert as convert_cli

    case = "gqa_tp4_kv2_fused_xser" if world == 4 else "gqa_tp2_fused_xser"
    conf = str(Path(tmp) / "conf")  # written by the test before the ranks start
    k = replication(world, 2)
    out = os.path.join(tmp, f"tp{world}pp{pp}{'x' if xser else 'p'}")
    assert convert_cli.main(["--config-name", case, "--config-dir", conf, "--convert_from_full_state", "true",
                             "--input_dir", _hf_dir(case), "--output_dir", out, "--tp_size", str(world), "--pp_size",
                             str(pp), "--save_xser", str(xser).lower(), "--kv_size_multiplier", str(k),
                             "--fuse_qkv", "true", "--qkv_linear", "true",
                             "++distributed_strategy.kv_replica_layout=interleaved"]) == 0


@pytest.mark.distributed
@pytest.mark.parametrize("xser", [False, True])
def test_nxd_lc_checkpoints_read_back_with_nxds_format(tmp_path: Path, xser: bool) -> None:
    config = json.loads((REF / "hf" / "gqa" / "config.json").read_text())
    source = load_file(str(REF / "hf" / "gqa" / "model.safetensors"))
    for case in ("gqa_tp2_fused_xser", "gqa_tp4_kv2_fused_xser"):
        _conf(tmp_path, case)
    for tp, pp in ((2, 1), (2, 2), (4, 1)):
        run_distributed(_write_worker, tp, str(tmp_path), pp, xser)
        tag_dir = str(tmp_path / f"tp{tp}pp{pp}{'x' if xser else 'p'}" / "step=0")
        names = set(os.listdir(os.path.join(tag_dir, "model")))
        shards = {sharded.checkpoint_file_name(0, t, p) for t in range(tp) for p in range(pp)}
        assert shards <= names and all((f + ".info.pt" in names) == xser for f in shards)
        done = json.loads(Path(tag_dir, "done").read_text())
        assert done["layout"] == {"kv_replica_layout": "interleaved"}
        back = _nxd_read(tag_dir, tp, pp, config)
        assert sorted(back) == sorted(source), (tp, pp)
        for name, value in source.items():
            assert torch.equal(back[name], value), f"TP {tp} PP {pp}: {name}"


# ----------------------------------------------------------------------------------------- markers and messages
def test_unmarked_tags_and_their_messages(tmp_path: Path) -> None:
    """A converter tag (no done, no manifest) is loadable when named, never the newest; a tag missing a shard is
    not; nxd_lc's head naming round-trips; the key-mismatch message names the head spelling found."""
    conv = _tag_dir("gqa_tp2_fused_xser")
    assert sharded.is_unmarked_nxd_checkpoint(conv) and not sharded.is_complete(conv)
    assert sharded.latest_checkpoint(str(Path(conv).parent)) is None  # none has a done marker
    assert sharded.list_checkpoints(str(Path(conv).parent)) == []
    partial = tmp_path / "t"
    (partial / "model").mkdir(parents=True)
    (partial / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").write_bytes(b"")
    assert not sharded.is_unmarked_nxd_checkpoint(str(partial))  # TP rank 0's shard is missing
    state = {"model.embed_tokens.weight": 1, "model.lm_head.weight": 2}
    assert list(nxd_format.to_nxd_names(state)) == ["model.embed_tokens.weight", "lm_head.weight"]
    assert nxd_format.from_nxd_names(nxd_format.to_nxd_names(state)) == state
    assert nxd_format.from_nxd_names({"lm_head.weight": 1}) == {"lm_head.weight": 1}  # a bare module's state
    text = nxd_format.key_mismatch_message("ck", ["model.lm_head.weight"], ["lm_head.weight", "x"], KeyError("k"))
    assert "'lm_head.weight' (NxD's and HF's name)" in text and "unexpected ['lm_head.weight', 'x']" in text


def test_full_resume_of_a_converter_checkpoint_names_weight_init_only(tmp_path: Path) -> None:
    from nxd_lc.app.validation import load_config
    from nxd_lc.config.errors import ConfigError
    from nxd_lc.lightning import exp_manager

    raw = yaml.safe_load(Path(_conf(tmp_path, "gqa_tp2_fused_xser"), "gqa_tp2_fused_xser.yaml").read_text())
    raw["exp_manager"]["resume_from_checkpoint"] = _tag_dir("gqa_tp2_fused_xser")
    raw["exp_manager"]["explicit_log_dir"] = str(tmp_path / "run")
    cfg = load_config(raw)
    with pytest.raises(ConfigError, match="model.weight_init_only: true"):
        exp_manager.resume_plan(cfg, exp_manager.experiment_paths(cfg))
    raw["model"]["weight_init_only"] = True
    cfg = load_config(raw)
    assert exp_manager.resume_plan(cfg, exp_manager.experiment_paths(cfg)) == (None, _tag_dir("gqa_tp2_fused_xser"))


# -------------------------------------------------------------------------------------- train.py from NxD's files
@pytest.mark.lane1_only  # two train.py launches of 4 ranks; the loads above run in both lanes
@pytest.mark.distributed
@pytest.mark.slow
def test_train_py_from_nxd_trn1_checkpoint_equals_hf_start(tmp_path: Path) -> None:
    from tests.test_e2e import _run, _small_corpus
    from tests.test_reshard import _losses_of

    corpus, cache = _small_corpus(str(tmp_path)), str(tmp_path / "cache")
    common = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "train.py",
              "--config-name", "cpu_tiny_llama_config", "trainer.max_steps=2", "trainer.devices=4",
              "trainer.log_every_n_steps=1", "+trainer.enable_progress_bar=false", "trainer.limit_val_batches=0",
              "exp_manager.create_checkpoint_callback=false", "~data.builtin_corpus", f"+data.train_dir={corpus}",
              "+data.file_glob=**/*.py", "data.val_fraction=0", "data.tokenizer.vocab_size=1000",
              f"+data.tokenizer.cache_dir={cache}", "data.global_batch_size=2", "data.micro_batch_size=1",
              f"model.model_config={_hf_dir('gqa_tp4_kv2_fused_xser')}/config.json", "model.encoder_seq_length=64",
              "distributed_strategy.tensor_model_parallel_size=4", "distributed_strategy.sequence_parallel=false",
              "distributed_strategy.kv_replicator=2", "exp_manager.checkpoint_callback_params.model_parallel_size=4",
              "model.optim.sched.warmup_steps=1"]
    hf_dir = str(tmp_path / "hf_start")
    start = f"+model.hf_weights_dir={_hf_dir('gqa_tp4_kv2_fused_xser')}"
    hf = _losses_of(_run(common + [f"exp_manager.explicit_log_dir={hf_dir}", start]), hf_dir)
    nxd_dir = str(tmp_path / "nxd_start")
    out = _run(common + [f"exp_manager.explicit_log_dir={nxd_dir}",
                         f"++exp_manager.resume_from_checkpoint={_tag_dir('gqa_tp4_kv2_fused_xser')}",
                         "++model.weight_init_only=true"])
    nxd = _losses_of(out, nxd_dir)
    text = out.stdout + out.stderr
    assert "KV replicas (kv_replicator 2) laid out interleaved" in text
    # the converter wrote no markers: one warning per rank says so, and no second one about the manifest
    assert text.count("has no 'done' marker and no manifest") == 4 and "without verifying its files" not in text
    assert sorted(nxd) == sorted(hf) == [1, 2]
    for step in (1, 2):
        assert nxd[step] == pytest.approx(hf[step], rel=1e-6, abs=0), (step, nxd, hf)
