"""Facts about local processes (Linux ``/proc``): liveness and start time, for stale-lock decisions."""

from __future__ import annotations

import os
from typing import Optional


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this host (``kill(pid, 0)``; one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), None when it is not
    running (or a zombie, or there is no ``/proc``). Tells a live owner from a later process that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19]) if fields[0] != "Z" else None
