"""Chat templates rendered in jinja2's sandbox with time and memory bounds.

A chat template comes with the tokenizer (``tokenizer_config.json`` / ``chat_template.jinja``) or from
``data.tokenizer.chat_template``; it is code from outside. transformers renders it in
``jinja2.sandbox.ImmutableSandboxedEnvironment``, which blocks attribute escapes and mutation but bounds neither time
nor memory: ``{{ 'x' * 10**9 }}`` allocates gigabytes and two nested ``range(100000)`` loops run for hours.

:class:`BoundedSandbox` is that environment (the same settings, globals, ``tojson`` filter and ``{% generation %}``
tag as transformers' ``apply_chat_template``, which :class:`SandboxedChatTemplate` reproduces for ``tokenize=False``)
with three bounds per rendering (:class:`RenderLimits`):

* time: every loop iteration, call, filter, intercepted operator and output chunk checks a deadline;
* size: every value the template creates (operator and ``~`` results, call and filter results, joined macro / block
  output, the output itself) is charged to a budget of characters (list / dict items count one each, integers one
  per byte), and operations that multiply sizes (``*``, ``**``, ``%``, ``center``, ``replace``, ``join``, ``format``,
  ``indent``, ``tojson`` and the like) are refused before they run when their size estimate exceeds what is left.
  The budget grows with the record (``max_chars + chars_per_input_char`` x the characters of its messages and tools),
  so long-context records render, and bounds peak memory to about 4 bytes per budget character.
  A container is charged the items reachable from it, each reference counted (:func:`_deep_items`), when a list /
  tuple / dict literal builds it and when an operator, call or filter returns it: ``[ns.a, ns.a]`` repeated doubles
  what printing, comparing or a filter would walk, so such a structure stops at the budget while it is built (the
  walk that follows it -- ``str()``, ``==`` -- is C code no deadline can interrupt).

* output: the rendered text of one record may hold at most ``max_output_chars + output_chars_per_input_char`` x
  its input characters (1 Mi + 8 per character by default): it is tokenized next, at ~110 bytes per character.

A template that recurses without bound (``RecursionError``) or exhausts memory (``MemoryError``) also stops with
:class:`ChatTemplateLimitError`.

Exceeding a bound raises :class:`ChatTemplateLimitError` (a ``ValueError``) naming the bound.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment


@dataclass(frozen=True)
class RenderLimits:
    """Bounds of one rendering of a chat template.

    Attributes:
        max_seconds: wall-clock seconds one rendering may take.
        max_chars: characters (list / dict items: one each) the values a rendering creates may total, plus
            ``chars_per_input_char`` per character of the record's messages and tools.
        chars_per_input_char: budget added per input character (templates copy each message a few times).
        max_output_chars: characters the rendered text of one record may hold, plus ``output_chars_per_input_char``
            per character of its messages and tools: what is rendered is tokenized next, at ~110 bytes of memory
            per character (a template emitting a 31.5 M-character system prompt, within ``max_chars``, took 14 s
            and 3.7 GB per record).
        output_chars_per_input_char: output allowed per input character (templates print each message about once;
            the tools' JSON a little more).
    """

    max_seconds: float = 10.0
    max_chars: int = 64 * 2**20
    chars_per_input_char: int = 32
    max_output_chars: int = 2**20
    output_chars_per_input_char: int = 8


class ChatTemplateLimitError(ValueError):
    """A chat template exceeded a :class:`RenderLimits` bound (the message names the bound)."""


@dataclass
class _Budget:
    deadline: float
    left: int
    limits: RenderLimits
    total: int

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateLimitError(f"rendering ran past the time bound of {self.limits.max_seconds:g} s "
                                         "(RenderLimits.max_seconds); the template loops without bound")

    def check(self, estimate: int, what: str) -> None:
        if estimate > self.left:
            raise ChatTemplateLimitError(
                f"{what} would create more characters / items than the {max(self.left, 0):,} left of the size "
                f"bound of {self.total:,} per rendering (RenderLimits.max_chars {self.limits.max_chars:,} + "
                f"{self.limits.chars_per_input_char} per input character); the template builds values without "
                "bound")

    def spend(self, value: Any, what: str) -> None:
        size = _deep_items(value, self.left, self) if isinstance(value, _CONTAINERS) else _size(value)
        self.check(size, what)
        self.left -= size


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("nxd_lc_chat_template_budget", default=None)


def _size(value: Any) -> int:
    """Shallow size: characters of a string, items of a container, bytes of an integer, else 0."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


_CONTAINERS = (list, tuple, set, frozenset, dict, jinja2.utils.Namespace)


def _children(v: Any) -> Collection[Any]:
    """The values a container holds (a namespace's attributes; a dict's keys and values)."""
    if isinstance(v, jinja2.utils.Namespace):
        v = object.__getattribute__(v, "_Namespace__attrs")
    if isinstance(v, dict):
        return [*v.keys(), *v.values()]
    return v


def _deep_items(value: Any, cap: int, budget: _Budget | None = None) -> int:
    """Container items reachable from ``value``, each reference counted (what ``str()`` / ``==`` walk); stops
    above ``cap``; checks ``budget``'s deadline every 65,536 items."""
    total, stack = 0, [value]
    while stack and total <= cap:
        v = stack.pop()
        if isinstance(v, _CONTAINERS):
            items = _children(v)
            n = len(items)
            if budget is not None and (total >> 16) != ((total + n) >> 16):
                budget.tick()
            total += n
            stack.extend(items)
    return total


def _deep_size(value: Any, cap: int) -> int:
    """Characters + items + integer bytes reachable from ``value`` (counted per reference; stops above ``cap``)."""
    total, stack = 0, [value]
    while stack and total <= cap:
        v = stack.pop()
        total += _size(v) if not isinstance(v, (list, tuple, set, frozenset, dict)) else len(v)
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
    return total


_DIGITS = re.compile(r"\d+")


def _amplified(value: Any, args: Iterable[Any], cap: int, *, formatting: bool = False) -> int:
    """Size estimate of an operation on ``value`` with ``args`` that can multiply sizes: (deep size of value + 1) x
    (1 + string lengths + integers + deep sizes of the arguments); ``formatting`` adds the widths written in a
    format string (``'%999999s'``, ``'{:>999999}'``) times its placeholders."""
    base = _deep_size(value, cap) + 1
    factor = 1
    for a in args:
        if isinstance(a, bool) or a is None:
            continue
        factor += max(a, 0) if isinstance(a, int) else _deep_size(a, cap) if not isinstance(a, float) else 0
        if factor > cap:
            return cap + 1
    estimate = base * factor
    if formatting and isinstance(value, str):
        digits = _DIGITS.findall(value)
        if any(len(d) >= 12 for d in digits):  # a width of 10^11 characters or more
            return cap + 1
        widths = max((int(d) for d in digits), default=0)
        estimate += widths * (value.count("%") + value.count("{") + 1)
    return estimate


#: filters and str methods whose result can be many times their input (estimated first, :func:`_amplified`)
_AMPLIFYING_FILTERS = frozenset({"center", "indent", "join", "replace", "format", "wordwrap", "sum", "tojson",
                                 "pprint", "string", "urlize", "xmlattr", "urlencode", "batch", "slice", "truncate"})
_AMPLIFYING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "translate",
                                 "format", "format_map", "encode"})


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the deadline checked, amplifying filters estimated first and the result charged.

    The wrapper takes the context (``pass_context``), which also keeps jinja from running it at compile time on
    constant arguments (constant folding would build ``'%999999999s' | format('x')`` while compiling, unbounded).
    """
    kind = getattr(getattr(func, "jinja_pass_arg", None), "name", None)  # context / eval_context / environment

    @jinja2.pass_context  # outermost: functools.wraps copies func's own jinja_pass_arg
    @functools.wraps(func)
    def bounded(context: jinja2.runtime.Context, *args: Any, **kwargs: Any) -> Any:
        passed = {"context": context, "eval_context": context.eval_ctx, "environment": context.environment}
        lead = (passed[kind],) if kind in passed else ()
        budget = _BUDGET.get()
        if budget is None:
            return func(*lead, *args, **kwargs)
        budget.tick()
        if name in _AMPLIFYING_FILTERS and args:
            value = args[0]
            if not isinstance(value, (str, list, tuple, dict)) and isinstance(value, Iterable):
                value = list(value)  # a generator (map / select): read it once
                args = (value, *args[1:])
            estimate = _amplified(value, [*args[1:], *kwargs.values()], budget.left, formatting=name == "format")
            if name == "sum" and isinstance(value, (list, tuple)) and \
                    any(isinstance(v, (str, list, tuple)) for v in value):
                estimate *= len(value)  # adding sequences copies the sum so far at each item
            budget.check(estimate, f"the filter '{name}'")
        result = func(*lead, *args, **kwargs)
        budget.spend(result, f"the filter '{name}'")
        return result

    return bounded


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without dict's class attributes (as transformers' ``TemplateDict``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed names (as transformers' ``TemplateNamespace``)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes on "
                                                  f"a namespace, got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _HookedCodeGenerator(CodeGenerator):
    """Compiles every ``for`` loop's iterable through ``environment.bounded_iter`` (a deadline check per
    iteration), every ``~`` concatenation and every list / tuple / dict literal through ``environment.charged``
    (its size is charged: a literal's, the items reachable from it)."""

    def _charged(self, visit: Callable[[Any, Frame], None], node: nodes.Node, frame: Frame) -> None:
        self.write("environment.charged(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:  # noqa: N802
        self._charged(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:  # noqa: N802
        self._charged(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:  # noqa: N802
        if node.ctx == "load":  # not an assignment target
            self._charged(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)

    def visit_For(self, node: nodes.For, frame: Frame) -> None:  # noqa: N802 - jinja's visitor naming
        if not (isinstance(node.iter, nodes.Call) and isinstance(node.iter.node, nodes.EnvironmentAttribute)):
            node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None,
                                   lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:  # noqa: N802
        self.write("environment.charged(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with the bounds of the module doc (active inside
    :meth:`SandboxedChatTemplate.render`; outside a rendering it behaves as the plain sandbox)."""

    code_generator_class = _HookedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)  # generates text of any size; no chat template uses it
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                            namespace=_TemplateNamespace)

    def bounded_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """``iterable`` with the deadline checked before each item."""
        budget = _BUDGET.get()
        for item in iterable:
            if budget is not None:
                budget.tick()
            yield item

    def charged(self, value: Any) -> Any:
        """``value`` (a ``~`` result or a list / tuple / dict literal), its size charged to the budget."""
        budget = _BUDGET.get()
        if budget is not None:
            budget.spend(value, "a '~' concatenation" if isinstance(value, str) else "a list / tuple / dict literal")
        return value

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Join macro / ``{% set %}`` block output, its size checked before joining."""
        budget = _BUDGET.get()
        if budget is None:
            return "".join(pieces)
        pieces = list(pieces)
        budget.check(sum(map(len, pieces)), "macro / block output")
        result = "".join(pieces)
        budget.spend(result, "macro / block output")
        return result

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        """``left <operator> right`` with its size estimated first (``*``, ``**``, ``%``) and charged."""
        budget = _BUDGET.get()
        if budget is not None:
            budget.tick()
            budget.check(_binop_estimate(operator, left, right, budget.left), f"the operator '{operator}'")
        result = super().call_binop(context, operator, left, right)
        if budget is not None:
            budget.spend(result, f"the operator '{operator}'")
        return result

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any,  # noqa: N805
             **kwargs: Any) -> Any:
        """A call from the template, with the deadline checked, amplifying ``str`` methods estimated first and
        the result charged (a macro's output is charged when it is joined)."""
        budget = _BUDGET.get()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.tick()
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format / format_map
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, str) and name in _AMPLIFYING_METHODS:
            if name == "join" and args and not isinstance(args[0], (str, list, tuple)):
                args = (list(args[0]), *args[1:])
            budget.check(_amplified(owner, [*args, *kwargs.values()], budget.left,
                                    formatting=name.startswith("format")), f"the method str.{name}")
        result = super().call(__context, __obj, *args, **kwargs)
        if not isinstance(__obj, Macro):
            budget.spend(result, f"the call {name or type(__obj).__name__}()")
        return result


def _binop_estimate(operator: str, left: Any, right: Any, cap: int) -> int:
    seqs = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(left, seqs) and isinstance(right, int):
            return len(left) * max(right, 0)
        if isinstance(right, seqs) and isinstance(left, int):
            return len(right) * max(left, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (left.bit_length() + right.bit_length()) // 8
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return min(left.bit_length() * right, 8 * (cap + 1)) // 8
    if operator == "%" and isinstance(left, str):
        return _amplified(left, right if isinstance(right, tuple) else [right], cap, formatting=True)
    return 0


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_messages(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as ``apply_chat_template`` passes them: null-valued keys dropped, the reasoning text under
    ``reasoning_content`` and ``thinking`` (transformers' aliasing of the older names)."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class SandboxedChatTemplate:
    """A chat template compiled in a :class:`BoundedSandbox`; :meth:`render` is ``apply_chat_template(...,
    tokenize=False)`` with the bounds of ``limits``.

    Args:
        source: the jinja template.
        special_tokens: the tokenizer's ``special_tokens_map`` (``bos_token``, ``eos_token``, ... template globals).
        limits: the bounds (default :class:`RenderLimits`).
    Raises:
        jinja2.TemplateSyntaxError: ``source`` does not parse.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, Any],
                 limits: RenderLimits | None = None) -> None:
        self.limits = limits or RenderLimits()
        self.special_tokens = dict(special_tokens)
        self.template = BoundedSandbox().from_string(source)

    def render(self, messages: list[Mapping[str, Any]], *, tools: list[Any] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The text of ``messages`` (and ``tools``) rendered with the template.

        Raises:
            ChatTemplateLimitError: the rendering ran past ``limits.max_seconds``, created more than its size
                budget (names the bound), recursed without bound or exhausted memory.
            jinja2.TemplateError / TypeError / ...: the template fails on the record (as transformers would).
        """
        chat = _template_messages(messages)
        input_chars = _deep_size([chat, tools], self.limits.max_chars)
        total = self.limits.max_chars + self.limits.chars_per_input_char * input_chars
        budget = _Budget(time.monotonic() + self.limits.max_seconds, total, self.limits, total)
        output_bound = self.limits.max_output_chars + self.limits.output_chars_per_input_char * input_chars
        token = _BUDGET.set(budget)
        try:
            chunks, length = [], 0
            for chunk in self.template.generate(**self.special_tokens, messages=chat, tools=tools, documents=None,
                                                add_generation_prompt=add_generation_prompt):
                budget.tick()
                budget.spend(chunk, "the template's output")
                length += len(chunk)
                if length > output_bound:
                    raise ChatTemplateLimitError(
                        f"the rendered text passed {output_bound:,} characters, the bound per record "
                        f"(RenderLimits.max_output_chars {self.limits.max_output_chars:,} + "
                        f"{self.limits.output_chars_per_input_char} per character of its messages and tools, "
                        f"{input_chars:,}); the template adds text the record does not hold")
                chunks.append(chunk)
            return "".join(chunks)
        except RecursionError:
            raise ChatTemplateLimitError("the template recursed past Python's recursion limit (a macro or include "
                                         "that calls itself without end)") from None
        except MemoryError:
            raise ChatTemplateLimitError("the rendering exhausted memory before a size bound could stop it; the "
                                         "template builds values without bound") from None
        finally:
            _BUDGET.reset(token)
