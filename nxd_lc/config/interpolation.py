"""A bound on the work of resolving a config's interpolations, checked before anything is resolved.

OmegaConf resolves an interpolation again each time it is referenced, with no memo: 41 keys each written
``${multiply:${k_prev},${k_prev}}`` (or ``"${k_prev}${k_prev}"``) take 2^40 resolutions, a dry run that never
ends. :func:`interpolation_problems` counts, from the unresolved text, how many node resolutions resolving the
whole config would take (each ``${key}`` reference costs what resolving ``key`` costs, plus one) and refuses a
config past :data:`MAX_INTERPOLATION_RESOLUTIONS`, naming the costliest key. The count is exact for plain
references (absolute ``${a.b}``, ``${a.b[0]}``, relative ``${.x}`` / ``${..x}``, inside resolver arguments too);
a reference it cannot follow statically (``${${x}}``, through another interpolation, to a missing key) counts
one, so it never refuses more than OmegaConf would do.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

#: the most node resolutions (``${...}`` references, counted with their repetitions) one config may take to
#: resolve; the shipped configs take under 200, and 10,000 take seconds (OmegaConf: ~0.1-0.5 ms each)
MAX_INTERPOLATION_RESOLUTIONS = 10_000

_REFERENCE = re.compile(r"\$\{([^${}:]*)\}")  # an innermost ${key} (a resolver call has a ':')
_SEGMENT = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")

Path = tuple[Any, ...]


def interpolation_problems(data: Any, limit: Optional[int] = None) -> list[str]:
    """The problem line when resolving ``data``'s interpolations would take more than ``limit`` node resolutions.

    Args:
        data: the unresolved config as plain containers (``OmegaConf.to_container(cfg, resolve=False)``).
        limit: the bound (default :data:`MAX_INTERPOLATION_RESOLUTIONS`).

    Returns:
        ``[]`` within the bound, else one line naming the key whose resolution costs the most and the fix.
    """
    limit = MAX_INTERPOLATION_RESOLUTIONS if limit is None else limit
    counter = _Counter(data, limit)
    try:
        total = counter.cost(())
    except RecursionError:
        return [f"{_dotted(counter.deepest)}: its interpolations reference each other more than "
                f"{counter.depth_seen} deep; write the value itself instead of a chain of ${{...}} references"]
    if total <= limit:
        return []
    key, cost = max(((p, c) for p, c in counter.memo.items() if p and isinstance(_at(data, p), str)),
                    key=lambda pc: (pc[1], -len(pc[0])), default=((), total))
    amount = f"more than {limit:,}" if cost > limit else f"{cost:,} (the whole config more than {limit:,})"
    return [f"{_dotted(key)}: resolving its interpolations takes {amount} node resolutions (the bound is "
            f"{limit:,}): OmegaConf resolves a ${{...}} again each time it is referenced, so each key that "
            "references the previous one twice doubles the work; write the value itself, or reference a key "
            "holding it once"]


class _Counter:
    """Memoized resolution cost per path, saturated at ``limit + 1``."""

    def __init__(self, data: Any, limit: int) -> None:
        self.data, self.limit = data, limit
        self.memo: dict[Path, int] = {}
        self.active: set[Path] = set()
        self.deepest: Path = ()
        self.depth_seen = 0

    def cost(self, path: Path) -> int:
        if path in self.memo:
            return self.memo[path]
        if path in self.active:  # a cycle: OmegaConf reports it; count it once
            return 1
        self.active.add(path)
        if len(self.active) > self.depth_seen:
            self.depth_seen, self.deepest = len(self.active), path
        value = _at(self.data, path)
        total = 1
        if isinstance(value, Mapping):
            children = [path + (k,) for k in value]
        elif isinstance(value, list):
            children = [path + (i,) for i in range(len(value))]
        elif isinstance(value, str):
            children = [t for t in (_target(self.data, path, ref) for ref in _REFERENCE.findall(value)) if t]
        else:
            children = []
        for child in children:
            total = min(total + self.cost(child), self.limit + 1)
        self.active.discard(path)
        self.memo[path] = total
        return total


def _at(data: Any, path: Path) -> Any:
    for key in path:
        data = data[key]
    return data


def _target(data: Any, path: Path, ref: str) -> Optional[Path]:
    """The path ``${ref}`` written at ``path`` points to (None where it cannot be followed statically)."""
    ref = ref.strip()
    dots = len(ref) - len(ref.lstrip("."))
    if dots > len(path):
        return None
    base: Path = path[:len(path) - dots] if dots else ()
    node = _at(data, base)
    out = list(base)
    for bracket, name in _SEGMENT.findall(ref[dots:]):
        key = (bracket or name).strip()
        if isinstance(node, Mapping) and key in node:
            pass
        elif isinstance(node, list) and key.lstrip("-").isdigit() and -len(node) <= int(key) < len(node):
            key = int(key) % len(node)
        else:
            return None
        out.append(key)
        node = node[key]
    return tuple(out) if len(out) > len(base) or not dots else None


def _dotted(path: Path) -> str:
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text or "<config>"
