"""The tool-call syntaxes of model families (vLLM's ``--tool-call-parser`` names), parsed.

Sans-IO, like ``tools``: a ``FamilyCallParser`` is one sequence's splitter of its output
text into content and tool calls, with ``ToolCallParser``'s interface (``feed(text,
final, cut)`` -> ``(content, deltas)``; ``calls``; ``content``). The families write
their calls in tags; the tools reach the model through its own chat template (the
``tools`` variable), as with hermes:

- ``glm45`` (GLM-4.5/4.6/4.7; ``glm47`` the same): ``<tool_call>NAME\\n<arg_key>K</arg_key>
  \\n<arg_value>V</arg_value>...</tool_call>``;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5, Qwen3-Next; ``qwen3_xml`` the same):
  ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...</function>\\n</tool_call>``;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n
  ```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; ``deepseek_v31``: the same
  section with ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``;
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I
  <|tool_call_argument_begin|>ARGS<|tool_call_end|>...<|tool_calls_section_end|>``;
- ``lfm2``: ``<|tool_call_start|>[f(a=1), g(b="x")]<|tool_call_end|>`` (Python calls);
- ``gemma4``: ``<|tool_call>call:NAME{k:<|"|>text<|"|>,n:1}<tool_call|>`` (Gemma 4's
  own value syntax: strings between ``<|"|>`` tags, bare keys);
- ``llama4_pythonic`` (``pythonic`` the same): the whole reply is ``[f(a=1), g()]``,
  optionally in ``<|python_start|>...<|python_end|>``;
- ``llama3_json`` (``llama4_json`` the same): the whole reply is ``{"name": ...,
  "parameters": {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``.

The two XML syntaxes write each value as text; its JSON type comes from the tool's
``parameters`` schema (a ``string`` stays the text, anything else is read as JSON, or a
Python literal, and stays a string if it is neither), as vLLM does.

Streaming re-reads the text from the first tag on at each delta (the calls' part of a
reply is short) and sends what grew: the content outside calls (trailing whitespace
and a possible tag held back until decided), each call once its name is written, and
the arguments' JSON text as far as it is decided (the XML syntaxes: a parameter once
its value closes, ``}`` once the call does), so the deltas concatenate to the final
``arguments``. A call that closes malformed is no call; a reply whose calls are all
malformed is content as written. A reply cut short (``cut``) keeps a call begun whose
name is written, with its arguments so far, as ``ToolCallParser`` does. Replies with
a forced ``tool_choice`` (``required``, a named function) are the generic JSON envelope
under a constraint, as in vLLM: ``parser_for`` gives ``ToolCallParser`` those.

Some families' tags are special tokens (DeepSeek's, Kimi's, LFM2's, Llama 4's python
tags): ``markers`` lists every tag, and the output processor keeps those tokens'
text in the detokenized output (``output.fan_out``).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from structllm.tools import ToolCall, ToolCallDelta, ToolCallParser, ToolRequest


@dataclass
class Part:
    """One call as far as it is written: ``name`` (None until complete), the JSON text
    of its arguments decided so far, whether they are complete, and ``broken`` (it
    closed, but does not parse)."""

    name: str | None
    arguments: str = ""
    complete: bool = False
    broken: bool = False


# a call's body (the text between its tags; ``closed``: its closing tag was seen) and
# the tools' parameter schemas by name -> its calls (one, or several for lfm2)
Body = Callable[[str, bool, Mapping[str, Mapping[str, Any]]], list[Part]]
# a whole reply's calls from its start, and where they end (None: not calls, yet)
Reader = Callable[[str], "tuple[list[Part], int] | None"]


@dataclass(frozen=True)
class Syntax:
    """Where a family's calls are: inside ``call`` tags, optionally grouped in a
    ``section``; ``whole``: the reply itself is the calls, beginning with ``lead`` or
    the first ``call`` tag (llama4_pythonic, llama3_json)."""

    call: tuple[str, str]
    body: Body
    section: tuple[str, str] | None = None
    whole: Reader | None = None
    lead: str = "["  # whole: how a reply of calls begins
    quotes: tuple[str, ...] = ()  # other tags inside calls (Gemma 4's string quote)

    @property
    def markers(self) -> tuple[str, ...]:
        return (*self.call, *(self.section or ()), *self.quotes)


# -- typed values (glm45, qwen3_coder) ----------------------------------------------------


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def typed_value(text: str, schema: Mapping[str, Any] | None) -> str:
    """The JSON text of a parameter written as ``text``, typed by its ``schema``."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return _json(text)
    try:
        return _json(json.loads(text))
    except ValueError:
        pass
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return _json(text.strip().lower() == "true")
    if kind in ("object", "array", None):
        try:
            return _json(ast.literal_eval(text))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return _json(text)


