"""``examples/slurm/train.sbatch`` without SLURM (issue 39, item 6): the script runs under bash with fake ``srun``,
``scontrol``, ``nproc``, ``curl`` (EC2 instance metadata) and ``neuron-ls`` first on PATH, and the fake ``srun``
records the torchrun command line and the environment it would start. Checks the processes per node (one per
NeuronCore, per instance type and logical-core config, never the vCPU count on Trainium) and the node settings
it exports. The real SLURM path is ``make test-slurm`` (root)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parent.parent / "examples" / "slurm" / "train.sbatch"
_NODE_VARS = ("MALLOC_ARENA_MAX", "XLA_DISABLE_FUNCTIONALIZATION", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA",
              "FI_EFA_FORK_SAFE")

_FAKES = {
    "srun": 'echo "ARGS $*" > "$FAKE_OUT"; env | grep -E "^(MALLOC_ARENA_MAX|XLA_DISABLE_FUNCTIONALIZATION|FI_)" '
            '>> "$FAKE_OUT"; exit 0',
    "scontrol": 'echo node1',
    "scancel": 'exit 0',
    "nproc": 'echo 128',  # a trn1.32xlarge's vCPUs
    # IMDSv2: the token request (PUT), then the instance type; unreachable (non-AWS host) when FAKE_IMDS is empty
    "curl": '[ -n "$FAKE_IMDS" ] || exit 28; case "$*" in *PUT*) echo token ;; *) echo "$FAKE_IMDS" ;; esac',
}


def _sbatch(tmp_path: Path, imds: str = "", neuron_ls: list[dict] | None = None, nodes: int = 1,
            scontrol: str | None = None, **env: str) -> tuple[int, dict[str, str], str]:
    """Run the script; returns (NPROC_PER_NODE given to torchrun, node settings exported, stderr); ``scontrol``
    replaces the fake ``scontrol``'s body."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = dict(_FAKES)
    if scontrol is not None:
        fakes["scontrol"] = scontrol
    if neuron_ls is not None:
        fakes["neuron-ls"] = f"echo '{json.dumps(neuron_ls)}'"
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "srun.txt"
    base = {k: v for k, v in os.environ.items() if k not in (*_NODE_VARS, "NPROC_PER_NODE", "INSTANCE_TYPE",
                                                            "NEURON_LOGICAL_NC_CONFIG")}
    run_env = {**base, "PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_OUT": str(out), "FAKE_IMDS": imds,
               "PYTHON_BIN": sys.executable, "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "7",
               "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": str(nodes), **env}
    proc = subprocess.run(["bash", str(SBATCH), "--config-name", "x"], env=run_env, capture_output=True, text=True,
                          timeout=60, check=False)
    if proc.returncode != 0:
        return -proc.returncode, {}, proc.stderr
    text = out.read_text()
    (tmp_path / "srun_args.txt").write_text(text.splitlines()[0])
    nproc = int(re.search(r"--nproc_per_node=(\d+)", text).group(1))
    exported = dict(line.split("=", 1) for line in text.splitlines()[1:])
    return nproc, exported, proc.stderr


_TRN = {"MALLOC_ARENA_MAX": "128", "XLA_DISABLE_FUNCTIONALIZATION": "0"}
_EFA = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}


@pytest.mark.parametrize("case,kwargs,nproc,exported", [
    ("trn1.32xlarge from IMDS", dict(imds="trn1.32xlarge"), 32, _TRN),  # not nproc's 128
    ("trn1.2xlarge", dict(INSTANCE_TYPE="trn1.2xlarge"), 2, _TRN),
    ("trn1n.32xlarge, 2 nodes: EFA", dict(imds="trn1n.32xlarge", nodes=2), 32, {**_TRN, **_EFA}),
    ("trn2.48xlarge, lnc 2 by default", dict(imds="trn2.48xlarge", nodes=2), 64, {**_TRN, **_EFA}),
    ("trn2.48xlarge at lnc 1", dict(imds="trn2.48xlarge", NEURON_LOGICAL_NC_CONFIG="1"), 128, _TRN),
    ("unknown Neuron instance: neuron-ls", dict(imds="trn9.big", neuron_ls=[{"nc_count": 4}] * 3), 12, _TRN),
    ("explicit NPROC_PER_NODE wins", dict(imds="trn1.32xlarge", NPROC_PER_NODE="8"), 8, _TRN),
    ("the environment's values win", dict(imds="trn1.32xlarge", nodes=2, FI_PROVIDER="sockets"), 32,
     {**_TRN, **_EFA, "FI_PROVIDER": "sockets"}),
    ("CPU host off AWS: nproc, nothing exported", dict(), 128, {}),
    ("CPU instance on AWS", dict(imds="c7i.4xlarge", nodes=2), 128, {}),
])
def test_processes_per_node_and_node_settings(tmp_path: Path, case: str, kwargs: dict, nproc: int,
                                               exported: dict[str, str]) -> None:
    got_nproc, got_env, err = _sbatch(tmp_path, **kwargs)
    assert (got_nproc, got_env) == (nproc, exported), (case, err[-2000:])


def test_a_trainium_instance_of_unknown_size_stops_asking_for_nproc(tmp_path: Path) -> None:
    status, _, err = _sbatch(tmp_path, imds="trn9.big")
    assert status == -2 and "set NPROC_PER_NODE" in err, err


#: ``scontrol show hostnames`` of a 512-node job (the fake's Python body): one name per line, written 4 KiB at a time
#: as a large output reaches a pipe, with a pause between writes (a reader that stops early has gone by the next)
_MANY_HOSTS = """import os, time
data = "".join(f"trn1-st-{i:04d}-{'x' * 40}\\n" for i in range(512)).encode()
for k in range(0, len(data), 4096):
    os.write(1, data[k:k + 4096])
    time.sleep(0.002)
"""


def test_the_first_host_of_a_512_node_list_is_the_master_every_time(tmp_path: Path) -> None:
    """Issue 52, item 3: with 512 host names the script launches in 10 of 10 runs, ``MASTER_ADDR`` (torchrun's
    rendezvous endpoint) the job's first host. ``scontrol show hostnames ... | head -n 1`` under ``set -o pipefail``
    exited 1 when ``head`` left before ``scontrol`` finished writing (SIGPIPE): 4 of 10 runs launched nothing
    (measured at 44f9ff5)."""
    hosts = tmp_path / "hosts.py"
    hosts.write_text(_MANY_HOSTS)
    first = "trn1-st-0000-" + "x" * 40
    for run in range(10):
        case = tmp_path / str(run)
        case.mkdir()
        nproc, _, err = _sbatch(case, scontrol=f'exec "$PYTHON_BIN" {hosts}', SLURM_JOB_NODELIST="trn1-st-[0000-0511]",
                                nodes=512)
        assert nproc == 128, (run, nproc, err[-2000:])
        args = (case / "srun_args.txt").read_text()
        assert f"--rdzv_endpoint={first}:29500" in args, (run, args)
