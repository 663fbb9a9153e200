"""The Responses API's builder: output-processor updates -> ``response`` objects and events.

Sans-IO like ``server.responses``: ``server.generation`` feeds it the updates of the
response's one sequence and writes what it returns. Streaming, every call returns
events (dicts with ``type`` and ``sequence_number``, counting up by one from 0):

    response.created, response.in_progress                         opening()
    per text:   response.output_item.added (message)               feed()
                response.content_part.added (output_text)
                response.output_text.delta ...
    per call:   response.output_item.added (function_call)          (closes a message
                response.function_call_arguments.delta ...           before it)
    at the end: response.output_text.done, response.content_part.done,
                response.function_call_arguments.done, response.output_item.done
                (each item, in order), then response.completed | response.incomplete
                                                                    closing()
    on a failure after the start: response.failed                  failed()

Not streaming, ``body()`` is the final response object. The same bookkeeping makes
both, so a streamed response's final object equals the non-streamed one. Output items
are ``message`` (one ``output_text`` part) and ``function_call``; with a reasoning
parser (``--reasoning-parser``) a ``reasoning`` item (one ``reasoning_text`` part, its
``response.reasoning_text.delta`` events) comes first, from the update's reasoning text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from structllm.output import SequenceState, SequenceUpdate
from structllm.protocol import SamplingParams
from structllm.server.responses_api import Item, ResponsesRequest, new_id


def echo(
    req: ResponsesRequest,
    store: bool,
    tool_choice: Any = None,
    sampling: SamplingParams | None = None,
) -> dict[str, Any]:
    """The request's parameters as a response object repeats them (``sampling``: the
    ones it ran with, where it left temperature or top_p to the model's defaults)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "background": req.background,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": store,
        "temperature": sampling.temperature
        if sampling is not None
        else (1.0 if req.temperature is None else req.temperature),
        "text": {"format": fmt or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [{"strict": None, **t} for t in req.tools or []],
        "top_logprobs": 0,
        "top_p": sampling.top_p
        if sampling is not None
        else (1.0 if req.top_p is None else req.top_p),
        "truncation": "disabled",
        "user": req.user,
        "safety_identifier": req.safety_identifier,
    }


def response_object(
    response_id: str,
    model: str,
    created_at: float,
    params: dict[str, Any],
    status: str,
    output: list[Item] | None = None,
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    done = status in ("completed", "incomplete", "failed", "cancelled")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": None,
        "status": status,
        "error": error,
        "incomplete_details": (
            {"reason": incomplete_reason} if incomplete_reason is not None else None
        ),
        "model": model,
        "output": output or [],
        "usage": usage if done else None,
        **params,
    }


def usage(seq: SequenceState) -> dict[str, Any]:
    n_in, n_out = len(seq.prompt_ids), len(seq.token_ids)
    return {
        "input_tokens": n_in,
        "input_tokens_details": {"cached_tokens": seq.num_cached_tokens},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": seq.num_reasoning_tokens},
        "total_tokens": n_in + n_out,
    }


@dataclass
class _Open:
    """An output item being written: its index in ``output`` and, for a message, its
    text so far; for a call, its arguments so far."""

    index: int
    item: Item
    pieces: list[str] = field(default_factory=list)