def _pairs_arguments(pairs: list[tuple[str, str]], closed: bool) -> str:
    """``{"k": v, ...`` so far (``}`` once ``closed``): grows monotonically."""
    return "{" + ", ".join(f"{_json(k)}: {v}" for k, v in pairs) + ("}" if closed else "")


def _props(tools: Mapping[str, Mapping[str, Any]], name: str) -> Mapping[str, Any]:
    props = tools.get(name, {}).get("properties")
    return props if isinstance(props, Mapping) else {}


# -- bodies -------------------------------------------------------------------------------

# a pair's opening, up to its value; the value runs to the next </arg_value> (found with
# str.find: a lazy regex over a long value is slow, and a search retries it everywhere)
_GLM_KEY = re.compile(r"\s*<arg_key>([^<]*)</arg_key>\s*<arg_value>")


def _glm45(body: str, closed: bool, tools: Mapping[str, Mapping[str, Any]]) -> list[Part]:
    # NAME, then (GLM-4.5: after a newline; GLM-4.7: at once) <arg_key>/<arg_value> pairs
    ends = [i for i in (body.find("\n"), body.find("<arg_key>")) if i >= 0]
    if not ends and not closed:
        return [Part(None)]
    cut = min(ends) if ends else len(body)
    name = body[:cut].strip()
    if not name:
        return [Part(None, broken=closed)]
    props = _props(tools, name)
    pairs, pos = [], cut
    while (m := _GLM_KEY.match(body, pos)) is not None:
        end = body.find("</arg_value>", m.end())
        if end < 0:
            break  # the value is still being written
        key = m.group(1).strip()
        pairs.append((key, typed_value(body[m.end() : end], props.get(key))))
        pos = end + len("</arg_value>")
    rest = body[pos:]
    if closed and rest.strip():
        return [Part(name, broken=True)]
    return [Part(name, _pairs_arguments(pairs, closed), complete=closed)]


_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_QWEN_PARAM = re.compile(r"\s*<parameter=([^>\n]*)>")  # its value: up to </parameter>


