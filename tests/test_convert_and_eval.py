"""Checkpoint -> HF conversion (nxd_lc.app.convert, nxd_lc.cli.convert) and loss by position
(nxd_lc.eval.loss_by_position).

* A tiny Llama (vocab 97 -> padded to 98 at TP 2) is saved as an NxD xser checkpoint at TP=2 + sequence
  parallel by 2 gloo processes, converted there to an HF directory, and transformers' LlamaForCausalLM loaded
  from it gives the logits of the TP=2 model. The CLI does the same under torchrun (slow).
* The CLI's boolean flags parse strictly (NxDT's ``type=bool`` defect), and bad checkpoints / TP mismatches fail
  with clear errors before any process group exists.
* loss_by_position equals a direct per-token cross-entropy bucketed by position, single-process and at CP=2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from dist_utils import run_distributed, shard_files
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.app import convert
from nxd_lc.app.validation import load_config
from nxd_lc.checkpoint import model_shards, sharded
from nxd_lc.cli import convert as convert_cli
from nxd_lc.data.packing import packed_document_ids
from nxd_lc.distributed import collectives
from nxd_lc.distributed import parallel_state as ps
from nxd_lc.eval.loss_by_position import bucket_sums, format_table, loss_by_position, parse_edges
from nxd_lc.models.llama.model import LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
VOCAB, B, S, EOS = 97, 2, 24, 5
TAG = "step=3"


def _model_json() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False}


def _raw_config(tmp: Path, tp: int) -> dict:
    """A run config for the tiny model (data: a small text dir and a tiny HF tokenizer dir)."""
    return {
        "name": "tiny_convert",
        "trainer": {"devices": tp, "num_nodes": 1, "max_steps": 1},
        "exp_manager": {"checkpoint_callback_params": {"model_parallel_size": tp}},
        "distributed_strategy": {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1},
        "data": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 16, "train_dir": str(tmp / "text"),
                 "val_fraction": 0.0, "tokenizer": {"type": str(tmp / "tokenizer")}},
        "model": {"model_config": str(tmp / "config.json"), "encoder_seq_length": 16},
        "precision": {"type": "fp32"},
    }


def _prepare(tmp: Path, tp: int = 2) -> None:
    """config.json, a text dir, a tiny byte-level BPE tokenizer dir and conf/tiny.yaml under ``tmp``."""
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    (tmp / "config.json").write_text(json.dumps(_model_json()))
    (tmp / "text").mkdir(exist_ok=True)
    text = "def hello(world):\n    return world + 1\n" * 20
    (tmp / "text" / "a.txt").write_text(text)
    train_bytelevel_bpe([text], 300).save_pretrained(str(tmp / "tokenizer"))
    (tmp / "conf").mkdir(exist_ok=True)
    (tmp / "conf" / "tiny.yaml").write_text(yaml.safe_dump(_raw_config(tmp, tp)))


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, 16), generator=torch.Generator().manual_seed(3))


def _save_and_convert_worker(rank: int, world: int, tmp: str) -> None:
    tmp_p = Path(tmp)
    cfg = load_config(_raw_config(tmp_p, 2))
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(1)
    model = convert.build_model(cfg)  # the training job's builder: TP=2 + SP, fused QKV
    with torch.no_grad():  # move away from the seeded init so only the checkpoint can explain the weights
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
        model._zero_padded_embedding_rows()
        logits = collectives.all_gather(model(_ids()), dim=-1, group=ps.get_tensor_model_parallel_group())
    state = {f"model.{k}": v for k, v in model.state_dict().items()}  # the LightningModule's keys
    sharded.save_checkpoint(str(tmp_p / "ckpt"), TAG, model_state=state, optim_state=None, user_content=None,
                            dp_rank=0, tp_rank=rank, pp_rank=0, is_global_zero=rank == 0, write_model=True,
                            write_optim=False, use_xser=True, step=3)
    out = convert.convert_checkpoint_to_hf(cfg, str(tmp_p / "ckpt"), str(tmp_p / "hf"))  # root -> newest tag
    assert out == str(tmp_p / "hf")
    if rank == 0:
        torch.save(logits[..., :VOCAB].clone(), tmp_p / "ours.pt")
    ps.destroy_model_parallel()
    _cp_eval(rank, str(tmp_p / "cp.json"))  # reuse the two processes for the CP=2 evaluation test


def _hf_logits(hf_dir: Path) -> torch.Tensor:
    model = HFLlama.from_pretrained(str(hf_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        return model(_ids()).logits


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("convert")
    _prepare(tmp)
    run_distributed(_save_and_convert_worker, 2, str(tmp))
    return tmp


@pytest.mark.compat
@pytest.mark.distributed
def test_tp2_checkpoint_converts_to_hf_with_equal_logits(converted: Path) -> None:
    hf = converted / "hf"
    names = sorted(os.listdir(hf))
    assert {"config.json", "model.safetensors", "tokenizer.json", model_shards.PROVENANCE_FILE} <= set(names)
    assert not [n for n in os.listdir(converted) if n.startswith(".hf.partial")]  # staging dir renamed away
    assert json.loads((hf / "config.json").read_text())["vocab_size"] == VOCAB  # padding cut back
    record = json.loads((hf / model_shards.PROVENANCE_FILE).read_text())
    assert record["step"] == 3 and record["tensor_model_parallel_size"] == 2
    ours = torch.load(converted / "ours.pt")
    theirs = _hf_logits(hf)
    assert theirs.shape == ours.shape == (B, 16, VOCAB)
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)


def test_boolean_flags_parse_strictly() -> None:
    parse = convert_cli.build_arg_parser().parse_args
    base = ["--config-name", "x", "--checkpoint", "c", "--output", "o"]
    a = parse(base)
    assert (a.overwrite, a.save_tokenizer, a.load_xser) == (False, True, None)
    a = parse([*base, "--overwrite", "--save_tokenizer", "False", "--load_xser", "True"])
    assert (a.overwrite, a.save_tokenizer, a.load_xser) == (True, False, True)
    a = parse([*base, "--overwrite=false", "--save-tokenizer=0", "--load-xser", "auto", "k=v"])
    assert (a.overwrite, a.save_tokenizer, a.load_xser, a.overrides) == (False, False, None, ["k=v"])
    for text, value in [("YES", True), ("on", True), ("1", True), ("no", False), ("Off", False)]:
        assert convert_cli.parse_bool(text) is value
    with pytest.raises(SystemExit):
        parse([*base, "--overwrite", "maybe"])


@pytest.mark.compat
def test_cli_reports_bad_checkpoints_before_starting(converted: Path, capsys: pytest.CaptureFixture) -> None:
    conf, ckpt = str(converted / "conf"), converted / "ckpt"

    def run(checkpoint: Path, *extra: str) -> str:
        argv = ["--config-name", "tiny", "--config-dir", conf, "--checkpoint", str(checkpoint),
                "--output", str(converted / "unused"), *extra]
        assert convert_cli.main(argv) == 2
        return capsys.readouterr().err

    assert "does not exist" in run(ckpt / "step=9") and TAG in run(ckpt / "step=9")
    err = run(ckpt / TAG, "distributed_strategy.tensor_model_parallel_size=1", "trainer.devices=1",
              "exp_manager.checkpoint_callback_params.model_parallel_size=1")
    assert "TP mismatch" in err and "tensor_model_parallel_size=2" in err
    assert "--nproc_per_node=2" in run(ckpt / TAG)  # config TP 2, but one process launched
    assert not dist_initialized()


def dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def test_incomplete_checkpoint_and_missing_shard(tmp_path: Path) -> None:
    tag_dir = tmp_path / "t"
    (tag_dir / "model").mkdir(parents=True)
    (tag_dir / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no 'done' marker"):
        model_shards.resolve_checkpoint(str(tag_dir))
    (tag_dir / "done").write_text("1")
    assert model_shards.resolve_checkpoint(str(tag_dir)) == (str(tmp_path), "t")
    with pytest.raises(FileNotFoundError, match=r"\(TP rank, PP rank\) \[\(0, 0\)\]"):
        model_shards.checkpoint_tp_size(str(tag_dir))
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        model_shards.resolve_checkpoint(str(tmp_path / "t" / "model"))
    model_shards.check_output(str(tmp_path / "new"), overwrite=False)  # missing: fine
    with pytest.raises(ValueError, match="--overwrite true"):
        model_shards.check_output(str(tmp_path), overwrite=False)
    model_shards.check_output(str(tmp_path), overwrite=True)
    with pytest.raises(ValueError, match="is a file"):
        model_shards.check_output(str(tag_dir / "done"), overwrite=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_cli_under_torchrun(converted: Path) -> None:
    out = converted / "hf_cli"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "nxd_lc.cli.convert", "--config-name", "tiny", "--config-dir", str(converted / "conf"),
           "--checkpoint", str(converted / "ckpt" / TAG), "--output", str(out), "--save-tokenizer", "false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote HF model" in proc.stdout
    assert not (out / "tokenizer.json").exists()
    torch.testing.assert_close(_hf_logits(out), torch.load(converted / "ours.pt"), atol=2e-5, rtol=1e-5)


# ---- loss by position ---------------------------------------------------------------------------------------
def _packed_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        ids = torch.randint(6, VOCAB, (B, S), generator=g)
        ids[0, [4, 15]] = EOS  # three documents in row 0, one in row 1
        pos, seg = packed_document_ids(ids, EOS)
        labels = torch.randint(0, VOCAB, (B, S), generator=g)
        labels[ids == EOS] = -100
        labels[1, -3:] = -100
        out.append({"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg})
    return out


def _tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in _model_json().items() if k != "architectures"})).eval()


def _direct(model: LlamaForCausalLM, batches: list[dict], edges: list[int]) -> dict[str, tuple[float, int]]:
    """Per-token cross-entropy with torch, bucketed with a Python loop over every token."""
    sums = [0.0] * (len(edges) - 1)
    counts = [0] * (len(edges) - 1)
    with torch.no_grad():
        for bt in batches:
            logits = model(bt["input_ids"], bt["position_ids"], bt["segment_ids"])
            ce = F.cross_entropy(logits.flatten(0, 1), bt["labels"].flatten(), reduction="none", ignore_index=-100)
            for t, (p, lab) in enumerate(zip(bt["position_ids"].flatten().tolist(), bt["labels"].flatten().tolist())):
                for k in range(len(edges) - 1):
                    if lab != -100 and edges[k] <= p < edges[k + 1]:
                        sums[k] += float(ce[t])
                        counts[k] += 1
    return {f"[{lo}, {hi})": (s / n, n) for lo, hi, s, n in zip(edges, edges[1:], sums, counts)}


@pytest.mark.compat
@pytest.mark.parametrize("edges", [[0, 4, 10, 24], [2, 6, 12]])
def test_loss_by_position_matches_direct_computation(edges: list[int]) -> None:
    model, batches = _tiny_model(), _packed_batches()
    result = loss_by_position(model, batches, edges)
    expected = _direct(model, batches, edges)
    assert list(result["buckets"]) == list(expected)
    for label, (loss, n) in expected.items():
        got = result["buckets"][label]
        assert got["num_tokens"] == n > 0
        assert got["loss"] == pytest.approx(loss, rel=1e-5)
    total = sum(n for _, n in expected.values())
    assert result["overall"]["num_tokens"] == total
    assert result["overall"]["loss"] == pytest.approx(sum(lo * n for lo, n in expected.values()) / total, rel=1e-5)
    table = format_table(result, "tiny")
    assert table.splitlines()[0] == "tiny" and all(label in table for label in expected)


@pytest.mark.compat
def test_bucket_sums_and_edges() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    labels = torch.tensor([[1, -100, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 9]])
    sums, counts = bucket_sums(loss, labels, pos, [0, 2, 9])
    assert sums.tolist() == [1.0, 3.0] and counts.tolist() == [1, 1]  # position 9 is outside [0, 9)
    assert parse_edges("0, 2048,8192") == [0, 2048, 8192]
    for bad in ("0", "0,0", "4,2", "-1,3", "a,b"):
        with pytest.raises(ValueError, match="--edges"):
            parse_edges(bad)
    empty = loss_by_position(_tiny_model(), [], [0, 4])
    assert empty["buckets"]["[0, 4)"]["num_tokens"] == 0


def _cp_eval(rank: int, out: str) -> None:
    """loss_by_position of the tiny model at CP=2 (ring), written to ``out`` by rank 0."""
    from nxd_lc.context import set_context_parallel_algo

    ps.initialize_model_parallel(context_parallel_size=2)
    set_context_parallel_algo("ring")
    result = loss_by_position(_tiny_model(), _packed_batches(), [0, 4, 10, 24], context_parallel_algo="ring")
    if rank == 0:
        Path(out).write_text(json.dumps(result))


@pytest.mark.compat
@pytest.mark.distributed
def test_loss_by_position_under_context_parallelism(converted: Path) -> None:
    got = json.loads((converted / "cp.json").read_text())
    ref = loss_by_position(_tiny_model(), _packed_batches(), [0, 4, 10, 24])
    assert got["overall"]["num_tokens"] == ref["overall"]["num_tokens"] > 0
    for label, r in ref["buckets"].items():
        assert got["buckets"][label]["num_tokens"] == r["num_tokens"]
        assert got["buckets"][label]["loss"] == pytest.approx(r["loss"], rel=1e-5)


@pytest.mark.compat
def test_yarn_continuation_config_is_valid() -> None:
    from nxd_lc.models.common.rope import rope_spec_from_config
    from nxd_lc.models.hf_config import build_llama_config

    cfg = convert.compose_run_config("cpu_tiny_llama_yarn_config", str(REPO / "conf"))
    ds, rope = cfg.distributed_strategy, cfg.model.hf_config_overrides["rope_scaling"]
    assert (ds.tensor_model_parallel_size, ds.context_parallel_size, ds.context_parallel_algo) == (1, 2, "ring")
    assert cfg.data.seq_length == 8192 and not cfg.data.cross_document_attention
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4 and rope["original_max_position_embeddings"] == 2048
    hf = build_llama_config(str(REPO / cfg.model.model_config), {"max_position_embeddings": 8192},
                            hf_config_overrides=cfg.model.hf_config_overrides)
    spec = rope_spec_from_config(hf)
    assert spec.rope_type == "yarn" and hf.rope_scaling["factor"] == 4


@pytest.mark.compat
def test_tp1_yarn_checkpoint_converts_in_process(tmp_path: Path) -> None:
    """TP=1 needs no process group; the YaRN rope_scaling of hf_config_overrides reaches config.json and
    transformers' YaRN gives our logits (positions 0..15 run past original_max_position_embeddings 8)."""
    _prepare(tmp_path, tp=1)
    raw = _raw_config(tmp_path, 1)
    raw["model"]["hf_config_overrides"] = {"rope_scaling": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 8,
        "truncate": True, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}}
    cfg = load_config(raw)
    ps.initialize_model_parallel()
    try:
        torch.manual_seed(2)
        model = convert.build_model(cfg).eval()
        assert model.rotary_emb.spec.rope_type == "yarn"
        with torch.no_grad():
            ours = model(_ids())
        state = {f"model.{k}": v for k, v in model.state_dict().items()}
        sharded.save_checkpoint(str(tmp_path / "ckpt"), TAG, model_state=state, optim_state=None, user_content=None,
                                dp_rank=0, tp_rank=0, pp_rank=0, is_global_zero=True, write_model=True,
                                write_optim=False, use_xser=False, step=3)
    finally:
        ps.destroy_model_parallel()
    convert.convert_checkpoint_to_hf(cfg, str(tmp_path / "ckpt" / TAG), str(tmp_path / "hf"), save_tokenizer=False)
    rope = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = rope.get("rope_scaling") or rope.get("rope_parameters")
    assert rope["rope_type"] == "yarn" and rope["factor"] == 2.0
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), ours, atol=2e-5, rtol=1e-5)
    assert not ps.model_parallel_is_initialized()


