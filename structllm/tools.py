"""Tool calling: OpenAI ``tools`` -> prompt and constraint; model output -> ``tool_calls``.

Imports neither torch nor the event loop: the front end prepares a request with it and
the output processor parses each sequence's text through a ``ToolCallParser``.

Two call formats, chosen by the chat template (``detect_format``), and gpt-oss's
harmony (``openai``, vLLM's name: ``structllm.harmony``, which prompts and parses it):

- ``hermes``, for templates that render the ``tools`` variable and write ``<tool_call>``
  (Hermes, Qwen and their family): the tools go through the template, and the model
  writes each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  possibly after some text. ``auto`` leaves the model free and parses what it wrote;
  ``required`` and a named function constrain it to calls of the given tools.
- ``generic``, for templates that know no tools (the default model's), like llama.cpp's
  generic format: the tools are described in a system message and the reply is either
  a JSON envelope ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` or, with
  ``auto``, plain text that does not start with ``{``. Every generic reply is
  constrained, so the envelope is always valid JSON matching the tools' schemas.

Streaming tracks the JSON text itself (``JsonScanner``) rather than re-parsing a
growing prefix: a call is announced once its name is complete, and its arguments go
out as the raw characters of the ``arguments`` value, so the fragments concatenate to
exactly the ``arguments`` string of the non-streamed response.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from structllm import structured
from structllm.protocol import StructuredOutputs
from structllm.structured import GrammarError
from structllm.tokenizer import JsonText

Format = Literal[
    "generic",
    "hermes",
    "openai",
    "glm45",
    "glm47",
    "qwen3_coder",
    "qwen3_xml",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "lfm2",
    "llama4_pythonic",
    "pythonic",
    "llama3_json",
    "llama4_json",
    "gemma4",
]
# the families' own syntaxes (``call_formats``): tools through the template as hermes,
# replies parsed by ``call_formats.FamilyCallParser``
FAMILY_FORMATS: tuple[str, ...] = (
    "glm45",
    "glm47",
    "qwen3_coder",
    "qwen3_xml",
    "deepseek_v3",
    "deepseek_v31",
    "kimi_k2",
    "lfm2",
    "llama4_pythonic",
    "pythonic",
    "llama3_json",
    "llama4_json",
    "gemma4",
)
FORMATS: tuple[str, ...] = ("generic", "hermes", "openai", *FAMILY_FORMATS)
# vLLM's other names of the hermes syntax (Granite 4 writes hermes' <tool_call> JSON)
HERMES_ALIASES: tuple[str, ...] = ("granite4",)
# templates that write a call's ``arguments`` as they are (a string), not as an object
STRING_ARGUMENTS: tuple[str, ...] = ("deepseek_v3", "deepseek_v31", "kimi_k2")
# a template's tags -> the family syntax it writes (checked before hermes' <tool_call>)
_TEMPLATE_TAGS: tuple[tuple[tuple[str, ...], Format], ...] = (
    (("<tool_call>", "<arg_key>"), "glm45"),
    (("<tool_call>", "<function=", "<parameter="), "qwen3_coder"),  # (not <seed:tool_call>)
    (("<｜tool▁calls▁begin｜>", "```json"), "deepseek_v3"),
    (("<｜tool▁calls▁begin｜>",), "deepseek_v31"),  # (its template renders no tools)
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("<|tool_call_start|>",), "lfm2"),
    (("<|tool_call>call:",), "gemma4"),
    (("<|tool_list_start|>",), "lfm2"),  # LFM2's templates list the tools in these
    (("List of tools: [", "<|im_start|>"), "lfm2"),
)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolError(ValueError):
    """A tool field or message that cannot be served; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def format_named(name: str) -> Format | None:
    """The format ``--tool-call-parser NAME`` asks for (None: ``auto``, from the chat
    template); ``ValueError`` naming the choices for an unknown name."""
    if name == "auto":
        return None
    if name in HERMES_ALIASES:
        return "hermes"
    if name not in FORMATS:
        raise ValueError(
            f"unknown tool-call parser {name!r}; expected auto or one of "
            f"{sorted((*FORMATS, *HERMES_ALIASES))}"
        )
    return name  # type: ignore[return-value]


