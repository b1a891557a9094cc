"""The dry run's promise on resource keys (issue 40, items 1, 2, 5, 6, 7): what validation accepts launches, and
what it refuses is refused in seconds, naming the key (or config.json's field), the bound and the fix.

* The memory estimate's cost does not depend on the layer count: layers of one kind (dense / MoE) are counted,
  not enumerated, so ``model.num_layers`` (or config.json's ``num_hidden_layers``) of 10^7 is judged with a
  handful of per-layer evaluations and a bounded allocation, and the figure is the exact linear extension of the
  small models' figures.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from nxd_lc.app.validation import load_config, memory
from nxd_lc.config.errors import ConfigError
from nxd_lc.config.structure import typed_config
from nxd_lc.models.config_json import read_model_json

S = 64
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 301,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False}
MIXTRAL = {**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
           "num_experts_per_tok": 2}
HUGE = 10**7


def _json(tmp_path: Path, base: dict[str, Any] = LLAMA, **fields: Any) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **fields}))
    return str(path)


def _raw(model_json: str, *, devices: int = 1, accelerator: str = "cpu", ds: dict[str, Any] | None = None,
         model: dict[str, Any] | None = None, data: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    return {"trainer": {"devices": devices, "num_nodes": 1, "max_steps": 2, "accelerator": accelerator},
            "data": {"micro_batch_size": 1, "global_batch_size": devices, "seq_length": S, **(data or {})},
            "distributed_strategy": ds or {},
            "model": {"model_config": model_json, "encoder_seq_length": S, **(model or {})}, **top}


def _parts(raw: dict[str, Any], layers: int) -> list[int]:
    """The estimate's parts that are linear in the layers (all but the optimizer's step buffers, which saturate at
    one 64 MiB bucket) with ``model.num_layers: layers`` (judged nowhere: typed config only)."""
    cfg = typed_config({**raw, "model": {**raw["model"], "num_layers": layers}})
    est = memory.estimate_memory(cfg, read_model_json(cfg))
    assert est is not None
    return [est.parameters, est.gradients, est.optimizer_state, est.master_weights, est.activations]


@pytest.fixture
def layer_evaluations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the estimate's evaluations of one decoder layer's tensors."""
    calls = [0]
    real = memory._layer_tensors

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "_layer_tensors", counting)
    return calls


