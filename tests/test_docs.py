"""Documentation checks (no torch, no processes; a few seconds).

* every relative link of the Markdown documentation (README.md, docs/**/*.md, benchmarks/README.md,
  examples/*/README.md) resolves to an existing file, and a ``#anchor`` into a Markdown file to one of its headings;
* README.md stays short (at most :data:`README_MAX_LINES` lines: the rest lives in docs/);
* the config keys docs/limitations.md lists as "not supported yet" are exactly the keys named by the "not supported
  yet" messages in nxd_lc's source.

How a message's key is found (:func:`source_keys`). Every ``.py`` file under ``nxd_lc/`` is parsed (recursively,
so modules may move); a message is a string expression that is not a docstring -- a literal, an f-string, or a
``+`` of them -- whose text says "not supported yet" (or "not supported with ... yet"). Its text is rendered
statically: f-string fields and ``+`` operands that are plain names are resolved to the string values the name can
take in the source (a constant or f-string assigned to it, the elements of the literal tuple / list a ``for`` loop
or comprehension iterates, with tuple unpacking, the strings ``append``-ed to a list, the strings a called function
of nxd_lc returns), anything else is left blank. The key of each rendered text is the first dotted config key in it
(``model.moe.routing_algorithm``, ``distributed_strategy.zero1``: a path under one of the YAML sections
:data:`SECTIONS`), or, when there is none, the first snake_case name (a top-level key such as ``model_source``, or
a field of a model's ``config.json`` such as ``partial_rotary_factor``). A message with neither fails the test,
naming its file and line: write the key into the message.

docs/limitations.md lists the keys in the table under the heading :data:`LIMITS_HEADING`, one row per (key,
limitation), the key in backticks in the first column.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "nxd_lc"
README = REPO / "README.md"
DOCS = REPO / "docs"
LIMITATIONS = DOCS / "limitations.md"
README_MAX_LINES = 220
LIMITS_HEADING = "Not supported yet"

# ---------------------------------------------------------------------------------------------------- links

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    """The documentation checked: README.md, docs/**/*.md, benchmarks/README.md, examples/*/README.md."""
    files = [README, *sorted(DOCS.rglob("*.md")), REPO / "benchmarks" / "README.md",
             *sorted(REPO.glob("examples/*/README.md"))]
    return [f for f in files if f.is_file()]


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every inline link / image and reference definition outside code."""
    out = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        ref = _REF_DEF.match(line)
        if ref:
            out.append((number, ref.group(1)))
            continue
        out += [(number, m.group(1)) for m in _LINK.finditer(_INLINE_CODE.sub("``", line))]
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The heading anchors of a Markdown file (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Every relative link of ``path`` whose file (or Markdown heading) does not exist."""
    bad = []
    for number, target in links(path):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # http(s):, mailto:, ...: not checked here
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(REPO)})")
    return bad


def test_markdown_files_found() -> None:
    names = {str(p.relative_to(REPO)) for p in markdown_files()}
    assert {"README.md", "docs/limitations.md", "docs/architecture.md", "docs/DESIGN.md"} <= names, names


def test_relative_links_resolve() -> None:
    bad = [b for path in markdown_files() for b in broken_links(path)]
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move "
                                            "detail into docs/ and link it")


# ---------------------------------------------------------------------------------- "not supported yet" keys

SECTIONS = ("trainer", "exp_manager", "distributed_strategy", "data", "model", "precision",
            "model_alignment_strategy")
_NOT_YET = re.compile(r"not supported(?: (?:(?![.;:] ).){1,120}?)? yet\b", re.IGNORECASE | re.DOTALL)
_SECTION_ALTERNATIVES = "|".join(sorted(SECTIONS, key=len, reverse=True))
_DOTTED_KEY = re.compile(rf"(?<![\w.])(?:{_SECTION_ALTERNATIVES})(?:\.[A-Za-z_]\w*)+")
_SNAKE_NAME = re.compile(r"(?<![\w.])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w])")
_BLANK = "\x00"  # a part of a message the static rendering cannot know
_MAX_VALUES = 64  # renderings kept per expression
_MAX_DEPTH = 8  # name / call resolution depth
_STR_METHODS = {"replace", "strip", "lstrip", "rstrip", "lower", "upper", "capitalize"}


class _Source:
    """All modules of the package, parsed once: parent links, docstrings, functions by name."""

    def __init__(self, root: Path) -> None:
        self.files: dict[ast.AST, Path] = {}
        self.parent: dict[ast.AST, ast.AST] = {}
        self.docstrings: set[int] = set()
        self.functions: dict[str, list[ast.AST]] = {}
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            self.files[tree] = path
            for node in ast.walk(tree):
                for child in ast.iter_child_nodes(node):
                    self.parent[child] = node
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = node.body[0] if node.body else None
                    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                        self.docstrings.add(id(first.value))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.setdefault(node.name, []).append(node)

    def path_of(self, node: ast.AST) -> Path:
        while node in self.parent:
            node = self.parent[node]
        return self.files[node]

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parent:
            node = self.parent[node]
            yield node

    # -- values of string expressions

    def values(self, node: ast.AST | None, depth: int = 0) -> set[str]:
        """The strings ``node`` can evaluate to, as far as the source shows (:data:`_BLANK` for unknown parts)."""
        if node is None or depth > _MAX_DEPTH:
            return {_BLANK}
        if isinstance(node, ast.Constant):
            return {node.value} if isinstance(node.value, str) else {_BLANK}
        if isinstance(node, ast.JoinedStr):
            parts = [self.values(v.value if isinstance(v, ast.FormattedValue) else v, depth + 1) for v in node.values]
            return _joined(parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return _joined([self.values(node.left, depth + 1), self.values(node.right, depth + 1)])
        if isinstance(node, ast.IfExp):
            return _capped(self.values(node.body, depth + 1) | self.values(node.orelse, depth + 1))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _STR_METHODS:
            return self.values(node.func.value, depth + 1)  # e.g. p.replace(...): the key at its start survives
        if isinstance(node, ast.Name):
            found: set[str] = set()
            for value in self.bindings(node, depth):
                found |= value
            return _capped(found) or {_BLANK}
        return {_BLANK}

    def bindings(self, name: ast.Name, depth: int) -> Iterator[set[str]]:
        """Values of the name at ``name``: from the loops / comprehensions around it, else from assignments in
        its function (or module)."""
        for anc in self.ancestors(name):
            generators = anc.generators if isinstance(anc, (ast.ListComp, ast.SetComp, ast.GeneratorExp,
                                                            ast.DictComp)) else []
            loops = [(g.target, g.iter) for g in generators]
            if isinstance(anc, (ast.For, ast.AsyncFor)):
                loops.append((anc.target, anc.iter))
            for target, iterable in loops:
                position = _position(target, name.id)
                if position is not None:
                    yield from (self.values(item, depth + 1) for item in self._picked(iterable, position, depth))
                    return
            if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)):
                args = anc.args if not isinstance(anc, ast.Module) else None
                if args is not None and name.id in {a.arg for a in args.args + args.kwonlyargs + args.posonlyargs}:
                    return  # a parameter: unknown here
                assigned = list(self._assigned(anc, name.id))
                if assigned:
                    yield from (self.values(v, depth + 1) for v in assigned)
                    return

    def _assigned(self, scope: ast.AST, name: str) -> Iterator[ast.AST]:
        for node in _walk_scope(scope):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                yield node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                    and node.value is not None:
                yield node.value

    def _picked(self, iterable: ast.AST, position: tuple[int, ...], depth: int) -> Iterator[ast.AST | None]:
        """The element expressions at ``position`` (a path into nested tuples) of what ``iterable`` yields."""
        for item in self.elements(iterable, depth + 1):
            for index in position:
                item = item.elts[index] if isinstance(item, (ast.Tuple, ast.List)) and index < len(item.elts) \
                    else None
                if item is None:
                    break
            yield item

    def elements(self, node: ast.AST, depth: int) -> list[ast.AST]:
        """The element expressions of a sequence expression (literal, list built by appends, sum of sequences,
        a call of an nxd_lc function returning one, a comprehension)."""
        if depth > _MAX_DEPTH:
            return []
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return list(node.elts)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return [node.elt]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.elements(node.left, depth + 1) + self.elements(node.right, depth + 1)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            out: list[ast.AST] = []
            for fn in self.functions.get(name or "", []):
                for ret in _walk_scope(fn):
                    if isinstance(ret, ast.Return) and ret.value is not None:
                        out += self.elements(ret.value, depth + 1)
            return out
        if isinstance(node, ast.Name):
            scope = next((a for a in self.ancestors(node) if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                              ast.Module))), None)
            if scope is None:
                return []
            out = []
            for value in self._assigned(scope, node.id):
                out += self.elements(value, depth + 1)
            for call in _walk_scope(scope):  # name.append(x), name.extend([...]), name += [...]
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                        and isinstance(call.func.value, ast.Name) and call.func.value.id == node.id and call.args:
                    if call.func.attr == "append":
                        out.append(call.args[0])
                    elif call.func.attr == "extend":
                        out += self.elements(call.args[0], depth + 1)
                elif isinstance(call, ast.AugAssign) and isinstance(call.target, ast.Name) \
                        and call.target.id == node.id and isinstance(call.op, ast.Add):
                    out += self.elements(call.value, depth + 1)
            return out
        return []

    # -- the messages

    def messages(self) -> Iterator[ast.AST]:
        """The outermost string expressions (literal, f-string, ``+`` of them) saying "not supported yet"."""
        seen: set[int] = set()
        for tree in self.files:
            for node in ast.walk(tree):
                if id(node) in self.docstrings or not _is_text(node):
                    continue
                outer = node
                while isinstance(self.parent.get(outer), (ast.JoinedStr, ast.FormattedValue)) or (
                        isinstance(self.parent.get(outer), ast.BinOp)
                        and isinstance(self.parent[outer].op, ast.Add)):
                    outer = self.parent[outer]
                if id(outer) in seen or id(outer) in self.docstrings \
                        or "not supported" not in _literal_text(outer).lower():
                    continue
                if any(_NOT_YET.search(v) for v in self.values(outer)) or _NOT_YET.search(_literal_text(outer)):
                    seen.add(id(outer))
                    yield outer


