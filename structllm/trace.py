"""Request lifecycle tracing: ``structllm run --trace FILE``, ``LLM(trace=FILE)``.

Every process of a server (front ends, engine) appends to the same file, one JSON
object per line, each a Chrome trace event (``ph: "i"`` for an instant, ``"X"`` for a
span), so a request's life reads across the process boundary in one place:
``jq -s . FILE > trace.json`` opens in Perfetto or ``chrome://tracing``. Timestamps are
``CLOCK_MONOTONIC`` in microseconds, one clock for every process on the machine.

Events, in a request's order (``args.request_id`` names the engine request; the
front end's events before the fan-out name the HTTP response, ``args.response_id``):

- front end: ``received``, ``rendered`` (chat template), ``tokenized``, ``sent``
  (one per engine request, with its ``response_id``);
- engine: ``queued``, ``scheduled`` (tokens this step), ``blocks_allocated`` (KV
  blocks gained), ``forward`` (the step's model call, with the step number; and one
  ``step`` span per step), ``sampled`` (tokens), ``finished`` (``reason``) or
  ``aborted``;
- front end: ``detokenized`` (characters of new text), ``streamed`` (a chunk written),
  and ``finished`` (``reason``) or ``aborted`` (``why``: the client left, a stop
  string, a stalled client).

Each event is one ``write`` to a file opened with ``O_APPEND``, so lines from different
processes never interleave. Off by default; a disabled tracer costs one attribute test
per hook.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def now_us() -> int:
    return time.monotonic_ns() // 1000


class Tracer:
    """Appends events to ``path`` (``None``: disabled) for process ``process``."""

    def __init__(self, path: str | None, process: str) -> None:
        self.enabled = path is not None
        self._fd = -1
        self._pid = os.getpid()
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._write(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": self._pid,
                    "tid": 0,
                    "args": {"name": process},
                }
            )

    def event(self, name: str, request_id: str, **args: Any) -> None:
        """An instant event of one request."""
        if self.enabled:
            self._write(
                {
                    "name": name,
                    "ph": "i",
                    "s": "p",
                    "ts": now_us(),
                    "pid": self._pid,
                    "tid": 0,
                    "args": {"request_id": request_id, **args},
                }
            )

    def span(self, name: str, start_us: int, **args: Any) -> None:
        """A span from ``start_us`` (``now_us()``) to now."""
        if self.enabled:
            self._write(
                {
                    "name": name,
                    "ph": "X",
                    "ts": start_us,
                    "dur": now_us() - start_us,
                    "pid": self._pid,
                    "tid": 0,
                    "args": args,
                }
            )

    def _write(self, event: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.enabled = False


OFF = Tracer(None, "")
"""The disabled tracer."""


def read(path: str) -> list[dict[str, Any]]:
    """The events of a trace file, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
