"""The official ``openai`` client against a real ``structllm run``: the default model
with one front end and with two, and three replicas of a tiny random-weight model (on
127.0.0.2-4, as if three hosts) behind ``vllm-router``'s cache-aware policy (the fleet
``test_router.py`` uses, ``tests/e2e/conftest.py``). Through the router, the
client-level checks go to the router's URL; the HTTP-level ones (raw bodies,
``/tokenize``, auth, routes) still ask the first replica, since the router answers some
bad input itself (pinned and documented in ``test_router.py``). The few checks that need
a trained model's answers (a stop string it is sure to write, a right continuation
scoring above a wrong one) run on the default model's deployments only."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import anyio
import openai
import pytest

from tests.e2e.conftest import FLEET_KEY
from tests.support.server import Server

pytestmark = pytest.mark.slow
KEY = FLEET_KEY
MESSAGES = [{"role": "user", "content": "List three fruits."}]
DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1"


@dataclass
class Deployment:
    server: Server  # the one the HTTP-level checks ask
    url: str  # the one the OpenAI client talks to
    trained: bool  # the default model (not the router fleet's random weights)


@pytest.fixture(
    scope="module",
    params=["1", "2", "router"],
    ids=["one-front-end", "two-front-ends", "router-three-tiny-replicas"],
)
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    if request.param != "router":
        with Server(
            "--max-model-len", "1024", "--api-server-count", request.param, api_key=KEY
        ) as s:
            yield Deployment(s, s.url, True)
            assert s.stop() == 0
        return
    # the router passes the client's Authorization on for some routes only (not
    # GET /v1/models/{id}); its --api-key is what it sends the replicas
    servers, router = request.getfixturevalue("tiny_fleet")
    yield Deployment(servers[0], router.url, False)


@pytest.fixture(scope="module")
def server(deployment: Deployment) -> Server:
    return deployment.server


@pytest.fixture(scope="module")
def url(deployment: Deployment) -> str:
    return deployment.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(
    client: openai.OpenAI, model: str, deployment: Deployment
) -> None:
    if deployment.trained:
        assert model == DEFAULT_MODEL
    else:
        assert model.startswith("tiny-qwen3-")


def test_models_retrieve_and_unknown_model(client: openai.OpenAI, model: str) -> None:
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_chat_completion_with_exact_usage(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=24, logprobs=True
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    _, tok = server.post("/tokenize", {"messages": MESSAGES})
    assert r.usage is not None
    assert r.usage.prompt_tokens == tok["count"]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert r.usage.completion_tokens == len(choice.logprobs.content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_equals_non_streamed_greedy(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=40
    )
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=0, max_tokens=40, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_streamed_completion_equals_non_streamed_with_usage_chunk(
    client: openai.OpenAI, model: str
) -> None:
    prompt = "The three primary colors are"
    full = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=20)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=prompt,
            temperature=0,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert full.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(
    server: Server, model: str
) -> None:
    """vLLM's ``continuous_usage_stats``: each chunk carries the usage so far, so a client
    can count the tokens of every delivery (several with speculative decoding). Asked of
    a structllm server itself: the router forwards only ``include_usage``."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    full = client.completions.create(model=model, prompt="Once", temperature=0, max_tokens=12)
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Once",
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options=opts,  # type: ignore[typeddict-unknown-key]
        )
    )
    assert full.usage is not None
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(counts) == len(chunks)  # every chunk
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in chunks if c.usage)
    chat = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options=opts,  # type: ignore[typeddict-unknown-key]
        )
    )
    assert all(c.usage is not None for c in chat)


def test_n_completions_have_distinct_indices(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, n=3, temperature=1.0, seed=3, max_tokens=16
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage is not None and r.usage.completion_tokens >= 3


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model, prompt="Paris is the capital of", temperature=0, max_tokens=5, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.token_logprobs is not None
        and lp.top_logprobs is not None
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs if v is not None)


def test_chat_top_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy takes the most likely
        assert bytes(item.bytes or []).decode(errors="replace") == item.token


