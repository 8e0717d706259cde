"""Tool calls (OpenAI's ``tools`` and ``tool_choice``): the formats the served families write them in, parsed back
into ``message.tool_calls``, and the grammar that forces one where ``tool_choice`` asks for a call.

The tools reach the model through the checkpoint's own chat template (``tools`` beside ``messages``, as
transformers' ``apply_chat_template(tools=...)`` passes them: ``{"type": "function", "function": {"name",
"description", "parameters"}}``); the model answers in its family's format, which :class:`ToolCallFormat` parses:

* ``hermes`` (Qwen2-MoE, Qwen3-MoE, OLMoE and the presets): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``, one block per call (the Hermes function-calling format that Qwen's templates use);
* ``mistral`` (Mixtral): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral's v3 tokenizer);
* ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (DeepSeek-V3's chat template).

``tool_choice`` ``required`` or a named function is enforced by constrained decoding
(:mod:`moeguard_runtime.engine.grammar`): :meth:`ToolCallFormat.grammar` is an llguidance Lark grammar whose
arguments are the tools' JSON Schemas inlined (``%json``), so the output parses and its arguments validate.
``auto`` lets the model choose and parses what it wrote (vLLM's behaviour); ``none`` renders the tools and parses
nothing.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moeguard_runtime.api.detokenize import StopMatcher

FAMILY_FORMATS = {"qwen2_moe": "hermes", "qwen3_moe": "hermes", "olmoe": "hermes", "preset": "hermes",
                  "mixtral": "mistral", "deepseek_v3": "deepseek_v3"}
"""The tool-call format of each served ``model_type`` (``GET /v1/models``): the one its family's chat templates
render and its instruct checkpoints were trained to write."""
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
"""llguidance's per-schema option: compact JSON (no whitespace for a model to spend its tokens on)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str

    def as_openai(self, call_id: str) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls[]`` item."""
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id(fmt: str) -> str:
    """A new tool call id: ``call_`` and 24 hex digits, or 9 letters and digits for ``mistral`` (its tokenizer's
    rule for the ids that come back in ``[TOOL_RESULTS]``)."""
    if fmt == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def _arguments(value: Any) -> str | None:
    """``arguments`` as JSON text, or None when it is not an object (a string holding one is taken)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _arguments(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else ToolCall(obj["name"], args)


def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """``{"name": <const>, "arguments": <the tool's parameters>}``."""
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": tool["name"]}, "arguments": parameters_schema(tool)}}


def parameters_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters`` (an object schema; OpenAI's default when absent: no parameters)."""
    params = tool.get("parameters")
    return dict(params) if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**schema, **COMPACT}, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's tool-call syntax. ``start``: the text that opens the calls. ``markers``: its marker strings,
    which may be single added tokens of a checkpoint's vocabulary: a grammar names those by id (``<[id]>``:
    llguidance matches special tokens only that way, and the model was trained to write the one token, not its
    spelling)."""

    name: str
    start: str
    markers: tuple[str, ...]

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """``(content before the calls, calls)`` of a model's output (special tokens kept), or None when it holds
        no call that parses (then the whole output is content, as vLLM's parsers answer)."""
        at = text.find(self.start)
        if at < 0:
            return None
        calls = self._calls(text[at:])
        return (text[:at], calls) if calls else None

    def _calls(self, text: str) -> list[ToolCall]:
        out: list[ToolCall] = []
        if self.name == "hermes":
            for body in re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.S):
                try:
                    call = _call(json.loads(body))
                except ValueError:
                    continue
                if call is not None:
                    out.append(call)
        elif self.name == "mistral":
            body = text[len(self.start):].strip()
            try:
                value, _ = json.JSONDecoder().raw_decode(body)
            except ValueError:
                return []
            for obj in value if isinstance(value, list) else [value]:
                if (call := _call(obj)) is not None:
                    out.append(call)
        else:  # deepseek_v3
            pattern = r"<｜tool▁call▁begin｜>\w*<｜tool▁sep｜>(.*?)\n```(?:json)?\n(.*?)\n```\s*<｜tool▁call▁end｜>"
            for name, args in re.findall(pattern, text, flags=re.S):
                arguments = _arguments(args)
                if arguments is not None:
                    out.append(ToolCall(name.strip(), arguments))
        return out

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool,
                special_ids: Mapping[str, int] | None = None) -> str:
        """The llguidance Lark grammar of one call (``parallel``: one or more) of one of ``tools`` (each
        ``{"name", "parameters"}``; one tool for a named ``tool_choice``).

        ``special_ids``: the id of each marker that is one added token of the serving tokenizer (DeepSeek-V3's
        ``<｜tool▁call▁begin｜>``, Qwen's ``<tool_call>``); a marker without one is matched as text.

        Raises:
            ValueError: no tools.
        """
        if not tools:
            raise ValueError("a tool-call grammar needs at least one tool")
        ids = dict(special_ids or {})

        def mark(text: str) -> str:
            return f"<[{ids[text]}]>" if text in ids else _lark_string(text)

        more = ' ("\\n" call)*' if parallel else ""
        if self.name == "hermes":
            body = _json_rule({"anyOf": [_call_schema(t) for t in tools]})
            return (f'start: call{more}\ncall: {mark("<tool_call>")} "\\n" body "\\n" {mark("</tool_call>")}\n'
                    f"body: {body}\n")
        if self.name == "mistral":
            item = {"anyOf": [_call_schema(t) for t in tools]}
            array = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
            return f"start: {mark('[TOOL_CALLS]')} \" \" body\nbody: {_json_rule(array)}\n"
        rules = [f"call{i}: {mark('<｜tool▁call▁begin｜>')} \"function\" {mark('<｜tool▁sep｜>')} "
                 f"{_lark_string(str(t['name']) + chr(10) + '```json' + chr(10))} args{i} \"\\n```\" "
                 f"{mark('<｜tool▁call▁end｜>')}\nargs{i}: {_json_rule(parameters_schema(t))}"
                 for i, t in enumerate(tools)]
        call = "call: " + " | ".join(f"call{i}" for i in range(len(tools)))
        return (f"start: {mark('<｜tool▁calls▁begin｜>')} call{more} {mark('<｜tool▁calls▁end｜>')}\n{call}\n"
                + "\n".join(rules) + "\n")


