"""The chat template an exported policy ships: ChatRenderer's rendering as a Hugging Face Jinja template.

transformers' ``apply_chat_template``, SGLang's and vLLM's chat endpoints render prompts with the
template in ``tokenizer_config.json``; :func:`chat_template` writes one that gives the text
:class:`~osvl.data.chat.ChatRenderer` renders, so a served policy sees the prompt it was trained on:

- the system turn: the training stage's system prompt and tool schema are the defaults; a leading
  ``system`` message replaces the prompt, a ``tools`` argument the schema (``tools=[]``: none);
- ``user`` turns: content parts in order, an image as ``<|vision_start|><|image_pad|><|vision_end|>``
  (the processor expands the pad to the image's token count), so images before text as osvl renders;
- ``assistant`` turns: the content verbatim (osvl keeps ``<think>`` in history), then any structured
  ``tool_calls`` as ``<tool_call>`` JSON blocks; ``tool`` turns: ``<tool_response>`` blocks in a user turn;
- the generation prompt ``<|im_start|>assistant\\n``.

Generations are re-tokenized from text on this path, so multi-turn ids match the trainer's only where
the text tokenizes as the engine generated it (osvl's own trainer and engines pass ids, never text).
:func:`render_chat_template` renders a template the way transformers does (same Jinja settings and
``tojson``), without transformers; :func:`trained_prompt` reads the defaults back out of an exported
template for ``osvl.eval``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from osvl.data.chat import TOOLS_FOOTER, TOOLS_HEADER, function_schema, parse_system_text, system_text

MARKER = "{#- osvl chat template"
_PROBE = "osvl-template-probe"

_BODY = """
{%- set ns = namespace(text="", lines="") %}
{%- if messages and messages[0].role == "system" %}
    {%- if messages[0].content is string %}
        {%- set system_prompt = messages[0].content %}
    {%- else %}
        {%- for part in messages[0].content or [] %}
            {%- if "text" in part %}
                {%- set ns.text = ns.text + part.text %}
            {%- endif %}
        {%- endfor %}
        {%- set system_prompt = ns.text %}
    {%- endif %}
{%- else %}
    {%- set system_prompt = default_system_prompt %}
{%- endif %}
{%- if tools is not defined or tools is none %}
    {%- set ns.lines = default_tool_lines %}
{%- else %}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set ns.lines = ns.lines + "\\n" + (tool | tojson) %}
        {%- else %}
            {%- set ns.lines = ns.lines + "\\n" + ({"type": "function", "function": tool} | tojson) %}
        {%- endif %}
    {%- endfor %}
{%- endif %}
{%- if ns.lines %}
    {{- "<|im_start|>system\\n" }}
    {%- if system_prompt %}
        {{- system_prompt + "\\n\\n" }}
    {%- endif %}
    {{- tools_header + ns.lines + tools_footer + "<|im_end|>\\n" }}
{%- elif system_prompt %}
    {{- "<|im_start|>system\\n" + system_prompt + "<|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- set ns.text = "" %}
    {%- if message.content is string %}
        {%- set ns.text = message.content %}
    {%- elif message.content is not none %}
        {%- for part in message.content %}
            {%- if part.type == "image" or part.type == "image_url" or "image" in part or "image_url" in part %}
                {%- set ns.text = ns.text + "<|vision_start|><|image_pad|><|vision_end|>" %}
            {%- elif part.type == "video" or "video" in part %}
                {%- set ns.text = ns.text + "<|vision_start|><|video_pad|><|vision_end|>" %}
            {%- elif "text" in part %}
                {%- set ns.text = ns.text + part.text %}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {%- if loop.first and message.role == "system" %}
    {%- elif message.role == "user" %}
        {{- "<|im_start|>user\\n" + ns.text + "<|im_end|>\\n" }}
    {%- elif message.role == "assistant" %}
        {{- "<|im_start|>assistant\\n" }}
        {%- if message.reasoning_content %}
            {{- "<think>" + message.reasoning_content + "</think>\\n" }}
        {%- endif %}
        {{- ns.text }}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- if ns.text or not loop.first %}
                    {{- "\\n" }}
                {%- endif %}
                {%- set call = call.function if call.function is defined else call %}
                {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
                {{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
                {{- "}\\n</tool_call>" }}
            {%- endfor %}
        {%- endif %}
        {{- "<|im_end|>\\n" }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- "<|im_start|>user" }}
        {%- endif %}
        {{- "\\n<tool_response>\\n" + ns.text + "\\n</tool_response>" }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- "<|im_end|>\\n" }}
        {%- endif %}
    {%- else %}
        {{- raise_exception("osvl chat template: unexpected role " + message.role | string
                            + " (a system message must come first; roles: user, assistant, tool)") }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\\n" }}
{%- endif %}
"""


def _literal(text: str) -> str:
    """A Jinja string literal for ``text`` (Jinja reads escapes the way Python's unicode-escape does)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    body = "".join(escapes.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x20 or c == "\x7f" else c) for c in text)
    return f'"{body}"'


def chat_template(system_prompt: str = "", tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """The Jinja chat template for a policy trained with ``system_prompt`` and ``tools`` shown (the
    arguments of its :class:`~osvl.data.chat.ChatRenderer`)."""
    schemas = [function_schema(tool) for tool in tools]
    system_text(schemas, system_prompt)  # the same checks (duplicate names) as the renderer
    lines = "".join("\n" + json.dumps(schema, ensure_ascii=False) for schema in schemas)
    head = (
        f"{MARKER}: ChatRenderer's rendering; the training stage's system prompt and tool schema are the "
        "defaults -#}\n"
        f"{{%- set default_system_prompt = {_literal(system_prompt)} %}}\n"
        f"{{%- set default_tool_lines = {_literal(lines)} %}}\n"
        f"{{%- set tools_header = {_literal(TOOLS_HEADER)} %}}\n"
        f"{{%- set tools_footer = {_literal(TOOLS_FOOTER)} %}}"
    )
    return head + _BODY


@cache
def _compiled(template: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateError as error:
        raise ValueError(f"chat template does not parse: {error}") from None


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The text ``template`` renders for ``messages``, as transformers' ``apply_chat_template(tokenize=False)``
    (same Jinja settings, ``tojson`` and ``raise_exception``; no ``{% generation %}`` tracking)."""
    try:
        return _compiled(template).render(
            messages=list(messages),
            tools=None if tools is None else list(tools),
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as error:
        raise ValueError(f"chat template failed to render: {error}") from None


def trained_prompt(template: str) -> tuple[str, list[dict[str, Any]]] | None:
    """``(system_prompt, tools)`` an osvl-written template renders by default, or None for a template
    osvl did not write (those carry no record of what their policy was trained with)."""
    if not template.lstrip().startswith(MARKER):
        return None
    text = render_chat_template(template, [{"role": "user", "content": _PROBE}], add_generation_prompt=True)
    user = f"<|im_start|>user\n{_PROBE}<|im_end|>\n<|im_start|>assistant\n"
    if not text.endswith(user):
        raise ValueError("the osvl chat template does not render a user turn as ChatRenderer does (edited by hand?)")
    return parse_system_text(text[: -len(user)])
