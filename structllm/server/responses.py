"""Response builders: output-processor updates -> OpenAI chunks and bodies.

Sans-IO, like hypercorn's protocol classes: a builder never awaits and never touches a
socket. The orchestration (``server.generation``) feeds it the ``SequenceUpdate``s of
one response and writes what it returns: ``opening()`` chunks first (streams only),
then one chunk per ``feed`` that has something to say, then ``closing()`` chunks and
``[DONE]``; or, not streaming, ``body()`` once every sequence has finished.

``ChatBuilder`` makes ``chat.completion`` objects (deltas with ``role``/``content``
and ``tool_calls`` pieces, logprobs as ``content`` entries with bytes); ``TextBuilder``
makes ``text_completion`` objects (legacy logprobs with ``text_offset``, the prompt
echoed first with ``echo``, scored when logprobs are asked for). With vLLM's
``prompt_logprobs`` both add a ``prompt_logprobs`` list (``null`` for the first prompt
token, then a map of token id to ``{logprob, rank, decoded_token}``): top-level in a
chat body, per choice in a completion body, and in a stream on the first chunk of each
prompt's first choice.

With a reasoning parser a chat message carries ``reasoning_content`` beside ``content``
(``null`` when the output had no such part), streamed as ``delta.reasoning_content``
before the ``content`` deltas, and the usage counts
``completion_tokens_details.reasoning_tokens`` (vLLM's and OpenAI's names). gpt-oss's
harmony output fills the same fields (its analysis channel, its calls).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from structllm.output import SequenceState, SequenceUpdate
from structllm.protocol import TokenLogprobs
from structllm.tokenizer import Tokenizer


def usage(
    prompt_tokens: int, completion_tokens: int, cached: int = 0, reasoning: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


@dataclass
class _Choice:
    """What a builder keeps of one sequence: its text and logprobs until the body
    (not streaming), or how much text has gone out (streaming)."""

    seq: SequenceState
    pieces: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # reasoning pieces, for the body
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    streamed_chars: int = 0  # text sent so far, echoed prompt included
    echoed: bool = False  # the prompt has gone out (streamed completions with echo)
    opened: bool = False  # a chunk of this choice has gone out (streams)


class ResponseBuilder:
    """One response over ``sequences`` (in choice order, ``n`` per prompt)."""

    object_name = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(
        self,
        sequences: list[SequenceState],
        tokenizer: Tokenizer,
        *,
        model: str,
        stream: bool,
        include_usage: bool = False,
        continuous_usage: bool = False,
        prompt_logprobs: bool = False,
        response_id: str | None = None,
    ) -> None:
        self.choices = [_Choice(s) for s in sequences]
        self.tokenizer = tokenizer
        self.model = model
        self.stream = stream
        self.include_usage = include_usage and stream
        # every chunk carries the usage so far (vLLM's continuous_usage_stats)
        self.continuous_usage = continuous_usage and self.include_usage
        self.want_logprobs = bool(sequences) and sequences[0].sampling.logprobs is not None
        self.want_prompt_logprobs = prompt_logprobs  # vLLM's field in the response
        self.prompt_scores: dict[
            int, list[TokenLogprobs]
        ] = {}  # prompt index -> scores of tokens 1..
        self.id = response_id or self.new_id()
        self.created = int(time.time())

    @classmethod
    def new_id(cls) -> str:
        return cls.id_prefix + uuid.uuid4().hex

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
            if u.prompt_logprobs:
                self.prompt_scores.setdefault(c.seq.prompt_index, []).extend(u.prompt_logprobs)
            if not self.stream:
                c.pieces.append(u.text)
                c.reasoning.append(u.reasoning)
                c.logprobs += u.logprobs
            elif (
                u.text
                or u.reasoning
                or u.finish_reason is not None
                or u.logprobs
                or u.tool_calls
                or (self.echo_pending(c) and u.token_ids)
            ):
                item = self.stream_choice(c, u)
                if (
                    not c.opened
                    and self.want_prompt_logprobs
                    and c.seq.sampling.prompt_logprobs is not None
                ):
                    item["prompt_logprobs"] = self.prompt_logprobs(c)
                c.opened = True
                out.append(item)
        return self.chunk(out) if out else None

    def echo_pending(self, c: _Choice) -> bool:
        """Whether this choice's prompt is still to be echoed (streamed completions)."""
        return False

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

    def with_prompt_logprobs(self, c: _Choice, item: dict[str, Any]) -> dict[str, Any]:
        if self.want_prompt_logprobs:
            item["prompt_logprobs"] = self.prompt_logprobs(c)
        return item

    # -- shared pieces -----------------------------------------------------------------

    def chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = usage if usage is not None or not self.continuous_usage else self.usage()
        return out

    def usage(self) -> dict[str, Any]:
        firsts: dict[int, SequenceState] = {}  # prompt index -> its first sequence
        for c in self.choices:
            firsts.setdefault(c.seq.prompt_index, c.seq)
        reasoning = any(
            c.seq.reasoning is not None or c.seq.harmony is not None for c in self.choices
        )
        return usage(
            sum(len(s.prompt_ids) for s in firsts.values()),
            sum(len(c.seq.token_ids) for c in self.choices),
            sum(s.num_cached_tokens for s in firsts.values()),
            sum(c.seq.num_reasoning_tokens for c in self.choices) if reasoning else None,
        )

    def prompt_logprobs(self, c: _Choice) -> list[dict[str, Any] | None]:
        """vLLM's shape: ``None``, then per prompt token a map of token id to its entry."""
        tok = self.tokenizer
        out: list[dict[str, Any] | None] = [None]
        for token, e in zip(
            c.seq.prompt_ids[1:], self.prompt_scores.get(c.seq.prompt_index, []), strict=False
        ):
            entry = {
                str(t): {"logprob": v, "rank": r, "decoded_token": tok.token_text(t)}
                for r, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True), start=1)
            }
            entry.setdefault(
                str(token), {"logprob": e.logprob, "decoded_token": tok.token_text(token)}
            )
            out.append(entry)
        return out

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

    def body(self) -> dict[str, Any]:
        out = super().body()
        if self.want_prompt_logprobs and self.choices:  # one chat, one prompt: top-level as vLLM
            out["prompt_logprobs"] = self.prompt_logprobs(self.choices[0])
        return out

    def opening(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [
            self.chunk(
                [
                    {"index": c.seq.index, "delta": role, "logprobs": None, "finish_reason": None}
                    for c in self.choices
                ]
            )
        ]

    def stream_choice(self, c: _Choice, u: SequenceUpdate) -> dict[str, Any]:
        lp = self.logprobs(u.token_ids, u.logprobs) if self.want_logprobs and u.logprobs else None
        delta: dict[str, Any] = {"reasoning_content": u.reasoning} if u.reasoning else {}
        if u.text:
            delta["content"] = u.text
        if u.tool_calls:
            delta["tool_calls"] = [d.as_openai() for d in u.tool_calls]
        item: dict[str, Any] = {"index": c.seq.index, "delta": delta, "logprobs": lp}
        return self.finish(c, item)

    def body_choice(self, c: _Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(c.pieces)}
        if c.seq.reasoning is not None:
            message["reasoning_content"] = (
                "".join(c.reasoning) if c.seq.reasoning.has_reasoning else None
            )
            message["content"] = message["content"] or None
        harmony = c.seq.harmony
        if harmony is not None:  # gpt-oss: reasoning, content and calls from one parser
            message["reasoning_content"] = harmony.reasoning if harmony.has_reasoning else None
            message["content"] = harmony.content or None
            if harmony.calls:
                message["tool_calls"] = [call.as_openai() for call in harmony.calls]
        tools = c.seq.tools
        if tools is not None:
            calls = tools.calls
            message["content"] = tools.content
            if calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
        item = {
            "index": c.seq.index,
            "message": message,
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
            e["top_logprobs"] = [
                entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
            ]
            content.append(e)
        return {"content": content}


class TextBuilder(ResponseBuilder):
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(
        self,
        sequences: list[SequenceState],
        tokenizer: Tokenizer,
        *,
        model: str,
        stream: bool,
        include_usage: bool = False,
        continuous_usage: bool = False,
        echo: bool = False,
        prompt_logprobs: bool = False,
        response_id: str | None = None,
    ) -> None:
        super().__init__(
            sequences,
            tokenizer,
            model=model,
            stream=stream,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            prompt_logprobs=prompt_logprobs,
            response_id=response_id,
        )
        self.echo = echo

    def prompt_text(self, c: _Choice) -> str:
        return self.tokenizer.decode(c.seq.prompt_ids) if self.echo else ""

    def echo_pending(self, c: _Choice) -> bool:
        return self.echo and not c.echoed

    def stream_choice(self, c: _Choice, u: SequenceUpdate) -> dict[str, Any]:
        # The first chunk sent carries the prompt (the first update may have no text: the
        # detokenizer can hold a whole delta back), and its scores, complete by then: the
        # engine scores the whole prompt before it samples.
        prefix, lp = "", None
        if not c.echoed:
            prefix, c.echoed = self.prompt_text(c), True
            if self.echo and self.want_logprobs:
                lp = self.echo_logprobs(c)
        offset = c.streamed_chars + len(prefix)
        c.streamed_chars = offset + len(u.text)
        if self.want_logprobs and u.logprobs:
            lp = self.join(lp, self.logprobs(u.token_ids, u.logprobs, offset))
        return self.finish(c, {"index": c.seq.index, "text": prefix + u.text, "logprobs": lp})

    def body_choice(self, c: _Choice) -> dict[str, Any]:
        prefix = self.prompt_text(c)
        lp = None
        if self.want_logprobs:
            lp = self.logprobs(c.seq.token_ids, c.logprobs, len(prefix))
            if self.echo:
                lp = self.join(self.echo_logprobs(c), lp)
        item = {"index": c.seq.index, "text": prefix + "".join(c.pieces), "logprobs": lp}
        return self.with_prompt_logprobs(c, self.finish(c, item))

    def echo_logprobs(self, c: _Choice) -> dict[str, Any]:
        """The legacy logprobs of the echoed prompt: the first token has none; each other
        token its own logprob, and its alternatives with it."""
        tok = self.tokenizer
        ids = c.seq.prompt_ids
        scores = self.prompt_scores.get(c.seq.prompt_index, [])
        texts = [tok.token_text(t) for t in ids]
        logprobs: list[float | None] = [None] * len(ids)
        top: list[dict[str, float] | None] = [None] * len(ids)
        for k, (t, e) in enumerate(zip(ids[1:], scores, strict=False), start=1):
            logprobs[k] = e.logprob
            alts = {tok.token_text(i): v for i, v in zip(e.top_ids, e.top_logprobs, strict=True)}
            alts.setdefault(tok.token_text(t), e.logprob)
            top[k] = alts
        return {
            "tokens": texts,
            "token_logprobs": logprobs,
            "top_logprobs": top,
            "text_offset": [sum(len(x) for x in texts[:k]) for k in range(len(texts))],
        }

    @staticmethod
    def join(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
        return b if a is None else {k: a[k] + b[k] for k in b}

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
            "top_logprobs": [
                {tok.token_text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
                for lp in lps
            ],
            "text_offset": offsets,
        }
