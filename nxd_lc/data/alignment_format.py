"""Alignment records -> token ids + target mask (SFT) or prompt / chosen / rejected ids (DPO, ORPO).

Record formats (one JSON object per record):

* NxDT SFT: ``{"input": str, "output": str}`` (keys ``data.input_key`` / ``data.output_key``);
* HF chat: ``{"messages": [{"role", "content"}, ...]}``, optionally OpenAI tool use: a ``tools`` list, assistant
  messages with ``tool_calls`` (``content`` may be null) and ``tool`` role messages with the results;
* preference (NxDT / TRL): ``{"prompt", "chosen", "rejected"}``, either three strings, or ``prompt`` a message
  list and ``chosen`` / ``rejected`` message lists (or strings = one assistant message); ``tools`` optional.

Strings are not templated (NxDT's and TRL's "standard" format): the prompt is tokenized as the tokenizer
tokenizes text (with its own leading special tokens, e.g. Llama 3's ``<|begin_of_text|>``; NxDT always prepends
BOS), the response is tokenized alone and EOS is appended. Message lists go through ``data.tokenizer.chat_template``:

* ``default``: the tokenizer's own template (a ValueError when it has none);
* ``null``: passthrough: the message contents concatenated as they are, no role markers, EOS after each
  assistant message (for data that carries its own formatting);
* any other string: a jinja template (HF ``apply_chat_template`` semantics), or the name of one of the
  tokenizer's named templates.

Templates are code from outside (the tokenizer's files): they render in jinja2's sandbox with time and size bounds
(:mod:`~nxd_lc.data.chat_sandbox`), and an error names the bound and the file the template came from.

Tool use: a template whose source mentions ``tool_calls`` receives the assistant ``tool_calls`` as they are, and
one that mentions ``tools`` receives the ``tools`` list. Otherwise (e.g. SmolLM2's ChatML template, or
passthrough) they are written into the message text, Hermes style: the tools as
``<tools>[...]</tools>`` appended to the system message (inserted when missing), each call as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` after the assistant content, and tool results as
``<tool_response>...</tool_response>``. Either way tool schemas and arguments are serialized exactly as given
(``json.dumps`` of the record's own objects; argument strings verbatim): keys are never added, dropped or
null-filled, which is why jsonl is read with the ``json`` module (see ``alignment_datamodule``).

Loss mask: only assistant tokens are targets. The assistant spans of a conversation are found by rendering it
prefix by prefix: for each assistant message ``i``, ``P = render(m[:i], add_generation_prompt=True)`` and
``F = render(m[:i+1])``; the span is ``F[len(P):]`` (the content and the template's end-of-turn marker, e.g.
``<|im_end|>\\n``), which requires the template to be prefix-stable (``F`` starts with ``P`` and the full
rendering starts with ``F``; a ValueError names the record otherwise). This works for any template, unlike
``return_assistant_tokens_mask``, which needs ``{% generation %}`` markers. The text is then cut at the span
boundaries and each piece is tokenized on its own (no special tokens added; the template writes its own); the
tokens of assistant pieces are the targets. Cutting keeps every token on one side of a boundary: a prompt that
ends in a space ("### assistant: " + "world") would otherwise merge into a token " world" holding prompt
characters; it also matches inference, where the prompt is tokenized alone and the reply is generated after it.
Plain string records are tokenized the same way (prompt, then response). Caveat: a tokenizer whose normalizer
prepends a space to every input (SentencePiece "legacy" Llama 2 / Mistral) adds it to each piece, as TRL's
separate prompt / completion tokenization does; byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen, GPT-2) do not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from nxd_lc.config.alignment_schema import DEFAULT_CHAT_TEMPLATE
from nxd_lc.data.chat_sandbox import ChatTemplateLimitError, RenderLimits, SandboxedChatTemplate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

Span = tuple[int, int]


@dataclass(frozen=True)
class Encoded:
    """One token sequence: ``input_ids`` int32 ``[L]``, ``target_mask`` bool ``[L]`` (True = the token is an
    assistant / output token and is predicted by the loss) and the rendered ``text`` (for inspection)."""

    input_ids: np.ndarray
    target_mask: np.ndarray
    text: str


@dataclass(frozen=True)
class EncodedPair:
    """A preference record: the shared ``prompt`` (no targets) and the ``chosen`` / ``rejected`` responses
    (their ``target_mask`` marks assistant tokens; tool results inside a response are not targets)."""

    prompt: Encoded
    chosen: Encoded
    rejected: Encoded


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def serialize_tool_call(call: Mapping[str, Any]) -> str:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` for an OpenAI ``tool_calls`` entry.

    ``arguments`` (OpenAI: a JSON string; HF: an object) is written verbatim when a string, else ``json.dumps``
    of the object as given; no key is added or removed.

    Raises:
        ValueError: the entry has no ``function.name`` / ``name``.
    """
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or "name" not in fn:
        raise ValueError(f"tool call {call!r} has no function name (expected {{'function': {{'name', "
                         "'arguments'}}}})")
    args = fn.get("arguments", {})
    args_text = args if isinstance(args, str) else _dumps(args)
    return f'<tool_call>{{"name": {_dumps(fn["name"])}, "arguments": {args_text}}}</tool_call>'


