"""The one error type of config problems, :class:`ConfigError` (a ``ValueError``).

Every package raises it for a bad config value; the application layer (:mod:`nxd_lc.app.validation`) collects
all problems of a config and raises them together.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Raised with every problem found in a config, one per line, each naming its key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid nxd_lc config ({len(problems)} problem(s)):\n{lines}")
