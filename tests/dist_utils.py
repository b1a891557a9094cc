"""Helpers for multi-process tests on CPU over gloo.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises a
gloo process group in each and calls ``fn(rank, world_size, *args)``. ``fn`` must be a
module-level function (it is pickled into spawned processes). An exception in any rank
fails the calling test with that rank's traceback.

The ranks are forks of Python's fork server, which has imported torch, transformers, Lightning
and nxd_lc once (see :func:`start_method`): a spawned rank re-imports them (6-9 s of CPU each on
this project's 2-core CI machines), which was most of a multi-process test's time.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_launch_env_of_one(setenv: Callable[[str, str], None]) -> None:
    """The environment of one process of a torchrun launch (rank 0 of 1, a free port), set with ``setenv`` (a
    ``pytest.MonkeyPatch``'s, so it is undone), after releasing any process group and nxd_lc parallel state an
    earlier in-process run of this worker left: the in-process run starts as train.py's fresh process does."""
    from nxd_lc.app.run import _shutdown_distributed
    from nxd_lc.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    _shutdown_distributed()
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        setenv(key, value)


# the seed a fresh interpreter's default CPU generator starts from (c10::detail::default_rng_seed_val): a forked
# rank starts from it as a spawned one does, not from whatever the tests before it left in the test process
_FRESH_PROCESS_SEED = 67280421310721

#: what the fork server imports once before it forks ranks and test beds: the slow imports of every child
#: (not torch-xla: importing it installs a root logging handler, which a CPU run's process, which never imports it,
#: does not have, and then nxd_lc's logging setup leaves the root logger alone: its log lines go to stderr)
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "transformers", "pytorch_lightning", "nxd_lc.app.run"]


def start_method() -> str:
    """How :func:`run_distributed` and the XLA test bed start their children: ``NXD_LC_TEST_START_METHOD`` when set
    (``spawn``: a fresh interpreter each, as before; ``fork``: a fork of the test process), else ``"forkserver"``.

    Python's fork server is a process this test process starts once (per pytest worker), which imports
    :data:`FORKSERVER_PRELOAD` and nothing of the tests' state (no pytest capture, logging handlers, warnings filters
    or torch-xla runtime); each child is a fork of it. A spawned child re-imports torch, transformers, Lightning and
    nxd_lc: 6-9 s of CPU per process on 2 cores, which was most of a multi-process test's time
    (``tests/test_pipeline.py``: 144 s spawned, 21 s forked). A child takes the caller's environment and directory
    at its start (``child_setup``), which the fork server (started once) would not otherwise give it."""
    chosen = os.environ.get("NXD_LC_TEST_START_METHOD")
    if chosen:
        return chosen
    import multiprocessing

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect when the server starts
    return "forkserver"


def redirect_output(stdout_path: str, stderr_path: str | None = None, append: bool = False) -> None:
    """Point this process's file descriptors 1 and 2, and ``sys.stdout`` / ``sys.stderr`` (line-buffered), at files:
    ``stdout_path``, and ``stderr_path`` or the same file. A fork server's child otherwise writes where the server
    does. ``append``: several processes share the files (each write lands at the end); else they are truncated."""
    sys.stdout.flush()
    sys.stderr.flush()
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    out = os.open(stdout_path, flags, 0o644)
    os.dup2(out, 1)
    os.dup2(out if stderr_path is None else os.open(stderr_path, flags, 0o644), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def child_setup(env: dict[str, str], cwd: str) -> None:
    """Make a child's process state what a fresh process started from the caller would have: its environment and
    working directory (a fork server's child has the server's), the torch seed of a fresh interpreter, and no
    nxd_lc parallel state."""
    from nxd_lc.distributed import parallel_state

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    parallel_state.destroy_model_parallel()
    torch.manual_seed(_FRESH_PROCESS_SEED)


def _worker(rank: int, world_size: int, port: int, err_dir: str, fn: Callable[..., Any], args: tuple,
            env: dict[str, str], cwd: str) -> None:
    redirect_output(os.path.join(err_dir, f"rank{rank}.log"))  # shown with the rank's traceback when it fails
    child_setup(env, cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        raise
    finally:
        try:
            from nxd_lc.distributed import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; re-raise failures."""
    with tempfile.TemporaryDirectory() as err_dir:
        try:
            mp.start_processes(
                _worker, args=(world_size, _free_port(), err_dir, fn, args, dict(os.environ), os.getcwd()),
                nprocs=world_size, join=True, start_method=start_method(),
            )
        except Exception as e:  # surface the worker's own traceback
            msgs = []
            for name in sorted(os.listdir(err_dir)):
                with open(os.path.join(err_dir, name), errors="replace") as f:
                    text = f.read()
                if name.endswith(".log"):  # a rank's output: its tail
                    text = text[-4000:]
                msgs.append(f"--- {name} ---\n{text}")
            raise AssertionError("distributed worker failed:\n" + "\n".join(msgs)) from e


def local_shard(model: torch.nn.Module, name: str, full: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of the full (TP=1 layout) tensor of parameter ``name`` of an nxd_lc Llama (its weight
    or its gradient): the fused GQA QKV weight is split into q/k/v and sharded by its layer (KV replication
    included), every other parameter by :func:`nxd_lc.layers.linear.shard_full_parameter`."""
    from nxd_lc.layers.linear import shard_full_parameter

    if name.endswith("qkv_proj.weight_qkv"):
        qkv = model.get_submodule(name.rsplit(".", 1)[0])
        hd, nq, nkv = qkv.head_dim, qkv.num_attention_heads, qkv.num_key_value_heads
        q, k, v = full.split([nq * hd, nkv * hd, nkv * hd])
        return qkv.shard_qkv_weights(q, k, v)["weight_qkv"]
    return shard_full_parameter(full, model.get_parameter(name))


def grads_in_hf_layout(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of an nxd_lc Llama in HF names and full shapes: each parameter is swapped with its gradient and
    exported (``export_hf_state_dict`` gathers TP, splits qkv, and under pipelining gathers every stage), then
    restored. Collective like the export."""
    from nxd_lc.models.llama.hf_adapter import export_hf_state_dict

    with torch.no_grad():
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.copy_(p.grad)
        grads = export_hf_state_dict(model)
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return grads


def shard_files(folder: Any) -> list[str]:
    """The NxD shard files (``dp_rank_XX[_ep_rank_XX]_tp_rank_XX_pp_rank_XX.pt``) in ``folder``, sorted: not their
    xser ``.tensors`` directories or ``.info.pt`` files."""
    from nxd_lc.checkpoint.layout import SHARD_RE

    return sorted(n for n in os.listdir(folder) if SHARD_RE.match(n))
