"""Fault injection for the recovery tests: ``NXD_LC_FAULT=<action>@<point>:<step>[:<rank>]``.

Unset (the normal case) nothing happens. Set, the process of global rank ``<rank>`` (default 0) performs
``<action>`` when it reaches ``<point>`` of optimizer step ``<step>`` (``global_step`` after that step):

* points: ``mid_cache_build`` (step 0: a data / tokenizer cache has been written to its temporary path during
  start-up, before it is published: the fault lands before the first step), ``mid_step`` (the step's first
  micro-batch is starting: the fault lands while the step runs),
  ``mid_save`` (the checkpoint of that step has written its first file into the staging directory, the rest not),
  ``after_publish`` (the checkpoint of that step was just published: ``done`` and ``newest`` are on disk);
* actions: ``kill9`` (SIGKILL to this process: a crash, an OOM kill, a node loss), ``sigterm_launcher``
  (SIGTERM to the parent torchrun, which forwards it to every worker: a SLURM / Kubernetes preemption),
  ``sigterm`` (SIGTERM to this process only).

Each fault fires once per process. Used by ``tests/test_fault_injection.py`` to kill runs at exact moments;
it is read once, at import.
"""

from __future__ import annotations

import os
import signal

POINTS = ("mid_cache_build", "mid_step", "mid_save", "after_publish")
ACTIONS = ("kill9", "sigterm_launcher", "sigterm")


def _parse(spec: str) -> tuple[str, str, int, int] | None:
    """``"kill9@mid_save:4:1" -> ("kill9", "mid_save", 4, 1)``.

    Raises:
        ValueError: malformed ``NXD_LC_FAULT`` (names the variable and the expected form).
    """
    if not spec:
        return None
    try:
        action, rest = spec.split("@", 1)
        point, *nums = rest.split(":")
        step, rank = int(nums[0]), int(nums[1]) if len(nums) > 1 else 0
    except (ValueError, IndexError):
        raise ValueError(f"NXD_LC_FAULT={spec!r}: expected <action>@<point>:<step>[:<rank>], e.g. "
                         f"kill9@mid_save:4:1") from None
    if action not in ACTIONS or point not in POINTS:
        raise ValueError(f"NXD_LC_FAULT={spec!r}: action must be one of {ACTIONS}, point one of {POINTS}")
    return action, point, step, rank


_FAULT = _parse(os.environ.get("NXD_LC_FAULT", ""))
_fired = False


def inject(point: str, step: int) -> None:
    """Perform the configured fault if this is its point, step and rank (see the module docstring)."""
    global _fired
    if _FAULT is None or _fired:
        return
    action, at, at_step, rank = _FAULT
    if at != point or at_step != step or int(os.environ.get("RANK", "0")) != rank:
        return
    _fired = True
    if action == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "sigterm_launcher":
        os.kill(os.getppid(), signal.SIGTERM)
    else:
        os.kill(os.getpid(), signal.SIGTERM)
