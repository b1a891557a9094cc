"""torch-version compatibility (lane 2 runs the ``compat`` subset under torch 2.9 + torch-xla): every module of
nxd_lc imports under the running torch, so an API newer than the oldest supported torch used at import time fails
here, not on a user's Trainium host. The behaviour of each module on torch 2.9 is exercised by the other tests
marked ``compat`` (see docs/testing.md)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import nxd_lc

pytestmark = pytest.mark.compat


def test_every_module_imports_under_this_torch() -> None:
    names = [m.name for m in pkgutil.walk_packages(nxd_lc.__path__, "nxd_lc.")]
    assert len(names) > 50, names  # the walk found the package (a broken walk would pass vacuously)
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is reported with its module
            failed[name] = f"{type(e).__name__}: {e}"
    assert not failed, f"torch {torch.__version__}: modules that do not import: {failed}"
