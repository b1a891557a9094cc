"""Trn2 / Trn3's native-device path run for real on a stand-in ``neuron`` device (issue 51,
:mod:`tests.neuron_standin`: a PrivateUse1 backend renamed ``neuron``, host memory, CPU kernels, a ``neuron``
process-group and compile backend).

Every test runs in child processes: registering a PrivateUse1 backend is process-wide and cannot be undone (it
would become every later test's ``torch.accelerator``). The job runs through ``train.py`` with
``PYTHONPATH=tests/neuron_standin/pkgs`` (a ``torch_neuronx`` that installs the stand-in, so nxd_lc takes its
native-device path as on Trn2) and is compared with the same job on the CPU: the reference is an independent
device, the values are the CPU run's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STANDIN_PATH = f"{REPO}{os.pathsep}{REPO / 'tests' / 'neuron_standin' / 'pkgs'}"
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

pytestmark = pytest.mark.lane1_only  # torch >= 2.10 (the native device's torch); lane 2 is torch 2.9 + torch-xla


def _env(devices: int = 1) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=STANDIN_PATH, NXD_LC_STANDIN_DEVICES=str(devices), OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1")


_SEMANTICS = r'''
import json, torch
import torch_neuronx  # the test bed's: installs the stand-in
from tests.neuron_standin import counters, reset_counters
from nxd_lc.runtime import accel
from nxd_lc.layers.param_attrs import move_module
from nxd_lc.distributed import parallel_state as ps

out = {"accelerator": str(torch.accelerator.current_accelerator()), "native": accel.native_neuron_available()}
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
w = torch.randn(8, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
xd, wd = x.to("neuron"), w.detach().to("neuron").requires_grad_(True)
y, yd = torch.tanh(x @ w).sum(), torch.tanh(xd @ wd).sum()
y.backward(); yd.backward()
out["device_type"] = yd.device.type
out["forward_equal"] = bool(torch.equal(y, yd.cpu()))
out["grad_equal"] = bool(torch.equal(w.grad, wd.grad.cpu())) and wd.grad.device.type == "neuron"
torch.manual_seed(7); a = torch.randn(16, device="neuron")
torch.manual_seed(7); b = torch.randn(16, device="neuron")
torch.manual_seed(8); c = torch.randn(16, device="neuron")
out["rng_reproducible"] = bool(torch.equal(a.cpu(), b.cpu())) and not bool(torch.equal(a.cpu(), c.cpu()))
torch.neuron.manual_seed(7); d = torch.randn(16, device="neuron")  # the device module's seed alone
out["device_seed"] = bool(torch.equal(a.cpu(), d.cpu()))
with torch.autocast("neuron", dtype=torch.bfloat16):
    out["autocast_dtype"] = str((xd @ wd).dtype)
out["compiled_equal"] = bool(torch.equal(torch.compile(lambda t: torch.tanh(t @ wd), backend="neuron")(xd).cpu(),
                                         torch.tanh(xd @ wd).detach().cpu()))
# parallel attributes across the device move: nxd_lc's move keeps them, a plain .to() does not on this device
from nxd_lc.layers import ColumnParallelLinear
ps.initialize_model_parallel(tensor_model_parallel_size=1)
kept = move_module(ColumnParallelLinear(8, 4, bias=False), "neuron")
plain = ColumnParallelLinear(8, 4, bias=False).to("neuron")
out["move_module_keeps"] = hasattr(kept.weight, "tensor_model_parallel") and kept.weight.device.type == "neuron"
out["plain_to_keeps"] = hasattr(plain.weight, "tensor_model_parallel")
reset_counters()
z = xd * 2
z.cpu()
out["copies_of_one_read"] = {k: v for k, v in counters().items() if k in ("host_to_device", "device_to_host")}
print("RESULT " + json.dumps(out))
'''


def _result(out: subprocess.CompletedProcess) -> dict:
    m = re.search(r"^RESULT (.*)$", out.stdout, re.M)
    assert m, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(m.group(1))


def test_the_standin_is_a_device_torch_and_nxd_lc_see_as_trainium() -> None:
    """Built (or loaded from its cache) in a fresh process: ``torch.accelerator`` reports ``neuron``, nxd_lc's
    detection finds the native device, ops and gradients equal the CPU's bit for bit, RNG follows
    ``torch.manual_seed``, autocast gives bf16, the ``neuron`` compile backend runs; nxd_lc's device move keeps the
    parallel attributes where a plain ``.to()`` loses them (the XLA path's defect, DESIGN principle 17)."""
    out = subprocess.run([sys.executable, "-c", _SEMANTICS], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=900, check=False)
    r = _result(out)
    assert r["accelerator"] == "neuron" and r["native"] and r["device_type"] == "neuron", r
    assert r["forward_equal"] and r["grad_equal"] and r["rng_reproducible"] and r["device_seed"], r
    assert r["compiled_equal"], r
    assert r["autocast_dtype"] == "torch.bfloat16", r
    assert r["move_module_keeps"] and not r["plain_to_keeps"], r
    assert r["copies_of_one_read"] == {"host_to_device": 0, "device_to_host": 1}, r


def _train_cmd(accelerator: str, log_dir: Path, corpus: str, cache: Path, nproc: int, extra: list[str],
               config: str = "cpu_tiny_llama_config") -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "train.py", "--config-name", config,
            f"trainer.accelerator={accelerator}", f"trainer.devices={nproc}",
            "trainer.max_steps=4", "model.encoder_seq_length=64", "data.micro_batch_size=1",
            "data.global_batch_size=2", "++model.num_layers=2", "trainer.val_check_interval=2",
            "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1", "+trainer.enable_progress_bar=false",
            f"exp_manager.explicit_log_dir={log_dir}", "exp_manager.checkpoint_callback_params.every_n_train_steps=2",
            "~data.builtin_corpus", f"+data.train_dir={corpus}", "+data.file_glob=**/*.py", "data.val_fraction=0.1",
            "data.tokenizer.vocab_size=1024", f"+data.tokenizer.cache_dir={cache}", "model.optim.sched.warmup_steps=1",
            *extra]


