"""Checks ``train.py`` runs on its command line before ``hydra.main`` composes the config: what Hydra itself would
do with a user's YAML before nxd_lc sees it.

- YAML files: a file over :data:`MAX_CONFIG_FILE_BYTES`, anchors / aliases that expand past
  :data:`MAX_YAML_NODES` nodes (a 10-line "alias bomb" grows to gigabytes while Hydra loads it), or a key given twice
  in one mapping (reported with both lines). Scanned from the YAML event stream, which never expands an alias: the
  primary config (``--config-name`` in ``--config-dir`` / ``--config-path`` / ``conf``), the files its defaults lists
  name (:func:`defaults_files`), and the group options given on the command line.
- The composed ``hydra`` node: Hydra instantiates ``hydra.callbacks`` (any ``_target_``, e.g.
  ``shutil.copyfile``) before the task runs, also in a dry run; nxd_lc defines none, so any is refused, as are a
  launcher / sweeper other than Hydra's basic ones and a logging config with a ``()`` factory.
- A YAML error Hydra meets while composing (one nxd_lc did not find first) is reported in one line, file and lines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

#: the largest config YAML file read (bytes); the shipped configs are under 20 KiB
MAX_CONFIG_FILE_BYTES = 4 * 1024 * 1024
#: the most YAML nodes one file may expand to, aliases counted with their repetitions (shipped: under 1,000)
MAX_YAML_NODES = 20_000
#: the launcher / sweeper Hydra runs by default (a single-process run and ``-m`` sweeps)
HYDRA_OWN_TARGETS = ("hydra._internal.core_plugins.basic_launcher.BasicLauncher",
                     "hydra._internal.core_plugins.basic_sweeper.BasicSweeper")


def yaml_file_problems(path: str | Path, max_nodes: Optional[int] = None) -> list[str]:
    """Problems of one YAML config file, found without constructing it: size, alias expansion, duplicate keys.

    Args:
        path: the file.
        max_nodes: the expansion bound (default :data:`MAX_YAML_NODES`).

    Returns:
        One line per problem, each naming the file and line(s) and the fix (``[]`` when fine; a YAML syntax error
        is left to the loader, which names its line).
    """
    max_nodes = MAX_YAML_NODES if max_nodes is None else max_nodes
    size = os.path.getsize(path)
    if size > MAX_CONFIG_FILE_BYTES:
        return [f"{path}: a config file of {size:,} bytes (the bound is {MAX_CONFIG_FILE_BYTES:,}); keep data out of "
                "the YAML (data.train_dir names files)"]
    scan = _Scan(str(path), max_nodes)
    try:
        with open(path, "rb") as f:
            for event in yaml.parse(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
                if scan.feed(event):
                    break
    except yaml.YAMLError:
        pass
    return scan.problems


class _Scan:
    """Node counts from the event stream; a frame per open collection:
    [size, anchor, keys seen (a mapping) or None, key next?, the key last read, its own key]."""

    def __init__(self, path: str, max_nodes: int) -> None:
        self.path, self.max_nodes = path, max_nodes
        self.stack: list[list[Any]] = []
        self.anchors: dict[str, int] = {}
        self.total = 0
        self.problems: list[str] = []

    def feed(self, event: yaml.Event) -> bool:
        """Take one event; True once the expansion bound is passed (scanning stops)."""
        line = event.start_mark.line + 1
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            keys = {} if isinstance(event, yaml.MappingStartEvent) else None
            parent = self.stack[-1] if self.stack else None
            name = parent[4] if parent is not None and parent[2] is not None and not parent[3] else "[]"
            self.stack.append([1, event.anchor, keys, True, None, name])
            return False
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            size, anchor = self.stack.pop()[:2]
            return self._node(size, anchor, None, line)
        if isinstance(event, yaml.ScalarEvent):
            return self._node(1, event.anchor, event.value, line)
        if isinstance(event, yaml.AliasEvent):
            return self._node(self.anchors.get(event.anchor, 1), None, None, line)
        return False

    def _node(self, size: int, anchor: Optional[str], scalar: Optional[str], line: int) -> bool:
        if anchor is not None:
            self.anchors[anchor] = size
        if not self.stack:
            self.total = size
        else:
            parent = self.stack[-1]
            parent[0] = min(parent[0] + size, self.max_nodes + 1)
            if parent[2] is not None:  # a mapping: keys and values alternate
                if parent[3] and scalar is not None and scalar in parent[2]:
                    key = ".".join([str(f[5]) for f in self.stack[1:]] + [scalar])
                    self.problems.append(f"{self.path}: key '{key}' is given twice, at line {parent[2][scalar]} and "
                                         f"line {line}; keep one")
                if parent[3]:
                    parent[4] = scalar
                    if scalar is not None:
                        parent[2].setdefault(scalar, line)
                parent[3] = not parent[3]
        if max(size, self.total) > self.max_nodes:
            self.problems.append(
                f"{self.path}: line {line}: its anchors and aliases (&name / *name) expand to more than "
                f"{self.max_nodes:,} YAML nodes (the bound; each alias is copied where it is used); write the values "
                "out or reference fewer aliases")
            return True
        return False


def defaults_files(config_name: str, search_dirs: list[str], overrides: Iterable[str]) -> list[str]:
    """The YAML files composing ``config_name`` that can be found without Hydra: the primary config, the entries of
    the defaults lists (``- name``, ``- group: option``, ``override`` / ``optional`` / ``@package`` forms, relative
    to the file's group or absolute with a leading ``/``) and each ``group=option`` override naming a file, each
    taken from the first directory of ``search_dirs`` holding it. Entries with interpolations are skipped (Hydra
    resolves them)."""
    chosen = {}
    for text in overrides:
        key, sep, value = text.lstrip("+~").partition("=")
        if sep and "." not in key and value and "," not in value:
            chosen[key.split("@")[0].strip("/")] = value
    found: list[str] = []
    todo = [("", config_name)]
    while todo:
        group, name = todo.pop()
        path = _find(os.path.join(group, name), search_dirs)
        if path is None or path in found:
            continue
        found.append(path)
        todo += _defaults_of(path, group, chosen)
    for group, option in chosen.items():
        path = _find(os.path.join(group, option), search_dirs)
        if path is not None and path not in found:
            found.append(path)
    return found


def _find(name: str, search_dirs: list[str]) -> Optional[str]:
    for base in search_dirs:
        for ext in ("", ".yaml", ".yml"):
            path = os.path.join(base, name.strip("/") + ext)
            if os.path.isfile(path) and (ext or name.endswith((".yaml", ".yml"))):
                return path
    return None


def _defaults_of(path: str, group: str, chosen: dict[str, str]) -> list[tuple[str, str]]:
    """(group, option) of each defaults entry of ``path`` (a file already scanned: loading it is bounded)."""
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return []
    entries = data.get("defaults") if isinstance(data, dict) else None
    out: list[tuple[str, str]] = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, str) and entry != "_self_" and "${" not in entry:
            name = entry.split("@")[0]
            out.append(("", name) if name.startswith("/") else (group, name))
        elif isinstance(entry, dict) and len(entry) == 1:
            (key, value), = entry.items()
            key = str(key).split()[-1].split("@")[0]
            sub = key.strip("/") if key.startswith("/") else os.path.join(group, key)
            options = value if isinstance(value, list) else [chosen.get(sub, value)]
            out += [(sub, str(v)) for v in options if isinstance(v, str) and "${" not in v]
    return out


def hydra_node_problems(hydra_cfg: Any) -> list[str]:
    """What nxd_lc refuses in a composed ``hydra`` node (``compose(..., return_hydra_config=True).hydra``):
    ``hydra.callbacks`` (any), a launcher / sweeper ``_target_`` other than :data:`HYDRA_OWN_TARGETS`, and a
    ``hydra.job_logging`` / ``hydra.hydra_logging`` with a ``()`` factory (``logging.config`` calls it)."""
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(hydra_cfg, resolve=False) if not isinstance(hydra_cfg, dict) else hydra_cfg
    problems = []
    callbacks = node.get("callbacks") or {}
    if callbacks:
        named = ", ".join(f"{k} -> {(v or {}).get('_target_', '?') if isinstance(v, dict) else v}"
                          for k, v in callbacks.items())
        problems.append(f"hydra.callbacks: nxd_lc defines no Hydra callbacks and refuses any ({named}): Hydra calls "
                        "each _target_ before nxd_lc sees the config, also in a dry run; remove hydra.callbacks "
                        "from the config file / the command line")
    for section in ("launcher", "sweeper"):
        target = (node.get(section) or {}).get("_target_")
        if target is not None and target not in HYDRA_OWN_TARGETS:
            problems.append(f"hydra.{section}._target_: {target} is not Hydra's basic {section}, the only one nxd_lc "
                            f"runs under; remove the hydra/{section} override")
    for section in ("job_logging", "hydra_logging"):
        if _has_factory(node.get(section)):
            problems.append(f"hydra.{section}: a logging config with a '()' factory (logging.config calls it); nxd_lc "
                            f"logs itself: remove the hydra/{section} override (nxd_lc sets it to none)")
    return problems


def _has_factory(node: Any) -> bool:
    if isinstance(node, dict):
        return "()" in node or any(_has_factory(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_factory(v) for v in node)
    return False


def yaml_error_line(error: BaseException) -> Optional[str]:
    """One line for a YAML error in ``error``'s cause chain (file, line(s), what), or None if there is none."""
    seen: Optional[BaseException] = error
    while seen is not None and not isinstance(seen, yaml.MarkedYAMLError):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    where = seen.problem_mark or seen.context_mark
    at = f"{where.name}: line {where.line + 1}" if where is not None else "a config file"
    context = ""
    if seen.context_mark is not None and seen.problem_mark is not None:
        context = f" ({seen.context} at line {seen.context_mark.line + 1})"
    return f"{at}: {seen.problem}{context}; fix the YAML"


def preflight_problems(argv: list[str], calling_file: str, config_path: str) -> list[str]:
    """Everything refused before ``hydra.main(config_path=config_path)`` runs ``argv`` (``sys.argv[1:]``) for the
    entry point ``calling_file`` (``train.py``): the YAML files' problems
    (:func:`yaml_file_problems`), then, on a config that composes, the ``hydra`` node's (:func:`hydra_node_problems`)
    or the YAML error met while composing. Argument errors are left to Hydra, which reports them."""
    from hydra._internal.utils import create_automatic_config_search_path, get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return []
    if args.help or args.hydra_help or args.shell_completion or args.config_name is None:
        return []
    base = os.path.dirname(os.path.abspath(calling_file))
    config_path = args.config_path if args.config_path is not None else config_path
    dirs = [os.path.abspath(args.config_dir)] if args.config_dir else []
    if not config_path.startswith("pkg://"):
        dirs.append(os.path.join(base, config_path.removeprefix("file://")))
    problems = [p for f in defaults_files(args.config_name, dirs, args.overrides) for p in yaml_file_problems(f)]
    if problems:
        return problems
    search_path = create_automatic_config_search_path(calling_file, None, config_path)
    if args.config_dir:
        from hydra.core.config_search_path import SearchPathQuery

        search_path.prepend(provider="command-line", path=f"file://{os.path.abspath(args.config_dir)}",
                            anchor=SearchPathQuery(provider="schema"))
    return _composed_problems(args.config_name, list(args.overrides), search_path)


def _composed_problems(config_name: str, overrides: list[str], search_path: Any) -> list[str]:
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    try:
        hydra = Hydra.create_main_hydra2(task_name="train", config_search_path=search_path)
        cfg = hydra.compose_config(config_name=config_name, overrides=overrides, run_mode=RunMode.MULTIRUN,
                                   validate_sweep_overrides=False)
    except Exception as e:  # noqa: BLE001 - hydra.main composes again and reports anything but a YAML error
        line = yaml_error_line(e)
        return [line] if line else []
    finally:
        GlobalHydra.instance().clear()
    return hydra_node_problems(cfg.hydra)
