"""RoPE scaling: parity with transformers' modeling_rope_utils for every Llama rope_type, config merging
(config.json rope_scaling + model.hf_config_overrides), validation messages, the ${div:...} factor, the
no-op warning, fp32 buffers, CP-consistent dynamic/longrope lengths, and a model forward per rope_type."""

from __future__ import annotations

import copy
import itertools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_distributed

from nxd_lc.models.common.rope import (
    ROPE_INV_FREQ_FNS,
    YARN_REQUIRED_FIELDS,
    RopeSpec,
    RotaryEmbedding,
    rope_scaling_problems,
    rope_spec_from_config,
    warn_if_rope_scaling_is_noop,
)

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

# transformers, OmegaConf and the model are imported inside the tests: the spawned CP workers import this
# module and need only torch + rope.py (importing transformers costs seconds per process on 2 cores).
CONF = Path(__file__).resolve().parents[1] / "conf"
MAX_POS = 4096


def _hf_rotary(config: Any) -> Any:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config)


def _hf_config(rope_scaling: dict[str, Any] | None, head_dim: int = 64, theta: float = 10000.0,
               max_pos: int = MAX_POS) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim,
                       intermediate_size=8, num_hidden_layers=1, vocab_size=16, max_position_embeddings=max_pos,
                       rope_theta=theta, rope_scaling=copy.deepcopy(rope_scaling))


def _hf_inv_freq(config: Any, seq_len: int | None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


def _assert_parity(scaling: dict[str, Any] | None, seq_lens: tuple[int | None, ...] = (None,), **cfg_kw: Any) -> None:
    """inv_freq (rtol 1e-6) and attention scaling (1e-6) equal transformers' for each seq_len."""
    config = _hf_config(scaling, **cfg_kw)
    spec = rope_spec_from_config(config)
    for seq_len in seq_lens:
        ours, our_scale = ROPE_INV_FREQ_FNS[spec.rope_type](spec, seq_len)
        ref, ref_scale = _hf_inv_freq(config, seq_len)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0, msg=f"{scaling} seq_len={seq_len}")
        assert abs(our_scale - float(ref_scale)) <= 1e-6, (scaling, our_scale, ref_scale)


def _yarn(**kw: Any) -> dict[str, Any]:
    base = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "truncate": True, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}
    return {**base, **kw}


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_default_linear_dynamic_parity(head_dim: int, theta: float) -> None:
    _assert_parity(None, head_dim=head_dim, theta=theta)
    for factor in (1.0, 2.0, 8.0):
        _assert_parity({"rope_type": "linear", "factor": factor}, head_dim=head_dim, theta=theta)
    for factor in (1.5, 2.0, 8.0):  # lengths below, at and above max_position_embeddings
        _assert_parity({"rope_type": "dynamic", "factor": factor}, (None, 100, MAX_POS, MAX_POS + 1, 3 * MAX_POS),
                       head_dim=head_dim, theta=theta)


