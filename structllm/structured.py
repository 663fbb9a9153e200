"""Grammars for constrained decoding, on llguidance; shared by the front end and the engine.

Imports no torch, so the front end can use it: ``validate`` checks a
``StructuredOutputs`` before a request is sent (bounded in size and time), and the
``*_spec`` helpers build specs from OpenAI request fields. The engine turns a spec into
a ``Matcher`` (``grammar_of`` + ``load_tokenizer``), one per constrained sequence.

Bounds. A spec's text is capped at ``MAX_SPEC_CHARS``; llguidance's own
``LLParserLimits`` (``LIMITS``) cap the grammar size, the lexer's states and the work of
each step, so a pathological schema (deeply nested ``oneOf``) fails fast with a message
instead of stalling the engine. The same limits are used on both sides, so a spec that
validates also builds in the engine.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np

from structllm.protocol import StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_SPEC_CHARS = 256 * 1024
"""Longest schema (as JSON text), regex, grammar or joined choices accepted."""

LIMITS = llg.LLParserLimits(
    max_grammar_size=200_000,  # symbols in productions (default 500k)
    max_lexer_states=50_000,  # ~1-2 kB each (default 250k)
    initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis at build time
    step_lexer_fuel=200_000,  # ~15 ms per mask at most
    step_max_items=50_000,
    verbose_errors=False,  # errors go back to clients: no parser dumps
)


class GrammarError(ValueError):
    """A spec that does not give a usable grammar; the message names the field."""


# -- specs -------------------------------------------------------------------------------


def grammar_of(spec: StructuredOutputs, field: str | None = None) -> str:
    """The llguidance grammar (its JSON form) of ``spec``. Raises ``GrammarError`` for
    what can be seen without compiling (oversized text, a ``json`` string that is not
    JSON, a schema that is not an object); whether the grammar compiles is checked by
    ``validate`` or by building a ``Matcher``. ``field`` prefixes the messages
    (default ``"structured_outputs.<kind>"``)."""
    kind = spec.kind
    where = field or f"structured_outputs.{kind}"
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(
            _schema(spec.json, where), overrides=json_options(spec)
        )
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=json_options(spec)
        )
    if kind == "regex":
        assert spec.regex is not None
        _check_size(spec.regex, where)
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        _check_size("".join(spec.choice), where)
        # a Lark alternative of JSON-quoted literals: exactly one of the strings
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec.choice)
        )
    assert spec.grammar is not None
    _check_size(spec.grammar, where)
    return llg.LLMatcher.grammar_from_lark(spec.grammar)


def json_options(spec: StructuredOutputs) -> JsonCompileOptions:
    # oneOf is compiled as anyOf (llguidance cannot enforce "exactly one"): pydantic
    # emits oneOf for discriminated unions, whose branches exclude each other anyway
    if spec.whitespace_flexible:
        return {"coerce_one_of": True, "whitespace_flexible": True}
    return {
        "coerce_one_of": True,
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }


def _schema(value: str | dict[str, Any] | None, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        _check_size(value, where)
        try:
            value = json.loads(value)
        except RecursionError:
            raise GrammarError(f"{where} is nested too deeply") from None
        except ValueError as e:
            raise GrammarError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise GrammarError(f"{where} must be a JSON schema object, got {type(value).__name__}")
    try:
        _check_size(json.dumps(value), where)
    except RecursionError:
        raise GrammarError(f"{where} is nested too deeply") from None
    except TypeError as e:
        raise GrammarError(f"{where} is not JSON: {e}") from None
    return value


def _check_size(text: str, where: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarError(
            f"{where} is too large ({len(text)} characters; at most {MAX_SPEC_CHARS})"
        )


def validate(
    spec: StructuredOutputs, tokenizer: llg.LLTokenizer | None = None, field: str | None = None
) -> str | None:
    """``None`` if ``spec`` compiles under ``LIMITS``, else a message naming ``field``
    (default ``"structured_outputs.<kind>"``) and what is wrong. Blocking (it drops the
    GIL while compiling): call it in a worker thread, never on the event loop. With the
    model's ``tokenizer`` the check is the engine's own (token-level limits included)."""
    where = field or f"structured_outputs.{spec.kind}"
    try:
        grammar = grammar_of(spec, field)
    except ValueError as e:  # GrammarError, or llguidance refusing a non-object schema
        return str(e) if isinstance(e, GrammarError) else f"{where}: {e}"
    error = llg.LLMatcher.validate_grammar(grammar, tokenizer, limits=LIMITS)
    if error:
        return f"{where}: {_first_line(error)}"
    return None


def _first_line(message: str) -> str:
    """llguidance's messages span lines (a source excerpt with a caret): one line of at
    most 500 characters for clients, the excerpt's caret lines dropped."""
    lines = [ln.strip() for ln in message.strip().splitlines()]
    kept = [ln for ln in lines if ln and ln.strip("^ |0123456789") != ""]
    return " ".join(kept)[:500] or "invalid grammar"