def _walk_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function / module body, not descending into nested functions or classes."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _position(target: ast.AST, name: str) -> tuple[int, ...] | None:
    """Where ``name`` sits in a loop target (``()`` = the whole item; ``(1,)`` = its second element)."""
    if isinstance(target, ast.Name):
        return () if target.id == name else None
    if isinstance(target, (ast.Tuple, ast.List)):
        for i, elt in enumerate(target.elts):
            inner = _position(elt, name)
            if inner is not None:
                return (i, *inner)
    return None


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _literal_text(node: ast.AST) -> str:
    """The literal parts of a string expression, joined (fields blank)."""
    return _BLANK.join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _capped(values: Iterable[str]) -> set[str]:
    return set(sorted(values)[:_MAX_VALUES])


def _joined(parts: list[set[str]]) -> set[str]:
    return _capped("".join(combo) for combo in itertools.islice(itertools.product(*parts), _MAX_VALUES))


def message_key(text: str) -> str | None:
    """The config key a rendered message names: its first dotted config key, else its first snake_case name."""
    for pattern in (_DOTTED_KEY, _SNAKE_NAME):
        m = pattern.search(text)
        if m:
            return m.group(0)
    return None


def source_keys(root: Path = PACKAGE) -> tuple[dict[str, list[str]], list[str]]:
    """``({key: ["file:line", ...]}, [sites whose key could not be found])`` over the package's messages."""
    src = _Source(root)
    keys: dict[str, list[str]] = {}
    unkeyed = []
    for node in src.messages():
        where = f"{src.path_of(node).relative_to(root.parent)}:{node.lineno}"
        texts = [v for v in src.values(node) if _NOT_YET.search(v)] or [_literal_text(node)]
        found = {message_key(t) for t in texts} - {None}
        if not found:
            unkeyed.append(f"{where}: {texts[0].replace(_BLANK, '{...}')[:160]!r}")
        for key in found:
            keys.setdefault(key, []).append(where)
    return keys, unkeyed


