"""HF <-> nxd_lc Llama state-dict adapter: round trips, sharded files, per-rank slice reads, errors,
and build_llama_config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.models.hf_config import build_llama_config
from nxd_lc.models.llama import (
    LlamaForCausalLM,
    export_hf_state_dict,
    hf_adapter,
    load_hf_weights,
    save_hf_weights,
)

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

CONF = Path(__file__).resolve().parents[1] / "conf"


def _hf_model(tmp: Path, *, seed: int = 0, **kw: object) -> tuple[HFLlama, str]:
    """A tiny random HF Llama (random biases too, when enabled) saved to ``tmp``."""
    args: dict[str, object] = {
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    }
    args.update(kw)
    torch.manual_seed(seed)
    hf = HFLlama._from_config(LlamaConfig(**args), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:  # make them non-trivial
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    hf.save_pretrained(tmp)
    return hf, str(tmp)


def _assert_same_state(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def test_load_export_save_roundtrip_tp1(tmp_path: Path) -> None:
    hf, ckpt = _hf_model(tmp_path / "hf")
    model = LlamaForCausalLM(build_llama_config(ckpt))
    load_hf_weights(model, ckpt)
    _assert_same_state(export_hf_state_dict(model), hf.state_dict())
    save_hf_weights(model, tmp_path / "out")
    back = HFLlama.from_pretrained(tmp_path / "out", attn_implementation="eager").float()
    _assert_same_state(back.state_dict(), hf.state_dict())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 97


def test_export_drops_the_source_auto_map(tmp_path: Path) -> None:
    """A source config.json whose ``auto_map`` maps model classes to code (loadable: nxd_lc builds its own Llama)
    exports without it: the export holds transformers' LlamaForCausalLM, and the mapped code files are not copied."""
    _, ckpt = _hf_model(tmp_path / "hf")
    raw = json.loads((Path(ckpt) / "config.json").read_text())
    raw["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (Path(ckpt) / "config.json").write_text(json.dumps(raw))
    model = LlamaForCausalLM(build_llama_config(ckpt))
    load_hf_weights(model, ckpt)
    save_hf_weights(model, tmp_path / "out")
    assert "auto_map" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert "auto_map" in model.config.to_dict()  # the run's own config is left as read


def test_sharded_save_writes_index_and_loads(tmp_path: Path) -> None:
    hf, ckpt = _hf_model(tmp_path / "hf")
    model = LlamaForCausalLM(build_llama_config(ckpt))
    load_hf_weights(model, ckpt)
    save_hf_weights(model, tmp_path / "sharded", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    index = json.loads((tmp_path / "sharded" / hf_adapter.INDEX_FILE).read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    fresh = LlamaForCausalLM(build_llama_config(ckpt))
    load_hf_weights(fresh, tmp_path / "sharded")
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    back = HFLlama.from_pretrained(tmp_path / "sharded").float()
    _assert_same_state(back.state_dict(), hf.state_dict())


def test_tied_embeddings_roundtrip(tmp_path: Path) -> None:
    hf, ckpt = _hf_model(tmp_path / "hf", tie_word_embeddings=True)
    model = LlamaForCausalLM(build_llama_config(ckpt))
    load_hf_weights(model, ckpt)
    assert model.lm_head.weight is model.embed_tokens.weight
    exported = export_hf_state_dict(model)
    assert "lm_head.weight" not in exported
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=2e-5, rtol=0)


def test_missing_and_mismatched_tensors_are_named(tmp_path: Path) -> None:
    _, ckpt = _hf_model(tmp_path / "hf")
    state = load_file(str(Path(ckpt) / "model.safetensors"))
    config = build_llama_config(ckpt)
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "missing").mkdir()
    save_file(missing, str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_hf_weights(LlamaForCausalLM(config), tmp_path / "missing")
    bad = dict(state)
    bad["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(32, 16)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"o_proj\.weight.*bad\.safetensors.*\(32, 16\)"):
        load_hf_weights(LlamaForCausalLM(config), tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_weights(LlamaForCausalLM(config), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_weights(LlamaForCausalLM(config), tmp_path / "empty")


def test_build_llama_config_overrides_and_errors(tmp_path: Path) -> None:
    big = build_llama_config(str(CONF / "llama3_8B_hf_config.json"))
    assert (big.hidden_size, big.num_hidden_layers, big.num_key_value_heads, big.vocab_size) == (4096, 32, 8, 128256)
    cfg = build_llama_config(str(CONF / "llama3_8B_hf_config.json"), {
        "num_layers": 2, "hidden_size": 512, "max_position_embeddings": 32768, "encoder_seq_length": 32768,
        "rope_theta": 1e6})
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.max_position_embeddings) == (2, 512, 16, 32768)
    from nxd_lc.models.common.rope import rope_spec_from_config

    assert rope_spec_from_config(cfg).rope_theta == 1e6
    assert build_llama_config(str(CONF / "llama3_8B_hf_config.json"), {"num_layers": -1}).num_hidden_layers == 32
    with pytest.raises(ValueError, match="model.foo is not a model-config override"):
        build_llama_config(str(CONF / "tiny_llama_config.json"), {"foo": 1})
    with pytest.raises(ValueError, match="encoder_seq_length \\(8192\\) exceeds max_position_embeddings \\(4096\\)"):
        build_llama_config(str(CONF / "tiny_llama_config.json"), {"encoder_seq_length": 8192})
    with pytest.raises(ValueError, match="model.num_layers must be a positive integer"):
        build_llama_config(str(CONF / "tiny_llama_config.json"), {"num_layers": 0})
    (tmp_path / "broken.json").write_text('{"vocab_size": 10,\n oops}')
    with pytest.raises(ValueError, match="broken.json is not valid JSON \\(line 2"):
        build_llama_config(str(tmp_path / "broken.json"))
    with pytest.raises(FileNotFoundError, match="model.model_config"):
        build_llama_config(str(tmp_path / "absent.json"))
    bad_heads = json.loads((CONF / "tiny_llama_config.json").read_text()) | {"hidden_size": 250}
    (tmp_path / "heads.json").write_text(json.dumps(bad_heads))
    with pytest.raises(ValueError, match="heads.json is not a valid Llama config"):
        build_llama_config(str(tmp_path / "heads.json"))
    yarn = json.loads((CONF / "tiny_llama_config.json").read_text())
    yarn["rope_scaling"] = {"rope_type": "ntk", "factor": 4.0}
    (tmp_path / "yarn.json").write_text(json.dumps(yarn))
    with pytest.raises(ValueError, match="rope_type: 'ntk' is not supported"):
        build_llama_config(str(tmp_path / "yarn.json"))


def test_tiny_demo_config_size() -> None:
    model = LlamaForCausalLM(build_llama_config(str(CONF / "tiny_llama_config.json")))
    num = sum(p.numel() for p in model.parameters())
    assert 2e6 < num < 10e6, num
    assert model(torch.randint(0, 8192, (1, 4))).shape == (1, 4, 8192)


def _tp2_worker(rank: int, world: int, ckpt: str, out_dir: str, ids: torch.Tensor, ref_logits: torch.Tensor,
                ref_state: dict[str, torch.Tensor]) -> None:
    """TP=2, 1 KV head (kv_replicator=2): read only slices, shard shapes, logits, export, save."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, kv_replicator=2)
    reads: list[tuple[str, tuple[int, ...]]] = []
    original = hf_adapter.SafetensorsCheckpoint.read

    def spy(self: hf_adapter.SafetensorsCheckpoint, name: str, *args: object) -> torch.Tensor:
        t = original(self, name, *args)
        reads.append((name, tuple(t.shape)))
        return t

    hf_adapter.SafetensorsCheckpoint.read = spy  # type: ignore[method-assign]
    model = LlamaForCausalLM(build_llama_config(ckpt), kv_replicator=2, sequence_parallel=True)
    load_hf_weights(model, ckpt)
    got = dict(reads)
    # q: 2 of 4 heads (hd 8); k/v: this rank's one KV head, read once; row layers: half the columns
    assert got["model.layers.0.self_attn.q_proj.weight"] == (16, 32)
    assert got["model.layers.0.self_attn.k_proj.weight"] == (8, 32)
    assert got["model.layers.0.self_attn.v_proj.bias"] == (8,)
    assert got["model.layers.0.self_attn.o_proj.weight"] == (32, 16)
    assert got["model.layers.0.mlp.gate_proj.weight"] == (24, 32)
    assert got["model.layers.0.mlp.down_proj.weight"] == (32, 24)
    assert got["model.embed_tokens.weight"] == ((49, 32) if rank == 0 else (48, 32))
    assert got["model.norm.weight"] == (32,)
    full_numel = sum(t.numel() for t in ref_state.values())
    assert sum(torch.Size(s).numel() for _, s in reads) < 0.6 * full_numel
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.weight_qkv.shape == (16 + 2 * 8, 32)
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (48, 32)
    assert model.embed_tokens.weight.shape == (49, 32)
    assert torch.equal(attn.o_proj.weight, ref_state["model.layers.0.self_attn.o_proj.weight"][:, rank * 16:][:, :16])
    logits = collectives.all_gather(model(ids).detach(), -1, parallel_state.get_tensor_model_parallel_group())
    torch.testing.assert_close(logits[..., :97], ref_logits, atol=2e-5, rtol=0)
    _assert_same_state(export_hf_state_dict(model), ref_state)
    assert (len(export_hf_state_dict(model, rank0_only=True)) > 0) == (rank == 0)
    save_hf_weights(model, out_dir, dtype=torch.bfloat16)


@pytest.mark.distributed
def test_tp2_kv_replicated_slice_loading_and_export(tmp_path: Path) -> None:
    hf, ckpt = _hf_model(tmp_path / "hf", num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        ref_logits = hf(ids).logits
    run_distributed(_tp2_worker, 2, ckpt, str(tmp_path / "out"), ids, ref_logits, hf.state_dict())
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    ref = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    _assert_same_state(saved, ref)


@pytest.mark.parametrize(("tensor", "bad", "dtype"), [
    ("model.layers.1.mlp.down_proj.weight", float("nan"), torch.float32),
    ("model.layers.0.self_attn.k_proj.weight", float("-inf"), torch.bfloat16),  # read into the fused q/k/v
    ("model.embed_tokens.weight", float("inf"), torch.float16),
])
def test_non_finite_hf_weights_are_refused_naming_file_and_tensor(tmp_path: Path, tensor: str, bad: float,
                                                                  dtype: torch.dtype) -> None:
    """A NaN / inf in an HF checkpoint is refused at load, naming the file and the tensor (issue 40, item 4: it
    loaded without a word, and the run stopped at step 1 with advice about the data and the learning rate)."""
    _, ckpt = _hf_model(tmp_path / "hf", num_hidden_layers=2)
    file = Path(ckpt) / "model.safetensors"
    state = {k: v.to(dtype) for k, v in load_file(file).items()}
    state[tensor].view(-1)[7] = bad
    save_file(state, file, metadata={"format": "pt"})
    model = LlamaForCausalLM(build_llama_config(ckpt))
    with pytest.raises(ValueError, match="NaN or infinite") as err:
        load_hf_weights(model, ckpt)
    assert repr(tensor) in str(err.value) and str(file) in str(err.value)
    assert "learning rate" not in str(err.value)


def test_non_finite_tensor_without_a_parameter_is_not_read(tmp_path: Path) -> None:
    """Only the tensors that are loaded are checked: a NaN in a layer beyond ``num_layers`` (skipped, logged) does
    not stop the load."""
    _, ckpt = _hf_model(tmp_path / "hf", num_hidden_layers=2)
    file = Path(ckpt) / "model.safetensors"
    state = load_file(file)
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, file, metadata={"format": "pt"})
    model = LlamaForCausalLM(build_llama_config(ckpt, {"num_layers": 1}))
    load_hf_weights(model, ckpt)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
