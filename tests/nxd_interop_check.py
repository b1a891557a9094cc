"""By hand, not in CI: NxD's own checkpoint converter and xser reader on checkpoints nxd_lc wrote.

NxD's package is not installable here (its PyPI name is a placeholder) and imports torch-neuronx's and the Neuron
compiler's modules at import time; this test bed puts inert stand-ins for those (and only those) into
``sys.modules``, then runs NxD's own, unmodified ``scripts/checkpoint_converter.py``
(``CheckpointConverterBase``, ``--convert_to_full_state --hw_backend trn1``; its xser loads go through
``trainer/checkpoint.py`` ``_xser_load_data``, which indexes the ``.info.pt`` files) on nxd_lc's checkpoints, and
compares the full state it writes with the source HF model, tensor by tensor. Run in the torch-xla venv::

    PJRT_DEVICE=CPU .venv-xla/bin/python tests/nxd_interop_check.py --nxd-src <neuronx-distributed checkout>/src \\
        --work /tmp/nxd_interop

It writes the checkpoints with nxd_lc's converter (HF -> TP 2 and TP 2 x PP 2 with unfused q / k / v, which is all
NxD's converter can unfuse there; TP 4 / kv_replicator 2 fused, in the Trn1 layout; plain and xser) from
``../shared/reference/nxd_checkpoints/hf/gqa``, then reads each back with NxD's.
Exit status 0 when every tensor is equal; the results are in docs/experiments/nxd_interop.md.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
HF = REPO.parent / "shared" / "reference" / "nxd_checkpoints" / "hf" / "gqa"
#: modules of the Neuron SDK that NxD imports at import time; none of them is used by the converter's code paths
#: (torch-xla is imported before the stand-ins exist: it probes libneuronxla at import)
STUBBED = ("torch_neuronx", "neuronxcc", "nki", "libneuronxla", "boto3", "botocore")
#: and single modules NxD's pipeline tracer imports that transformers 5 no longer has (unused by the converter)
STUBBED_MODULES = ("transformers.utils.fx",)


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any import of a :data:`STUBBED` module (and submodules) gets a package whose attributes are mocks;
    ``torch_neuronx.utils.get_platform_target`` says trn1 (the converter's --hw_backend)."""

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in STUBBED or name in STUBBED_MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__getattr__ = lambda attr: mock.MagicMock(name=f"{spec.name}.{attr}")  # type: ignore[method-assign]
        if spec.name == "torch_neuronx.utils":
            module.get_platform_target = lambda: "trn1"  # type: ignore[attr-defined]
        if spec.name == "transformers.utils.fx":  # a base class of NxD's pipeline tracer
            import torch.fx

            module.HFTracer = type("HFTracer", (torch.fx.Tracer,), {})  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _BarePackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """NxD's top package and its ``pipeline`` and ``trainer`` packages without their ``__init__`` code: those
    import the tracing, kernel, model-building and training stacks, which the converter does not use; its own
    modules (``scripts/checkpoint_converter.py``, ``trainer/checkpoint.py``, ...)
    load unmodified from the package directories."""

    def __init__(self, src: str) -> None:
        self.src = src

    #: the packages whose __init__ is skipped (the others' hold code the converter uses, e.g. utils.cpu_mode)
    BARE = ("neuronx_distributed", "neuronx_distributed.pipeline", "neuronx_distributed.trainer")

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.BARE:
            return None
        folder = os.path.join(self.src, *name.split("."))
        if not os.path.isdir(folder):
            return None  # a module file: the standard finder loads it
        spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
        spec.submodule_search_locations = [folder]
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = list(spec.submodule_search_locations or [])  # type: ignore[attr-defined]
        if spec.name == "neuronx_distributed.pipeline":  # trainer/checkpoint.py's isinstance checks only
            module.NxDPPModel = type("NxDPPModel", (), {})  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _write(work: Path, tp: int, pp: int, xser: bool, fuse: bool) -> Path:
    """nxd_lc's converter: the HF model as an nxd_lc checkpoint at TP ``tp`` x PP ``pp`` (Trn1 KV layout)."""
    conf = work / "conf"
    conf.mkdir(parents=True, exist_ok=True)
    k = max(1, tp // 2)
    raw = {"name": "gqa", "trainer": {"devices": tp, "num_nodes": 1},
           "exp_manager": {"checkpoint_callback_params": {"model_parallel_size": tp}},
           "distributed_strategy": {"tensor_model_parallel_size": tp, "kv_replicator": k,
                                    "kv_replica_layout": "interleaved"},
           "data": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": 32, "train_dir": str(work),
                    "val_fraction": 0.0},
           "model": {"model_config": str(HF / "config.json"), "encoder_seq_length": 32},
           "precision": {"type": "fp32"}}
    (conf / "gqa.yaml").write_text(json.dumps(raw))
    out = work / f"tp{tp}pp{pp}{'x' if xser else 'p'}"
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", f"--nproc_per_node={tp}",
           "-m", "nxd_lc.cli.convert", "--config-name", "gqa", "--config-dir", str(conf),
           "--convert_from_full_state", "true", "--input_dir", str(HF), "--output_dir", str(out), "--tp_size",
           str(tp), "--pp_size", str(pp), "--save_xser", str(xser).lower(), "--kv_size_multiplier", str(k),
           "--fuse_qkv", str(fuse).lower(), "--qkv_linear", "true"]
    env = dict(os.environ, PJRT_DEVICE="", OMP_NUM_THREADS="1")
    env.pop("PJRT_DEVICE")
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    return out / "step=0"


