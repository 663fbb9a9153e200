"""Tokenizer, chat template, incremental detokenization and stop strings.

These live on the front-end side of the process boundary (as in vLLM v1): the engine
only sees token ids. Built on the ``tokenizers`` library (``tokenizer.json``) and a
sandboxed Jinja environment for chat templates, so importing this module does not pull
in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from structllm.model.files import ModelFiles, TokenizerMeta

REPLACEMENT_CHAR = "\ufffd"

Message = Mapping[str, Any]


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to
    code points from 256 up. Returned inverted: character -> byte."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _bytes_to_unicode()


class ChatTemplateError(ValueError):
    """The model's chat template could not render these messages."""


RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
    }
)
"""The chat template's variables that structllm sets itself."""


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``kwargs`` as extra chat-template variables (vLLM's ``chat_template_kwargs``, e.g.
    ``{"enable_thinking": False}``). Raises ``ValueError`` naming the field if it is not a
    mapping of strings or sets a variable structllm sets itself."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(
            f"chat_template_kwargs must be an object (a mapping of variable names to values), "
            f"got {type(kwargs).__name__}"
        )
    clash = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs))
    if clash:
        raise ValueError(
            f"chat_template_kwargs must not set {', '.join(clash)}: "
            f"{', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))} are set by structllm itself"
        )
    return dict(kwargs)


