"""``data.curriculum``: the stage arithmetic against hand-computed values, the sampler's order against
``torch.randperm`` (the documented formula) with exact resume at every step and across epoch ends, the data module's
per-stage batches, a stage's RoPE against transformers, config errors, and train.py end to end: the first stage
(128 tokens, unscaled RoPE, micro batch 4) reproduces a plain 128-token run without YaRN, and a run resumed inside
the first stage crosses into the YaRN stage with the uninterrupted run's losses."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from nxd_lc.app.validation import load_config
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.schema import DataConfig, TokenizerConfig
from nxd_lc.data.curriculum import (
    CurriculumBatchSampler,
    CurriculumDataModule,
    consumed_at,
    parse_curriculum,
    stage_at,
    step_of_consumed,
)
from nxd_lc.data.datamodule import PretrainingDataModule

pytestmark = pytest.mark.compat  # torch-2.9 compatibility subset (lane 2; docs/testing.md)

# DP 2, global batch 8 with micro batch 4 -> 1 micro-batch per step; stages of micro batch 4, 2, 1
STAGES = [{"until_step": 3, "seq_length": 8}, {"until_step": 5, "seq_length": 16, "micro_batch_size": 2},
          {"seq_length": 32, "micro_batch_size": 1}]


def _stages() -> Any:
    return parse_curriculum(STAGES, micro_batch_size=4, global_batch_size=8, data_parallel_size=2)


def test_stage_arithmetic_matches_hand_computed_values() -> None:
    stages = _stages()
    assert [(s.start_step, s.until_step, s.global_batch_size) for s in stages] == [(0, 3, 8), (3, 5, 4), (5, None, 2)]
    assert [stage_at(stages, k).index for k in range(8)] == [0, 0, 0, 1, 1, 2, 2, 2]
    # steps 0-2 take 8 samples, steps 3-4 take 4, later steps 2
    expected = {0: 0, 1: 8, 3: 24, 4: 28, 5: 32, 6: 34, 9: 40}
    assert {k: consumed_at(stages, k) for k in expected} == expected
    assert {c: step_of_consumed(stages, c) for c in expected.values()} == {c: k for k, c in expected.items()}
    for bad in (4, 26, 33):  # not a step boundary of these stages
        with pytest.raises(ValueError, match="not a step boundary of data.curriculum"):
            step_of_consumed(stages, bad)
    with pytest.raises(ValueError, match=r"data.curriculum\[1\].until_step: must be an int > 3"):
        parse_curriculum([{"until_step": 3, "seq_length": 8}, {"until_step": 2, "seq_length": 8},
                          {"seq_length": 8}], micro_batch_size=1, global_batch_size=1, data_parallel_size=1)


def _expected_steps(lengths: list[int], steps: int, seed: int) -> list[list[tuple[int, int]]]:
    """Each step's global batch, written from the documented formula: a stage draws its samples in the order of
    ``randperm(len, seed + epoch)`` (epochs trimmed to whole global batches) from its own start."""
    stages, out, drawn = _stages(), [], [0, 0, 0]
    for k in range(steps):
        s = stage_at(stages, k)
        per_epoch = (lengths[s.index] // s.global_batch_size) * s.global_batch_size
        batch = []
        for _ in range(s.global_batch_size):
            epoch, pos = divmod(drawn[s.index], per_epoch)
            gen = torch.Generator()
            gen.manual_seed(11 + epoch)
            batch.append((s.index, int(torch.randperm(lengths[s.index], generator=gen)[pos])))
            drawn[s.index] += 1
        out.append(batch)
    return out


def _drain(stages: Any, lengths: list[int], consumed: int, steps: int) -> list[list[tuple[int, int]]]:
    """Steps of global batches (both DP ranks' micro-batches, rank 0 first), iterating like Lightning: a new
    ``__iter__`` whenever one ends (an epoch end)."""
    ranks = [CurriculumBatchSampler(stages, lengths, consumed, 1, r, 2, seed=11) for r in (0, 1)]
    iters = [iter(r) for r in ranks]
    out = []
    for _ in range(steps):
        step = []
        for i, r in enumerate(ranks):
            try:
                step += next(iters[i])
            except StopIteration:
                iters[i] = iter(r)
                step += next(iters[i])
        out.append(step)
    return out


def test_sampler_order_stage_switches_and_exact_resume() -> None:
    stages, lengths = _stages(), [20, 9, 7]  # stage 3 ends an epoch every 3 steps (7 // 2 = 3 global batches)
    full = _drain(stages, lengths, 0, 14)
    assert full == _expected_steps(lengths, 14, seed=11)
    assert [len(b) for b in full] == [8, 8, 8, 4, 4] + [2] * 9
    for k in range(1, 13):  # resume at every step boundary: the same remaining batches
        assert _drain(stages, lengths, consumed_at(stages, k), 14 - k) == full[k:], k


def _corpus(root: str) -> None:
    import sysconfig

    src = sysconfig.get_paths()["stdlib"]
    os.makedirs(root, exist_ok=True)
    for n in ("bisect.py", "heapq.py", "textwrap.py", "shlex.py", "string.py", "fractions.py", "numbers.py",
              "queue.py"):
        with open(os.path.join(src, n)) as f, open(os.path.join(root, n), "w") as g:
            g.write(f.read())


def test_datamodule_batches_are_each_stages_own_batches(tmp_path: Any) -> None:
    _corpus(str(tmp_path / "corpus"))
    tok = TokenizerConfig(type="bytelevel_bpe", vocab_size=600, train_max_bytes=300_000,
                          cache_dir=str(tmp_path / "cache"))
    curriculum = [{"until_step": 2, "seq_length": 64, "micro_batch_size": 4}, {"seq_length": 256}]
    base = dict(global_batch_size=4, train_dir=str(tmp_path / "corpus"), val_fraction=0.25, tokenizer=tok)
    kw = dict(seed=3, model_vocab_size=600, data_parallel_rank=0, data_parallel_size=1)
    dm = CurriculumDataModule(DataConfig(micro_batch_size=1, curriculum=curriculum, **base), seq_length=256,
                              global_batch_size=4, **kw)
    dm.setup("fit")
    # references: ordinary data modules at each stage's length and batch (independent of the curriculum code)
    short = PretrainingDataModule(DataConfig(micro_batch_size=4, **base), seq_length=64, global_batch_size=16, **kw)
    long = PretrainingDataModule(DataConfig(micro_batch_size=1, **base), seq_length=256, global_batch_size=4, **kw)
    short.setup("fit")
    long.setup("fit")
    got = [b for _, b in zip(range(2 * 4 + 3 * 4), dm.train_dataloader())]  # 2 steps x 4 micro, 3 steps x 4
    ref_short = [b for _, b in zip(range(8), short.train_dataloader())]
    ref_long = [b for _, b in zip(range(12), long.train_dataloader())]
    for b, r in zip(got, ref_short + ref_long):
        assert set(b) == set(r)
        for key in b:
            assert torch.equal(b[key], r[key]), key
    assert [tuple(b["input_ids"].shape) for b in got] == [(4, 64)] * 8 + [(1, 256)] * 12
    # resumed inside the second stage (the checkpoint's consumed_samples): the same batches
    again = CurriculumDataModule(DataConfig(micro_batch_size=1, curriculum=curriculum, **base), seq_length=256,
                                 global_batch_size=4, **kw)
    again.setup("fit")
    again.load_state_dict({"consumed_samples": 2 * 16 + 1 * 4})
    resumed = [b for _, b in zip(range(8), again.train_dataloader())]
    for b, r in zip(resumed, ref_long[4:]):
        assert torch.equal(b["input_ids"], r["input_ids"])
    assert again.global_batch_size_at(1) == 16 and again.global_batch_size_at(2) == 4
    # validation follows the stage of the current step
    assert next(iter(dm.val_dataloader()))["input_ids"].shape == (4, 64)


def test_stage_rope_matches_transformers() -> None:
    """A stage's rope_scaling applied to the model's RoPE in place (set_spec) gives transformers' cos / sin for a
    model configured with that scaling; switching back restores the model's own."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from nxd_lc.models.common.rope import RotaryEmbedding, rope_spec_from_config, rope_spec_with_scaling

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}

    def hf_config(rope: dict[str, Any] | None) -> LlamaConfig:
        return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=2048, rope_theta=10000.0, rope_scaling=rope)

    ours = RotaryEmbedding(rope_spec_from_config(hf_config(dict(yarn))))
    model_spec = ours.spec
    pos = torch.arange(0, 2048, 7).unsqueeze(0)
    for rope, ref_rope in (({"rope_type": "default"}, None),
                           ({"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
                           (None, dict(yarn))):
        ours.set_spec(rope_spec_with_scaling(model_spec, rope))
        cos, sin = ours(pos)
        ref = LlamaRotaryEmbedding(hf_config(ref_rope))
        rcos, rsin = ref(torch.zeros(1, dtype=torch.float32), pos)
        torch.testing.assert_close(cos, rcos, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin, rsin, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="data.curriculum.0..rope_scaling"):
        rope_spec_with_scaling(model_spec, {"rope_type": "yarn", "factor": 0.5}, key="data.curriculum[0].rope_scaling")


def test_curriculum_config_errors_name_the_stage() -> None:
    from tests.test_config import _tiny

    raw = _tiny(trainer={"devices": 2, "num_nodes": 1, "max_steps": 10, "val_check_interval": 0.5},
                data={"micro_batch_size": 1, "global_batch_size": 2, "curriculum": [
                    {"until_step": 4, "seq_length": 128, "rope_scaling": {"rope_type": "yarn", "factor": 0.5}},
                    {"seq_length": 48, "micro_batch_size": 0, "until_step": 2, "rope": 1},
                    {"seq_length": 32, "until_step": 8, "rope_scaling": {"rope_type": "default"}}]},
                distributed_strategy={"tensor_model_parallel_size": 2, "sequence_parallel": True})
    raw["distributed_strategy"]["context_parallel_size"] = 1
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    problems = info.value.problems
    for text in ("trainer.val_check_interval: 0.5 is a fraction of an epoch",
                 "data.curriculum[0].seq_length: 128 exceeds the model's length 64",
                 "data.curriculum[0].rope_scaling", "data.curriculum[1]: unknown keys ['rope']",
                 "data.curriculum[1].until_step: must be an int > 4", "data.curriculum[1].micro_batch_size: must be",
                 "data.curriculum[2].until_step: 8 < trainer.max_steps 10",
                 "data.curriculum[2].rope_scaling: the last stage trains with the model's own RoPE"):
        assert any(text in p for p in problems), (text, problems)
    ok = _tiny(data={"micro_batch_size": 1, "global_batch_size": 2, "curriculum": [
        {"until_step": 4, "seq_length": 32, "micro_batch_size": 2, "rope_scaling": {"rope_type": "default"}},
        {"seq_length": 64}]})
    assert load_config(ok).data.curriculum[0]["micro_batch_size"] == 2
    sft = _tiny(data={"micro_batch_size": 1, "global_batch_size": 2, "train_dir": "x.jsonl",
                      "curriculum": [{"seq_length": 64}]},
                model_alignment_strategy={"sft": {}})
    with pytest.raises(ConfigError, match="data.curriculum"):
        load_config(sft)


YARN_OVERRIDE = ("+model.hf_config_overrides.rope_scaling={rope_type:yarn,rope_theta:10000.0,factor:2.0,"
                 "original_max_position_embeddings:128,truncate:true,beta_fast:32.0,beta_slow:1.0,mscale:1.0,"
                 "mscale_all_dim:0.0}")
CURRICULUM = ("+data.curriculum=[{until_step:3,seq_length:128,micro_batch_size:4,rope_scaling:{rope_type:default}},"
              "{seq_length:256}]")


@pytest.mark.lane1_only  # end-to-end (3 torchrun launches); the unit tests above run in both lanes
@pytest.mark.distributed
@pytest.mark.slow
def test_train_py_curriculum_first_stage_and_resume(tmp_path: Any) -> None:
    from tests.test_e2e import _run, _small_corpus, _train_cmd
    from tests.test_reshard import _losses_of

    corpus, cache = _small_corpus(str(tmp_path)), str(tmp_path / "cache")
    full_dir = str(tmp_path / "curriculum")
    full = _losses_of(_run(_train_cmd(full_dir, corpus, cache, max_steps=5) + [YARN_OVERRIDE, CURRICULUM]),
                      full_dir)
    assert sorted(full) == [1, 2, 3, 4, 5]
    # consumed samples in the checkpoint names: 3 steps x 8 (micro 4 x 2 micro-batches) then 4 per step
    root = os.path.join(full_dir, "checkpoints")
    tags = sorted(t for t in os.listdir(root) if os.path.isdir(os.path.join(root, t)))
    assert tags == ["cpu_tiny_llama--step=2-consumed_samples=16.0", "cpu_tiny_llama--step=4-consumed_samples=28.0"]
    # the first stage is a plain 128-token run with unscaled RoPE (no YaRN in the model) and micro batch 4
    plain_dir = str(tmp_path / "plain")
    plain = _losses_of(_run(_train_cmd(plain_dir, corpus, cache, max_steps=3) + [
        "data.seq_length=128", "data.micro_batch_size=4", "data.global_batch_size=8"]), plain_dir)
    for step in (1, 2, 3):
        assert full[step] == pytest.approx(plain[step], rel=1e-5, abs=0), (step, full, plain)
    # resumed from step 2 (inside the first stage): steps 3 (stage 1) and 4-5 (stage 2, YaRN) as uninterrupted
    ckpt = os.path.join(root, tags[0])
    resumed_dir = str(tmp_path / "resumed")
    resumed = _losses_of(_run(_train_cmd(resumed_dir, corpus, cache, max_steps=5) + [
        YARN_OVERRIDE, CURRICULUM, f"exp_manager.resume_from_checkpoint='{ckpt}'"]), resumed_dir)
    assert sorted(resumed) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=0), (step, resumed, full)
    assert np.isfinite(full[5])