_METRIC = re.compile(r"step (\d+)(?:/\d+)? \| (?:loss ([\d.]+) \| lr \S+ \| grad_norm ([\d.]+)|val_loss ([\d.]+))")


def _metrics(text: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {"loss": {}, "grad_norm": {}, "val_loss": {}}
    for m in _METRIC.finditer(text):
        step = int(m.group(1))
        if m.group(4):
            out["val_loss"][step] = float(m.group(4))
        else:
            out["loss"][step], out["grad_norm"][step] = float(m.group(2)), float(m.group(3))
    return out


def _run_both(tmp_path: Path, nproc: int, extra: list[str], config: str = "cpu_tiny_llama_config",
              cpu_extra: tuple[str, ...] = ()) -> tuple[dict, dict, str]:
    from tests.test_e2e import _small_corpus

    corpus, cache = _small_corpus(str(tmp_path)), tmp_path / "cache"
    runs = {}
    for acc in ("cpu", "neuron"):
        more = [*extra, *(cpu_extra if acc == "cpu" else ())]
        out = subprocess.run(_train_cmd(acc, tmp_path / acc, corpus, cache, nproc, more, config), cwd=REPO,
                             env=_env(nproc), capture_output=True, text=True, timeout=900, check=False)
        text = out.stdout + out.stderr
        (tmp_path / f"{acc}.log").write_text(text)
        assert out.returncode == 0, text[-4000:]
        runs[acc] = (_metrics(text), text)
    return runs["cpu"][0], runs["neuron"][0], runs["neuron"][1]


TP1 = ["distributed_strategy.tensor_model_parallel_size=1", "distributed_strategy.sequence_parallel=false"]
#: (processes, config, overrides, relative tolerance, overrides of the CPU run only)
LAYOUTS = {
    "1-device": (1, "cpu_tiny_llama_config", TP1, 1e-5, ()),
    "tp2-sp": (2, "cpu_tiny_llama_config", [], 1e-5, ()),  # the demo's TP 2 + SP with kv_replicator 1
    "dp2-zero1": (2, "cpu_tiny_llama_config", [*TP1, "distributed_strategy.zero1=true"], 1e-5, ()),
    "cp2-ring": (2, "cpu_tiny_llama_config", [*TP1, "distributed_strategy.context_parallel_size=2",
                                              "++distributed_strategy.context_parallel_algo=ring"], 1e-5, ()),
    "cp2-ulysses": (2, "cpu_tiny_llama_config", [*TP1, "distributed_strategy.context_parallel_size=2",
                                                 "++distributed_strategy.context_parallel_algo=ulysses"], 1e-5, ()),
    "pp2-1f1b": (2, "cpu_tiny_llama_config", [*TP1, "distributed_strategy.pipeline_model_parallel_size=2"], 1e-5,
                 ()),
    # dropless: on the native device every expert takes T slots (static shapes, no host read); the CPU run's
    # capacity is the largest load read back, so the two dispatch differently and must agree
    "ep2-mixtral": (2, "cpu_tiny_mixtral_config", ["model.moe.dropless=true"], 1e-5, ()),
    "bf16-mixed": (1, "cpu_tiny_llama_config", [*TP1, "precision.type=mixed_precision"], 2 ** -7, ()),
    "autocast": (1, "cpu_tiny_llama_config", [*TP1, "precision.type=autocast"], 2 ** -7, ()),
    # the stochastic-rounding modes: software rounding with the device generator (no Neuron hardware rounding)
    "bf16sr": (1, "cpu_tiny_llama_config", [*TP1, "precision.type=bf16SR"], 2 ** -7, ()),
    "mixed-sr": (1, "cpu_tiny_llama_config", [*TP1, "precision.type=mixed_precisionSR"], 2 ** -7, ()),
    "manual": (1, "cpu_tiny_llama_config", [*TP1, "precision.type=manual"], 2 ** -7, ()),
    # model.compile true: the decoder layers compiled with the 'neuron' backend; the CPU run stays eager (inductor
    # on 2 cores compiles for minutes), which the compiled graphs (aot_eager) must equal
    "compile": (1, "cpu_tiny_llama_config", [*TP1, "++model.compile=true"], 1e-5, ("++model.compile=false",)),
}


#: run by ``make test-extended`` only (CI time; lane 1 keeps one case of each kind: a bf16 mode, PP 2 (1F1B) and
#: ring CP 2 run in the shrunk NxDT 70B_CP file below (PP 2 x ring CP 2 on 4 devices), ring CP 2 also in the
#: two-device copy test; DP and Ulysses CP run on the XLA test bed and on gloo)
EXTENDED = frozenset({"dp2-zero1", "cp2-ulysses", "cp2-ring", "pp2-1f1b", "bf16-mixed", "autocast", "bf16sr",
                      "mixed-sr", "manual", "sft", "dpo", "orpo", "hf_llama3_8B_trn2_config"})


def _cases(names: object) -> list[object]:
    return [pytest.param(n, id=n, marks=(pytest.mark.extended,) if n in EXTENDED else ()) for n in sorted(names)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", _cases(LAYOUTS))
def test_train_py_on_the_standin_equals_the_cpu_run(tmp_path: Path, layout: str) -> None:
    """``train.py`` with ``trainer.accelerator=neuron`` on the stand-in (its native-device path: the ``neuron``
    process-group backend, the device module, autocast on ``neuron``) against ``trainer.accelerator=cpu`` at the
    same layout: the same losses, gradient norms and validation losses (fp32 to 1e-5 relative as printed, the bf16
    modes to 2^-7), and a checkpoint."""
    nproc, config, extra, rel, cpu_extra = LAYOUTS[layout]
    cpu, neuron, text = _run_both(tmp_path, nproc, extra, config, cpu_extra)
    assert sorted(cpu["loss"]) == [1, 2, 3, 4] and sorted(cpu["val_loss"]) == [2, 4], cpu
    for key in ("loss", "grad_norm", "val_loss"):
        assert neuron[key].keys() == cpu[key].keys(), (key, neuron, cpu)
        for step, value in cpu[key].items():
            assert neuron[key][step] == pytest.approx(value, rel=rel), (key, step, neuron, cpu)
    ckpts = list((tmp_path / "neuron" / "checkpoints").iterdir())
    assert any("step=4" in p.name for p in ckpts), ckpts


def _in_process_job(tmp_path: Path, *, steps: int, seq: int, global_batch: int, layers: int, vocab: int,
                    log_every: int, devices: int = 1) -> list[str]:
    """Overrides of ``cpu_tiny_llama_config`` for a job on stand-in devices run in the test bed's process
    (``probe_job.py``, ``nan_job.py``; one process per device under torchrun): micro-batch 1, TP 1, no validation,
    no checkpoint, no TensorBoard, no preemption handler (the callers that vote per step add it back)."""
    from tests.test_e2e import _small_corpus

    corpus = _small_corpus(str(tmp_path))
    return ["trainer.accelerator=neuron", f"trainer.devices={devices}", *TP1, f"trainer.max_steps={steps}",
            f"model.encoder_seq_length={seq}", "data.micro_batch_size=1", f"data.global_batch_size={global_batch}",
            f"++model.num_layers={layers}", "trainer.val_check_interval=100", "trainer.limit_val_batches=0",
            f"trainer.log_every_n_steps={log_every}", "+trainer.enable_progress_bar=false", "~data.builtin_corpus",
            f"+data.train_dir={corpus}", "+data.file_glob=**/*.py", "data.val_fraction=0.1",
            f"data.tokenizer.vocab_size={vocab}", f"+data.tokenizer.cache_dir={tmp_path / 'cache'}",
            f"exp_manager.explicit_log_dir={tmp_path / 'run'}", "exp_manager.create_tensorboard_logger=false",
            "exp_manager.checkpoint_callback_params.every_n_train_steps=100", "+exp_manager.preemption_signals=[]"]


#: model -> (config, overrides) of the per-step inventory test
PROBED = {"llama": ("cpu_tiny_llama_config", ["++model.num_layers=2"]),
          "mixtral-dropless": ("cpu_tiny_mixtral_config", ["model.moe.dropless=true",
                                                           "distributed_strategy.expert_model_parallel_size=1"])}


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(PROBED))
def test_every_ordinary_step_runs_the_same_ops_and_reads_nothing_back(tmp_path: Path, model: str) -> None:
    """The demo's model (and the tiny Mixtral, dropless) on one stand-in device, 5 steps of 2 micro-batches of
    packed documents, logging every 4th step: from step 2 on every step runs the same distinct (op, dtype, shape)
    set (on TorchNeuron each new one is a compile; the per-document attention split made new shapes every step
    before, and so did the dropless dispatch, whose capacity was the largest expert load read back: 8 reads per
    step), and an ordinary step copies only its batch to the device (4 tensors x 2 micro-batches; the router's token
    count was uploaded per MoE layer and micro-batch) and reads nothing back (the non-finite check read its norm
    every step before); the logging steps read their metrics."""
    config, extra = PROBED[model]
    args = [a for a in _in_process_job(tmp_path, steps=5, seq=64, global_batch=2, layers=2, vocab=1024, log_every=4)
            if not a.startswith("++model.num_layers")] + extra
    out = subprocess.run([sys.executable, str(REPO / "tests" / "neuron_standin" / "probe_job.py"), "--config-path",
                          str(REPO / "conf"), "--config-name", config, *args], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=900, check=False)
    steps = _result(out)["steps"]
    assert sorted(steps, key=int) == ["1", "2", "3", "4", "5"], steps.keys()
    inventories = [set(steps[s]["ops"]) for s in ("2", "3", "4", "5")]
    assert all(inv == inventories[0] for inv in inventories), [sorted(inv - inventories[0])[:5] for inv in inventories]
    assert len(inventories[0]) > 50  # the step's real op set, not an empty record
    for s in ("2", "3"):  # ordinary steps
        assert steps[s]["copies"]["host_to_device"] == 8 and steps[s]["copies"]["device_to_host"] == 0, steps[s]
    assert steps["4"]["copies"]["device_to_host"] > 0  # the logging step reads its metrics


@pytest.mark.slow
@pytest.mark.distributed
def test_two_devices_with_ring_cp_read_nothing_back_on_ordinary_steps(tmp_path: Path) -> None:
    """Ring CP 2 on two stand-in devices (one process each, with the preemption handler's per-step vote): every
    ordinary step runs the same op set from step 2 on and reads nothing back on either rank; it copies the batch
    to the device (4 tensors x 2 micro-batches). Two reads per step are gone: the ring's (it read its segment
    bounds on the host to skip and mask tiles: 27 device-to-host reads per step; the rank-invariant ring of XLA
    now runs on the native device too) and the step vote's (a device all-reduce read back; now the rendezvous
    store's, as on XLA)."""
    args = [a for a in _in_process_job(tmp_path, steps=5, seq=64, global_batch=2, layers=2, vocab=1024,
                                       log_every=4, devices=2) if a != "+exp_manager.preemption_signals=[]"]
    args += ["distributed_strategy.context_parallel_size=2", "++distributed_strategy.context_parallel_algo=ring"]
    out = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", "tests/neuron_standin/probe_job.py", *args],
                         cwd=REPO, env=dict(_env(2), PROBE_RESULT_DIR=str(tmp_path)), capture_output=True, text=True,
                         timeout=900, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())["steps"]
        inventories = [set(steps[s]["ops"]) for s in ("2", "3", "4", "5")]
        assert all(inv == inventories[0] for inv in inventories) and len(inventories[0]) > 50, rank
        for s in ("2", "3"):
            assert steps[s]["copies"]["device_to_host"] == 0, (rank, s, steps[s]["copies"])
            assert steps[s]["copies"]["host_to_device"] == 8, (rank, s, steps[s]["copies"])


