"""Response builders: output-processor updates -> OpenAI chunks and bodies.

Sans-IO, like hypercorn's protocol classes: a builder never awaits and never touches a
socket. The orchestration (``server.generation``) feeds it the ``SequenceUpdate``s of
one response and writes what it returns: ``opening()`` chunks first (streams only),
then one chunk per ``feed`` that has something to say, then ``closing()`` chunks and
``[DONE]``; or, not streaming, ``body()`` once every sequence has finished.

``ChatBuilder`` makes ``chat.completion`` objects (deltas with ``role``/``content``,
logprobs as ``content`` entries with bytes); ``TextBuilder`` makes ``text_completion``
objects (legacy logprobs with ``text_offset``, the prompt echoed first with ``echo``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from structllm.output import SequenceState, SequenceUpdate
from structllm.protocol import TokenLogprobs
from structllm.tokenizer import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


@dataclass
class _Choice:
    """What a builder keeps of one sequence: its text and logprobs until the body
    (not streaming), or how much text has gone out (streaming)."""

    seq: SequenceState
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    streamed_chars: int = 0  # text sent so far, echoed prompt included
    echoed: bool = False  # the prompt has gone out (streamed completions with echo)


class ResponseBuilder:
    """One response over ``sequences`` (in choice order, ``n`` per prompt)."""

    object_name = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, sequences: list[SequenceState], tokenizer: Tokenizer, *, model: str, stream: bool,
                 include_usage: bool = False) -> None:
        self.choices = [_Choice(s) for s in sequences]
        self.tokenizer = tokenizer
        self.model = model
        self.stream = stream
        self.include_usage = include_usage and stream
        self.want_logprobs = bool(sequences) and sequences[0].sampling.logprobs is not None
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())

    # -- the protocol ------------------------------------------------------------------

    def opening(self) -> list[dict[str, Any]]:
        """Chunks that start a stream, before any token."""
        return []

    def feed(self, updates: list[SequenceUpdate]) -> dict[str, Any] | None:
        """Take the updates of one wake-up. Streaming: the chunk to send, if any.
        Otherwise kept for ``body`` (returns None)."""
        out = []
        for u in updates:
            c = self.choices[u.index]
            if not self.stream:
                c.pieces.append(u.text)
                c.logprobs += u.logprobs
            elif u.text or u.finish_reason is not None or u.logprobs:
                out.append(self.stream_choice(c, u))
        return self.chunk(out) if out else None

    def closing(self) -> list[dict[str, Any]]:
        """Chunks that end a stream (before ``[DONE]``)."""
        return [self.chunk([], usage=self.usage())] if self.include_usage else []

    def body(self) -> dict[str, Any]:
        """The whole non-streamed response."""
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [self.body_choice(c) for c in self.choices],
            "usage": self.usage(),
        }

    # -- shared pieces -----------------------------------------------------------------

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": self.chunk_object, "created": self.created,
                               "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = usage
        return out

    def usage(self) -> dict[str, Any]:
        firsts: dict[int, SequenceState] = {}  # prompt index -> its first sequence
        for c in self.choices:
            firsts.setdefault(c.seq.prompt_index, c.seq)
        return usage(sum(len(s.prompt_ids) for s in firsts.values()),
                     sum(len(c.seq.token_ids) for c in self.choices),
                     sum(s.num_cached_tokens for s in firsts.values()))

    @staticmethod
    def finish(c: _Choice, item: dict[str, Any]) -> dict[str, Any]:
        item["finish_reason"] = c.seq.finish_reason
        if c.seq.stop_reason is not None and item["finish_reason"] is not None:
            item["stop_reason"] = c.seq.stop_reason
        return item

    def stream_choice(self, c: _Choice, u: SequenceUpdate) -> dict[str, Any]:
        raise NotImplementedError

    def body_choice(self, c: _Choice) -> dict[str, Any]:
        raise NotImplementedError


class ChatBuilder(ResponseBuilder):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def opening(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [self.chunk([{"index": c.seq.index, "delta": role, "logprobs": None, "finish_reason": None}
                            for c in self.choices])]

    def stream_choice(self, c: _Choice, u: SequenceUpdate) -> dict[str, Any]:
        lp = self.logprobs(u.token_ids, u.logprobs) if self.want_logprobs and u.logprobs else None
        item = {"index": c.seq.index, "delta": {"content": u.text} if u.text else {}, "logprobs": lp}
        return self.finish(c, item)

    def body_choice(self, c: _Choice) -> dict[str, Any]:
        item = {
            "index": c.seq.index,
            "message": {"role": "assistant", "content": "".join(c.pieces)},
            "logprobs": self.logprobs(c.seq.token_ids, c.logprobs) if self.want_logprobs else None,
        }
        return self.finish(c, item)

    def logprobs(self, tokens: list[int], lps: list[TokenLogprobs]) -> dict[str, Any]:
        tok = self.tokenizer

        def entry(t: int, lp: float) -> dict[str, Any]:
            b = tok.token_bytes(t)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

        content = []
        for t, lp in zip(tokens, lps, strict=False):
            e = entry(t, lp.logprob)
            e["top_logprobs"] = [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
            content.append(e)
        return {"content": content}


class TextBuilder(ResponseBuilder):
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, sequences: list[SequenceState], tokenizer: Tokenizer, *, model: str, stream: bool,
                 include_usage: bool = False, echo: bool = False) -> None:
        super().__init__(sequences, tokenizer, model=model, stream=stream, include_usage=include_usage)
        self.echo = echo

    def prompt_text(self, c: _Choice) -> str:
        return self.tokenizer.decode(c.seq.prompt_ids) if self.echo else ""

    def stream_choice(self, c: _Choice, u: SequenceUpdate) -> dict[str, Any]:
        # the first chunk sent carries the prompt (the first update may have no text:
        # the detokenizer can hold a whole delta back)
        prefix = ""
        if not c.echoed:
            prefix, c.echoed = self.prompt_text(c), True
        offset = c.streamed_chars + len(prefix)
        c.streamed_chars = offset + len(u.text)
        lp = self.logprobs(u.token_ids, u.logprobs, offset) if self.want_logprobs and u.logprobs else None
        return self.finish(c, {"index": c.seq.index, "text": prefix + u.text, "logprobs": lp})

    def body_choice(self, c: _Choice) -> dict[str, Any]:
        prefix = self.prompt_text(c)
        lp = self.logprobs(c.seq.token_ids, c.logprobs, len(prefix)) if self.want_logprobs else None
        return self.finish(c, {"index": c.seq.index, "text": prefix + "".join(c.pieces), "logprobs": lp})

    def logprobs(self, tokens: list[int], lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        tok = self.tokenizer
        texts = [tok.token_text(t) for t in tokens]
        offsets = []
        for t in texts:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": texts,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{tok.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
                             for lp in lps],
            "text_offset": offsets,
        }