# ------------------------------------------------------------------ NxD converter vocabulary: full state <-> NxD


def _round_trip_worker(rank: int, world: int, tmp: str, xser: bool) -> None:
    t = Path(tmp)
    conf = ["--config-name", "tiny", "--config-dir", str(t / "conf")]
    assert convert_cli.main(conf + ["--convert_from_full_state", "true", "--input_dir", str(t / "hf"), "--output_dir",
                                str(t / "ck"), "--tp_size", "2", "--pp_size", "2", "--save_xser", str(xser).lower(),
                                "--kv_size_multiplier", "1", "--fuse_qkv", "true", "--qkv_linear", "true"]) == 0
    collectives.barrier()
    assert convert_cli.main(conf + ["--convert_to_full_state", "--input_dir", str(t / "ck" / "step=0"), "--output_dir",
                                str(t / "hf2"), "--tp_size", "2", "--pp_size", "2", "--save_tokenizer", "false",
                                "--load_xser", str(xser).lower(), "++trainer.devices=4",
                                "++exp_manager.checkpoint_callback_params.model_parallel_size=4"]) == 0


@pytest.mark.lane1_only  # end-to-end; the torch-2.9 lane covers its parts in unit-level tests
@pytest.mark.slow
@pytest.mark.parametrize("xser", [False, True])
def test_full_state_to_tp2_pp2_checkpoint_and_back_is_bit_exact(tmp_path: Path, xser: bool) -> None:
    from safetensors.torch import load_file

    _prepare(tmp_path, tp=2)
    torch.manual_seed(11)
    HFLlama(LlamaConfig(**_model_json())).save_pretrained(str(tmp_path / "hf"))
    run_distributed(_round_trip_worker, 2, str(tmp_path), xser)
    ck = tmp_path / "ck" / "step=0"
    names = shard_files(ck / "model")
    assert names == [sharded.checkpoint_file_name(0, t, p) for t in (0, 1) for p in (0, 1)]
    assert any(n.endswith(".tensors") for n in os.listdir(ck / "model")) == xser  # --save_xser is obeyed
    stage0 = sharded.load_checkpoint(str(tmp_path / "ck"), "step=0", dp_rank=0, tp_rank=0, pp_rank=0,
                                     load_optim=False)[0]
    stage1 = sharded.load_checkpoint(str(tmp_path / "ck"), "step=0", dp_rank=0, tp_rank=0, pp_rank=1,
                                     load_optim=False)[0]
    assert any(k.startswith("model.layers.0.") for k in stage0) and not any(k.startswith("model.layers.1.")
                                                                             for k in stage0)
    assert "model.embed_tokens.weight" in stage0 and "model.lm_head.weight" in stage1
    original, back = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(
        str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(back) == sorted(original)
    for k, v in original.items():
        assert torch.equal(back[k], v), k  # bit for bit


def test_converter_direction_and_tp_size_flags_are_checked(capsys: pytest.CaptureFixture) -> None:
    base = ["--config-name", "x", "--input_dir", "a", "--output_dir", "b"]
    for extra, message in ((["--convert_from_full_state", "--convert_to_full_state"], "choose one direction"),
                           (["--convert_to_full_state", "false"], "needs --convert_from_full_state true"),
                           (["--tp_size", "4"], "--tp_size 4: launch one process per TP rank")):
        with pytest.raises(SystemExit) as e:
            convert_cli.main(base + extra)
        assert e.value.code == 2 and message in capsys.readouterr().err
    args = convert_cli.build_arg_parser().parse_args(base + ["--save_xser", "False", "--fuse_qkv", "no"])
    assert args.save_xser is False and args.fuse_qkv is False  # not NxDT's type=bool (where "False" is True)