LAYOUTS = {"pp1": {}, "pp2": {"pipeline_model_parallel_size": 2},
           "pp2v2": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_memory_estimate_counts_layer_kinds_not_layers(tmp_path: Path, layer_evaluations: list[int], family: str,
                                                       layout: str) -> None:
    """10^4 then 10^7 decoder layers: a few per-layer evaluations per pipeline rank whatever the count, and the
    figure is the exact linear extension of 8 and 16 layers (every part of the estimate is linear in the layers of
    each kind; MoE every 2nd layer)."""
    ds = LAYOUTS[layout]
    devices = ds.get("pipeline_model_parallel_size", 1)
    base = MIXTRAL if family == "mixtral" else LLAMA
    raw = _raw(_json(tmp_path, base), devices=devices, accelerator="auto", ds=ds,
               model={"moe": {"frequency": 2}} if family == "mixtral" else None)
    small, larger = _parts(raw, 8), _parts(raw, 16)
    for layers in (10**4, HUGE):
        layer_evaluations[0] = 0
        assert _parts(raw, layers) == [a + (layers - 8) // 8 * (b - a) for a, b in zip(small, larger)]
        assert layer_evaluations[0] <= 2 * devices, (layers, layer_evaluations[0])


@pytest.mark.parametrize("where", ["model.num_layers", "config.json"])
def test_dry_run_at_ten_million_layers_answers_with_bounded_memory(tmp_path: Path, where: str) -> None:
    """The dry run at 10^7 layers answers with a bounded allocation (it took 1.46 GB at 10^6 layers): on ``cpu``
    refused by the host's memory; on a device the dry run cannot size (``auto`` on this host, as NxDT's examples are
    dry-run off the device) refused too, against the most memory any device has -- it answered "valid" before, and
    the launch would fail -- each naming the layer count's key or config.json's field and the bound; a normal layer
    count on ``auto`` stays valid, reporting its figure."""
    from nxd_lc.app.run import dry_run

    fields = {"num_hidden_layers": HUGE} if where == "config.json" else {}
    model = {"num_layers": HUGE} if where == "model.num_layers" else None
    path = _json(tmp_path, **fields)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as e:
            load_config(_raw(path, model=model))
        with pytest.raises(ConfigError) as unknown_device:
            load_config(_raw(path, accelerator="auto", model=model))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    named = "model.num_layers: 10000000" if where == "model.num_layers" else \
        f"model.model_config: config.json ({path}): num_hidden_layers=10000000"
    (problem,) = e.value.problems
    assert problem.startswith(named) and "this host's memory" in problem, problem
    (problem,) = unknown_device.value.problems
    assert problem.startswith(named) and "the most memory any device nxd_lc runs on has (288 GB" in problem, problem
    assert peak < 64 * 2**20, peak
    if where == "config.json" and not __import__("torch").cuda.is_available():
        report = dry_run(load_config(_raw(_json(tmp_path), accelerator="auto")))
        line = next(x for x in report.splitlines() if x.startswith("# memory estimate per rank: "))
        assert "parameters" in line and "not judged" in report, report


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@pytest.mark.parametrize("devices", [1, 2])
def test_num_workers_is_bounded_by_the_cpus_per_rank(tmp_path: Path, devices: int) -> None:
    """``data.num_workers`` of 100000 validated and then forked workers until the process limit (a raw
    BlockingIOError at launch): refused, naming the key, the bound (this host's CPUs over ``trainer.devices``
    ranks, at least 1) and the fix; the bound itself is accepted."""
    from nxd_lc.app.run import dry_run

    bound = max(1, _cpus() // devices)
    path = _json(tmp_path)
    raw = _with_run_dir(_raw(path, devices=devices, data={"num_workers": 100000}), explicit_log_dir=str(tmp_path))
    (problem,) = _launch_problems(raw)  # every rank at launch, on its own node
    assert problem.startswith("data.num_workers: 100000 exceeds"), problem
    assert f"set data.num_workers <= {bound}" in problem and f"trainer.devices={devices}" in problem, problem
    # the dry run (maybe a login node smaller than the training nodes) lists it, under a headline that says so
    report = dry_run(load_config(raw)).splitlines()
    assert report[0].endswith("but launching it on this host would stop (1 problem(s), listed at the end; exit "
                              "status 3)"), report[0]
    assert report[-1] == f"#   - at launch: {problem}", report[-1]
    ok = _with_run_dir(_raw(path, devices=devices, data={"num_workers": bound}), explicit_log_dir=str(tmp_path))
    assert _launch_problems(ok) == []
    over = {"num_workers": bound + max(1, _cpus())}
    assert _launch_problems(_with_run_dir(_raw(path, devices=devices, data=over), explicit_log_dir=str(tmp_path)))


def _launch_problems(raw: dict[str, Any]) -> list[str]:
    """The problems ``load_config(check_paths=True)`` (every rank, at launch) reports, [] when it passes."""
    try:
        load_config(raw, check_paths=True)
    except ConfigError as e:
        return e.problems
    return []


def _with_run_dir(raw: dict[str, Any], **exp_manager: Any) -> dict[str, Any]:
    """``raw`` with what a launch needs besides the run directory ``exp_manager`` (data and a tokenizer)."""
    return {**raw, "data": {**raw["data"], "builtin_corpus": "python_stdlib", "tokenizer": {"type": "bytelevel_bpe"}},
            "exp_manager": exp_manager}


@pytest.mark.parametrize("where", ["/proc/nxd_lc_run", "/proc"])
def test_an_unwritable_run_directory_is_refused_before_launch(tmp_path: Path, where: str) -> None:
    """``exp_manager.explicit_log_dir`` where nothing can be created (under /proc even root cannot) validated and
    the launch died with a raw PermissionError on ``.nxd_lc.lock``: refused at validation naming the key and the
    path, and listed by the dry run as what launching would stop with."""
    from nxd_lc.app.run import dry_run

    raw = _with_run_dir(_raw(_json(tmp_path)), explicit_log_dir=where)
    (problem,) = _launch_problems(raw)
    assert problem.startswith(f"exp_manager.explicit_log_dir: the run directory {where} is not writable"), problem
    assert "/proc" in problem and "choose a writable directory" in problem, problem
    assert "at launch: exp_manager.explicit_log_dir" in dry_run(load_config(raw))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_a_read_only_run_directory_is_refused_for_a_user(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        (problem,) = _launch_problems(_with_run_dir(_raw(_json(tmp_path)), exp_dir=str(locked), name="run"))
    finally:
        locked.chmod(0o755)
    assert problem.startswith(f"exp_manager.exp_dir: the run directory {locked / 'run'} is not writable"), problem


def test_a_run_directory_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    where = tmp_path / "file" / "run"
    (problem,) = _launch_problems(_with_run_dir(_raw(_json(tmp_path)), explicit_log_dir=str(where)))
    assert problem.startswith(f"exp_manager.explicit_log_dir: the run directory {where} cannot be created: "
                              f"{tmp_path / 'file'} is not a directory"), problem


def test_the_writability_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    """A run directory that does not exist yet is judged by its nearest existing parent; the probe creates
    neither the directory nor any file (validation runs on every rank)."""
    base = tmp_path / "runs"
    base.mkdir()
    raw = _with_run_dir(_raw(_json(tmp_path)), explicit_log_dir=str(base / "a" / "b"))
    assert _launch_problems(raw) == []
    assert list(base.iterdir()) == []
    existing = _with_run_dir(_raw(_json(tmp_path)), explicit_log_dir=str(base))
    assert _launch_problems(existing) == [] and list(base.iterdir()) == []


@pytest.mark.parametrize("field", ["vocab_size", "intermediate_size", "num_hidden_layers"])
def test_a_config_json_size_no_layout_can_hold_is_named(tmp_path: Path, field: str) -> None:
    """config.json's ``vocab_size`` / ``intermediate_size`` of 10^12 (or 10^7 layers) was refused by the memory
    estimate naming the micro batch, the sequence length and the parallel sizes; no layout holds such a model, so
    the error names config.json, its path and the field, and the fix."""
    value = HUGE if field == "num_hidden_layers" else 10**12
    path = _json(tmp_path, **{field: value})
    with pytest.raises(ConfigError) as e:
        load_config(_raw(path, devices=2))
    (problem,) = e.value.problems
    assert problem.startswith(f"model.model_config: config.json ({path}): {field}={value} makes the model's "
                              "parameters, gradients and optimizer state "), problem
    assert "even spread over all 2 ranks" in problem and f"fix config.json's {field}" in problem, problem


def test_a_model_key_no_layout_can_hold_is_named(tmp_path: Path) -> None:
    """``model.num_layers`` of 10^7 (item 1's dry run): the refusal names that key, not the layout's."""
    with pytest.raises(ConfigError) as e:
        load_config(_raw(_json(tmp_path), model={"num_layers": HUGE}))
    (problem,) = e.value.problems
    assert problem.startswith(f"model.num_layers: {HUGE} makes the model's parameters, gradients and optimizer "
                              "state "), problem
    assert "lower model.num_layers" in problem, problem


def test_a_layout_problem_still_names_the_layout_keys(tmp_path: Path) -> None:
    """A model that fits spread over the ranks but not at this micro batch: the layout's keys, as before."""
    path = _json(tmp_path, max_position_embeddings=2**16)
    first = r"^invalid .*\n  - data.micro_batch_size: the estimated memory per rank"
    with pytest.raises(ConfigError, match=first) as e:
        load_config(_raw(path, data={"micro_batch_size": 2**10, "global_batch_size": 2**10, "seq_length": 2**16},
                         model={"encoder_seq_length": 2**16}))
    # the layer count is among the keys to change (the re-run: 300 layers in config.json were not named)
    assert e.value.problems[0].endswith(", config.json's num_hidden_layers"), e.value.problems[0]
    with pytest.raises(ConfigError) as e:
        load_config(_raw(path, data={"micro_batch_size": 2**10, "global_batch_size": 2**10, "seq_length": 2**16},
                         model={"encoder_seq_length": 2**16, "num_layers": 4}))
    assert e.value.problems[0].endswith(", model.num_layers"), e.value.problems[0]


def _megatron_raw(tmp_path: Path, global_batch_size: int, docs: int = 8) -> tuple[dict[str, Any], str]:
    """A Megatron indexed corpus of ``docs`` documents of 100 tokens (12 samples of 64+1 tokens)."""
    from nxd_lc.data import megatron_indexed as mi

    prefix = str(tmp_path / "corpus")
    mi.write_indexed_dataset(prefix, [list(range(1, 101))] * docs)
    raw = _raw(_json(tmp_path), data={"data_prefix": prefix, "global_batch_size": global_batch_size,
                                      "tokenizer": {"type": "gpt2"}})
    return raw, prefix


def test_a_global_batch_above_the_megatron_data_is_refused_at_validation(tmp_path: Path) -> None:
    """``data.global_batch_size`` of 10^12 validated, and after the model was built a raw traceback said the dataset
    has fewer samples than one global batch. Megatron indexed data knows its size from its files (.bin bytes over
    the token width of .idx's header, no scan): refused naming the key, the bound and the file; a batch the data
    holds passes."""
    raw, prefix = _megatron_raw(tmp_path, 10**12)
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    (problem,) = e.value.problems
    assert problem.startswith(f"data.global_batch_size: {10**12} exceeds the training samples data.data_prefix "
                              "holds: at most 12 samples"), problem
    assert f"{prefix}.bin" in problem and "lower data.global_batch_size to at most 12" in problem, problem
    load_config(_megatron_raw(tmp_path, 12)[0])


def test_a_global_batch_above_the_built_dataset_names_the_key() -> None:
    """Where the size is known only once the data is built (tokenized text), the sampler's refusal is a
    ConfigError naming data.global_batch_size and the bound (the launch prints it, no traceback)."""
    from nxd_lc.data.sampler import PretrainingSampler

    with pytest.raises(ConfigError) as e:
        PretrainingSampler(10, 0, 1, 0, 2, seed=0, global_batch_size=10**12)
    (problem,) = e.value.problems
    assert problem.startswith("data.global_batch_size: the dataset has 10 samples, fewer than one global batch "
                              f"({10**12})"), problem
    assert "lower data.global_batch_size to at most 10" in problem, problem


def test_a_global_batch_above_an_alignment_jsonl_is_refused_at_validation(tmp_path: Path) -> None:
    """An SFT file of 8 records with ``data.global_batch_size`` 10^12 validated (the dry run said valid) and the
    launch refused once the data was built: every sample holds at least one record, so validation refuses it naming
    the key, the file and the bound; 8 is accepted."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": f"q {i}", "output": f"a {i}"}) + "\n" for i in range(8)) + "\n")
    raw = _raw(_json(tmp_path), data={"train_dir": str(data), "global_batch_size": 10**12},
               model_alignment_strategy={"sft": {}})
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    (problem,) = e.value.problems
    assert problem == (f"data.global_batch_size: {10**12} exceeds the 8 records of data.train_dir ({data}); every "
                       "training sample holds at least one record: lower data.global_batch_size to at most 8 or add "
                       "records"), problem
    load_config({**raw, "data": {**raw["data"], "global_batch_size": 8}})
