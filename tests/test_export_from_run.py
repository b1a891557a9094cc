"""The HF export is of the model the run trained (issue 50, item 1): every checkpoint carries its run's resolved
config (``run_config.yaml``) and model config.json, which the export builds from; a command-line config that would
build another model is refused naming the key; ``config.json`` / ``generation_config.json`` carry the run
tokenizer's special ids, so transformers' ``generate`` stops at its eos.

The reference values are the test's own: the overrides it trains with (``max_position_embeddings``, ``rope_theta``,
the layer count) and the tokenizer's ids read by transformers from the exported files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nxd_lc.app.convert import convert_checkpoint_to_hf, export_config_differences, saved_run_config
from nxd_lc.cli.convert import main as convert_main

REPO = Path(__file__).resolve().parent.parent

# the trained model's settings that differ from the demo config (conf/cpu_tiny_llama_config.yaml, which names
# conf/tiny_llama_config.json: 4096 positions, rope_theta 10000, 4 layers, bos 1 / eos 2)
TRAINED = {"max_position_embeddings": 8192, "rope_theta": 50000.0, "num_hidden_layers": 2, "hidden_size": 64}


def _sft_data(dst: Path) -> Path:
    rows = [{"input": f"question {i}: what is {i} plus {i}?", "output": f"{2 * i}"} for i in range(24)]
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def _overrides(tmp: Path) -> list[str]:
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    tok = tmp / "hf_tokenizer"
    texts = [f"question {i}: what is {i} plus {i}? {2 * i}" for i in range(200)]
    train_bytelevel_bpe(texts, 300).save_pretrained(str(tok))
    data = _sft_data(tmp / "sft.jsonl")
    return ["~data.builtin_corpus", f"+data.train_dir={data}", f"data.tokenizer.type={tok}",
            "+model_alignment_strategy={sft:{packing:true}}", "~data.val_fraction",
            "trainer.max_steps=2", "+exp_manager.preemption_signals=[]", "data.micro_batch_size=1",
            "data.global_batch_size=1", "model.encoder_seq_length=64",
            f"+model.num_layers={TRAINED['num_hidden_layers']}", f"+model.hidden_size={TRAINED['hidden_size']}",
            f"model.max_position_embeddings={TRAINED['max_position_embeddings']}",
            f"+model.rope_theta={TRAINED['rope_theta']}", "trainer.val_check_interval=100",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=2", "name=sft_export_run",
            f"exp_manager.explicit_log_dir={tmp / 'run'}", "exp_manager.create_tensorboard_logger=false",
            "+trainer.enable_progress_bar=false", "trainer.devices=1",
            "distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false"]


def run_demo_config(overrides: list[str]) -> None:
    """``train.py``'s job in this process (one rank of a torchrun launch of one) on the demo config + overrides."""
    from dist_utils import set_launch_env_of_one
    from hydra import compose, initialize_config_dir

    from nxd_lc.app.run import _shutdown_distributed, run

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="cpu_tiny_llama_config", overrides=overrides)
    with pytest.MonkeyPatch.context() as mp:  # its own MonkeyPatch (module-scoped fixtures use it too)
        set_launch_env_of_one(mp.setenv)
        try:
            run(raw)
        finally:
            _shutdown_distributed()


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step SFT run of the demo config's model, shrunk and changed (``TRAINED``), checkpointed at step 2."""
    tmp = tmp_path_factory.mktemp("export_run")
    run_demo_config(_overrides(tmp))
    return tmp


def _tag(tmp: Path) -> Path:
    root = tmp / "run" / "checkpoints"
    (tag,) = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return tag


def test_the_checkpoint_carries_its_run_config(sft_run: Path) -> None:
    """``run_config.yaml`` loads back to the run's settings; ``model_config.json`` is the source file's bytes; both
    are in the checkpoint's manifest (checked like the shards)."""
    tag = _tag(sft_run)
    cfg = saved_run_config(str(tag))
    assert cfg is not None and cfg.name == "sft_export_run"
    assert cfg.model.max_position_embeddings == TRAINED["max_position_embeddings"]
    assert cfg.model.num_layers == TRAINED["num_hidden_layers"] and cfg.model_alignment_strategy is not None
    assert (tag / "model_config.json").read_bytes() == (REPO / "conf" / "tiny_llama_config.json").read_bytes()
    manifest = json.loads((tag / "manifest.json").read_text())
    listed = json.dumps(manifest)
    assert "run_config.yaml" in listed and "model_config.json" in listed