class ChatRenderer:
    """Renders message lists to text with ``data.tokenizer.chat_template`` and finds assistant spans.

    Args:
        tokenizer: the fast tokenizer (its ``apply_chat_template`` and ``eos_token``).
        chat_template: ``'default'`` | None (passthrough) | a jinja string | a named template of the tokenizer.
        limits: the time / size bounds of one rendering (:mod:`~nxd_lc.data.chat_sandbox`; default
            :class:`~nxd_lc.data.chat_sandbox.RenderLimits`).
    Raises:
        ValueError: a string that is neither a jinja template nor one of the tokenizer's template names; a
            template that does not parse (names where it comes from).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, chat_template: str | None,
                 limits: RenderLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.setting = chat_template
        self.template = _resolve_template(tokenizer, chat_template)
        self.origin = template_origin(tokenizer, chat_template)
        self.native_tool_calls = self.template is not None and "tool_calls" in self.template
        self.native_tools = self.template is not None and "tools" in self.template
        self.sandboxed: SandboxedChatTemplate | None = None
        if self.template is not None:
            try:
                self.sandboxed = SandboxedChatTemplate(self.template, tokenizer.special_tokens_map, limits)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"data.tokenizer.chat_template: the chat template from {self.origin} does not "
                                 f"parse (template line {e.lineno}: {e.message}); fix it or give another "
                                 "template") from None

    def _check_template(self, where: str) -> None:
        if self.setting is not None and self.template is None:
            raise ValueError(f"{where}: data.tokenizer.chat_template is {DEFAULT_CHAT_TEMPLATE!r} but the "
                             "tokenizer has no chat template; give a jinja template string, or null to "
                             "concatenate message contents as they are")

    def normalize(self, messages: Any, tools: Any, where: str) -> list[dict[str, Any]]:
        """Checked copies of ``messages`` with tool use written into the text where the template lacks it.

        Raises:
            ValueError: not a list of ``{"role": str, "content": str | null}`` objects, ``tool_calls`` not a list
                of ``{"function": {"name": str, "arguments": str | object}}`` (or ``{"name", "arguments"}``)
                objects, or ``tools`` not a list of objects (names ``where``, the key and the type found).
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, got "
                             f"{_kind(messages)}")
        _check_tools(tools, where)
        out = [_check_message(m, where, k) for k, m in enumerate(messages)]
        if not self.native_tool_calls:
            out = [_inline_tool_use(m) for m in out]
        if tools and not self.native_tools:
            text = f"<tools>{_dumps(tools)}</tools>"
            if out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def render(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool,
               where: str) -> str:
        """Text of normalized ``messages`` (passthrough: contents concatenated, EOS after assistant turns).

        The template runs in a bounded sandbox (:mod:`~nxd_lc.data.chat_sandbox`; as ``apply_chat_template``
        with ``tokenize=False`` otherwise).

        Raises:
            ValueError: the template fails on the record (jinja's error, naming ``where``).
            ChatTemplateLimitError: the rendering exceeded a time / size bound (names ``where``, the template's
                origin, e.g. ``<tokenizer dir>/tokenizer_config.json``, and the bound).
        """
        if self.setting is None:
            eos = self.tokenizer.eos_token or ""
            return "".join(m["content"] + (eos if m["role"] == "assistant" else "") for m in messages)
        self._check_template(where)
        assert self.sandboxed is not None
        try:
            return self.sandboxed.render(messages, tools=tools if self.native_tools and tools else None,
                                         add_generation_prompt=add_generation_prompt)
        except ChatTemplateLimitError as e:
            raise ChatTemplateLimitError(f"{where}: the chat template from {self.origin} stopped: {e}; fix or "
                                         "replace the template (data.tokenizer.chat_template: a jinja string, or "
                                         "null)") from None
        except Exception as e:  # jinja raises its own types (TemplateError, UndefinedError, TypeError)
            raise ValueError(f"{where}: the chat template failed on this record: {type(e).__name__}: {e}") from e

    def assistant_spans(self, messages: list[dict[str, Any]], tools: Any, where: str,
                        first_message: int = 0) -> tuple[str, list[Span]]:
        """``(text, spans)``: the full rendering and the character spans of assistant messages >= ``first_message``.

        Raises:
            ValueError: the template is not prefix-stable on this record (see module doc), naming ``where``.
        """
        full = self.render(messages, tools, False, where)
        spans: list[Span] = []
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant" or i < first_message:
                continue
            if i == 0 and self.setting is not None:
                raise ValueError(f"{where}: the conversation starts with an assistant message, so the template "
                                 "gives it no prompt to locate it after; start with a system or user message")
            prefix = self.render(messages[:i], tools, True, where)
            upto = self.render(messages[: i + 1], tools, False, where)
            if not (upto.startswith(prefix) and full.startswith(upto)) or (spans and len(prefix) < spans[-1][1]):
                raise ValueError(f"{where}: the chat template is not prefix-stable at message {i} (rendering the "
                                 "conversation up to it does not extend the rendering before it), so assistant "
                                 "tokens cannot be located; use a template that renders earlier turns unchanged")
            if len(upto) > len(prefix):
                spans.append((len(prefix), len(upto)))
        return full, spans


