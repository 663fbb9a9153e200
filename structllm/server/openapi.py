"""The OpenAPI description of the server, from the request Structs."""

from __future__ import annotations

from typing import Any

import msgspec

from structllm.server.embeddings import EmbeddingRequest
from structllm.server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from structllm.server.responses_api import ResponsesRequest
from structllm.server.scores import RerankRequest, ScoreRequest


def openapi_document(version: str) -> dict[str, Any]:
    """OpenAPI 3.1 description of the server (request bodies from the Structs above)."""
    bodies = {
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
        "/v1/responses": ResponsesRequest,
        "/v1/embeddings": EmbeddingRequest,
        "/score": ScoreRequest,
        "/rerank": RerankRequest,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
    }
    schemas, components = msgspec.json.schema_components(
        list(bodies.values()), ref_template="#/components/schemas/{name}"
    )
    error = {
        "description": "OpenAI error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    components["Error"] = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
    ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
    paths: dict[str, Any] = {}
    for (path, _), schema in zip(bodies.items(), schemas, strict=True):
        paths[path] = {
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                },
                "responses": {
                    "200": ok,
                    "400": error,
                    "401": error,
                    "404": error,
                    "413": error,
                    "503": error,
                },
            }
        }
    # the last four: what routers in front of replicas read (SGLang's names)
    for path in (
        "/v1/models",
        "/health",
        "/version",
        "/health_generate",
        "/get_load",
        "/get_model_info",
        "/get_server_info",
    ):
        paths[path] = {"get": {"responses": {"200": ok, "503": error}}}
    paths["/v1/models/{model}"] = {
        "get": {
            "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {"200": ok, "404": error},
        }
    }
    response_id = [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    stored = {"parameters": response_id, "responses": {"200": ok, "404": error}}
    paths["/v1/responses/{response_id}"] = {"get": stored, "delete": stored}
    paths["/v1/responses/{response_id}/input_items"] = {"get": stored}
    paths["/v1/responses/{response_id}/cancel"] = {
        "post": {"parameters": response_id, "responses": {"200": ok, "400": error, "404": error}}
    }
    paths["/metrics"] = {
        "get": {
            "responses": {"200": {"description": "Prometheus text", "content": {"text/plain": {}}}}
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "structllm", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