class Tokenizer:
    def __init__(
        self, tokenizer_json: str, meta: TokenizerMeta, eos_token_ids: Sequence[int] = ()
    ) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(tokenizer_json)
        self._plain: HFTokenizer | None = None  # encode_plain's, made on first use
        self.path = tokenizer_json
        self.meta = meta
        ids = set(eos_token_ids)
        if (
            meta.eos_token is not None
            and (eid := self._tok.token_to_id(meta.eos_token)) is not None
        ):
            ids.add(eid)
        self.eos_token_ids: list[int] = sorted(ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template: Any = None
        self._token_bytes: dict[int, bytes] = {}
        self._max_token_bytes = 0  # see min_tokens_for
        self._byte_level = "ByteLevel" in str(self._tok.decoder)
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = set(added)  # ids of added tokens
        self._skipped_ids = {i for i, t in added.items() if t.special}  # what decode drops

    @classmethod
    def from_files(cls, files: ModelFiles) -> Tokenizer:
        return cls(str(files.tokenizer_json), files.tokenizer_meta, files.generation_eos_ids)

    # -- text <-> ids ----------------------------------------------------------------

    def encode_plain(self, text: str) -> list[int]:
        """``text``'s ids with no special token matched: a special token's spelling in
        it is text (openai-harmony's ``encode_ordinary``). A second tokenizer does it (the
        switch is the tokenizer's state, and threads share this one)."""
        if self._plain is None:
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_file(self.path)
            plain.encode_special_tokens = True
            self._plain = plain
        ids: list[int] = self._plain.encode_batch([text], add_special_tokens=False)[0].ids
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt
        # tokenized in a worker thread must not freeze the event loop's thread.
        ids: list[int] = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[
            0
        ].ids
        bos = self.meta.bos_token
        if add_special_tokens and self.meta.add_bos_token and bos is not None:
            bos_id = self._tok.token_to_id(bos)
            if bos_id is not None and (not ids or ids[0] != bos_id):
                ids.insert(0, bos_id)
        return ids

    def encode_pair(self, first: str, second: str) -> list[int]:
        """A cross-encoder's input, as transformers' ``tokenizer(first, second)``: the
        pair template of the tokenizer's post-processor (a decoder's, often just the two
        texts' tokens one after the other)."""
        ids: list[int] = self._tok.encode_batch([(first, second)])[0].ids
        return ids

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is ``text`` (None if no single token is)."""
        found: int | None = self._tok.token_to_id(text)
        return found

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> str:
        """``ids`` as text; ``skip_special_tokens`` leaves out special tokens but those in
        ``keep`` (a tool-call syntax's tags that are special tokens: ``call_formats``)."""
        if skip_special_tokens and keep:
            skipped = self._skipped_ids
            ids = [i for i in ids if i in keep or i not in skipped]
            skip_special_tokens = False
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: exact for byte-level BPE (GPT-2 style) and
        byte-fallback tokens (``<0x0A>``), the UTF-8 of its text otherwise."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self._tok.id_to_token(token_id) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out = bytes([int(piece[3:5], 16)])
        elif (
            self._byte_level
            and token_id not in self._special_ids
            and all(c in _BYTE_DECODER for c in piece)
        ):
            out = bytes(_BYTE_DECODER[c] for c in piece)
        else:
            out = piece.replace("\u2581", " ").encode()
        self._token_bytes[token_id] = out
        return out

    def min_tokens_for(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, in O(1) after the first call: no token
        stands for more bytes than the vocabulary's longest one. (A normalizer may
        shorten the text first, so then the bound is loosened by a factor of 4.)"""
        if self._max_token_bytes == 0:
            longest = max((len(self.token_bytes(t)) for t in range(self.vocab_size)), default=1)
            self._max_token_bytes = max(1, longest) * (1 if self._tok.normalizer is None else 4)
        return len(text.encode("utf-8", errors="surrogatepass")) // self._max_token_bytes

    def token_text(self, token_id: int) -> str:
        """``token_bytes`` as text (an incomplete character shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # -- chat ------------------------------------------------------------------------

    def set_chat_template(self, template: str) -> None:
        """Use ``template`` instead of the model's. Raises ``ChatTemplateError`` if it
        does not compile."""
        self._template = compile_chat_template(template)
        self.meta = msgspec.structs.replace(self.meta, chat_template=template)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``, and whatever else the
        template reads, e.g. ``tool_calls``) to the prompt text; ``variables`` are extra
        template variables (``tools``). Raises ``ChatTemplateError`` if the model has no
        template or it fails."""
        if self._template is None:
            if not self.meta.chat_template:
                raise ChatTemplateError(
                    "this model has no chat template (its files carry none and no built-in "
                    "one fits its family): use /v1/completions with a plain prompt, or give "
                    "the server one with --chat-template"
                )
            self._template = compile_chat_template(self.meta.chat_template)
        try:
            rendered: str = self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.meta.bos_token or "",
                eos_token=self.meta.eos_token or "",
                **variables,
            )
        except Exception as e:
            raise ChatTemplateError(
                f"the chat template failed to render these messages: {e}"
            ) from e
        return rendered

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        # The template already writes the special tokens it wants (as Hugging Face does).
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )


def compile_chat_template(template: str) -> Any:
    """The compiled Jinja template; ``ChatTemplateError`` if it does not compile."""
    try:
        return _jinja_env().from_string(template)
    except Exception as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def load_chat_template(value: str) -> str:
    """A chat template given as a file's path or as the template itself (like vLLM's
    ``--chat-template``), checked to compile. Raises ``ChatTemplateError``."""
    if "{" not in value:
        try:
            value = Path(value).read_text()
        except OSError as e:
            raise ChatTemplateError(
                f"cannot read the chat template file {value!r}: {e.strerror}"
            ) from None
    compile_chat_template(value)
    return value


class JsonText(str):
    """A value that is already JSON text (a tool call's ``arguments`` for templates that
    write them out): a string to ``+`` and ``is string``, itself under ``tojson``. So
    DeepSeek's templates, which write ``'<｜tool▁sep｜>' + arguments`` (Hugging Face's)
    or ``arguments | tojson`` (vLLM's examples), both render the JSON once."""


def _jinja_env() -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
    ) -> str:
        if isinstance(x, JsonText):
            return str(x)
        return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Detokenizer:
    """Turns one request's output ids into text, incrementally, and applies stop strings.

    ``add(ids)`` returns ``(text_delta, stopped)``. The concatenated deltas plus
    ``finish()`` equal ``tokenizer.decode(all_ids)`` cut at the first stop string: text
    is decoded over a window starting a few tokens back (``prefix``) so tokens whose
    bytes combine into one character, or whose leading space depends on context, come
    out as a one-shot decode would; a window that ends in an incomplete UTF-8 sequence
    (U+FFFD at the end) is held until the next token completes it. When stop strings are
    set, a tail that could be the start of one is held back until it is decided.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self.tok = tokenizer
        self.keep = keep  # special tokens kept in the text (Tokenizer.decode)
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far (cut at a stop string once one matched)
        self.emitted = 0  # len(text) already returned
        self.prefix = 0  # ids[prefix:read] decode to the tail the window is measured from
        self.read = 0
        self.stopped = False
        self.stop_str: str | None = None

    def add(self, new_ids: Sequence[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self.prefix : self.read], self.skip_special, self.keep)
        window = self.tok.decode(self.ids[self.prefix :], self.skip_special, self.keep)
        if len(window) > len(before) and not window.endswith(REPLACEMENT_CHAR):
            self._append(window[len(before) :])
            self.prefix, self.read = self.read, len(self.ids)
        return self._emit(final=False), self.stopped

    def finish(self) -> str:
        """Flush what is held back (an incomplete character decodes as U+FFFD, exactly as
        a one-shot decode would). Returns the last delta."""
        if not self.stopped:
            before = self.tok.decode(
                self.ids[self.prefix : self.read], self.skip_special, self.keep
            )
            window = self.tok.decode(self.ids[self.prefix :], self.skip_special, self.keep)
            self._append(window[len(before) :])
            self.prefix = self.read = len(self.ids)
        return self._emit(final=True)

    def _append(self, delta: str) -> None:
        if not delta:
            return
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        if not self.stop:
            return
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s) if self.include_stop else i]
            self.stopped, self.stop_str = True, s

    def _emit(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end -= self._held_back()
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold
