"""Structured output through the official ``openai`` client against a real server:
``response_format``, ``.parse()`` with pydantic models, vLLM's ``structured_outputs``,
and the 400s for what cannot compile. Every output is checked with ``jsonschema``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("--max-model-len", "1024") as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client: openai.OpenAI, model: str, **kw: Any) -> Any:
    kw = {"max_tokens": 120, "temperature": 0, **kw}
    return client.chat.completions.create(model=model, messages=ASK, **kw)


def test_json_schema_strict_and_not(client: openai.OpenAI, model: str) -> None:
    for strict in (True, False):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": strict},
        }
        out = chat(client, model, response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_json_object(client: openai.OpenAI, model: str) -> None:
    out = chat(client, model, response_format={"type": "json_object"}, max_tokens=60)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert out.choices[0].message.content.startswith("{")


class Color(StrEnum):
    red = "red"
    green = "green"


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    legs: int = pydantic.Field(ge=0, le=8)
    color: Color


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    pets: list[Pet] = pydantic.Field(max_length=2)


def test_parse_with_nested_pydantic_models(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "An owner and pets."}],
        response_format=Owner,
        max_tokens=200,
        temperature=0,
    )
    owner = out.choices[0].message.parsed
    assert isinstance(owner, Owner) and len(owner.pets) <= 2
    assert all(0 <= p.legs <= 8 for p in owner.pets)


def test_streamed_sampled_and_n2_outputs_are_valid(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=120,
        temperature=0,  # type: ignore[call-overload]
        response_format=fmt,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    out = chat(client, model, response_format=fmt, temperature=1.0, n=2, seed=3)
    for choice in out.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_structured_outputs_choice_and_regex(client: openai.OpenAI, model: str) -> None:
    out = chat(client, model, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")
    out = chat(client, model, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.choices[0].message.content)


def test_structured_completion(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = client.completions.create(
        model=model,
        prompt="A person: ",
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nosuch"}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"$ref": "#/$defs/missing"}},
                        },
                    },
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: nosuchrule"}}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_400_and_the_server_goes_on(
    client: openai.OpenAI, model: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, extra_body=body)
    assert e.value.body["param"] == param  # type: ignore[index]
    assert chat(client, model, max_tokens=2).choices[0].finish_reason == "length"


def test_pathological_schema_is_answered(client: openai.OpenAI, model: str) -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for depth in range(60):  # deeply nested oneOf (one reference per level: linear in size)
        schema = {
            "oneOf": [
                {"type": "array", "items": schema},
                {"type": "array", "maxItems": depth},
                {"type": "integer", "maximum": depth},
            ]
        }
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    try:
        out = chat(client, model, response_format=fmt, max_tokens=8)
        assert out.choices[0].finish_reason in ("stop", "length")
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format"  # type: ignore[index]
    assert chat(client, model, max_tokens=2).choices[0].finish_reason == "length"


def test_embeddings_refused_on_a_generate_server(client: openai.OpenAI, model: str) -> None:
    """(This module's server is a plain generate server: one runner per server.)"""
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input="hi")
    assert e.value.body["message"] == "The model does not support Embeddings API"  # type: ignore[index]