def template_origin(tokenizer: PreTrainedTokenizerFast, setting: str | None) -> str:
    """Where the template of ``setting`` comes from, for errors: ``data.tokenizer.chat_template`` for a jinja
    string, else the tokenizer directory's file that holds it (``chat_template.jinja``,
    ``additional_chat_templates/<name>.jinja`` or ``tokenizer_config.json``)."""
    own = tokenizer.chat_template
    if setting is not None and setting != DEFAULT_CHAT_TEMPLATE and not (isinstance(own, Mapping) and setting in own):
        return "data.tokenizer.chat_template (a jinja string of the config)"
    directory = str(getattr(tokenizer, "name_or_path", "") or "")
    if not directory or not os.path.isdir(directory):
        return "the tokenizer's tokenizer_config.json ('chat_template')"
    named = setting not in (None, DEFAULT_CHAT_TEMPLATE)
    name = os.path.join("additional_chat_templates", f"{setting}.jinja") if named else "chat_template.jinja"
    path = os.path.join(directory, name)
    return path if os.path.isfile(path) else os.path.join(directory, "tokenizer_config.json")


def _resolve_template(tokenizer: PreTrainedTokenizerFast, setting: str | None) -> str | None:
    own = tokenizer.chat_template
    named = own if isinstance(own, Mapping) else {}
    if setting is None:
        return None
    if setting == DEFAULT_CHAT_TEMPLATE:
        return named.get("default") if named else own
    if setting in named:
        return named[setting]
    if "{{" in setting or "{%" in setting:
        return setting
    raise ValueError(f"data.tokenizer.chat_template: {setting[:60]!r} is neither 'default', null, a jinja "
                     f"template (with {{{{ }}}} / {{% %}}) nor one of the tokenizer's templates {sorted(named)}")


