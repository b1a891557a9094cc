"""Chat templates from the tokenizer's files render in a bounded sandbox (issue 40, item 3).

A crafted ``tokenizer_config.json`` template rendered with a 3.9 GB peak (``'x' * 10**9``) and another hung (two
nested ``range(100000)`` loops). Both now stop with an error naming the file and the bound; ordinary templates
render exactly as transformers' ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from nxd_lc.config.schema import TokenizerConfig
from nxd_lc.data.alignment_format import RecordFormatter
from nxd_lc.data.chat_sandbox import ChatTemplateLimitError, RenderLimits, SandboxedChatTemplate
from nxd_lc.data.tokenizer import load_tokenizer, train_bytelevel_bpe

CHAT = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]}
LOOP = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
SMALL = RenderLimits(max_seconds=0.5, max_chars=100_000, chars_per_input_char=32)


def _tokenizer_dir(tmp_path: Path, template: str) -> Path:
    tok_dir = tmp_path / "tok"
    train_bytelevel_bpe(["user assistant hello there hi"] * 20, 300).save_pretrained(tok_dir)
    (tok_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = tok_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return tok_dir


def _load(tok_dir: Path) -> PreTrainedTokenizerFast:
    return load_tokenizer(TokenizerConfig(type=str(tok_dir)), None)


def test_string_multiplication_in_tokenizer_config_is_refused_before_it_allocates(tmp_path: Path) -> None:
    tok_dir = _tokenizer_dir(tmp_path, "{{ 'x' * 10**8 }}" + LOOP)
    fmt = RecordFormatter(_load(tok_dir), limits=SMALL)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"r:1: the chat template from {tok_dir}/tokenizer_config\.json stopped: "
                                         r"the operator '\*' .*size bound of [\d,]+ per rendering "
                                         r"\(RenderLimits\.max_chars 100,000"):
        fmt.encode_sft(CHAT, "r:1")
    assert time.perf_counter() - start < 1.0  # refused before the 100 MB string exists


def test_endless_loop_in_tokenizer_config_stops_at_the_time_bound(tmp_path: Path) -> None:
    template = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + LOOP
    tok_dir = _tokenizer_dir(tmp_path, template)
    fmt = RecordFormatter(_load(tok_dir), limits=SMALL)
    start = time.perf_counter()
    with pytest.raises(ChatTemplateLimitError, match=rf"{tok_dir}/tokenizer_config\.json stopped: rendering ran "
                                                     r"past the time bound of 0\.5 s \(RenderLimits\.max_seconds\)"):
        fmt.encode_sft(CHAT, "r:1")
    assert time.perf_counter() - start < 5.0


# Each builds a value far beyond the bound from small inputs, in a different way; all must stop quickly.
AMPLIFIERS = {
    "namespace doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}",
    "concat chain": "{% set a = 'xxxxxxxx' %}" + "{% set a = a ~ a %}" * 40,
    "plus chain": "{% set a = 'xxxxxxxx' %}" + "{% set a = a + a %}" * 40,
    "center": "{{ 'x' | center(10**9) }}",
    "ljust": "{{ 'x'.ljust(10**9) }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "percent width": "{{ '%999999999d' % 1 }}",
    "format filter": "{{ '%999999999s' | format('x') }}",
    "power": "{{ 10 ** (10 ** 9) }}",
    "macro output": "{% macro m() %}{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}{% endmacro %}"
                    "{{ m() }}",
    "block set": "{% set x %}{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}{% endset %}",
    "output": "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
    "join": "{{ ([messages[0].content] * 10000) | join(messages[0].content) }}",
    "replace": "{{ ('x' * 10000).replace('x', 'y' * 1000) }}",
    "sum of lists": "{{ range(100000) | map('string') | map('list') | sum(start=[]) }}",
    "tojson indent": "{{ messages | tojson(indent=10**8) }}",
    "loop over a string": "{% for a in 'x' * 50000 %}{% for b in 'x' * 50000 %}{% endfor %}{% endfor %}",
    # shared sub-lists: 2 items per step, 2^60 reachable -- str() / == / a filter walk them in C, past any deadline
    "shared list printed": "{% set ns = namespace(a=[1]) %}{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}"
                           "{% endfor %}{{ ns.a }}",
    "shared list filtered": "{% set ns = namespace(a=[1]) %}{% for i in range(60) %}{% set ns.a = [ns.a, ns.a] %}"
                            "{% endfor %}{{ ns.a | lower }}",
    "shared list compared": "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(60) %}"
                            "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
    "shared dict": "{% set ns = namespace(a={}) %}{% for i in range(60) %}{% set ns.a = {'x': ns.a, 'y': ns.a} %}"
                   "{% endfor %}{{ ns.a }}",
    "shared tuple via namespace": "{% set ns = namespace(a=(1,)) %}{% for i in range(60) %}"
                                  "{% set ns.a = namespace(x=ns.a, y=ns.a) %}{% endfor %}{{ ns.a }}",
    "shared list by +": "{% set ns = namespace(a=[1]) %}{% for i in range(60) %}{% set ns.a = [ns.a] + [ns.a] %}"
                        "{% endfor %}{{ ns.a }}",
    "bytes repeated": "{{ ('x'.encode() * 10**10) | length }}",
    "12-digit format width": "{{ '{:>100000000000}'.format(1) }}",
}


def test_unbounded_recursion_stops_with_the_bound_error() -> None:
    """A macro calling itself without end: RecursionError became "failed on this record"; now the bound error."""
    template = SandboxedChatTemplate("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", {}, SMALL)
    with pytest.raises(ChatTemplateLimitError, match="recursed past Python's recursion limit"):
        template.render([{"role": "user", "content": "y"}])


@pytest.mark.parametrize("name", sorted(AMPLIFIERS))
def test_amplifying_templates_stop_at_a_bound(name: str) -> None:
    start = time.perf_counter()  # compiling included: jinja folds constant filter calls while compiling
    template = SandboxedChatTemplate(AMPLIFIERS[name], {}, SMALL)
    with pytest.raises(ChatTemplateLimitError, match=r"time bound of 0\.5 s|size bound of"):
        template.render([{"role": "user", "content": "y" * 1000}])
    assert time.perf_counter() - start < 5.0


PARITY_TEMPLATES = [
    LOOP,
    # ChatML with a default system turn (SmolLM2), string '+' and add_generation_prompt
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    # namespace, bos/eos globals, {% generation %}, reasoning aliasing, tojson(indent), tools, trim/upper, '~'
    "{%- set ns = namespace(n=0) -%}{{ bos_token }}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% generation %}{{ m.role | upper ~ ':' ~ m.content | trim }}{% endgeneration %}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}\n"
    "{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c | tojson(indent=2) }}{% endfor %}{% endif %}"
    "{% endfor %}{{ ns.n }}{% if tools %}{{ tools | tojson }}{% endif %}{{ eos_token }}"
    "{% if messages | length > 99 %}{{ raise_exception('too long') }}{% endif %}"
    "{{ '%s-%d' % ('a', 3) }}{{ '{}!'.format('b') }}{{ [1, 2] | join(',') }}{{ 'q' | center(5) }}"
    "{% for k, v in dict(a=1).items() %}{{ k }}{{ v }}{% endfor %}{% for m in messages %}{% if loop.last %}"
    "{% break %}{% endif %}{% endfor %}",
    # Qwen2.5's tool-calling template (abridged): tools loop, tool_calls, loop.index0, whitespace control
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not"
    " loop.first) or (message.role == 'assistant' and not message.tool_calls) %}{{- '<|im_start|>' + message.role"
    " + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}{{- '\\n<tool_call>\\n{\"name\": \"' }}"
    "{{- tool_call.name }}{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- elif message.role == 'tool' %}{%- if (loop.index0 == 0) or"
    " (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}{%- if loop.last or"
    " (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
]


@pytest.mark.parametrize("index", range(len(PARITY_TEMPLATES)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_sandboxed_rendering_equals_apply_chat_template(index: int, add_generation_prompt: bool) -> None:
    tok = train_bytelevel_bpe(["user assistant hello"] * 10, 300)
    messages = [{"role": "user", "content": " hello "},
                {"role": "assistant", "content": "hi", "reasoning": "hmm", "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
                {"role": "tool", "content": "r", "tool_call_id": None}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    source = PARITY_TEMPLATES[index]
    expected = tok.apply_chat_template(messages, tools=tools, chat_template=source, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    got = SandboxedChatTemplate(source, tok.special_tokens_map).render(
        messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert got == expected


def test_a_long_record_renders_within_the_default_bounds() -> None:
    """The size budget grows with the record: a 4 M-character conversation renders with a ChatML-style template
    that copies each message several times ('+' chains)."""
    template = SandboxedChatTemplate(PARITY_TEMPLATES[1], {})
    text = template.render([{"role": "user", "content": "a" * 4_000_000},
                            {"role": "assistant", "content": "b" * 4_000_000}])
    assert len(text) > 8_000_000


def test_a_template_that_does_not_parse_names_its_file(tmp_path: Path) -> None:
    tok_dir = _tokenizer_dir(tmp_path, "{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match=rf"chat template from {tok_dir}/tokenizer_config\.json does not parse "
                                         r"\(template line 1: .*endfor"):
        RecordFormatter(_load(tok_dir))