def test_export_without_a_config_is_the_trained_model_and_generate_stops_at_eos(sft_run: Path,
                                                                                tmp_path: Path) -> None:
    """No ``--config-name``: config.json holds the trained settings and the tokenizer's ids (the demo file's are
    bos 1 / eos 2); greedy ``generate`` stops when the model emits the tokenizer's eos."""
    from dist_utils import set_launch_env_of_one
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        set_launch_env_of_one(mp.setenv)
        assert convert_main(["--checkpoint", str(sft_run / "run" / "checkpoints"), "--output",
                             str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    rope = config.get("rope_parameters") or {}  # transformers 5 writes rope_theta there, 4.x at the top level
    for field, value in TRAINED.items():
        got = config.get(field, rope.get(field))
        assert got == value, (field, got, value)
    tok = AutoTokenizer.from_pretrained(str(out))
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    assert eos == tok.eos_token_id and eos != 2
    assert config["eos_token_id"] == eos and config["bos_token_id"] == tok.bos_token_id
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == eos and gen["pad_token_id"] == (tok.pad_token_id if tok.pad_token_id is not None
                                                                   else eos)
    conversion = json.loads((out / "nxd_lc_conversion.json").read_text())
    assert conversion["run_name"] == "sft_export_run"

    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    prompt = tok("question 3: what is 3 plus 3?", return_tensors="pt")
    max_new = 12
    with torch.no_grad():  # the greedy continuation with no stop token
        free = model.generate(**prompt, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                              pad_token_id=eos)[0, prompt["input_ids"].shape[1]:].tolist()
    assert len(free) == max_new
    k = next((i for i, t in enumerate(free) if t == eos), None)
    if k is None:  # make the model emit eos at step 3: swap the head rows of eos and the token it chose there
        k, chosen = 3, free[3]
        with torch.no_grad():
            w = model.get_output_embeddings().weight
            w[[eos, chosen]] = w[[chosen, eos]]
    with torch.no_grad():  # the exported generation config (eos from generation_config.json)
        stopped = model.generate(**prompt, max_new_tokens=max_new, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert stopped.tolist()[-1] == eos and len(stopped) <= k + 1 < max_new, (stopped.tolist(), k)


def test_a_config_that_would_build_another_model_is_refused_naming_the_key(sft_run: Path, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The demo config (4096 positions, 4 layers) against the run's checkpoint: refused before anything is written,
    naming each key; the same config with the run's model keys is accepted; so is a harmless override."""
    from dist_utils import set_launch_env_of_one

    from nxd_lc.app.convert import compose_run_config

    ckpt = str(sft_run / "run" / "checkpoints")
    with pytest.MonkeyPatch.context() as mp:
        set_launch_env_of_one(mp.setenv)
        rc = convert_main(["--config-name", "cpu_tiny_llama_config", "--config-dir", str(REPO / "conf"),
                           "--checkpoint", ckpt, "--output", str(tmp_path / "hf")])
        err = capsys.readouterr().err
        assert rc == 2 and not (tmp_path / "hf").exists()
        assert "model.max_position_embeddings: 4096 on the command line, 8192 in the checkpoint's run config" in err
        assert "model.num_layers" in err and "model.rope_theta" in err
        # an override of the checkpoint's own config that changes the model is refused the same way
        rc = convert_main(["--checkpoint", ckpt, "--output", str(tmp_path / "hf"), "model.rope_theta=10000.0"])
        assert rc == 2 and "model.rope_theta: 10000.0 on the command line, 50000.0" in capsys.readouterr().err
    given = compose_run_config("cpu_tiny_llama_config", str(REPO / "conf"), _overrides(tmp_path))
    tag = _tag(sft_run)
    saved = saved_run_config(str(tag))
    assert saved is not None and export_config_differences(saved, given) == []
    out = Path(convert_checkpoint_to_hf(given, ckpt, str(tmp_path / "hf2")))
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 8192


def test_a_damaged_run_tokenizer_is_refused_before_the_export(sft_run: Path, tmp_path: Path) -> None:
    """A half-truncated ``tokenizer.json`` in the run directory: refused naming the file; nothing is written."""
    run = tmp_path / "run"
    shutil.copytree(sft_run / "run" / "checkpoints", run / "checkpoints")
    shutil.copytree(sft_run / "run" / "tokenizer", run / "tokenizer")
    tok_json = run / "tokenizer" / "tokenizer.json"
    data = tok_json.read_bytes()
    tok_json.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"tokenizer\.json is not valid JSON"):
        convert_checkpoint_to_hf(None, str(run / "checkpoints"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_the_export_never_replaces_the_run_and_cleans_up_after_a_killed_export(sft_run: Path, tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]
                                                                              ) -> None:
    """``--output`` = the run directory, one of its parents or a directory inside the checkpoint root is refused
    (with ``--overwrite``), the run intact; a bare ``--overwrite`` before an override takes ``true``, not the
    override; a stale ``.<name>.partial-<id>`` of a killed export is removed by the next export; a truncated
    shard is one error line naming the file."""
    from dist_utils import set_launch_env_of_one

    run = tmp_path / "run"
    shutil.copytree(sft_run / "run", run)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    ckpt = str(run / "checkpoints")
    with pytest.MonkeyPatch.context() as mp:
        set_launch_env_of_one(mp.setenv)
        for output in (run, tmp_path, run / "checkpoints" / "hf"):
            assert convert_main(["--checkpoint", ckpt, "--output", str(output), "--overwrite", "true"]) == 2
            assert "choose a directory outside it" in capsys.readouterr().err
        assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
        stale = tmp_path / ".hf.partial-0123abcd"
        stale.mkdir()
        (stale / "model.safetensors").write_bytes(b"half")
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "old.txt").write_text("an earlier export")
        assert convert_main(["--checkpoint", ckpt, "--output", str(tmp_path / "hf"), "--overwrite",
                             "name=renamed_run"]) == 0
        assert not stale.exists() and not (tmp_path / "hf" / "old.txt").exists()
        assert json.loads((tmp_path / "hf" / "nxd_lc_conversion.json").read_text())["run_name"] == "renamed_run"
        shard = next((run / "checkpoints").glob("*/model/*.pt"))
        target = shard if shard.is_file() else next(p for p in shard.rglob("*") if p.is_file())
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        capsys.readouterr()
        assert convert_main(["--checkpoint", ckpt, "--output", str(tmp_path / "hf3")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(target) in err[0] and "truncated" in err[0], err