def _kind(value: Any) -> str:
    """The JSON type name of ``value`` for error messages (``null``, ``bool``, ``number``, ``string``, ...)."""
    if value is None:
        return "null"
    names = {bool: "a bool", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    kind = next((n for t, n in names.items() if isinstance(value, t)), f"a {type(value).__name__}")
    return f"an empty {kind.split()[-1]}" if isinstance(value, (str, list, dict)) and not value else kind


def _check_tools(tools: Any, where: str) -> None:
    if tools is None:
        return
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        bad = tools if not isinstance(tools, list) else next(t for t in tools if not isinstance(t, Mapping))
        raise ValueError(f"{where}: 'tools' must be a list of tool objects (OpenAI {{'type': 'function', "
                         f"'function': {{...}}}}), got {_kind(bad)}" + (" in the list" if bad is not tools else ""))


def _check_tool_calls(calls: Any, where: str, k: int) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"{where}: message {k} 'tool_calls' must be a list of calls, got {_kind(calls)}")
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            got = _kind(call) if fn is None else (_kind(fn) if not isinstance(fn, Mapping) else
                                                  f"'name' {_kind(fn.get('name'))}")
            raise ValueError(f"{where}: message {k} tool_calls[{j}] must be {{'function': {{'name': <string>, "
                             f"'arguments': <JSON string or object>}}}}, got {got}")
        args = fn.get("arguments", {})
        if not isinstance(args, (str, Mapping)):
            raise ValueError(f"{where}: message {k} tool_calls[{j}] 'arguments' must be a JSON string or an "
                             f"object, got {_kind(args)}")


def _check_message(msg: Any, where: str, k: int) -> dict[str, Any]:
    if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
        got = _kind(msg) if not isinstance(msg, Mapping) else f"'role' {_kind(msg.get('role'))}"
        raise ValueError(f"{where}: message {k} must be an object with a string 'role', got {got}: {msg!r:.120}")
    if msg.get("tool_calls") is not None:
        _check_tool_calls(msg["tool_calls"], where, k)
    content = msg.get("content")
    if content is None and not msg.get("tool_calls"):
        raise ValueError(f"{where}: message {k} ({msg['role']}) has no 'content' (null is allowed only with "
                         "'tool_calls')")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{where}: message {k} 'content' must be a string, got {_kind(content)}")
    return {**msg, "content": content or ""}  # null content (tool calls) must not render as 'None'


def _inline_tool_use(msg: dict[str, Any]) -> dict[str, Any]:
    """Tool calls / results written into ``content`` (Hermes style) for templates without tool support."""
    if msg.get("tool_calls"):
        calls = "".join(serialize_tool_call(c) for c in msg["tool_calls"])
        rest = {k: v for k, v in msg.items() if k != "tool_calls"}
        return {**rest, "content": (msg.get("content") or "") + calls}
    if msg["role"] == "tool":
        return {**msg, "content": f"<tool_response>{msg['content']}</tool_response>"}
    return msg