@functools.lru_cache(maxsize=4)
def load_tokenizer(
    tokenizer_json: str, eos_token_ids: tuple[int, ...], vocab_size: int | None = None
) -> llg.LLTokenizer:
    """The llguidance view of the model's ``tokenizer.json`` (about 0.2 s to build;
    cached per arguments). ``eos_token_ids``: the ids that end generation, which the
    grammar allows once it is complete. ``vocab_size``: the model's vocabulary when it
    is larger than the tokenizer's (ids past the tokenizer's are never allowed)."""
    return llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


# -- OpenAI request fields -> specs -------------------------------------------------------


def json_object_spec() -> StructuredOutputs:
    """``response_format: {"type": "json_object"}``."""
    return StructuredOutputs(json_object=True)


def response_format_spec(response_format: Mapping[str, Any] | None) -> StructuredOutputs | None:
    """The spec of an OpenAI ``response_format`` (``text``: ``None``). Raises
    ``GrammarError`` naming ``response_format...`` for an unknown type or a missing
    schema; ``validate(spec, field="response_format.json_schema.schema")`` must still be
    called."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec()
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, Mapping):
            raise GrammarError("response_format.json_schema is required with type json_schema")
        schema = js.get("schema", {"type": "object"})  # OpenAI: schema is optional
        if not isinstance(schema, Mapping):
            raise GrammarError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputs(json=dict(schema))
    raise GrammarError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}"
    )


# -- the engine's per-sequence matcher ----------------------------------------------------


class Matcher:
    """One constrained sequence's grammar state (an llguidance ``LLMatcher``).

    Never raises for grammar problems: ``error`` is set instead (a grammar that did not
    compile, or a token the grammar refused), and the sequence must end with it. The
    state covers every token consumed so far: preemption and recompute leave it as is
    (the sequence keeps its tokens, and they are not consumed twice).
    """

    __slots__ = ("_m", "_mask", "tokenizer")

    def __init__(self, tokenizer: llg.LLTokenizer, grammar: str) -> None:
        self.tokenizer = tokenizer
        self._m = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        self._mask: np.ndarray | None = None  # [W] int32 scratch for forced_tokens

    @property
    def llmatcher(self) -> llg.LLMatcher:
        return self._m

    @property
    def error(self) -> str | None:
        return _first_line(self._m.get_error()) if self._m.is_error() else None

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (only the end)."""
        return bool(self._m.is_stopped())

    def consume(self, token: int) -> bool:
        """Advance by one sampled token; ``False`` (and ``error`` set) if it is refused."""
        return bool(self._m.consume_token(token))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, from the first, the grammar would accept in turn (the
        state does not change)."""
        return int(self._m.validate_tokens(list(tokens)))

    def forced_tokens(self, limit: int, never: frozenset[int] = frozenset()) -> list[int]:
        """Consume and return up to ``limit`` tokens that the grammar forces: tokens each
        of which, in its turn, is the only token the mask allows. Step-by-step decoding
        picks exactly these (a row with one allowed token has one choice, greedy or
        sampled), so fast-forwarding them cannot change the output. llguidance's
        ``compute_ff_tokens`` proposes the candidates (a canonical tokenization of the
        forced bytes); each is checked against the mask before it is taken, and the run
        stops at the first that is not alone in it. Tokens in ``never`` (end of sequence,
        stop ids, which the scheduler must see sampled) are never taken."""
        if limit <= 0 or self._m.is_stopped():
            return []
        candidates = self._m.compute_ff_tokens()[:limit]
        if not candidates:
            return []
        if self._mask is None:
            self._mask = np.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        mask = self._mask
        taken: list[int] = []
        for t in candidates:
            if t in never:
                break
            self._m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            word = int(mask[t >> 5]) & 0xFFFFFFFF
            if word != 1 << (t & 31) or np.count_nonzero(mask) != 1:
                break
            if not self._m.consume_token(t):
                break  # cannot happen for an allowed token; error is set, the caller sees it
            taken.append(t)
        return taken