def detect_format(chat_template: str | None) -> Format:
    """For a template that renders ``tools``: the family syntax whose tags it writes
    (``_TEMPLATE_TAGS``: GLM-4.5's ``<arg_key>``, Qwen3-Coder's ``<function=``, DeepSeek's
    and Kimi K2's sections, LFM2's ``<|tool_call_start|>``), else ``hermes`` if it writes
    ``<tool_call>``; ``generic`` otherwise."""
    t = chat_template or ""
    if not re.search(r"\btools\b", t):
        return "generic"
    for tags, fmt in _TEMPLATE_TAGS:
        if all(tag in t for tag in tags):
            return fmt
    return "hermes" if OPEN in t else "generic"


# -- the request -------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked.

    ``choice`` is ``"none"``, ``"auto"``, ``"required"`` or the name of the one function
    the model must call (``named``)."""

    tools: list[dict[str, Any]]
    choice: str
    named: bool
    parallel: bool
    format: Format

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """The reply must be tool calls (``required`` or a named function)."""
        return self.named or self.choice == "required"


def tool_request(
    tools: Sequence[Any] | None, tool_choice: Any, parallel: bool | None, fmt: Format
) -> ToolRequest | None:
    """The checked request (``None`` without tools). Raises ``ToolError`` for a
    malformed ``tools`` entry (not its schema: ``validate_tools`` compiles those), a
    ``tool_choice`` that is not one of OpenAI's forms or names an unknown function, and
    ``required`` or a named function without tools."""
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif (
        isinstance(tool_choice, Mapping)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), Mapping)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        choice = tool_choice["function"]["name"]
    else:
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
            '{"name": ...}}',
            "tool_choice",
        )
    named = choice not in ("none", "auto", "required")
    if not tools:
        if named or choice == "required":
            raise ToolError(
                f"tool_choice {choice!r} needs at least one entry in tools", "tool_choice"
            )
        return None
    checked = _check_shapes(tools)
    if named and choice not in {t["function"]["name"] for t in checked}:
        raise ToolError(
            f"tool_choice names the function {choice!r}, which is not in tools", "tool_choice"
        )
    return ToolRequest(checked, choice, named, True if parallel is None else parallel, fmt)


def _check_shapes(tools: Sequence[Any]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for i, t in enumerate(tools):
        if (
            not isinstance(t, Mapping)
            or t.get("type") != "function"
            or not isinstance(t.get("function"), Mapping)
        ):
            raise ToolError(
                f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools"
            )
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', "
                f"got {name!r}",
                "tools",
            )
        if name in seen:
            raise ToolError(
                f"tools[{i}].function.name {name!r} is used by an earlier tool", "tools"
            )
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out.append({"type": "function", "function": dict(fn)})
    return out


def validate_tools(tools: Sequence[Mapping[str, Any]], tokenizer: Any = None) -> str | None:
    """``None`` if every tool's ``parameters`` compiles as a JSON schema (under
    ``structured.LIMITS``), else a message naming ``tools[i].function.parameters``.
    Blocking, like ``structured.validate``: call it in a worker thread."""
    for i, t in enumerate(tools):
        params = t["function"].get("parameters")
        if params is not None:
            spec = StructuredOutputs(json=dict(params))
            error = structured.validate(spec, tokenizer, field=f"tools[{i}].function.parameters")
            if error is not None:
                return error
    return None


# -- constraints -------------------------------------------------------------------------


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` in which every object that lists ``properties`` and says
    nothing of ``additionalProperties`` allows no others (as llama.cpp's grammars do):
    a small model otherwise pads a call with arguments the function does not take.
    Iterative, so a deeply nested schema cannot exhaust the stack."""
    root = json.loads(json.dumps(schema))
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return root


def _call_schemas(tools: Sequence[Mapping[str, Any]], name: str | None) -> list[dict[str, Any]]:
    """One schema per callable tool: ``{"name": <const>, "arguments": <parameters>}``,
    the parameters ``closed``."""
    calls = []
    for t in tools:
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        params = closed(dict(fn.get("parameters") or {"type": "object", "properties": {}}))
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not calls:
        raise GrammarError(
            f"tool_choice names an unknown function {name!r}" if name else "tools is empty"
        )
    return calls


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def tool_calls_schema(
    tools: Sequence[Mapping[str, Any]], name: str | None = None, parallel: bool = True
) -> dict[str, Any]:
    """The JSON schema of the generic envelope, ``{"tool_calls": [{"name", "arguments"}, ...]}``:
    each call names one of ``tools`` (restricted to ``name`` if given) with arguments
    valid against its ``parameters``; one call at least, and exactly one without
    ``parallel``."""
    array: dict[str, Any] = {
        "type": "array",
        "items": _one_of(_call_schemas(tools, name)),
        "minItems": 1,
    }
    if not parallel:
        array["maxItems"] = 1
    return {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }


def _json_rule(schema: dict[str, Any]) -> str:
    # llguidance's Lark embeds a JSON schema as a rule; x-guidance carries the same
    # compile options (fixed separators) as response_format's schemas
    options = structured.json_options(StructuredOutputs(json_object=True))
    return "%json " + json.dumps({**schema, "x-guidance": options})


def constraint(req: ToolRequest) -> StructuredOutputs | None:
    """The output constraint for ``req`` (``None``: free text).

    generic: ``required``/named -> the envelope; ``auto`` -> the envelope, or text whose
    first character is not ``{`` (so the first character decides the branch).
    hermes: ``required``/named -> one or more (one without ``parallel``) tagged calls;
    ``auto`` -> free, parsed afterwards. A family syntax (``call_formats``): ``auto``
    free; ``required``/named -> the generic envelope, as vLLM constrains every parser's
    forced calls to JSON."""
    if not req.calls_allowed or req.format == "openai":  # harmony: free (auto only)
        return None
    name = req.choice if req.named else None
    # a named function is exactly one call of it (as OpenAI and vLLM); only required and
    # auto may make several, and only with parallel_tool_calls
    parallel = req.parallel and not req.named
    if req.format == "generic" or (req.format in FAMILY_FORMATS and req.forced):
        envelope = tool_calls_schema(req.tools, name, parallel)
        if req.forced:
            return StructuredOutputs(json=envelope)
        return StructuredOutputs(
            grammar=f"start: calls | TEXT\ncalls: {_json_rule(envelope)}\nTEXT: /[^{{](.|\\n)*/\n"
        )
    if not req.forced:
        return None
    more = ' ("\\n" call)*' if parallel else ""
    call = f'call: "{OPEN}\\n" {_json_rule(_one_of(_call_schemas(req.tools, name)))} "\\n{CLOSE}"'
    return StructuredOutputs(grammar=f"start: call{more}\n{call}\n")


# -- the prompt --------------------------------------------------------------------------