@pytest.mark.parametrize("head_dim", [32, 128])
def test_yarn_parity_grid(head_dim: int) -> None:
    grid = itertools.product((1.0, 2.0, 4.0, 16.0), (256, 2048), ((32, 1), (16, 2), (64, 0.5)), (True, False),
                             ((1.0, 0.0), (0.707, 1.0), (1.0, 1.0), (0.0, 0.0)), (10000.0, 1e6))
    for factor, orig, (fast, slow), truncate, (mscale, mscale_all_dim), theta in grid:
        scaling = _yarn(factor=factor, original_max_position_embeddings=orig, beta_fast=fast, beta_slow=slow,
                        truncate=truncate, mscale=mscale, mscale_all_dim=mscale_all_dim, rope_theta=theta)
        _assert_parity(scaling, (None, 8 * orig), head_dim=head_dim, theta=theta)
    _assert_parity(_yarn(attention_factor=0.8), head_dim=head_dim)  # explicit attention factor
    # HF defaults (config.json style): no beta/mscale/truncate; factor None -> max_pos / orig
    _assert_parity({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, head_dim=head_dim)
    _assert_parity({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024}, head_dim=head_dim)


def test_llama3_parity_grid() -> None:
    grid = itertools.product((1.0, 4.0, 8.0, 32.0), ((1.0, 4.0), (2.0, 8.0), (0.5, 3.0)), (512, 1024),
                             (10000.0, 500000.0), (32, 128))
    for factor, (low, high), orig, theta, head_dim in grid:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": orig}
        _assert_parity(scaling, head_dim=head_dim, theta=theta)


def _longrope(head_dim: int, seed: int, **kw: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    short = (1.0 + torch.rand(head_dim // 2, generator=g)).tolist()
    long = (1.0 + 30 * torch.rand(head_dim // 2, generator=g)).tolist()
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": 1024, **kw}


@pytest.mark.parametrize("head_dim", [32, 96])
def test_longrope_parity_both_regimes(head_dim: int) -> None:
    for seed, extra in enumerate(({}, {"factor": 4.0}, {"factor": 1.0}, {"attention_factor": 1.3})):
        for theta in (10000.0, 250000.0):
            # None and <= orig select short_factor; > orig selects long_factor
            _assert_parity(_longrope(head_dim, seed, **extra), (None, 10, 1024, 1025, 8192), head_dim=head_dim,
                           theta=theta)


def _cos_sin_parity(config: Any, lengths: list[int]) -> None:
    """Our RotaryEmbedding and HF's LlamaRotaryEmbedding fed the same sequence of lengths (stateful HF)."""
    ours, ref = RotaryEmbedding(rope_spec_from_config(config)), _hf_rotary(config)
    x = torch.zeros(1, dtype=torch.float32)
    for length in lengths:
        pos = torch.arange(length).unsqueeze(0)
        cos, sin = ours(pos)
        ref_cos, ref_sin = ref(x, pos)
        assert cos.dtype == torch.float32
        torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=0, msg=f"length {length}")
        torch.testing.assert_close(sin, ref_sin, atol=2e-6, rtol=0, msg=f"length {length}")


def test_cos_sin_match_hf_module_for_every_type() -> None:
    """The HF module's forward (dynamic's grow/reset state machine, longrope's length switch) included."""
    lengths = [64, 300, 200, 600, 100, 700]  # max_position_embeddings 256 below
    scalings = [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 3.0},
                _yarn(factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0),
                {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 64},
                _longrope(32, 0, original_max_position_embeddings=256, factor=4.0)]
    for scaling in scalings:
        _cos_sin_parity(_hf_config(scaling, head_dim=32, max_pos=256), lengths)


def test_frequencies_stay_fp32_under_dtype_casts() -> None:
    config = _hf_config(_longrope(32, 1), head_dim=32)
    rope = RotaryEmbedding(rope_spec_from_config(config))
    ref_short, ref_long = rope.inv_freq.clone(), rope.long_inv_freq.clone()
    rope.to(torch.bfloat16).half()
    assert rope.inv_freq.dtype == rope.long_inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq, ref_short, rtol=0, atol=0)
    rope.to_empty(device="cpu")  # non-persistent buffers are refilled from the fp32 masters
    torch.testing.assert_close(rope.long_inv_freq, ref_long, rtol=0, atol=0)
    assert "inv_freq" not in rope.state_dict()


def _cp_dynamic_worker(rank: int, world_size: int) -> None:
    """CP=2 head-tail shards: dynamic/longrope use the full sequence's length, so cos/sin equal the slice."""
    from nxd_lc.distributed import parallel_state

    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    seq, chunk = 64, 64 // (2 * world_size)
    full = torch.arange(seq).unsqueeze(0)
    shard = torch.cat([full[:, rank * chunk:(rank + 1) * chunk],
                       full[:, (2 * world_size - 1 - rank) * chunk:(2 * world_size - rank) * chunk]], dim=1)
    for rope_type, params in (("dynamic", {"factor": 2.0}), ("longrope", _longrope(16, 2, factor=2.0))):
        # rank 1 holds positions 16..47: its local length 48 < 50 < 64 would pick unscaled/short frequencies
        params = {k: v for k, v in params.items() if k != "rope_type"} | {"original_max_position_embeddings": 50}
        spec = RopeSpec(head_dim=16, rope_theta=10000.0, rope_type=rope_type, max_position_embeddings=50,
                        params=params)
        ref_cos, _ = RotaryEmbedding(spec)(full, seq_len=seq)
        cos, _ = RotaryEmbedding(spec)(shard)  # L all-reduced over CP
        expect = torch.cat([ref_cos[:, rank * chunk:(rank + 1) * chunk],
                            ref_cos[:, (2 * world_size - 1 - rank) * chunk:(2 * world_size - rank) * chunk]], dim=1)
        torch.testing.assert_close(cos, expect, rtol=0, atol=0)


@pytest.mark.distributed
@pytest.mark.slow
def test_dynamic_and_longrope_lengths_follow_the_full_sequence_under_cp() -> None:
    run_distributed(_cp_dynamic_worker, 2)


def test_yarn_missing_fields_listed_together() -> None:
    problems = rope_scaling_problems({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    assert len(problems) == 1, problems
    msg = problems[0]
    assert msg.startswith("model.hf_config_overrides.rope_scaling: rope_type 'yarn' requires every one of")
    assert msg.endswith("missing: rope_theta, truncate, beta_fast, beta_slow, mscale, mscale_all_dim"), msg
    assert rope_scaling_problems(_yarn()) == []
    everything_missing = rope_scaling_problems({"rope_type": "yarn"}, key="k")[0]
    assert everything_missing.endswith("missing: " + ", ".join(YARN_REQUIRED_FIELDS))
    # HF's rules for a config.json: yarn needs factor only
    assert rope_scaling_problems({"rope_type": "yarn", "factor": 4.0}, strict=False) == []


def test_rope_scaling_value_problems_name_the_key() -> None:
    key = "model.hf_config_overrides.rope_scaling"
    bad = _yarn(factor=0.5, truncate="yes", beta_fast=1, beta_slow=2, original_max_position_embeddings=10.5,
                mscale=-1.0, low_freq_factor=1.0)
    problems = rope_scaling_problems(bad)
    expected = [f"{key}: low_freq_factor not used by rope_type 'yarn'", f"{key}.factor: must be a number >= 1",
                f"{key}.truncate: must be true or false", f"{key}.original_max_position_embeddings: must be a positive",
                f"{key}.mscale: must be a number >= 0", f"{key}.beta_fast: must be greater than beta_slow"]
    for start in expected:
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)
    assert len(problems) == len(expected), problems
    llama3 = rope_scaling_problems({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                    "high_freq_factor": 1.0}, key="k")
    assert llama3 == ["k: rope_type 'llama3' requires factor, low_freq_factor, high_freq_factor, "
                      "original_max_position_embeddings; missing: original_max_position_embeddings",
                      "k.high_freq_factor: must be greater than low_freq_factor (1.0 <= 4.0)"]
    longrope = rope_scaling_problems(_longrope(32, 0, factor=0.9), key="k", head_dim=64)
    assert longrope == ["k.short_factor: must have head_dim / 2 = 32 entries, got 16",
                        "k.long_factor: must have head_dim / 2 = 32 entries, got 16",
                        "k.factor: must be a number >= 1, got 0.9"]
    assert rope_scaling_problems({"rope_type": "longrope"}, key="k") == [
        "k: rope_type 'longrope' requires short_factor, long_factor, original_max_position_embeddings; missing: "
        "short_factor, long_factor, original_max_position_embeddings"]
    assert rope_scaling_problems({"rope_type": "ntk"}, key="k")[0].startswith("k.rope_type: 'ntk' is not supported")
    assert rope_scaling_problems({"factor": 2.0}) == []  # partial override: rope_type from config.json
    assert rope_scaling_problems({"type": "linear", "factor": 2.0}) == []  # legacy spelling
    assert rope_scaling_problems([1, 2], key="k") == ["k: must be a mapping of RoPE scaling fields (rope_type, "
                                                      "factor, ...), got list"]


def _write_config(tmp_path: Path, **fields: Any) -> Path:
    raw = json.loads((CONF / "tiny_llama_config.json").read_text())
    raw.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    raw.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_config_json_rope_scaling_is_honoured(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    from nxd_lc.models.hf_config import build_llama_config

    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}  # Qwen-style, HF defaults
    config = build_llama_config(str(_write_config(tmp_path, rope_scaling=scaling, rope_theta=5e5)))
    spec = rope_spec_from_config(config)
    assert (spec.rope_type, spec.rope_theta, spec.params["factor"]) == ("yarn", 5e5, 4.0)
    hf = LlamaConfig.from_pretrained(tmp_path)
    torch.testing.assert_close(RotaryEmbedding(spec).inv_freq, _hf_inv_freq(hf, None)[0], rtol=1e-6, atol=0)
    # transformers 5.x format: rope_parameters with rope_theta inside
    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 123.0}
    spec = rope_spec_from_config(build_llama_config(str(_write_config(tmp_path, rope_parameters=params))))
    assert (spec.rope_type, spec.rope_theta, dict(spec.params)) == ("linear", 123.0, {"factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_scaling of .*config.json\.factor: must be a number >= 1"):
        build_llama_config(str(_write_config(tmp_path, rope_scaling={"rope_type": "linear", "factor": 0.5})))


def test_hf_config_overrides_merge(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from nxd_lc.models.hf_config import build_llama_config

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 128}
    path = str(_write_config(tmp_path, rope_scaling=llama3, rope_theta=5e5))
    spec = rope_spec_from_config(build_llama_config(path, hf_config_overrides={"rope_scaling": {"factor": 2.0}}))
    assert (spec.rope_type, spec.params["factor"], spec.params["high_freq_factor"]) == ("llama3", 2.0, 4.0)
    over = build_llama_config(path, {"encoder_seq_length": 1024}, hf_config_overrides={
        "rope_scaling": _yarn(rope_theta=1e6, original_max_position_embeddings=128), "max_position_embeddings": 1024})
    spec = rope_spec_from_config(over)
    assert (spec.rope_type, spec.rope_theta, over.max_position_embeddings) == ("yarn", 1e6, 1024)
    assert "low_freq_factor" not in spec.params  # another rope_type replaces the file's scaling fields
    longrope = OmegaConf.create({"rope_scaling": _longrope(16, 0)})  # DictConfig / ListConfig as Hydra gives them
    spec = rope_spec_from_config(build_llama_config(path, hf_config_overrides=longrope))
    assert spec.rope_type == "longrope" and spec.params["long_factor"] == list(longrope.rope_scaling.long_factor)
    spec = rope_spec_from_config(build_llama_config(path, hf_config_overrides={"rope_scaling": None}))
    assert (spec.rope_type, spec.rope_theta) == ("default", 5e5)
    with pytest.raises(ValueError, match="missing: rope_theta, truncate, beta_fast, beta_slow, mscale, mscale_all_dim"):
        build_llama_config(path, hf_config_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                       "original_max_position_embeddings": 128}})
    with pytest.raises(ValueError, match=r"model.rope_theta \(1000.0\) and .*rope_scaling.rope_theta \(1000000.0\)"):
        build_llama_config(path, {"rope_theta": 1000.0}, hf_config_overrides={"rope_scaling": _yarn(rope_theta=1e6)})
    with pytest.raises(ValueError, match="hf_config_overrides.rms_norm_epsilon: not a Llama config.json key; did you "
                                         "mean 'rms_norm_eps'"):
        build_llama_config(path, hf_config_overrides={"rms_norm_epsilon": 1e-6})
    with pytest.raises(ValueError, match=r"merged over .*\.short_factor: must have head_dim / 2 = 8 entries"):
        build_llama_config(path, hf_config_overrides={"rope_scaling": _longrope(32, 0)})


def test_div_interpolation_sets_the_factor(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from nxd_lc.app.validation import load_config
    from nxd_lc.models.hf_config import build_llama_config

    raw = OmegaConf.load(CONF / "cpu_tiny_llama_config.yaml")
    raw.data.seq_length = raw.model.encoder_seq_length = raw.model.max_position_embeddings = 8192
    raw.model.model_config = str(_write_config(tmp_path))
    raw.model.hf_config_overrides = {"rope_scaling": _yarn(
        original_max_position_embeddings=2048,
        factor="${div:${data.seq_length},${model.hf_config_overrides.rope_scaling.original_max_position_embeddings}}")}
    cfg = load_config(raw)
    assert cfg.model.hf_config_overrides["rope_scaling"]["factor"] == 4
    config = build_llama_config(cfg.model.model_config, {"max_position_embeddings": 8192},
                                hf_config_overrides=cfg.model.hf_config_overrides)
    spec = rope_spec_from_config(config)
    assert spec.params["factor"] == 4
    torch.testing.assert_close(RotaryEmbedding(spec).inv_freq, _hf_inv_freq(config, None)[0], rtol=1e-6, atol=0)


def test_noop_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nxd_lc.models.common.rope"):
        msg = warn_if_rope_scaling_is_noop(_hf_config(_yarn(factor=4.0)), 1024)
    assert msg is not None and "no-op at seq_length 1024 <= original_max_position_embeddings 1024" in msg
    assert "HF's YaRN formula is still applied" in msg and msg in caplog.text
    assert "equals unscaled RoPE exactly" in warn_if_rope_scaling_is_noop(_hf_config(_yarn(factor=1.0)), 512)
    assert warn_if_rope_scaling_is_noop(_hf_config(_yarn(factor=4.0)), 4096) is None
    assert "dynamic is a no-op" in warn_if_rope_scaling_is_noop(
        _hf_config({"rope_type": "dynamic", "factor": 2.0}), MAX_POS)
    assert warn_if_rope_scaling_is_noop(_hf_config(None), 64) is None
    # factor 1 really is unscaled RoPE: same frequencies, attention factor 1
    inv, scale = ROPE_INV_FREQ_FNS["yarn"](rope_spec_from_config(_hf_config(_yarn(factor=1.0))), None)
    torch.testing.assert_close(inv, _hf_inv_freq(_hf_config(None), None)[0], rtol=1e-6, atol=0)
    assert scale == 1.0


@pytest.mark.parametrize("rope_type", ["default", "linear", "dynamic", "yarn", "llama3", "longrope"])
def test_model_builds_and_runs_with_each_rope_type(tmp_path: Path, rope_type: str) -> None:
    from nxd_lc.models.hf_config import build_llama_config
    from nxd_lc.models.llama.model import LlamaForCausalLM

    scalings = {
        "default": {"rope_type": "default"}, "linear": {"rope_type": "linear", "factor": 4.0},
        "dynamic": {"rope_type": "dynamic", "factor": 4.0}, "yarn": _yarn(original_max_position_embeddings=8),
        "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8},
        "longrope": _longrope(16, 3, original_max_position_embeddings=8),
    }
    path = str(_write_config(tmp_path, max_position_embeddings=16))
    config = build_llama_config(path, hf_config_overrides={"rope_scaling": scalings[rope_type]})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(build_llama_config(path))
    ids, pos = torch.randint(0, 128, (2, 24)), torch.arange(24).repeat(2, 1)  # 24 > 16 = max_position_embeddings
    logits = model(ids, pos)
    assert logits.shape == (2, 24, 128) and torch.isfinite(logits).all()
    differs = not torch.allclose(logits, plain(ids, pos))
    assert differs == (rope_type != "default"), rope_type  # the scaling reaches attention
    cos, _ = model.rotary_emb(pos)
    ref_cos, _ = _hf_rotary(config)(torch.zeros(1), pos)
    torch.testing.assert_close(cos, ref_cos, atol=2e-6, rtol=0)