class RecordFormatter:
    """Turns records into :class:`Encoded` (SFT) or :class:`EncodedPair` (DPO / ORPO).

    Args:
        tokenizer: fast tokenizer with an ``eos_token_id``.
        chat_template: ``data.tokenizer.chat_template`` (see module doc).
        input_key, output_key: ``data.input_key`` / ``data.output_key`` of NxDT SFT records.
        limits: bounds of one chat-template rendering (see :class:`ChatRenderer`).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
                 *, input_key: str = "input", output_key: str = "output",
                 limits: RenderLimits | None = None) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("data.tokenizer.type: the tokenizer has no eos token; responses end with it")
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, chat_template, limits)
        self.input_key, self.output_key = input_key, output_key
        self.eos_id = int(tokenizer.eos_token_id)
        self._text_prefix = _leading_special_ids(tokenizer)

    # ---- tokenization helpers ------------------------------------------------------------------------------
    def _encode_spans(self, text: str, spans: Sequence[Span]) -> Encoded:
        """Tokenize ``text`` piece by piece, cut at the span boundaries; tokens of the spans are targets."""
        cuts = sorted({0, len(text), *(p for span in spans for p in span)})
        pieces = [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]
        encs = self.tokenizer.backend_tokenizer.encode_batch_fast([text[a:b] for a, b in pieces],
                                                                 add_special_tokens=False)
        if not encs:
            return Encoded(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool), text)
        ids = [np.asarray(e.ids, dtype=np.int32) for e in encs]
        mask = [np.full(len(e.ids), any(s <= a and b <= t for s, t in spans), dtype=bool)
                for e, (a, b) in zip(encs, pieces, strict=True)]
        return Encoded(np.concatenate(ids), np.concatenate(mask), text)

    def _encode_plain(self, text: str, *, prompt: bool) -> Encoded:
        ids = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        ids = [*self._text_prefix, *ids] if prompt else [*ids, self.eos_id]
        suffix = "" if prompt else (self.tokenizer.eos_token or "")
        return Encoded(np.asarray(ids, dtype=np.int32), np.full(len(ids), not prompt), text + suffix)

    # ---- SFT -----------------------------------------------------------------------------------------------
    def encode_sft(self, record: Mapping[str, Any], where: str) -> Encoded:
        """Token ids and target mask of an SFT record (NxDT input/output or chat messages).

        Raises:
            ValueError: neither ``messages`` nor both input/output keys, wrong types, or template problems;
                the message names ``where`` (file:line) and the keys found.
        """
        if "messages" in record:
            messages = self.renderer.normalize(record["messages"], record.get("tools"), where)
            text, spans = self.renderer.assistant_spans(messages, record.get("tools"), where)
            return self._encode_spans(text, spans)
        src, dst = record.get(self.input_key), record.get(self.output_key)
        if not isinstance(src, str) or not isinstance(dst, str):
            wrong = [f"'{k}' is {_kind(v)}" for k, v in ((self.input_key, src), (self.output_key, dst))
                     if k in record and not isinstance(v, str)]
            raise ValueError(f"{where}: an SFT record needs 'messages' or string '{self.input_key}' and "
                             f"'{self.output_key}' (data.input_key / data.output_key); found keys "
                             f"{sorted(record)}" + (f" ({', '.join(wrong)})" if wrong else ""))
        prompt, response = self._encode_plain(src, prompt=True), self._encode_plain(dst, prompt=False)
        return _concat(prompt, response)

    # ---- preference ----------------------------------------------------------------------------------------
    def encode_preference(self, record: Mapping[str, Any], where: str) -> EncodedPair:
        """Prompt, chosen and rejected ids of a ``{"prompt", "chosen", "rejected"}`` record.

        Raises:
            ValueError: missing keys, mixed string / message-list fields, or template problems (names ``where``).
        """
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
        if missing:
            raise ValueError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected' (missing "
                             f"{missing}; found keys {sorted(record)})")
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
        if not isinstance(prompt, (str, list)):
            raise ValueError(f"{where}: 'prompt' must be a string or a list of messages, got {_kind(prompt)}")
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, (str, list)) or (isinstance(prompt, str) and not isinstance(value, str)):
                need = "a string (as 'prompt' is)" if isinstance(prompt, str) else "a string or a list of messages"
                raise ValueError(f"{where}: '{name}' must be {need}, got {_kind(value)}")
        if isinstance(prompt, str):
            return EncodedPair(self._encode_plain(prompt, prompt=True), self._encode_plain(chosen, prompt=False),
                               self._encode_plain(rejected, prompt=False))
        tools = record.get("tools")
        prompt_msgs = self.renderer.normalize(prompt, tools, where)
        prompt_text = self.renderer.render(prompt_msgs, tools, True, where)
        prompt_enc = self._encode_spans(prompt_text, [])
        return EncodedPair(prompt_enc, self._response(prompt, prompt_text, chosen, tools, f"{where} chosen"),
                           self._response(prompt, prompt_text, rejected, tools, f"{where} rejected"))

    def _response(self, prompt: list[Any], prompt_text: str, response: Any, tools: Any, where: str) -> Encoded:
        if isinstance(response, str):
            response = [{"role": "assistant", "content": response}]
        messages = self.renderer.normalize([*prompt, *response], tools, where)
        first = len(messages) - len(response)
        text, spans = self.renderer.assistant_spans(messages, tools, where, first_message=first)
        if not text.startswith(prompt_text):
            raise ValueError(f"{where}: the rendered conversation does not start with the rendered prompt "
                             "(template not prefix-stable), so the response cannot be split off")
        cut = len(prompt_text)
        return self._encode_spans(text[cut:], [(max(s, cut) - cut, e - cut) for s, e in spans if e > cut])


def _concat(a: Encoded, b: Encoded) -> Encoded:
    return Encoded(np.concatenate([a.input_ids, b.input_ids]), np.concatenate([a.target_mask, b.target_mask]),
                   a.text + b.text)


def _leading_special_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Special ids the tokenizer puts before text on its own (e.g. Llama 3's BOS); [] for most BPE tokenizers."""
    backend = tokenizer.backend_tokenizer
    plain = backend.encode("x", add_special_tokens=False).ids
    full = backend.encode("x", add_special_tokens=True).ids
    idx = full.index(plain[0]) if plain and plain[0] in full else 0
    return list(full[:idx])