FORMATS = {"hermes": ToolCallFormat("hermes", "<tool_call>", ("<tool_call>", "</tool_call>")),
           "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", ("[TOOL_CALLS]",)),
           "deepseek_v3": ToolCallFormat("deepseek_v3", "<｜tool▁calls▁begin｜>", (
               "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁sep｜>"))}


def format_for(model_type: str) -> ToolCallFormat:
    """The tool-call format of a ``model_type`` (:data:`FAMILY_FORMATS`; ``hermes`` for any other)."""
    return FORMATS[FAMILY_FORMATS.get(model_type, "hermes")]


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tool calling: its family's ``format``, the id of each of its markers that is one added
    token of the serving tokenizer (found once per worker), the tools a forced call may name (empty: ``auto``, the
    model chooses) and whether a forced answer may hold several calls."""

    format: ToolCallFormat
    marker_ids: Mapping[str, int]
    forced: tuple[dict[str, Any], ...] = ()
    parallel: bool = True

    def grammar(self) -> str:
        """The Lark grammar of the forced call (:meth:`ToolCallFormat.grammar`)."""
        return self.format.grammar(self.forced, self.parallel, self.marker_ids)

    def content_hold(self) -> ContentHold:
        """A request's :class:`ContentHold`, watching for the start marker's text and, where it is one token, id."""
        start = self.marker_ids.get(self.format.start)
        return ContentHold(self.format, frozenset() if start is None else frozenset({start}))


class ContentHold:
    """Streams an answer's content until a tool call begins (``format.start`` in the text, or one of
    ``start_ids``, the start marker's token where it is one added token), then holds the rest back: the calls are
    parsed from the whole output at the end (:meth:`ToolCallFormat.parse`), the content before them stays
    content. Text that may be the start of the marker is held until it is told apart."""

    def __init__(self, fmt: ToolCallFormat, start_ids: frozenset[int] = frozenset()) -> None:
        self._match = StopMatcher([fmt.start])
        self._start_ids = start_ids
        self.calling = False

    def push(self, token: int | None, text: str) -> str:
        """The content to emit of ``token``'s ``text`` (``token`` None: the detokenizer's last text)."""
        if self.calling:
            return ""
        if token in self._start_ids:
            self.calling = True
            return self._match.flush()
        out, self.calling = self._match.push(text)
        return out

    def end(self) -> str:
        """The held-back tail once generation ended without a call."""
        return "" if self.calling else self._match.flush()
