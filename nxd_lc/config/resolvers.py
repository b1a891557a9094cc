"""OmegaConf resolvers used by NxDT-style YAMLs: ``${multiply:a,b}`` and ``${div:a,b}``."""

from __future__ import annotations

from omegaconf import OmegaConf


def _number(x: object) -> int | float:
    if isinstance(x, (int, float)):
        return x
    text = str(x).strip()
    try:
        return int(text)
    except ValueError:
        return float(text)


def multiply(a: object, b: object) -> int | float:
    """``${multiply:a,b}`` -> a * b (ints stay ints)."""
    return _number(a) * _number(b)


def div(a: object, b: object) -> int | float:
    """``${div:a,b}`` -> a / b; an int when b divides a exactly (NeMo RL uses it for rope factors).

    Raises:
        ZeroDivisionError: when b is 0.
    """
    x, y = _number(a), _number(b)
    if isinstance(x, int) and isinstance(y, int) and y != 0 and x % y == 0:
        return x // y
    return x / y


def register_resolvers() -> None:
    """Register ``multiply`` and ``div`` once (safe to call repeatedly)."""
    for name, fn in (("multiply", multiply), ("div", div)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