class ResponsesBuilder:
    """One response of one sequence. ``params`` is ``echo(...)`` of its request."""

    def __init__(
        self,
        seq: SequenceState,
        *,
        model: str,
        stream: bool,
        params: dict[str, Any],
        response_id: str | None = None,
        created_at: float | None = None,
    ) -> None:
        self.seq = seq
        self.model = model
        self.stream = stream
        self.params = params
        self.id = response_id or new_id("resp")
        self.created_at = created_at if created_at is not None else time.time()
        self.sequence_number = 0
        self.output: list[Item] = []
        self.message: _Open | None = None
        self.thought: _Open | None = None  # the reasoning item while it is written
        self.calls: dict[int, _Open] = {}  # the parser's call index -> its item
        self.close_events: list[dict[str, Any]] | None = None  # made once, by finish()
        self.completed_at: float | None = None

    # -- objects -----------------------------------------------------------------------

    def status(self) -> tuple[str, str | None]:
        reason = self.seq.finish_reason
        if reason is None:
            return "in_progress", None
        if reason == "length":
            return "incomplete", "max_output_tokens"
        if reason == "abort":
            return "cancelled", None
        return "completed", None

    def response(
        self, status: str | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        own, incomplete = self.status()
        out = response_object(
            self.id,
            self.model,
            self.created_at,
            self.params,
            status or own,
            self.output if status != "in_progress" else [],
            usage(self.seq),
            error,
            incomplete if status is None else None,
        )
        if out["status"] == "completed":
            out["completed_at"] = self.completed_at
        return out

    def finish(self) -> None:
        """Close the open items (idempotent; once the sequence has finished)."""
        if self.close_events is None:
            self.close_events = self.close_items()
            self.completed_at = time.time()

    def body(self) -> dict[str, Any]:
        self.finish()
        return self.response()

    # -- events ------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return out

    def opening(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def feed(self, updates: list[SequenceUpdate]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for u in updates:
            if u.reasoning:
                events += self.reasoning_text(u.reasoning)
            if u.text:
                events += self.text(u.text)
            for d in u.tool_calls:
                if d.id is not None:
                    events += self.open_call(d.index, d.id, d.name or "")
                call = self.calls[d.index]
                if d.arguments:
                    call.pieces.append(d.arguments)
                    events.append(
                        self.event(
                            "response.function_call_arguments.delta",
                            item_id=call.item["id"],
                            output_index=call.index,
                            delta=d.arguments,
                        )
                    )
        return events if self.stream else []

    def closing(self) -> list[dict[str, Any]]:
        self.finish()
        assert self.close_events is not None
        events = self.close_events
        status, _ = self.status()
        kind = "response.incomplete" if status == "incomplete" else f"response.{status}"
        events.append(self.event(kind, response=self.response()))
        return events

    def failed(self, message: str) -> list[dict[str, Any]]:
        """The end of a stream that broke after it began (the engine died...)."""
        self.finish()
        assert self.close_events is not None
        events = self.close_events
        error = {"code": "server_error", "message": message}
        events.append(self.event("response.failed", response=self.response("failed", error)))
        return events

    # -- items -------------------------------------------------------------------------

    def reasoning_text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.thought is None:
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            }
            self.thought = _Open(len(self.output), item)
            self.output.append(item)
            events.append(
                self.event("response.output_item.added", output_index=self.thought.index, item=item)
            )
        self.thought.pieces.append(text)
        events.append(
            self.event(
                "response.reasoning_text.delta",
                item_id=self.thought.item["id"],
                output_index=self.thought.index,
                content_index=0,
                delta=text,
            )
        )
        return events

    def close_reasoning(self) -> list[dict[str, Any]]:
        r = self.thought
        if r is None:
            return []
        self.thought = None
        text = "".join(r.pieces)
        part = {"type": "reasoning_text", "text": text}
        done = {**r.item, "status": self.item_status(), "content": [part]}
        self.output[r.index] = done
        return [
            self.event(
                "response.reasoning_text.done",
                item_id=done["id"],
                output_index=r.index,
                content_index=0,
                text=text,
            ),
            self.event("response.output_item.done", output_index=r.index, item=done),
        ]

    def text(self, text: str) -> list[dict[str, Any]]:
        events = self.close_reasoning()  # the answer ends the reasoning before it
        if self.message is None:
            events += self.open_message()
        assert self.message is not None
        self.message.pieces.append(text)
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self.message.item["id"],
                output_index=self.message.index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def open_message(self) -> list[dict[str, Any]]:
        item = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.message = _Open(len(self.output), item)
        self.output.append(item)
        return [
            self.event("response.output_item.added", output_index=self.message.index, item=item),
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self.message.index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            ),
        ]

    def close_message(self) -> list[dict[str, Any]]:
        m = self.message
        if m is None:
            return []
        self.message = None
        text = "".join(m.pieces)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        done = {**m.item, "status": self.item_status(), "content": [part]}
        self.output[m.index] = done
        where = {"item_id": done["id"], "output_index": m.index}
        return [
            self.event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            ),
            self.event("response.content_part.done", **where, content_index=0, part=part),
            self.event("response.output_item.done", output_index=m.index, item=done),
        ]

    def open_call(self, k: int, call_id: str, name: str) -> list[dict[str, Any]]:
        events = self.close_reasoning() + self.close_message()  # a call ends what was before
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        self.calls[k] = _Open(len(self.output), item)
        self.output.append(item)
        events.append(
            self.event("response.output_item.added", output_index=self.calls[k].index, item=item)
        )
        return events

    def item_status(self) -> str:
        return "incomplete" if self.seq.finish_reason == "length" else "completed"

    def close_items(self) -> list[dict[str, Any]]:
        """Close what is open: the reasoning, the message, then the calls in order; a
        reply with no message or call gets an empty message, as OpenAI's."""
        events = self.close_reasoning()
        if not any(item["type"] != "reasoning" for item in self.output):
            events += self.open_message()
        events += self.close_message()
        for call in self.calls.values():
            args = "".join(call.pieces)
            done = {**call.item, "status": self.item_status(), "arguments": args}
            self.output[call.index] = done
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=done["id"],
                    output_index=call.index,
                    name=done["name"],
                    arguments=args,
                )
            )
            events.append(
                self.event("response.output_item.done", output_index=call.index, item=done)
            )
        return events