def _arguments_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def prompt_messages(
    messages: list[dict[str, Any]], req: ToolRequest | None, fmt: Format
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages (``chat_messages``' dicts, which may carry assistant ``tool_calls`` and
    ``tool`` messages) and extra template variables, for the chat template.

    hermes and the family syntaxes: the tools go in as the template's ``tools``; a
    call's ``arguments`` as an object, as such templates expect (as the string it is for
    ``STRING_ARGUMENTS``: DeepSeek's and Kimi's templates write it out). generic: the
    tools are described in the system message (unless ``tool_choice`` is ``none``),
    earlier calls are written back in the envelope the model is asked for, and tool
    results become user messages, which any template can render."""
    if fmt == "hermes" or fmt in FAMILY_FORMATS:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": (
                                JsonText(c["function"]["arguments"])
                                if fmt in STRING_ARGUMENTS
                                else _arguments_value(c["function"]["arguments"])
                            ),
                        },
                    }
                    for c in m["tool_calls"]
                ]
                if fmt == "lfm2":  # its templates render an assistant's content only
                    m["content"] = (m.get("content") or "") + _pythonic(m["tool_calls"])
            out.append(m)
        return out, ({"tools": req.tools} if req is not None else {})
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                {
                    "name": c["function"]["name"],
                    "arguments": _arguments_value(c["function"]["arguments"]),
                }
                for c in m["tool_calls"]
            ]
            text = ((m.get("content") or "") + "\n" if m.get("content") else "") + json.dumps(
                {"tool_calls": calls}
            )
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            result = json.dumps(
                {"tool_result": {"tool_call_id": m.get("tool_call_id"), "content": m["content"]}}
            )
            if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    for m in out:
        m.pop("tool_results", None)
    if req is not None and req.calls_allowed:
        described = _describe(req)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, {}


def _pythonic(calls: list[dict[str, Any]]) -> str:
    """Calls as LFM2 writes them: ``<|tool_call_start|>[f(a=1, b='x')]<|tool_call_end|>``
    (each argument a Python literal; arguments that are no JSON object go as one
    ``arguments`` string)."""
    out = []
    for c in calls:
        args = c["function"]["arguments"]
        if not isinstance(args, dict):
            args = {"arguments": args}
        out.append(f"{c['function']['name']}({', '.join(f'{k}={v!r}' for k, v in args.items())})")
    return "<|tool_call_start|>[" + ", ".join(out) + "]<|tool_call_end|>"


def _describe(req: ToolRequest) -> str:
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "parameters": t["function"].get("parameters") or {"type": "object", "properties": {}},
        }
        for t in req.tools
    ]
    example = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
    lines = [
        "You can call these tools; each takes arguments that match its JSON schema:",
        json.dumps(tools),
    ]
    if req.named:
        lines.append(f"Call the tool {req.choice!r} now. Answer with only a JSON object: {example}")
    elif req.choice == "required":
        lines.append(f"Call one or more tools now. Answer with only a JSON object: {example}")
    else:
        lines.append(
            f"To call tools, answer with only a JSON object: {example}. "
            "Otherwise, answer in plain text."
        )
    return "\n".join(lines)


# -- the output --------------------------------------------------------------------------


class JsonScanner:
    """An incremental scanner of one JSON value's text.

    It does not build values: it records where each value begins and ends, by path
    (object keys and array indices from the root; ``()`` is the root), so a caller can
    stream the raw text of the value at a path while it is being written. Text is fed
    in pieces of any size; ``feed`` stops at the end of the root value and says how
    many characters of the piece it took. Malformed JSON is not detected beyond what
    the bookkeeping needs (the grammar guarantees it where it matters)."""

    def __init__(self) -> None:
        self.text = ""  # everything taken so far
        self.spans: dict[
            tuple[str | int, ...], list[int]
        ] = {}  # path -> [start, end) (end -1: open)
        # per open container: [kind "{" or "[", current key or index, what comes next:
        # "key", "colon", "value" or "comma"]
        self._stack: list[list[Any]] = []
        self._string: int | None = None  # start of the open string
        self._string_is_key = False
        self._escape = False
        self._scalar: int | None = None  # start of the open number or literal
        self.done = False

    def _path(self) -> tuple[str | int, ...]:
        return tuple(f[1] for f in self._stack)

    def _begin(self, pos: int) -> None:
        self.spans[self._path()] = [pos, -1]

    def _end(self, end: int) -> None:
        self.spans[self._path()][1] = end
        if self._stack:
            self._stack[-1][2] = "comma"
        else:
            self.done = True

    def feed(self, piece: str) -> int:
        base = len(self.text)
        for k, ch in enumerate(piece):
            if self.done:
                self.text += piece[:k]
                return k
            pos = base + k
            if self._string is not None:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    start, self._string = self._string, None
                    if self._string_is_key:
                        key = json.loads((self.text + piece[: k + 1])[start : pos + 1])
                        self._stack[-1][1:] = [key, "colon"]
                    else:
                        self._end(pos + 1)
                continue
            if self._scalar is not None:
                if ch not in ",]} \t\r\n":
                    continue
                self._scalar = None
                self._end(pos)
                if self.done:
                    self.text += piece[:k]
                    return k
            top: list[Any] | None = self._stack[-1] if self._stack else None
            if ch in " \t\r\n":
                continue
            if ch == '"':
                self._string, self._string_is_key = pos, top is not None and top[2] == "key"
                if not self._string_is_key:
                    self._begin(pos)
            elif ch in "{[":
                self._begin(pos)
                self._stack.append([ch, 0 if ch == "[" else None, "value" if ch == "[" else "key"])
            elif ch in "}]":
                self._stack.pop()
                self._end(pos + 1)
            elif ch == ":" and top is not None:
                top[2] = "value"
            elif ch == "," and top is not None:
                if top[0] == "[":
                    top[1] += 1
                    top[2] = "value"
                else:
                    top[2] = "key"
            else:
                self._scalar = pos
                self._begin(pos)
        self.text += piece
        return len(piece)

    def value(self, path: tuple[str | int, ...]) -> str | None:
        """The complete text of the value at ``path``, or None if it is not complete."""
        span = self.spans.get(path)
        return None if span is None or span[1] < 0 else self.text[span[0] : span[1]]

    def partial(self, path: tuple[str | int, ...], start: int) -> tuple[str, int]:
        """The text of the value at ``path`` from offset ``start`` on, as far as it is
        written, and the offset reached."""
        span = self.spans.get(path)
        if span is None:
            return "", start
        end = span[1] if span[1] >= 0 else len(self.text)
        begin = max(start, span[0])
        return self.text[begin:end], max(end, begin)


@dataclass
class ToolCall:
    """A call the model made: ``arguments`` is the JSON text exactly as written."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallDelta:
    """A streamed piece of call ``index``: its first delta has ``id`` and ``name``,
    later ones only ``arguments`` text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            out["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass
class _Call:
    """One call being written: its JSON object, at ``path`` in ``scanner``."""

    scanner: JsonScanner
    path: tuple[str | int, ...]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    announced: bool = False
    sent: int = 0  # offset in scanner.text up to which the arguments have gone out
    lead: str = ""  # hermes: the whitespace before its tag (content only if it is text)

    def name(self) -> str | None:
        text = self.scanner.value((*self.path, "name"))
        try:
            name = json.loads(text) if text is not None else None
        except ValueError:
            return None
        return name if isinstance(name, str) else None

    def arguments_path(self) -> tuple[str | int, ...]:
        params = (*self.path, "parameters")  # some hermes models write "parameters"
        return (
            params
            if params in self.scanner.spans and (*self.path, "arguments") not in self.scanner.spans
            else (*self.path, "arguments")
        )

    def complete(self) -> ToolCall | None:
        """The call, once its name and arguments are written (a call object that closed
        without arguments has ``{}``)."""
        name, args = self.name(), self.scanner.value(self.arguments_path())
        if name is None or (
            args is None
            and (
                self.arguments_path() in self.scanner.spans or self.scanner.value(self.path) is None
            )
        ):
            return None
        return ToolCall(self.id, name, args if args is not None else "{}")

    def partial(self, name: str | None) -> ToolCall | None:
        """The call as far as it was written (a reply cut short): its name (``name`` if
        it has not written its own) and the arguments' text so far, ``""`` if they had
        not begun; ``None`` without a name."""
        name = self.name() or name
        if name is None:
            return None
        return ToolCall(self.id, name, self.scanner.partial(self.arguments_path(), 0)[0])


class ToolCallParser:
    """One sequence's output text -> content and tool calls, incrementally.

    ``feed(text)`` takes the sequence's new text and returns the content to show and
    the call deltas (``final=True`` with the last text). Afterwards ``calls`` are the
    complete calls and ``content`` the whole content (``None`` when the reply was only
    calls). The deltas of each call concatenate to its ``arguments``.

    A reply cut short (``cut=True`` with the last text: ``max_tokens``, the context)
    ends its calls where it stopped, as vLLM does: a call begun whose name is known (or
    forced: a named ``tool_choice``) is a call whose ``arguments`` are the text written
    so far, and the generic envelope's text is never content. A hermes call cut before
    its name is content, as it was written."""

    def __init__(self, req: ToolRequest) -> None:
        self.format = req.format
        self.named = req.choice if req.named else None  # the one function it must call
        self.cut = False  # the reply was cut short (see the class docstring)
        # generic: "?" until the first character decides (auto), then "json" or "text"
        self.mode = ("json" if req.forced else "?") if req.format == "generic" else "text"
        self._calls: list[_Call] = []
        self._envelope = JsonScanner()
        self._pending = ""  # hermes: text not yet classified (a tag may be starting)
        self._held_space = ""  # hermes: whitespace next to calls, dropped if calls follow
        self._in_call: _Call | None = None
        self._after_call = False  # hermes: a call's JSON ended; waiting for </tool_call>
        self._content: list[str] = []
        self._raw: list[str] = []

    # -- feeding -------------------------------------------------------------------------

    def feed(
        self, text: str, final: bool = False, cut: bool = False
    ) -> tuple[str, list[ToolCallDelta]]:
        """Take the sequence's new ``text`` (``final``: its last; ``cut``: its last, and
        the reply was cut short) and return the new content and call deltas. At the end,
        text that could still have begun a tag is content after all, and whitespace held
        next to calls is dropped."""
        self._raw.append(text)
        final = final or cut
        self.cut = cut
        out: list[str] = []
        if self.format == "generic":
            self._feed_generic(text, out)
            if cut and self.named is not None and self.mode == "json" and not self._calls:
                self._calls.append(_Call(self._envelope, ("tool_calls", 0)))  # not begun yet
        else:
            self._feed_hermes(text, out)
            if cut:
                self._cut_hermes(out)
            if final and self._in_call is None and not self._after_call:
                if not self._calls:
                    out.append(self._held_space + self._pending)
                elif not OPEN.startswith(self._pending):  # after calls, a cut-off tag is no content
                    out.append(self._pending)
                self._pending = self._held_space = ""
        content = "".join(out)
        self._content.append(content)
        return content, self._deltas()

    def _cut_hermes(self, out: list[str]) -> None:
        """The end of a hermes reply cut short: the call being written is a call if its
        name is known (or forced), else the text it was; a forced reply cut inside its
        first ``<tool_call>`` tag is the named call, not begun."""
        call = self._in_call
        if call is not None and call.name() is None and self.named is None:
            self._calls.remove(call)
            self._in_call = None
            self._text(call.lead + OPEN + call.scanner.text, out)
        elif call is None and not self._after_call and self.named is not None and not self._calls:
            self._calls.append(_Call(JsonScanner(), ()))
            self._pending = self._held_space = ""

    def _feed_generic(self, text: str, out: list[str]) -> None:
        if self.mode == "?" and text:
            self.mode = "json" if text[0] == "{" else "text"
        if self.mode == "text":
            out.append(text)
        elif self.mode == "json":
            self._envelope.feed(text)
            spans = self._envelope.spans
            while ("tool_calls", len(self._calls)) in spans:
                self._calls.append(_Call(self._envelope, ("tool_calls", len(self._calls))))

    def _feed_hermes(self, text: str, out: list[str]) -> None:
        rest = self._pending + text
        self._pending = ""
        while rest:
            if self._in_call is not None:
                taken = self._in_call.scanner.feed(rest)
                rest = rest[taken:]
                if self._in_call.scanner.done:
                    self._in_call, self._after_call = None, True
            elif self._after_call:
                i = rest.find(CLOSE)
                if i < 0:
                    self._pending = rest[-(len(CLOSE) - 1) :]  # wait for the closing tag
                    return
                rest, self._after_call = rest[i + len(CLOSE) :], False
            else:
                i = rest.find(OPEN)
                if i < 0:
                    keep = _partial_tag(rest)
                    self._text(rest[: len(rest) - keep], out)
                    self._pending = rest[len(rest) - keep :]
                    return
                self._text(rest[:i], out)
                # whitespace before a call is not content
                self._in_call = _Call(JsonScanner(), (), lead=self._held_space)
                self._held_space = ""
                self._calls.append(self._in_call)
                rest = rest[i + len(OPEN) :]

    def _text(self, text: str, out: list[str]) -> None:
        """Content outside calls; whitespace is held until something that is not
        whitespace follows (then it is content) or a call does (then it is dropped)."""
        if not text:
            return
        if text.isspace():
            self._held_space += text
            return
        stripped = text.rstrip()
        out.append(self._held_space + stripped)
        self._held_space = text[len(stripped) :]

    def _deltas(self) -> list[ToolCallDelta]:
        out = []
        for k, call in enumerate(self._calls):
            if not call.announced:
                name = call.name() or (self.named if self.cut else None)
                if name is None:
                    break  # calls are announced in order
                call.announced = True
                out.append(ToolCallDelta(k, "", call.id, name))
            fragment, call.sent = call.scanner.partial(call.arguments_path(), call.sent)
            if fragment:
                if out and out[-1].index == k:
                    out[-1].arguments += fragment
                else:
                    out.append(ToolCallDelta(k, fragment))
        return out

    # -- the result ----------------------------------------------------------------------

    @property
    def calls(self) -> list[ToolCall]:
        """The complete calls; after a cut, with the call it cut as far as it went."""
        done = (c.complete() or (c.partial(self.named) if self.cut else None) for c in self._calls)
        return [c for c in done if c is not None]

    @property
    def content(self) -> str | None:
        """The reply's text outside calls; the raw text if calls were begun but none
        completed (a reply that stopped inside one); ``None`` if it was calls and
        nothing else, or a generic envelope cut short."""
        if self.cut and self.format == "generic" and self.mode == "json":
            return None
        if self._calls and not self.calls:
            return "".join(self._raw)
        text = "".join(self._content)
        return None if self._calls and not text else text


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that could begin ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