@pytest.mark.slow
def test_a_nan_step_is_decided_on_the_device_and_stops_the_run_at_the_next_read(tmp_path: Path) -> None:
    """The non-finite guard on the native device (one stand-in device, the demo's model): NaN gradients in
    optimizer step 2, logging every 3rd step. The decision is made in the step (``in_graph``, as on XLA: no read of
    the norm), so steps 1 and 2 read nothing back, and the run raises ``NonFiniteTrainingError`` naming step 2 at
    step 3, its first read, with finite parameters (step 2's update selected away). On CPU it raises at step 2
    (``tests/test_nonfinite_step.py``)."""
    args = _in_process_job(tmp_path, steps=6, seq=32, global_batch=1, layers=1, vocab=300, log_every=3)
    out = subprocess.run([sys.executable, str(REPO / "tests" / "neuron_standin" / "nan_job.py"), "--nan-step", "2",
                          *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900, check=False)
    r = _result(out)
    assert r["error_type"] == "NonFiniteTrainingError" and "optimizer step 2 " in r["error"], r
    assert r["in_graph"] is True and r["param_device"] == "neuron" and r["params_finite"] is True, r
    reads = r["device_to_host_per_step"]
    assert reads.get("1") == 0 and reads.get("2") == 0, reads  # no read of the norm on the steps before the log


def _alignment_data(tmp: Path) -> list[str]:
    """An HF tokenizer dir, SFT records and preference pairs under ``tmp``; the data keys of an alignment run."""
    from nxd_lc.data.tokenizer import train_bytelevel_bpe

    texts = [f"question {i}: what is {i} plus {i}? the answer is {2 * i}" for i in range(200)]
    train_bytelevel_bpe(texts, 300).save_pretrained(str(tmp / "tok"))
    (tmp / "sft.jsonl").write_text("".join(json.dumps({"input": f"what is {i} plus {i}?", "output": f"{2 * i}"})
                                           + "\n" for i in range(16)))
    (tmp / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?", "chosen": f"{2 * i}",
                                                         "rejected": f"{2 * i + 1}"}) + "\n" for i in range(16)))
    return ["~data.builtin_corpus", "~data.val_fraction", f"data.tokenizer.type={tmp / 'tok'}"]


