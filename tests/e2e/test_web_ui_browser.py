"""The chat page at ``/`` in headless Chromium against a real server on the default
model, with an API key: the key prompt, a streamed reply with logprobs, Stop (the
engine aborts), JSON mode, a tool call, model text that holds markup, and the live panel.
One server and one browser for the module; the page is reloaded per test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.support.browser import chromium, screenshot, wait_until
from tests.support.procs import wait_for
from tests.support.server import Server

pytestmark = pytest.mark.slow

KEY = "page-test-key"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("--max-model-len", "2048", api_key=KEY) as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as d:
        yield d


def by_id(d: Any, id_: str) -> Any:
    return d.find_element("id", id_)


def state(d: Any) -> str:
    return str(d.execute_script("return document.body.dataset.state"))


def open_page(d: Any, server: Server, **settings: Any) -> None:
    """Load the page, give it the key, and fill in ``settings`` (element id -> value;
    booleans tick checkboxes)."""
    d.get(server.url + "/")
    wait_until(d, lambda d: state(d) == "key", "the page did not ask for the API key")
    by_id(d, "key-input").send_keys(KEY)
    by_id(d, "key-submit").click()
    wait_until(d, lambda d: state(d) == "idle", "the page did not accept the key")
    for id_, value in settings.items():
        field = by_id(d, id_.replace("_", "-"))
        if isinstance(value, bool):
            if field.is_selected() != value:
                field.click()
        else:
            # set through the DOM: send_keys would type JSON's braces one by one
            d.execute_script("arguments[0].value = arguments[1]", field, str(value))


def send(d: Any, text: str) -> None:
    by_id(d, "input").send_keys(text)
    by_id(d, "send").click()


def last_reply(d: Any) -> Any:
    return d.find_elements("css selector", "#messages .msg.assistant")[-1]


def reply_text(d: Any) -> str:
    return str(
        d.execute_script(
            "const r = [...document.querySelectorAll('#messages .msg.assistant .content')];"
            "return r.length ? r[r.length - 1].textContent : ''"
        )
    )


def wait_done(d: Any) -> None:
    wait_until(d, lambda d: state(d) in ("done", "error", "stopped"), "the reply never ended")
    assert state(d) == "done", by_id(d, "error").text


def test_the_page_asks_for_the_key_and_sends_it_as_a_bearer_token(
    browser: Any, server: Server
) -> None:
    browser.get(server.url + "/")
    wait_until(browser, lambda d: state(d) == "key", "the page did not ask for the API key")
    assert by_id(browser, "key-dialog").is_displayed()
    assert browser.find_elements("css selector", "#model option") == []
    by_id(browser, "key-input").send_keys("wrong")
    by_id(browser, "key-submit").click()
    wait_until(
        browser,
        lambda d: state(d) == "key" and by_id(d, "key-error").is_displayed(),
        "a wrong key was not refused",
    )
    assert "refused" in by_id(browser, "key-error").text
    by_id(browser, "key-input").send_keys(KEY)
    by_id(browser, "key-submit").click()
    wait_until(browser, lambda d: state(d) == "idle", "the right key was not accepted")
    assert not by_id(browser, "key-dialog").is_displayed()
    _, models = server.get("/v1/models")
    names = [o.text for o in browser.find_elements("css selector", "#model option")]
    assert names == [m["id"] for m in json.loads(models)["data"]]
    # the key lives in the page only: a reload asks again
    browser.refresh()
    wait_until(browser, lambda d: state(d) == "key", "a reloaded page did not ask again")


def test_a_reply_streams_in_with_logprobs_and_the_panel_counts_it(
    browser: Any, server: Server
) -> None:
    open_page(
        browser,
        server,
        temperature=0,
        max_tokens=24,
        logprobs=True,
        extra='{"ignore_eos": true}',
    )
    wait_until(browser, lambda d: by_id(d, "m-gen").text.isdigit(), "the panel never filled")
    generated = int(by_id(browser, "m-gen").text)
    requests = int(by_id(browser, "m-reqs").text)
    send(browser, "Name three colors.")
    wait_done(browser)
    reply = last_reply(browser)
    # event by event (a token whose text is held back sends none, so not one per token)
    assert int(reply.get_attribute("data-chunks")) >= 2
    assert reply_text(browser).strip()
    assert "24 tokens" in reply.text
    tokens = reply.find_elements("css selector", ".tok")
    assert len(tokens) >= 2
    assert all("logprob" in (t.get_attribute("title") or "") for t in tokens)
    # the live panel picks the request up from /metrics
    wait_until(
        browser,
        lambda d: (
            int(d.find_element("id", "m-gen").text) >= generated + 24
            and int(d.find_element("id", "m-reqs").text) >= requests + 1
        ),
        "the panel's counters did not move",
    )
    wait_until(browser, lambda d: by_id(d, "m-ttft").text.startswith("p50"), "no TTFT")
    assert by_id(browser, "m-itl").text.startswith("p50")
    screenshot(browser, "web_ui_logprobs.png")


def test_stop_closes_the_stream_and_the_engine_aborts(browser: Any, server: Server) -> None:
    open_page(browser, server, temperature=0, max_tokens=1900, extra='{"ignore_eos": true}')
    aborted = server.metric("engine_requests_aborted_total")
    send(browser, "Count to a thousand.")
    # text is in the page while the request still has ~1900 tokens to go: it streamed
    wait_until(
        browser,
        lambda d: state(d) == "streaming" and reply_text(d).strip(),
        "no text streamed in",
    )
    by_id(browser, "stop").click()
    wait_until(browser, lambda d: state(d) == "stopped", "Stop did not end the stream")
    wait_for(
        lambda: server.metric("engine_requests_aborted_total") == aborted + 1,
        "the engine did not abort the request",
    )
    server.wait_idle()
    assert server.metric("num_open_requests") == 0
    assert reply_text(browser).strip()  # what arrived stays
    assert by_id(browser, "send").is_enabled() and not by_id(browser, "stop").is_enabled()


def test_json_mode_yields_json_valid_against_the_schema(browser: Any, server: Server) -> None:
    open_page(browser, server, temperature=0, max_tokens=256, json_mode=True)
    schema = json.loads(by_id(browser, "json-schema").get_attribute("value"))
    send(browser, "Describe a parrot.")
    wait_done(browser)
    jsonschema.validate(json.loads(reply_text(browser)), schema)
    assert "valid JSON" in last_reply(browser).text


def test_markup_in_a_reply_is_shown_as_text_and_never_runs(browser: Any, server: Server) -> None:
    payload = '<script>window.pwned = 1</script><img src="x" onerror="window.pwned = 2">'
    # a choice constraint makes the model say exactly this
    extra = json.dumps({"structured_outputs": {"choice": [payload]}})
    open_page(browser, server, temperature=0, max_tokens=100, extra=extra)
    send(browser, "Say something.")
    wait_done(browser)
    assert reply_text(browser) == payload
    assert browser.execute_script("return window.pwned") is None
    assert browser.find_elements("css selector", "#messages script, #messages img") == []


def test_a_tool_call_is_shown_as_a_call(browser: Any, server: Server) -> None:
    open_page(
        browser, server, temperature=0, max_tokens=100, tool_mode=True, tool_choice="required"
    )
    wait_until(browser, lambda d: by_id(d, "m-reqs").text.isdigit(), "the panel never filled")
    requests = int(by_id(browser, "m-reqs").text)
    send(browser, "What is the weather in Paris?")
    wait_done(browser)
    call = last_reply(browser).find_element("css selector", ".tool-call")
    assert call.find_element("css selector", ".name").text == "get_weather"
    args = call.find_element("css selector", ".args").text
    assert isinstance(json.loads(args[1:-1])["city"], str)
    assert "tool_calls" in last_reply(browser).text
    # the result form sends the call's answer back and the model replies to it
    call.find_element("css selector", "input").send_keys("sunny, 21 C")
    call.find_element("css selector", "button").click()
    wait_until(
        browser,
        lambda d: (
            len(d.find_elements("css selector", "#messages .msg.assistant")) == 2
            and state(d) in ("done", "error")
        ),
        "no reply to the tool result",
    )
    assert state(browser) == "done", by_id(browser, "error").text
    # an artifact for people to look at: the page after a chat, panel filled in
    wait_until(
        browser,
        lambda d: (
            int(d.find_element("id", "m-reqs").text) >= requests + 2
            and d.find_element("id", "m-running").text == "0"
        ),
        "the panel did not catch up",
    )
    screenshot(browser, "web_ui.png")
