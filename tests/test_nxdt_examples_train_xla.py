"""Issue 39, item 2: every NxDT example trains shrunk on the multi-device XLA test bed, equal to one device.

The 20 examples: NxDT's 19 files (``../shared/reference/nxdt_examples``, unchanged; else nxd_lc's ``conf/``
copies, :func:`test_nxdt_examples._configs`) and NxDT's older SFT layout ``megatron_llama2_7B_SFT_config`` (keys as
``tests/test_nxdt_sft_layout.py`` writes them). Each is composed as ``python train.py --config-path <dir>
--config-name <file> <overrides> +trainer.accelerator=xla`` would compose it and run through ``train.py``'s code path
(:func:`nxd_lc.app.run.run`, the Lightning Trainer) in the device threads of :mod:`xla_testbed`, twice:

* at **its own parallel layout shrunk to 2-4 devices** (:data:`CASES`): TP 2 where the file has TP > 1, PP 2 where
  it has PP > 1, ring CP 2 where it has CP > 1 (the CP file: PP 2 x CP 2, TP 1, to stay at 4 devices); the file's
  sequence parallelism, ZeRO-1, activation checkpointing, fusions, MoE routing and precision block as written; its
  ``kv_replicator`` semantics kept: the HF Llama files replicate each KV head over TP (8 KV heads x 4 / TP 32 = one
  replicated head per rank; the Mixtral files need it too, nxd_lc's conf copies add ``kv_replicator: 4``), so their
  shrunk model has one KV head and ``kv_replicator`` 2 at TP 2;
* on **one XLA device** (TP = PP = CP = EP = 1, ``kv_replicator`` 1, no ``pipeline_cuts``): the same shrunk model,
  data and seed.

The shrinking overrides are :func:`test_nxdt_examples.shrink_overrides`' (sizes only: hidden 64, sequence 64, micro
batch 1, global batch 4, 2 steps with a checkpoint at step 2, tiny tokenizers and data) with :data:`LAYERS` layers
(one per stage at PP 2) and the layout replaced as above; the alignment files start from a checkpoint of their own
model (another seed) at the run's layout, through their own ``resume_from_checkpoint`` + ``weight_init_only``.
Each run applies the file's environment table as startup does (the parent applies it before the child starts:
torch-xla reads its variables once per process, :mod:`test_precision_xla`). One key besides sizes is changed, with
its reason in :data:`CASES`: ``megatron_gpt_config``'s attention dropout (per-TP-rank masks by design).

Equality: every rank's loss and global gradient norm of both steps (and the validation loss where the run
validates) against the one-device run: within :data:`FP32_TOL` in fp32 modes; the NxDT files are all bf16 modes
(``mixed_precision``: bf16 parameters and compute, fp32 master weights; ``autocast``: bf16 matmuls), compared within
:data:`BF16_REL` (its comment: why). Every rank must also report the layout the case asks for (a run that silently
fell back to another layout fails), the tiling must be on exactly where a case asks for it, and the step-2 checkpoint
must be complete with one model shard per TP x PP (x EP) rank.

Variants beyond the files (:data:`CASES`, each with its reason): expert parallelism (``*-ep2``: EP 2 over DP 2 at
TP 2; no file sets EP > 1), the tiled loss + tiled MLP (``*-tiled``, on the LoRA file; no file sets them) and a
validation batch under PP x ring CP (``*-val``; the CP file validates never).

``make test-nxdt-xla`` runs all (marker ``nxdt_xla``); lane 2 (``make test-xla``, marker ``xla``) runs
:data:`CI_SUBSET`, the fewest cases that cover PP, ring CP, EP (MoE), SFT, DPO, LoRA, each precision mode the
files use (mixed_precision, autocast), tiled loss / MLP and both activation-checkpointing granularities (selective:
the CP and LoRA files; full: the Mixtral and DPO files): ``hf_llama3_70B_CP_config-val``,
``hf_mixtral_8x7b_config-ep2``, ``hf_llama3_8B_SFT_lora_config-tiled`` and ``hf_llama3_8B_DPO_config`` (also lane
2's check of DPO at TP 2 + SP for ``tests/test_xla_alignment.py``, whose lane-2 cases are LoRA's); ORPO's file runs
in ``make test-nxdt-xla`` only (CI time; its loss is plain torch ops over the same log-probs as DPO's).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch_xla")

import yaml  # noqa: E402
from dist_utils import shard_files  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from test_nxdt_examples import _configs, _get, _has, _megatron_files, shrink_overrides  # noqa: E402
from xla_testbed import run_on_xla_devices  # noqa: E402

FP32_TOL = 1e-5  # absolute, fp32 modes: the same sums in another order (TP / PP / CP reductions)
#: bf16 modes, relative: the layouts split the bf16 matmuls' reductions (row-parallel partial sums over TP, the
#: ring's blockwise softmax over CP, micro-batch gradients summed per stage under PP) and each partial result is
#: rounded to bf16 (8 significant bits) before it is combined, where one device rounds the whole sum once; the
#: losses and norms are fp32 reductions of those bf16 values. One bf16 step (2**-7 relative at most) bounds what a
#: single rounding of the compared value may move; measured (this file's runs) the differences stay within it.
BF16_REL = 2.0 ** -7


@dataclass(frozen=True)
class Layout:
    """A shrunk parallel layout: TP, PP, CP, EP (EP > 1 is carved out of DP = EP), kv_replicator."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    kv: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel size: EP's (experts are carved out of DP), else 1."""
        return self.ep

    @property
    def devices(self) -> int:
        """Test-bed devices: TP x PP x CP x DP."""
        return self.tp * self.pp * self.cp * self.dp

    def describe(self) -> str:
        """``'TP 2 x PP 2, kv_replicator 2'``: the sizes above 1."""
        parts = [f"{k.upper()} {v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep),
                                                  ("dp", self.dp)) if v > 1]
        return " x ".join(parts) + (f", kv_replicator {self.kv}" if self.kv > 1 else "")