#: alignment workflow -> its overrides (data file, algorithm); "lora" also compares the merged HF export
ALIGNMENT = {
    "sft": ["+data.train_dir={tmp}/sft.jsonl", "+model_alignment_strategy={sft:{packing:true}}"],
    "dpo": ["+data.train_dir={tmp}/pairs.jsonl", "+model_alignment_strategy={dpo:{precompute_ref_log_probs:true}}"],
    "orpo": ["+data.train_dir={tmp}/pairs.jsonl", "+model_alignment_strategy={orpo:{}}"],
    "lora": ["+data.train_dir={tmp}/sft.jsonl",
             "+model_alignment_strategy={sft:{packing:true},peft:{lora_rank:4,lora_alpha:8,"
             "target_modules:[qkv_proj,down_proj],merge_lora:true}}"],
}


@pytest.mark.slow
@pytest.mark.parametrize("workflow", _cases(ALIGNMENT))
def test_alignment_on_the_standin_equals_the_cpu_run(tmp_path: Path, workflow: str) -> None:
    """SFT, DPO (precomputed reference), ORPO and LoRA (with its merged HF export) through ``train.py`` on one
    stand-in device against the CPU: the same losses and gradient norms (1e-5), and for LoRA the same merged
    weights (transformers loads both exports)."""
    data = _alignment_data(tmp_path)
    extra = [*TP1, *data, *(o.replace("{tmp}", str(tmp_path)) for o in ALIGNMENT[workflow])]
    runs = {}
    for acc in ("cpu", "neuron"):
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node=1", "train.py", "--config-name", "cpu_tiny_llama_config",
               f"trainer.accelerator={acc}", "trainer.devices=1", "trainer.max_steps=3",
               "model.encoder_seq_length=64", "data.micro_batch_size=1", "data.global_batch_size=2",
               "++model.num_layers=2", "trainer.val_check_interval=100", "trainer.log_every_n_steps=1",
               "+trainer.enable_progress_bar=false", f"exp_manager.explicit_log_dir={tmp_path / acc}",
               "exp_manager.checkpoint_callback_params.every_n_train_steps=3", "model.optim.sched.warmup_steps=1",
               *extra]
        out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900, check=False)
        text = out.stdout + out.stderr
        (tmp_path / f"{acc}.log").write_text(text)
        assert out.returncode == 0, text[-4000:]
        runs[acc] = _metrics(text)
    assert sorted(runs["cpu"]["loss"]) == [1, 2, 3], runs
    for key in ("loss", "grad_norm"):
        for step, value in runs["cpu"][key].items():
            assert runs["neuron"][key][step] == pytest.approx(value, rel=1e-5), (key, step, runs)
    if workflow == "lora":
        import torch
        from transformers import AutoModelForCausalLM

        merged = [AutoModelForCausalLM.from_pretrained(str(tmp_path / acc / "hf_merged")).state_dict()
                  for acc in ("cpu", "neuron")]
        assert merged[0].keys() == merged[1].keys()
        for name, tensor in merged[0].items():
            torch.testing.assert_close(merged[1][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_resume_on_the_standin_equals_the_uninterrupted_run_and_exports(tmp_path: Path) -> None:
    """On one stand-in device: 4 steps uninterrupted; 2 steps, then a resume to 4 from the step-2 checkpoint (saved
    from device tensors): steps 3-4 give the same losses (1e-5). The step-4 checkpoint exports to HF
    (``python -m nxd_lc.cli.convert``, no ``--config-name``) and transformers' logits equal those of the export of the
    CPU run's checkpoint (the two runs' weights agree to fp32 rounding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_e2e import _small_corpus

    corpus, cache = _small_corpus(str(tmp_path)), tmp_path / "cache"

    def train(acc: str, log_dir: Path, steps: int) -> dict[str, dict[int, float]]:
        cmd = _train_cmd(acc, log_dir, corpus, cache, 1, [*TP1, f"trainer.max_steps={steps}"])
        out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900, check=False)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        return _metrics(out.stdout + out.stderr)

    full = train("neuron", tmp_path / "full", 4)
    train("neuron", tmp_path / "resumed", 2)
    resumed = train("neuron", tmp_path / "resumed", 4)
    assert sorted(resumed["loss"]) == [3, 4], resumed
    for step in (3, 4):
        assert resumed["loss"][step] == pytest.approx(full["loss"][step], rel=1e-5), (step, resumed, full)
    train("cpu", tmp_path / "cpu", 4)
    logits = []
    for run in ("full", "cpu"):
        out = subprocess.run([sys.executable, "-m", "nxd_lc.cli.convert", "--checkpoint",
                              str(tmp_path / run / "checkpoints"), "--output", str(tmp_path / f"hf_{run}")],
                             cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                             timeout=600, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"hf_{run}")).eval()
        with torch.no_grad():
            logits.append(model(torch.arange(1, 33).unsqueeze(0)).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


#: NxDT's own example files shrunk (tests/test_nxdt_examples.py's overrides) that run on the stand-in: TP 2 with
#: Trn2's settings, PP 2 x ring CP 2 on 4 devices, and Mixtral 8x7B's MoE at TP 2 + SP x PP 2 on 4 devices
NXDT_FILES = ("hf_llama3_8B_trn2_config", "hf_llama3_70B_CP_config", "hf_mixtral_8x7b_config")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", _cases(NXDT_FILES))
def test_nxdt_example_shrunk_on_the_standin_equals_the_cpu_run(name: str, tmp_path: Path) -> None:
    """An NxDT example file, shrunk as ``make test`` trains it, on one stand-in device per process against the
    CPU: the same losses and gradient norms (fp32 1e-5; the files' bf16 modes 2^-7: the native device's
    fixed-shape attention, one masked SDPA, sums in another order than the CPU's per-document split)."""
    import yaml

    from tests.test_e2e import _small_corpus
    from tests.test_nxdt_examples import EXAMPLES, _tiny_mixtral_json, _tiny_model_json, shrink_overrides

    path = EXAMPLES / f"{name}.yaml"
    if not path.is_file():
        pytest.skip(f"{path} is not present")
    files = {"corpus": Path(_small_corpus(str(tmp_path))), "cache": tmp_path / "cache",
             "pretrain_json": _tiny_model_json(tmp_path / "pretrain_config.json", 512),
             "moe_json": _tiny_mixtral_json(tmp_path / "mixtral_config.json", 512)}
    tree = yaml.safe_load(path.read_text())
    rel = 1e-5 if (tree.get("precision") or {}).get("type", "fp32") == "fp32" else 2 ** -7  # the bf16 modes
    runs = {}
    for acc in ("cpu", "neuron"):
        overrides, nproc = shrink_overrides(tree, files, tmp_path / acc)
        cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "train.py", "--config-path", str(path.parent),
               "--config-name", name, *overrides, f"++trainer.accelerator={acc}"]
        out = subprocess.run(cmd, cwd=REPO, env=dict(_env(nproc), HF_HUB_OFFLINE="1"), capture_output=True,
                             text=True, timeout=900, check=False)
        text = out.stdout + out.stderr
        (tmp_path / f"{acc}.log").write_text(text)
        assert out.returncode == 0, text[-4000:]
        runs[acc] = _metrics(text)
    assert sorted(runs["cpu"]["loss"]) == [1, 2], runs
    for key in ("loss", "grad_norm"):
        for step, value in runs["cpu"][key].items():
            assert runs["neuron"][key][step] == pytest.approx(value, rel=rel), (key, step, runs)