def _nxd_read(nxd_src: str, tag_dir: Path, tp: int, pp: int, xser: bool, fuse: bool, out: Path) -> dict:
    """NxD's converter, --convert_to_full_state, on ``tag_dir``; returns the full state it saved."""
    import torch

    if not any(isinstance(f, _BarePackages) for f in sys.meta_path):
        sys.meta_path.insert(0, _BarePackages(nxd_src))
    sys.path.insert(0, nxd_src)
    from neuronx_distributed.scripts.checkpoint_converter import CheckpointConverterBase

    converter = CheckpointConverterBase()
    args = converter.get_arg_parser().parse_args([
        "--input_dir", str(tag_dir / "model"), "--output_dir", str(out), "--hw_backend", "trn1", "--config",
        str(HF / "config.json"), "--tp_size", str(tp), "--pp_size", str(pp), "--kv_size_multiplier",
        str(max(1, tp // 2)), "--qkv_linear", "True", "--n_layers", "4", "--convert_to_full_state", "--model_style",
        "hf"] + (["--load_xser", "True"] if xser else []) + (["--fuse_qkv", "True"] if fuse else []))
    cwd = os.getcwd()
    os.chdir("/")  # NxD's load_partial_xser rebuilds the checkpoint path without its leading '/'
    try:
        converter.run(args)
    finally:
        os.chdir(cwd)
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nxd-src", required=True, help="the src/ directory of a neuronx-distributed checkout")
    p.add_argument("--work", default="/tmp/nxd_interop")
    a = p.parse_args()
    import torch_xla  # noqa: F401 - before the stand-ins: torch-xla probes libneuronxla at import

    sys.meta_path.insert(0, _Stubs())
    import torch
    from safetensors.torch import load_file

    source = load_file(str(HF / "model.safetensors"))
    work = Path(a.work)
    failures = 0
    # NxD's converter unfuses weight_qkv by cutting it in three equal parts (find_size), right only where a rank's
    # query and KV rows are equal (TP 4 / kv 2 here); the TP 2 checkpoints are written unfused (weight_q/k/v)
    for tp, pp, fuse in ((2, 1, False), (2, 2, False), (4, 1, True)):
        for xser in (False, True):
            tag = _write(work, tp, pp, xser, fuse)
            name = f"nxd_full_tp{tp}pp{pp}{'x' if xser else 'p'}"
            full = _nxd_read(a.nxd_src, tag, tp, pp, xser, fuse, work / name)
            full = {k: v.cpu() for k, v in full.items()}
            bad = sorted(n for n, v in source.items() if n not in full or not torch.equal(full[n].to(v.dtype), v))
            extra = sorted(set(full) - set(source))
            print(f"TP {tp} PP {pp} {'fused' if fuse else 'unfused'} {'xser' if xser else 'plain'}: "
                  f"{len(source) - len(bad)}/{len(source)} tensors "
                  f"equal to the source bit for bit; differing or missing {bad[:4]}; extra {extra[:4]}")
            failures += bool(bad or extra)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