def _qwen3_coder(body: str, closed: bool, tools: Mapping[str, Mapping[str, Any]]) -> list[Part]:
    m = _QWEN_FUNCTION.match(body)
    if m is None:
        return [Part(None, broken=closed)]
    name = m.group(1).strip()
    props = _props(tools, name)
    pairs, pos = [], m.end()
    while (p := _QWEN_PARAM.match(body, pos)) is not None:  # (as _glm45's pairs)
        end = body.find("</parameter>", p.end())
        if end < 0:
            break
        value = body[p.end() : end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = p.group(1).strip()
        pairs.append((key, typed_value(value, props.get(key))))
        pos = end + len("</parameter>")
    rest = body[pos:].strip()
    done = rest.startswith("</function>")
    if closed and (not done or rest[len("</function>") :].strip()):
        return [Part(name, broken=True)]
    return [Part(name, _pairs_arguments(pairs, done), complete=closed)]


def _raw_json(text: str, closed: bool) -> tuple[str, bool]:
    """Arguments written as JSON text: the text so far without what may still be
    whitespace or a closing fence, and whether the whole is valid JSON (when closed)."""
    if not closed:
        return text.lstrip().rstrip(" \t\r\n`"), True
    text = text.strip()
    try:
        json.loads(text)
    except ValueError:
        return text, False
    return text, True


def _deepseek_v3(body: str, closed: bool, tools: Mapping[str, Mapping[str, Any]]) -> list[Part]:
    sep = "<｜tool▁sep｜>"
    i = body.find(sep)
    if i < 0:
        return [Part(None, broken=closed)]
    after = body[i + len(sep) :]
    fence = after.find("```json")
    if fence < 0:
        return [Part(None, broken=closed)]
    name = after[:fence].strip()
    args = after[fence + len("```json") :]
    end = args.find("```")
    text, ok = _raw_json(args[:end] if end >= 0 else args, closed)
    if closed and (end < 0 or args[end + 3 :].strip() or not ok):
        return [Part(name or None, broken=True)]
    return [Part(name or None, text, complete=closed)]


def _deepseek_v31(body: str, closed: bool, tools: Mapping[str, Mapping[str, Any]]) -> list[Part]:
    sep = "<｜tool▁sep｜>"
    i = body.find(sep)
    if i < 0:
        return [Part(None, broken=closed)]
    text, ok = _raw_json(body[i + len(sep) :], closed)
    name = body[:i].strip() or None
    return [Part(name, text, complete=closed, broken=closed and (not ok or name is None))]


def _kimi_k2(body: str, closed: bool, tools: Mapping[str, Mapping[str, Any]]) -> list[Part]:
    sep = "<|tool_call_argument_begin|>"
    i = body.find(sep)
    if i < 0:
        return [Part(None, broken=closed)]
    # the call's id: functions.NAME:INDEX
    m = re.fullmatch(r"\s*(?:functions\.)?(.+?)(?::\d+)?\s*", body[:i])
    text, ok = _raw_json(body[i + len(sep) :], closed)
    name = m.group(1) if m else None
    return [Part(name, text, complete=closed, broken=closed and (not ok or name is None))]


def pythonic_calls(text: str) -> list[Part] | None:
    """``[f(a=1), g(b="x")]`` as complete calls; None if it is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    node = tree.body
    if not isinstance(node, ast.List) or not node.elts:
        return None
    out = []
    for call in node.elts:
        if not isinstance(call, ast.Call) or call.args:
            return None
        func = call.func
        name = _dotted(func)
        if name is None or any(k.arg is None for k in call.keywords):
            return None
        try:
            args = {k.arg: _literal(k.value) for k in call.keywords}
        except ValueError:
            return None
        out.append(Part(name, _json(args), complete=True))
    return out


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    """A Python literal as a JSON value (``true``/``false``/``null`` spelled as in
    JSON are taken too)."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.Dict):
        pairs = zip(node.keys, node.values, strict=True)
        return {_literal(k) if k else None: _literal(v) for k, v in pairs}
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    value = ast.literal_eval(node)
    if isinstance(value, set | bytes | complex):
        raise ValueError("not a JSON value")
    return value


def _json_calls(text: str) -> tuple[list[Part], int] | None:
    """Llama 3's and 4's JSON calls from the start of ``text``: ``{"name": ...,
    "parameters": {...}}`` objects (or ``"arguments"``), separated by ``;`` or
    whitespace (vLLM's llama3_json); the calls and where they end, None if none."""
    decoder, pos, end, out = json.JSONDecoder(), 0, 0, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        try:
            call, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        args = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            break
        if not isinstance(args, dict):
            break
        out.append(Part(call["name"], _json(args), complete=True))
        end = pos
    return (out, end) if out else None


def _pythonic_list(text: str) -> tuple[list[Part], int] | None:
    """A pythonic list of calls from the start of ``text``, and where it ends: the
    first ``]`` after which the text so far parses (one inside a string does not)."""
    end = text.find("]")
    while end >= 0:
        parts = pythonic_calls(text[: end + 1])
        if parts is not None:
            return parts, end + 1
        end = text.find("]", end + 1)
    return None


def _lfm2(body: str, closed: bool, tools: Mapping[str, Mapping[str, Any]]) -> list[Part]:
    if not closed:
        return []  # the list is read once it closes
    return pythonic_calls(body) or [Part(None, broken=True)]


GEMMA_QUOTE = '<|"|>'
# Gemma 4's values: a string between quote tags, a bare key before ':', None
_GEMMA_TOKEN = re.compile(
    r'<\|"\|>(.*?)<\|"\|>|([A-Za-z_][\w.\-]*)(?=\s*:)|\b(None|True|False)\b', re.DOTALL
)


def gemma_value(text: str) -> Any:
    """Gemma 4's argument syntax (``{key:<|"|>text<|"|>,n:1,flag:true,xs:[...]}``) as a
    value; ``ValueError`` if it is not one."""

    def token(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return _json(m.group(1))
        if m.group(2) is not None:
            return _json(m.group(2))
        return {"None": "null", "True": "true", "False": "false"}[m.group(3)]

    return json.loads(_GEMMA_TOKEN.sub(token, text))


def _gemma4(body: str, closed: bool, tools: Mapping[str, Mapping[str, Any]]) -> list[Part]:
    # call:NAME{ARGS}: the name once its brace opens, the arguments once the call closes
    m = re.match(r"\s*call:([^{\s]+)\{", body)
    if m is None:
        return [Part(None, broken=closed)]
    if not closed:
        return [Part(m.group(1))]
    try:
        args = gemma_value(body[m.end() - 1 :].strip())
    except ValueError:
        return [Part(m.group(1), broken=True)]
    if not isinstance(args, dict):
        return [Part(m.group(1), broken=True)]
    return [Part(m.group(1), _json(args), complete=True)]


SYNTAXES: dict[str, Syntax] = {
    "glm45": Syntax(("<tool_call>", "</tool_call>"), _glm45),
    "qwen3_coder": Syntax(("<tool_call>", "</tool_call>"), _qwen3_coder),
    "deepseek_v3": Syntax(
        ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
        _deepseek_v3,
        section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    ),
    "deepseek_v31": Syntax(
        ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
        _deepseek_v31,
        section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    ),
    "kimi_k2": Syntax(
        ("<|tool_call_begin|>", "<|tool_call_end|>"),
        _kimi_k2,
        section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    ),
    "lfm2": Syntax(("<|tool_call_start|>", "<|tool_call_end|>"), _lfm2),
    "gemma4": Syntax(("<|tool_call>", "<tool_call|>"), _gemma4, quotes=(GEMMA_QUOTE,)),
    "llama4_pythonic": Syntax(("<|python_start|>", "<|python_end|>"), _lfm2, whole=_pythonic_list),
    "llama3_json": Syntax(("<|python_tag|>", ""), _lfm2, whole=_json_calls, lead="{"),
}
ALIASES = {
    "glm47": "glm45",
    "qwen3_xml": "qwen3_coder",
    "pythonic": "llama4_pythonic",
    "llama4_json": "llama3_json",
}
_CLOSING = {"[": "]", "{": "}"}
NAMES: tuple[str, ...] = (*SYNTAXES, *ALIASES)


def syntax_of(fmt: str) -> Syntax | None:
    """The family syntax named ``fmt`` (vLLM's name or alias); None for the formats
    ``tools`` parses itself (generic, hermes, openai)."""
    return SYNTAXES.get(ALIASES.get(fmt, fmt))


def parser_for(req: ToolRequest) -> ToolCallParser | FamilyCallParser:
    """The parser of a request's replies: a family's own syntax with ``auto``; the JSON
    envelope (``ToolCallParser``, generic) when the choice forces calls."""
    if syntax_of(req.format) is None:
        return ToolCallParser(req)
    if req.forced:
        return ToolCallParser(dataclasses.replace(req, format="generic"))
    return FamilyCallParser(req)


def kept_markers(
    parser: ToolCallParser | FamilyCallParser | None, token_id: Callable[[str], int | None]
) -> frozenset[int]:
    """The token ids of ``parser``'s tags that are single tokens (``token_id``: the
    tokenizer's), for the detokenizer to keep even when it skips special tokens."""
    if not isinstance(parser, FamilyCallParser):
        return frozenset()
    ids = (token_id(m) for m in parser.syntax.markers)
    return frozenset(i for i in ids if i is not None)


# -- the parser ---------------------------------------------------------------------------


@dataclass
class _Sent:
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    announced: bool = False
    arguments: int = 0  # characters of the arguments sent


class FamilyCallParser:
    """One sequence's output text -> content and tool calls, in a family's syntax
    (see the module's docstring); the interface of ``tools.ToolCallParser``."""

    def __init__(self, req: ToolRequest) -> None:
        syntax = syntax_of(req.format)
        assert syntax is not None, req.format
        self.syntax = syntax
        self.format = req.format
        self.tools = {
            t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools
        }
        # the text is read again at each delta from ``text``, which starts after the
        # content settled before any tag (``_settled``, sent and dropped from it)
        self.text = ""
        self._settled: list[str] = []
        self._raw: list[str] = []  # all of the text
        self.cut = False
        self._parts: list[Part] = []
        self._began = False  # a call (or section) tag was seen
        self._plain = False  # whole syntaxes: the reply is text, not calls
        self._content = ""  # content of ``text`` sent so far
        self._sent: list[_Sent] = []

    def feed(
        self, text: str, final: bool = False, cut: bool = False
    ) -> tuple[str, list[ToolCallDelta]]:
        """Take the sequence's new ``text`` (``final``: its last; ``cut``: its last, and
        the reply was cut short); the new content and call deltas."""
        self._raw.append(text)
        self.text += text
        final = final or cut
        self.cut = cut
        content, self._parts, self._began = self._scan(self.text, final)
        made = any(p.complete and not p.broken for p in self._parts)
        kept = cut and any(p.name is not None and not p.broken for p in self._parts)
        if final and not made and not kept:
            content = self.text  # no call came of it: the reply as written
        new = content[len(self._content) :] if content.startswith(self._content) else ""
        self._content = content if content.startswith(self._content) else self._content
        if not self._began and not final and self.text.startswith(self._content):
            # no tag yet: what was sent is settled, and is not read again
            self._settled.append(self._content)
            self.text, self._content = self.text[len(self._content) :], ""
        return new, self._deltas()

    def _scan(self, text: str, final: bool) -> tuple[str, list[Part], bool]:
        """The content decided so far, the calls and whether a tag was seen."""
        syn = self.syntax
        if syn.whole is not None:
            return self._scan_whole(text, final)
        opener = syn.section[0] if syn.section else syn.call[0]
        first = text.find(opener)
        if first < 0:
            if final:
                return text, [], False
            keep = _partial(text, opener)
            return text[: len(text) - keep].rstrip(), [], False
        content = [text[:first].rstrip()]
        parts: list[Part] = []
        pos = first
        while pos >= 0:
            pos, piece = self._tail(text, pos, parts, final)
            content.append(piece)
        return "".join(content), parts, True

    def _tail(self, text: str, pos: int, parts: list[Part], final: bool) -> tuple[int, str]:
        """Read the calls (or one section of them) at ``pos``; the position after them
        (-1: the text ends inside) and the content that follows up to the next tag."""
        syn = self.syntax
        open_call, close_call = syn.call
        if syn.section is not None:
            begin, end_section = syn.section
            pos += len(begin)
            stop = text.find(end_section, pos)
            region = text[pos:] if stop < 0 else text[pos:stop]
            self._calls_in(region, parts)
            if stop < 0:
                return -1, ""
            after = stop + len(end_section)
        else:
            close = text.find(close_call, pos + len(open_call))
            body = _open_body(text[pos + len(open_call) :], close_call, close, pos + len(open_call))
            parts.extend(syn.body(body, close >= 0, self.tools))
            if close < 0:
                return -1, ""
            after = close + len(close_call)
        opener = syn.section[0] if syn.section else open_call
        nxt = text.find(opener, after)
        between = text[after:] if nxt < 0 else text[after:nxt]
        if nxt >= 0:
            return nxt, between.strip()
        if final:
            return -1, between.strip()
        keep = _partial(between, opener)
        return -1, between[: len(between) - keep].strip()

    def _calls_in(self, region: str, parts: list[Part]) -> None:
        """The calls in a section's ``region`` (text between them is not content)."""
        open_call, close_call = self.syntax.call
        pos = region.find(open_call)
        while pos >= 0:
            close = region.find(close_call, pos + len(open_call))
            body = _open_body(
                region[pos + len(open_call) :], close_call, close, pos + len(open_call)
            )
            parts.extend(self.syntax.body(body, close >= 0, self.tools))
            if close < 0:
                return
            pos = region.find(open_call, close + len(close_call))

    def _scan_whole(self, text: str, final: bool) -> tuple[str, list[Part], bool]:
        """llama4_pythonic, llama3_json: a reply that starts with the syntax's ``lead``
        (or its python tag) is held until it reads as calls or is over (then it is
        content as written); text after the calls (and their closing tag) is content."""
        syn = self.syntax
        assert syn.whole is not None
        head = text.lstrip()
        start, stop = syn.call
        if not head:
            return ("" if not final else text), [], False
        if self._plain or not (
            head.startswith(syn.lead) or head.startswith(start) or start.startswith(head)
        ):
            self._plain = True  # (the text is settled: ``text`` is only the rest of it)
            return text, [], False
        body = head[len(start) :] if head.startswith(start) else head
        read = syn.whole(body)
        if read is None:
            return ("", [], True) if not final else (text, [], True)
        parts, end = read
        rest = body[end:].lstrip()
        if stop and rest.startswith(stop):
            rest = rest[len(stop) :].lstrip()
        elif stop and not final and stop.startswith(rest):
            rest = ""  # its closing tag may be coming
        rest = rest.lstrip("; \t\r\n")  # (llama3_json's separators)
        if not final and (not rest or rest.startswith(syn.lead)):
            rest = ""  # more calls may be coming
        return (rest if final else rest.rstrip()), parts, True

    def _deltas(self) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while len(self._sent) < len(self._parts):
            self._sent.append(_Sent())
        for k, part in enumerate(self._parts):
            sent = self._sent[k]
            if part.broken:
                continue  # no call (if it was announced, its arguments stop)
            if not sent.announced:
                if part.name is None:
                    break  # calls are announced in order
                sent.announced = True
                out.append(ToolCallDelta(k, "", sent.id, part.name))
            piece = part.arguments[sent.arguments :]
            sent.arguments = max(sent.arguments, len(part.arguments))
            if piece:
                if out and out[-1].index == k:
                    out[-1].arguments += piece
                else:
                    out.append(ToolCallDelta(k, piece))
        return out

    @property
    def calls(self) -> list[ToolCall]:
        """The complete calls; after a cut, with the call it cut as far as it went."""
        out = []
        for part, sent in zip(self._parts, self._sent, strict=True):
            if part.broken or part.name is None:
                continue
            if part.complete or self.cut:
                out.append(ToolCall(sent.id, part.name, part.arguments))
        return out

    @property
    def content(self) -> str | None:
        """The text outside calls; the whole text if no call came of it; ``None`` if
        the reply was calls only."""
        if not self.calls:
            return "".join(self._raw)
        return "".join((*self._settled, self._content)) or None


def _open_body(rest: str, close_tag: str, close: int, start: int) -> str:
    """A call's body: ``rest`` (the text after its opening tag, at ``start``) up to its
    closing tag at ``close``, or, while it is open (-1), without a tail that may be
    the closing tag beginning."""
    if close >= 0:
        return rest[: close - start]
    return rest[: len(rest) - _partial(rest, close_tag)]


def _partial(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