def test_stop_string_cuts_the_text(
    client: openai.OpenAI, model: str, deployment: Deployment
) -> None:
    prompt = "1, 2, 3, 4,"
    full = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=20
    ).choices[0]
    if deployment.trained:
        assert " 7," in full.text
        stop = " 7"
    else:  # random weights: a piece of what it writes, from the middle on
        middle = len(full.text) // 2
        stop = full.text[middle : middle + 3]
        assert stop.strip()
    cut = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=20, stop=[stop]
    ).choices[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop"


def test_seed_reproducibility(client: openai.OpenAI, model: str) -> None:
    def run(seed: int) -> str:
        r = client.completions.create(
            model=model, prompt="Once upon a time", temperature=1.0, max_tokens=20, seed=seed
        )
        return r.choices[0].text

    assert run(11) == run(11)
    assert len({run(s) for s in (1, 2, 3)}) > 1


def test_token_id_and_batched_prompts(client: openai.OpenAI, model: str, server: Server) -> None:
    _, tok = server.post("/tokenize", {"prompt": "Hello there"})
    by_text = client.completions.create(
        model=model, prompt="Hello there", temperature=0, max_tokens=6
    )
    by_ids = client.completions.create(
        model=model, prompt=tok["tokens"], temperature=0, max_tokens=6
    )
    assert by_text.choices[0].text == by_ids.choices[0].text
    batch = client.completions.create(
        model=model, prompt=["Hello there", "Good morning"], temperature=0, max_tokens=6
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text


def test_echo_returns_the_prompt_first(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model, prompt="Roses are red,", temperature=0, max_tokens=5, echo=True
    )
    assert r.choices[0].text.startswith("Roses are red,")


def test_streamed_echo_survives_a_held_back_first_token(client: openai.OpenAI, model: str) -> None:
    # A stop string that starts with the first generated text makes the detokenizer hold
    # that text back, so the first delta sends nothing; the prompt must still go first.
    args = dict(model=model, prompt="Roses are red,", temperature=0, max_tokens=6)
    plain = client.completions.create(**args)  # type: ignore[call-overload]
    first_text = client.completions.create(**{**args, "max_tokens": 1}).choices[0].text  # type: ignore[call-overload]
    assert first_text and plain.choices[0].text.startswith(first_text)
    stream = client.completions.create(**args, echo=True, stream=True, stop=[first_text + "\u2603"])  # type: ignore[call-overload]
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == "Roses are red," + plain.choices[0].text


def test_async_client_streams(url: str, model: str) -> None:
    async def main() -> str:
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        parts = []
        stream = await aclient.chat.completions.create(
            model=model, messages=MESSAGES, temperature=0, max_tokens=20, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        await aclient.close()
        return "".join(parts)

    sync = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    want = (
        sync.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=20)
        .choices[0]
        .message.content
    )
    assert anyio.run(main) == want


# -- errors: each is followed by a request that succeeds -----------------------------------


def ok(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="Hi", temperature=0, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ("{not json", 400, None),
        ('{"messages": "hello"}', 400, "messages"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages"),
        ('{"messages": [{"role": "user", "content": "x"}], "temperature": 5}', 400, "temperature"),
        ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400, "max_tokens"),
        ('{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', 400, "top_p"),
        ('{"messages": [{"role": "user", "content": "x"}], "n": 1000}', 400, "n"),
        (
            '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}',
            400,
            "top_logprobs",
        ),
        ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}', 400, "max_tokens"),
        ('{"messages": []}', 400, "messages"),
        ('{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "messages"),
        ("[]", 400, None),
    ],
)
def test_bad_chat_requests_get_openai_errors(
    server: Server, client: openai.OpenAI, model: str, body: str, status: int, param: str | None
) -> None:
    code, data = server.request("POST", "/v1/chat/completions", raw=body.encode())
    import json

    err = json.loads(data)["error"]
    assert code == status
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok(client, model)


def test_prompt_longer_than_max_model_len(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * 1100, max_tokens=5)
    assert e.value.status_code == 400 and "maximum context length" in str(e.value)
    ok(client, model)


def test_token_ids_outside_the_vocabulary(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=model, prompt=[1, 2, 10**7], max_tokens=5)
    ok(client, model)


def test_missing_or_wrong_api_key(server: Server, client: openai.OpenAI, model: str) -> None:
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "x", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    code, _ = server.request("GET", "/v1/models", headers={"authorization": ""})
    assert code == 401
    code, _ = server.request("GET", "/health", headers={"authorization": ""})
    assert code == 200  # health is open
    ok(client, model)


def test_unknown_route_and_method(server: Server, client: openai.OpenAI, model: str) -> None:
    assert server.get("/v1/nope")[0] == 404
    assert server.get("/v1/chat/completions")[0] == 405
    ok(client, model)


def test_tokenize_detokenize_version(server: Server) -> None:
    code, tok = server.post("/tokenize", {"prompt": "Hello world"})
    assert code == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    code, detok = server.post("/detokenize", {"tokens": tok["tokens"]})
    assert code == 200 and detok["prompt"] == "Hello world"
    code, body = server.get("/version")
    assert code == 200 and b"version" in body
    assert server.post("/detokenize", {"tokens": [-5]})[0] == 400


# -- scoring and logits control (#14) --------------------------------------------------


def test_echo_logprobs_with_max_tokens_zero_scores_the_prompt(
    client: openai.OpenAI, model: str
) -> None:
    prompt = "The capital city of France is Paris"
    out = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    [choice] = out.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert (
        lp is not None
        and lp.token_logprobs is not None
        and lp.tokens is not None
        and lp.top_logprobs is not None
    )
    assert "".join(lp.tokens) == prompt and len(lp.token_logprobs) == out.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(
        x is not None and x <= 0 for x in lp.token_logprobs[1:]
    )
    assert lp.top_logprobs[0] is None and all(
        t is not None and len(t) >= 2 for t in lp.top_logprobs[1:]
    )


def test_a_right_continuation_scores_above_a_wrong_one(
    client: openai.OpenAI, model: str, deployment: Deployment
) -> None:
    if not deployment.trained:
        pytest.skip("needs a trained model (runs on the default model's deployments)")

    def score(text: str) -> float:
        out = client.completions.create(
            model=model, prompt=text, echo=True, logprobs=0, max_tokens=0
        )
        lps = out.choices[0].logprobs
        assert lps is not None and lps.token_logprobs is not None
        return float(lps.token_logprobs[-1] or 0.0)  # the last token: " Paris" or " Banana"

    assert score("The capital city of France is Paris") > score(
        "The capital city of France is Banana"
    )


def test_vllm_prompt_logprobs_on_chat(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=1,  # type: ignore[arg-type]
        extra_body={"prompt_logprobs": 1},
    )
    plp = out.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert out.usage is not None and len(plp) == out.usage.prompt_tokens
    assert plp[0] is None and all(isinstance(e, dict) and e for e in plp[1:])


def token_ids(client: openai.OpenAI, text: str) -> list[int]:
    out = client.post(
        "/../tokenize", body={"prompt": text, "add_special_tokens": False}, cast_to=object
    )
    return list(out["tokens"])  # type: ignore[index]


def first_token(client: openai.OpenAI, model: str, **kw: object) -> str:
    out = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=1, temperature=0, **kw
    )  # type: ignore[call-overload]
    return str(out.choices[0].text)


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, model: str) -> None:
    greedy = first_token(client, model)
    [greedy_id] = token_ids(client, greedy)
    assert first_token(client, model, logit_bias={str(greedy_id): -100}) != greedy
    zebra = token_ids(client, " zebra")[0]  # not what the model would say here
    forced = first_token(client, model, logit_bias={str(zebra): 100})
    assert forced != greedy and token_ids(client, forced) == [zebra]


@pytest.mark.parametrize("bias", [{"49152000": 1}, {"5": 101}, {"five": 1}])
def test_bad_logit_bias_is_400_and_the_server_goes_on(
    client: openai.OpenAI, model: str, bias: dict[str, float]
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", max_tokens=1, logit_bias=bias)  # type: ignore[arg-type]
    assert e.value.body["param"] == "logit_bias"  # type: ignore[index]
    assert (
        client.completions.create(model=model, prompt="Hi", max_tokens=1).choices[0].finish_reason
    )