ONE = Layout()


@dataclass(frozen=True)
class Case:
    """One example (file stem) at a shrunk layout; ``variant``: a name for extra overrides beyond the file."""

    example: str
    layout: Layout
    variant: str = ""
    extra: tuple[str, ...] = ()
    ci: bool = False
    xfail: str = ""
    #: why the variant's extra overrides are there
    why: str = field(default="", compare=False)

    @property
    def id(self) -> str:
        """The test id: the file stem, ``-<variant>`` for a variant."""
        return f"{self.example}-{self.variant}" if self.variant else self.example


OLD_SFT = "megatron_llama2_7B_SFT_config"
TP2_KV2 = Layout(tp=2, kv=2)  # the HF Llama / Mixtral files: one KV head replicated over TP
CASES: list[Case] = [
    Case("hf_llama3.1_70B_config", Layout(tp=2, pp=2, kv=2)),
    Case("hf_llama3.1_8B_config", TP2_KV2),
    Case("hf_llama3_70B_CP_config", Layout(pp=2, cp=2)),
    Case("hf_llama3_70B_config", Layout(tp=2, pp=2, kv=2)),
    Case("hf_llama3_70B_trn2_config", Layout(tp=2, pp=2, kv=2)),
    Case("hf_llama3_8B_DPO_config", TP2_KV2, ci=True),
    Case("hf_llama3_8B_ORPO_config", TP2_KV2),  # make test-nxdt-xla (CI time: lane 2 trains DPO's file)
    Case("hf_llama3_8B_SFT_config", TP2_KV2),
    Case("hf_llama3_8B_SFT_lora_config", TP2_KV2),
    Case("hf_llama3_8B_config", TP2_KV2),
    Case("hf_llama3_8B_trn2_config", TP2_KV2),
    Case("hf_mixtral_8x7b_config", Layout(tp=2, pp=2, kv=2)),
    Case("hf_mixtral_8x7b_dropless_config", Layout(tp=2, pp=2, kv=2)),
    Case("megatron_gpt_config", Layout(tp=2), extra=("model.attention_dropout=0.0",),
         why="attention dropout draws each TP rank's heads' masks from a stream of its own (Megatron's model-parallel "
             "RNG tracker; nxd_lc's CoreAttention), so no TP layout can equal one device with it; the file's hidden "
             "and FFN dropout (0.1, masks independent of the layout) stay"),
    Case("megatron_llama_70b_config", Layout(tp=2, pp=2)),
    Case("megatron_llama_7B_config", Layout(tp=2)),
    Case("megatron_mistral_config", Layout(tp=2)),
    Case("megatron_mixtral_8x7b_config", Layout(tp=2, pp=2)),
    Case("megatron_mixtral_8x7b_dropless_config", Layout(tp=2, pp=2)),
    Case(OLD_SFT, Layout(tp=2)),
    # variants: what no NxDT file uses, or lane 2's subset needs
    Case("hf_llama3_70B_CP_config", Layout(pp=2, cp=2), variant="val", ci=True,
         extra=("trainer.limit_val_batches=1", "+data.val_fraction=0.1"),
         why="a validation batch at step 2 (the pipeline's forward-only schedule with the ring), which the file's "
             "limit_val_batches 0 leaves out"),
    Case("hf_mixtral_8x7b_config", Layout(tp=2, ep=2, kv=2), variant="ep2", ci=True,
         extra=("model.moe.router_aux_loss_coef=0.0",),
         why="EP 2 needs DP 2, and the load-balancing loss is per DP rank's tokens by definition (Megatron / NxD): "
             "it differs from one device's over the union, so its coefficient is 0 in this variant"),
    Case("hf_llama3_8B_SFT_lora_config", TP2_KV2, variant="tiled", ci=True,
         extra=("+model.tiled_loss_chunk_size=16", "+model.tiled_mlp_chunk_size=16"),
         why="the tiled vocab-parallel loss and tiled MLP, 16 tokens per chunk (4 chunks of the 64-token sequence), "
             "on the SFT + LoRA file (its adapters are on qkv_proj, which the tiled MLP does not bypass)"),
]
CI_SUBSET = {c.id for c in CASES if c.ci}


