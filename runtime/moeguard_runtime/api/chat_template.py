"""Chat templates rendered with jinja2 exactly as ``transformers`` renders them.

The environment is ``transformers.utils.chat_template_utils``'s
(``_cached_compile_jinja_template``): an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` block that renders its body, ``raise_exception``,
``strftime_now`` and a ``tojson`` filter that does not escape HTML. The
variables are ``messages``, ``add_generation_prompt`` (True: the model answers
next), ``tools`` (None without) and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SAMPLE_MESSAGES = ({"role": "user", "content": "Hello!"},)
"""The conversation rendered at start-up to find a template that raises before serving
(one user turn: templates may refuse a system turn or turns that do not alternate)."""


class ChatTemplateError(ValueError):
    """A template that does not compile or raises while rendering; the message says why."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker):
    renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the jinja2 text (``tokenizer_config.json`` ``chat_template``).
        special_tokens: ``bos_token``, ``eos_token``, ... passed to the template.

    Raises:
        ChatTemplateError: the template does not compile (with the line).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"syntax error at line {exc.lineno}: {exc.message}") from None
        self._special = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt text of ``messages``; ``tools``: OpenAI's ``tools`` (``{"type": "function", "function":
        {...}}``), None without (as transformers passes them: ``tools`` is always defined).

        Raises:
            ChatTemplateError: the template raised (``raise_exception`` or any
                error while rendering); the message is the template's.
        """
        try:
            return str(self._template.render(messages=[dict(m) for m in messages],
                                             add_generation_prompt=add_generation_prompt,
                                             tools=[dict(t) for t in tools] if tools else None,
                                             **self._special))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc.message or exc)) from None
        except Exception as exc:  # a template may fail in any way (TypeError, KeyError, ...)
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None

    def check(self) -> None:
        """Render :data:`SAMPLE_MESSAGES` (start-up check).

        Raises:
            ChatTemplateError: the template raised on a plain conversation.
        """
        self.render(SAMPLE_MESSAGES)