def documented_keys(path: Path = LIMITATIONS) -> set[str]:
    """The backticked keys in the first column of the table under the heading :data:`LIMITS_HEADING`."""
    keys, inside = set(), False
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        heading = _HEADING.match(line)
        if heading:
            inside = heading.group(2).strip().lower() == LIMITS_HEADING.lower()
            continue
        m = re.match(r"^\s*\|\s*`([^`]+)`\s*\|", line)
        if inside and m:
            keys.add(m.group(1).strip())
    return keys


def test_message_keys_extraction_sees_the_known_shapes() -> None:
    """The extraction itself: a key at the start, after the prefix, through a loop, a list of appends, a call."""
    code = '''
def rules(m):
    p = []
    for key in ("hidden_dropout", "ffn_dropout"):
        p.append(f"not supported yet: model.{key} > 0 with PP")
    checks = [(m.a, "model.optim.name", m.b)]
    p += [f"not supported yet: {k}={v!r}" for bad, k, v in checks if bad]
    p += ["not supported yet: " + q.replace("x", "y") for q in other(m)]
    p.append("model.compile: not supported yet with LoRA")
    p.append(f"router_jitter_noise {m.x} in the config is not supported yet")
    p.append("data.curriculum: not supported with distributed_strategy.pipeline_model_parallel_size > 1 yet")
    return p


def other(m):
    """not supported yet: docstring.ignored"""
    return [f"distributed_strategy.context_parallel_algo: ring on {m.acc}"]
'''
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp, "pkg")
        pkg.mkdir()
        (pkg / "rules.py").write_text(code)
        keys, unkeyed = source_keys(pkg)
    assert not unkeyed, unkeyed
    assert set(keys) == {"model.hidden_dropout", "model.ffn_dropout", "model.optim.name", "model.compile",
                         "distributed_strategy.context_parallel_algo", "router_jitter_noise", "data.curriculum"}


def test_limitations_list_the_keys_the_code_refuses() -> None:
    """docs/limitations.md's "Not supported yet" table names exactly the keys of the source's messages."""
    keys, unkeyed = source_keys()
    assert not unkeyed, ("'not supported yet' messages without a recognisable config key (name the key at the "
                         "start of the message):\n" + "\n".join(unkeyed))
    documented = documented_keys()
    assert documented, f"no keys found in the '{LIMITS_HEADING}' table of {LIMITATIONS}"
    missing = sorted(set(keys) - documented)
    stale = sorted(documented - set(keys))
    assert not missing and not stale, (
        f"{LIMITATIONS.relative_to(REPO)} is out of step with the source:\n"
        + "".join(f"  refused in the source but not listed: {k} ({', '.join(keys[k])})\n" for k in missing)
        + "".join(f"  listed but no 'not supported yet' message names it: {k}\n" for k in stale))


def test_every_module_a_command_names_exists() -> None:
    """``python -m <module>`` / ``torchrun ... -m <module>`` in the configs' comments, the docs, the README and the
    example scripts name modules of this repository that exist (``nxd_lc.checkpoint.convert`` did not); found as
    files, without importing anything."""
    sources = [*REPO.glob("conf/*.yaml"), *REPO.glob("docs/**/*.md"), REPO / "README.md",
               *REPO.glob("examples/**/*.sh"), *REPO.glob("benchmarks/**/*.sh")]
    missing = []
    for path in sources:
        for module in sorted(set(re.findall(r"-m\s+(nxd_lc(?:\.\w+)+)", path.read_text(errors="replace")))):
            base = REPO.joinpath(*module.split("."))
            if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                missing.append(f"{path.relative_to(REPO)}: {module}")
    assert not missing, missing