def _example_paths() -> dict[str, Path]:
    return {p.stem: p for _, p in _configs()}


def _params() -> list[Any]:
    out = []
    for case in CASES:
        marks: list[Any] = [pytest.mark.nxdt_xla] + ([pytest.mark.xla] if case.ci else [])
        if case.xfail:
            marks.append(pytest.mark.xfail(reason=case.xfail, strict=True))
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


# ---- data, tokenizers, model configs, the alignment files' starting checkpoint -------------------------------------
LAYERS = 2  # one decoder layer per stage at PP 2


def _model_json(path: Path, vocab: int, kv_heads: int, moe: bool = False) -> Path:
    """A tiny ``config.json``: :data:`LAYERS` layers, hidden 64, 4 heads, ``kv_heads`` KV heads; Mixtral with 8
    experts."""
    base = {"vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
            "num_key_value_heads": kv_heads, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "tie_word_embeddings": False, "initializer_range": 0.02}
    if moe:
        base.update(architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=96,
                    rope_theta=1000000.0, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                    output_router_logits=False, router_jitter_noise=0.0, sliding_window=None)
    else:
        base.update(architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=128,
                    rope_theta=500000.0)
    path.write_text(json.dumps(base))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Everything the shrunk runs read: the pretraining corpus (a byte-level BPE is trained on it by the first run
    into ``cache``), Megatron indexed files, the alignment tokenizer and jsonl files, the tiny model configs, and
    the checkpoints the alignment files start from (one per layout, written on first use: :func:`_pretrained`)."""
    from test_nxdt_sft_layout import _answer, _prompt, _write_tokenizer
    from test_xla_graphs import _corpus

    root = tmp_path_factory.mktemp("nxdt_xla")
    corpus = Path(_corpus(str(root / "corpus"), limit=60))
    out: dict[str, Path] = {"corpus": corpus, "cache": root / "cache", "root": root,
                            "tokenizer": _write_tokenizer(root / "align_tokenizer"),
                            "pretrained_ckpt": root / "pretrained_per_layout"}  # replaced per layout
    for name, vocab, moe in (("pretrain", 512, False), ("moe", 512, True), ("align", 400, False)):
        out[f"{name}_json"] = _model_json(root / f"{name}_config.json", vocab, 2, moe)
        out[f"{name}_json_kv1"] = _model_json(root / f"{name}_config_kv1.json", vocab, 1, moe)
    sft = [{"input": _prompt(i), "output": _answer(i)} for i in range(16)]
    pref = [{"prompt": _prompt(i), "chosen": _answer(i), "rejected": _answer(i + 1)} for i in range(16)]
    for name, rows in (("sft", sft), ("pref", pref)):
        out[f"{name}_jsonl"] = root / f"{name}.jsonl"
        out[f"{name}_jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.update(_megatron_files(root, corpus))
    return out


def _pretrained_dir(files: dict[str, Path], layout: Layout) -> Path:
    """The starting checkpoint of the alignment files at ``layout`` (one per TP size and kv_replicator)."""
    return files["root"] / f"pretrained_tp{layout.tp}_kv{layout.kv}" / "pretrained"


def _pretrained(files: dict[str, Path], layout: Layout, config_dir: Path, name: str, overrides: list[str]) -> None:
    """Write the alignment example's starting checkpoint at ``layout`` once: its own model from another seed
    (:func:`xla_scenarios_nxdt.pretrained_checkpoint`, CPU processes)."""
    path = _pretrained_dir(files, layout)
    if (path / "done").is_file():
        return
    from dist_utils import run_distributed

    run_distributed(_pretrained_entry, layout.devices, str(config_dir), name, overrides, str(path.parent))


def _pretrained_entry(rank: int, world: int, config_dir: str, name: str, overrides: list[str], root: str) -> None:
    from xla_scenarios_nxdt import pretrained_checkpoint

    pretrained_checkpoint(rank, world, config_dir, name, overrides, root, seed=4321)


# ---- overrides -----------------------------------------------------------------------------------------------------
def _set(overrides: list[str], tree: dict, values: dict[str, Any]) -> list[str]:
    """``overrides`` with ``values`` replacing any override of the same keys (``+`` for keys the file lacks)."""
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in values]
    return keep + [f"{k}={v}" if _has(tree, k) else f"+{k}={v}" for k, v in values.items()]


def _replicates_kv(tree: dict, name: str) -> bool:
    """The HF Llama / Mixtral files replicate KV heads over TP (``kv_replicator`` > 1 in the file or, for the
    Mixtral files that lack the key, in nxd_lc's conf copy)."""
    if tree.get("model_source") == "megatron":
        return False
    if int(_get(tree, "distributed_strategy.kv_replicator") or 1) > 1:
        return True
    copy = Path(__file__).resolve().parents[1] / "conf" / f"{name}.yaml"
    return copy.is_file() and int(_get(yaml.safe_load(copy.read_text()), "distributed_strategy.kv_replicator")
                                  or 1) > 1


def example_overrides(case: Case, layout: Layout, tree: dict, files: dict[str, Path], run_dir: Path) -> list[str]:
    """The shrinking overrides of ``case``'s file at ``layout`` (module docstring), the variant's extras last."""
    overrides, _ = shrink_overrides(tree, files, run_dir)
    values: dict[str, Any] = {"trainer.devices": layout.devices, "model.num_layers": LAYERS,
                              "distributed_strategy.tensor_model_parallel_size": layout.tp,
                              "distributed_strategy.pipeline_model_parallel_size": layout.pp,
                              "distributed_strategy.kv_replicator": layout.kv}
    if layout.cp > 1 or _has(tree, "distributed_strategy.context_parallel_size"):
        values["distributed_strategy.context_parallel_size"] = layout.cp
    if layout.ep > 1 or _has(tree, "distributed_strategy.expert_model_parallel_size"):
        values["distributed_strategy.expert_model_parallel_size"] = layout.ep
    if _get(tree, "model.pipeline_cuts"):  # one device: no stages to cut (refused otherwise)
        values["model.pipeline_cuts"] = "[model.layers.0]" if layout.pp > 1 else "null"
    if tree.get("model_source") != "megatron":
        alignment = tree.get("model_alignment_strategy")
        kind = "align" if alignment else "moe" if _has(tree, "model.moe") else "pretrain"
        values["model.model_config"] = files[f"{kind}_json_kv1" if _replicates_kv(tree, case.example)
                                             else f"{kind}_json"]
        if _get(tree, "exp_manager.resume_from_checkpoint"):  # the layout's own (LoRA cannot re-shard it)
            values["exp_manager.resume_from_checkpoint"] = f"'{_pretrained_dir(files, layout)}'"
        if alignment:  # the small BPE of the SFT-layout tests (400 tokens) instead of SmolLM2's 49,152
            values["data.tokenizer.type"] = files["tokenizer"]
            values["data.train_dir"] = files["sft_jsonl" if "sft" in alignment else "pref_jsonl"]
            if _get(tree, "data.val_dir") is not None:
                values["data.val_dir"] = values["data.train_dir"]
    return [*_set(overrides, tree, values), *case.extra]


def _old_sft_layout(files: dict[str, Path], run_dir: Path) -> tuple[Path, list[str]]:
    """NxDT's older SFT layout written as a YAML file (its keys, shrunk; ``tests/test_nxdt_sft_layout.py``) in a
    directory of its own; returns (that directory, overrides that point it at ``run_dir``)."""
    from test_nxdt_sft_layout import _old_layout

    config_dir = files["root"] / "old_sft_layout"
    config_dir.mkdir(exist_ok=True)
    tree = _old_layout({"train": files["sft_jsonl"], "val": files["sft_jsonl"], "tokenizer": files["tokenizer"]},
                       run_dir)
    (config_dir / f"{OLD_SFT}.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    return config_dir, [f"exp_manager.explicit_log_dir={run_dir}", f"compiler_cache_url={run_dir}/compile_cache",
                        "exp_manager.checkpoint_callback_params.every_n_train_steps=2"]  # as the others: at step 2


def _resolve(case: Case, layout: Layout, files: dict[str, Path], run_dir: Path) -> tuple[Path, str, list[str]]:
    """(config directory, config name, overrides) of ``case`` at ``layout``."""
    if case.example == OLD_SFT:
        config_dir, overrides = _old_sft_layout(files, run_dir)
        tree = yaml.safe_load((config_dir / f"{OLD_SFT}.yaml").read_text())
        values = {"trainer.devices": layout.devices, "distributed_strategy.tensor_model_parallel_size": layout.tp}
        return config_dir, OLD_SFT, [*_set(overrides, tree, values), *case.extra]
    path = _example_paths()[case.example]
    tree = yaml.safe_load(path.read_text())
    return path.parent, path.stem, example_overrides(case, layout, tree, files, run_dir)


# ---- the test ------------------------------------------------------------------------------------------------------
@pytest.fixture
def run_environment() -> Iterator[Any]:
    """``apply(config_dir, name, overrides, world)``: the run's environment table applied to ``os.environ`` as
    startup applies it (variables already set win), so the test bed's child starts under it; restored after."""
    from nxd_lc.app.validation import load_config
    from nxd_lc.config.resolvers import register_resolvers
    from nxd_lc.runtime.env import apply_env

    saved = dict(os.environ)

    def apply(config_dir: Path, name: str, overrides: list[str], world: int) -> tuple[Any, dict[str, str]]:
        register_resolvers()
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            raw = compose(config_name=name, overrides=overrides)
        cfg = load_config(raw, world_size=world)
        return cfg, {e.var: e.value for e in apply_env(cfg)}

    yield apply
    os.environ.clear()
    os.environ.update(saved)


def _run(config_dir: Path, name: str, overrides: list[str], devices: int) -> list[dict[str, Any]]:
    kwargs = {"config_dir": str(config_dir), "config_name": name, "overrides": overrides}
    return run_on_xla_devices("xla_scenarios_nxdt:example_job", devices, kwargs, timeout_s=900,
                              wait_timeout_s=180).results


def compare(case: Case, precision: str, one: dict[str, Any], runs: list[dict[str, Any]]) -> float:
    """Assert every rank of ``runs`` equals the one-device run ``one`` (module docstring); returns the largest
    difference found (absolute in fp32 modes, relative in bf16 modes)."""
    fp32 = precision == "fp32"
    assert sorted(one["steps"]) == ["1", "2"] and one["global_step"] == 2, one
    worst = 0.0
    for rank, r in enumerate(runs):
        assert r["global_step"] == 2 and sorted(r["steps"]) == ["1", "2"], (rank, r)
        pairs = [(f"step {s} {k}", r["steps"][s][k], one["steps"][s][k]) for s in ("1", "2") for k in ("loss", "norm")]
        assert sorted(r["vals"]) == sorted(one["vals"]), (rank, r["vals"], one["vals"])
        pairs += [(f"validation at step {s}", r["vals"][s], one["vals"][s]) for s in one["vals"]]
        for what, got, want in pairs:
            diff = abs(got - want) if fp32 else abs(got - want) / abs(want)
            worst = max(worst, diff)
            assert diff <= (FP32_TOL if fp32 else BF16_REL), \
                f"{case.id} rank {rank} {what}: {got!r} vs one device {want!r} ({precision})"
    return worst


@pytest.mark.parametrize("case", _params())
def test_nxdt_example_trains_on_xla_devices_equal_to_one_device(case: Case, files: dict[str, Path], tmp_path: Path,
                                                               run_environment: Any) -> None:
    """The module docstring's comparison for one case of :data:`CASES`."""
    config_dir, name, many = _resolve(case, case.layout, files, tmp_path / "many")
    _, _, single = _resolve(case, ONE, files, tmp_path / "one")
    for layout, overrides in ((ONE, single), (case.layout, many)):
        if any(str(_pretrained_dir(files, layout)) in o for o in overrides):
            _pretrained(files, layout, config_dir, name, overrides)
    cfg, env = run_environment(config_dir, name, many, case.layout.devices)
    assert env["XLA_USE_BF16"] == os.environ["XLA_USE_BF16"] == "0"  # the children inherit the table
    t0 = time.monotonic()
    one = _run(config_dir, name, single, 1)[0]
    t1 = time.monotonic()
    runs = _run(config_dir, name, many, case.layout.devices)
    seconds = {"one_device_s": round(t1 - t0, 1), "devices_s": round(time.monotonic() - t1, 1)}
    _report(case, cfg.precision.type, one, runs, seconds)
    layout = {"tp": case.layout.tp, "pp": case.layout.pp, "cp": case.layout.cp, "ep": case.layout.ep,
              "dp": case.layout.dp}
    assert one["layout"] == dict.fromkeys(layout, 1), one["layout"]
    assert all(r["layout"] == layout for r in runs), [r["layout"] for r in runs]
    tiled = any("tiled" in o for o in case.extra)  # the variant's tiling is on in every run, and only there
    assert all((r["tiled"]["loss_chunk"] == 16 and r["tiled"]["mlps"] > 0) == tiled for r in (one, *runs)), \
        [r["tiled"] for r in (one, *runs)]
    compare(case, cfg.precision.type, one, runs)
    _check_checkpoint(tmp_path / "many", case.layout)


def _check_checkpoint(run_dir: Path, layout: Layout) -> None:
    """The step-2 checkpoint of the run at ``layout`` is complete (``done``) and holds one model shard per TP x PP
    (x EP) rank."""
    (ckpts,) = list(run_dir.rglob("checkpoints"))
    (tag,) = [p for p in ckpts.iterdir() if p.is_dir() and "step=2" in p.name]
    assert (tag / "done").is_file(), sorted(p.name for p in tag.iterdir())
    shards = shard_files(tag / "model")
    assert len(shards) == layout.tp * layout.pp * layout.ep, shards


def _report(case: Case, precision: str, one: dict[str, Any], runs: list[dict[str, Any]],
            seconds: dict[str, float]) -> None:
    """With ``NXDT_XLA_REPORT=<file>``: append one JSON line per case (layout, precision, the runs' steps, the
    largest difference, the seconds each run took) -- the table of ``docs/nxdt_examples_xla.md``."""
    path = os.environ.get("NXDT_XLA_REPORT")
    if not path:
        return
    fp32 = precision == "fp32"
    diffs = [abs(r["steps"][s][k] - one["steps"][s][k]) / (1 if fp32 else abs(one["steps"][s][k]))
             for r in runs for s in one["steps"] if s in r["steps"] for k in ("loss", "norm")]
    diffs += [abs(r["vals"][s] - one["vals"][s]) / (1 if fp32 else abs(one["vals"][s]))
              for r in runs for s in one["vals"] if s in r["vals"]]
    with open(path, "a") as f:
        f.write(json.dumps({"case": case.id, "layout": case.layout.describe(), "devices": case.layout.devices,
                            "precision": precision, "max_diff": max(diffs, default=None),
                            "diff_kind": "abs" if fp32 else "rel", "one": one, "ranks": runs, **seconds}) + "\n")
