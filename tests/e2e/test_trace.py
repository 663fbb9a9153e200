"""Lifecycle tracing (``--trace`` / ``LLM(trace=...)``): the events of a streamed, a
stopped and an aborted request come in the order of the lifecycle, across both
processes of a real server, and offline."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from structllm import LLM, SamplingParams
from structllm.trace import read
from tests.support.server import Server, open_stream, read_until

# the front end's and the engine's events of one engine request, in lifecycle order
STREAMED = [
    "sent",
    "queued",
    "scheduled",
    "blocks_allocated",
    "forward",
    "sampled",
    "detokenized",
    "streamed",
    "finished",
]


def of(events: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """One request's events, by time."""
    mine = [e for e in events if e.get("args", {}).get("request_id") == request_id]
    return sorted(mine, key=lambda e: e["ts"])


def names(events: list[dict[str, Any]]) -> list[str]:
    """Event names with repeats collapsed (a request is scheduled, forwarded... each step)."""
    out: list[str] = []
    for e in events:
        if not out or out[-1] != e["name"]:
            out.append(e["name"])
    return out


def first(events: list[dict[str, Any]], name: str, **args: Any) -> int:
    """Index of the first event called ``name`` whose args include ``args``."""
    return next(
        i for i, e in enumerate(events) if e["name"] == name and args.items() <= e["args"].items()
    )


def assert_in_order(events: list[dict[str, Any]], expected: list[str]) -> None:
    """``expected`` occur in this order (each at its first occurrence)."""
    seen = names(events)
    positions = [seen.index(n) for n in expected]
    assert positions == sorted(positions), seen


# -- a real server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    with Server("--trace", str(path), "--max-model-len", "512") as s:
        yield s, path
        assert s.stop() == 0


def engine_ids(events: list[dict[str, Any]], response_id: str) -> list[str]:
    return [
        e["args"]["request_id"]
        for e in events
        if e["name"] == "sent" and e["args"]["response_id"] == response_id
    ]


def stream_chat(server: Server, **body: Any) -> tuple[str, str]:
    """A streamed chat completion: its response id and text."""
    body = {
        "messages": [{"role": "user", "content": "Count from one to ten."}],
        "temperature": 0,
        "stream": True,
        **body,
    }
    rid, text = "", []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                rid = chunk["id"]
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    return rid, "".join(text)


def test_a_streamed_request_in_order(traced: tuple[Server, Path]) -> None:
    server, path = traced
    rid, _ = stream_chat(server, max_tokens=6)
    events = read(str(path))
    front = sorted(
        (e for e in events if e.get("args", {}).get("request_id") == rid), key=lambda e: e["ts"]
    )
    assert names(front) == ["received", "rendered", "tokenized"]
    [engine_id] = engine_ids(events, rid)
    mine = of(events, engine_id)
    assert_in_order(mine, STREAMED)
    assert front[-1]["ts"] <= mine[0]["ts"]
    assert [e["args"]["reason"] for e in mine if e["name"] == "finished"] == [
        "length",
        "length",
    ]  # engine, front end
    assert {e["pid"] for e in mine} | {e["pid"] for e in front} == {
        e["pid"] for e in mine
    }  # two processes
    assert len({e["pid"] for e in mine}) == 2
    assert sum(1 for e in events if e["name"] == "step") >= 6


def test_a_stopped_request_in_order(traced: tuple[Server, Path]) -> None:
    server, path = traced
    _, whole = stream_chat(server, max_tokens=12)
    stop = whole.strip()[len(whole.strip()) // 2 :][:3]  # text from the middle of the greedy reply
    assert stop.strip()
    rid, text = stream_chat(server, max_tokens=12, stop=[stop])
    assert stop not in text
    events = read(str(path))
    [engine_id] = engine_ids(events, rid)
    mine = of(events, engine_id)
    assert_in_order(
        mine,
        ["sent", "queued", "scheduled", "forward", "sampled", "detokenized", "aborted", "finished"],
    )
    stopped = first(mine, "aborted", why="a stop string ended it")
    assert first(mine, "finished", reason="stop") > stopped


def test_an_aborted_request_in_order(traced: tuple[Server, Path]) -> None:
    server, path = traced
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    s = open_stream(server.port, "/v1/chat/completions", body)
    head = read_until(
        s, b'"delta":{"content":', timeout=120
    )  # the first chunk with text (not the role's)
    rid = head.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
    s.close()
    deadline = (
        time.monotonic() + 120
    )  # the server notices the disconnect; bound the wait, not the assertion
    while True:
        events = read(str(path))
        ids = engine_ids(events, rid)
        mine = of(events, ids[0]) if ids else []
        if sum(1 for e in mine if e["name"] == "aborted") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert_in_order(
        mine, ["sent", "queued", "scheduled", "forward", "sampled", "streamed", "aborted"]
    )
    front_abort = first(mine, "aborted", why="the client disconnected")
    engine_abort = next(
        i for i, e in enumerate(mine) if e["name"] == "aborted" and "why" not in e["args"]
    )
    assert front_abort < engine_abort
    assert not any(e["name"] == "finished" for e in mine)


# -- offline -------------------------------------------------------------------------------


def test_offline_trace(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "offline.jsonl"
    llm = LLM(str(tiny_llama_dir), kv_cache_memory=16 << 20, trace=str(path))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate("hello there", greedy)[0]
    stop = next(t for t in (llm.tokenizer.decode([i]) for i in ref.token_ids[3:]) if t.strip())
    out = llm.generate(
        ["hello there", "hello there"],
        [greedy, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])],
    )
    assert out[1].finish_reason == "stop"
    llm.close()
    events = read(str(path))
    assert_in_order(
        of(events, f"{out[0].request_id}-0"),
        [
            "sent",
            "queued",
            "scheduled",
            "blocks_allocated",
            "forward",
            "sampled",
            "detokenized",
            "finished",
        ],
    )
    stopped = of(events, f"{out[1].request_id}-0")
    assert first(stopped, "aborted", why="a stop string ended it") < first(
        stopped, "finished", reason="stop"
    )
