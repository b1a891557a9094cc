#!/usr/bin/env bash
# Download the wheels the GPU image lacks into .device_wheels/ at the repository root (run on the development
# machine, which reaches PyPI through pip; the device machine reaches nothing).
#
# The H100/H200 images have torch, transformers, pytorch-lightning and triton, but not hydra-core, omegaconf,
# antlr4-python3-runtime (nxd_lc's configuration) or liger-kernel (the hf_liger* baselines of
# benchmarks/accel_step.py). benchmarks/device/accel_step.sh installs them there with
# `pip install --no-index --no-deps --target /tmp/site .device_wheels/*.whl`; the device call carries
# `.device_wheels` (it is git-ignored). Versions: those of the 2026-11-26 H200 baseline.
#
# Usage (from anywhere): bash benchmarks/device/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -x .venv/bin/pip ]; then PIP=(.venv/bin/pip); else PIP=(python3 -m pip); fi
DEST=.device_wheels
mkdir -p "$DEST"
# pure-Python / manylinux wheels for the image's CPython 3.12
"${PIP[@]}" download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    -d "$DEST" hydra-core==1.3.2 omegaconf==2.3.0 liger-kernel==0.8.5
# antlr4-python3-runtime 4.9.3 is published as an sdist only: build its (pure-Python) wheel here
"${PIP[@]}" wheel --no-deps antlr4-python3-runtime==4.9.3 -w "$DEST"
ls -l "$DEST"
du -sh "$DEST"
