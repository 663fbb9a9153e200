"""The generation endpoints, ``/v1/chat/completions`` and ``/v1/completions``, and the chat
path's preparation (images, template, tokens, constraint, context, sampling) that
``/v1/responses`` reuses through ``App.chat_sequences``.

They run over the app's ``GenerationPipeline`` (``server/pipeline.py``), so this module
does not import ``app.py``; the app routes to these functions and stays routing plus
the lifecycle handlers.
"""

from __future__ import annotations

import msgspec

from structllm.client import EngineClient
from structllm.harmony.parser import HarmonyParser
from structllm.harmony.sampling import for_harmony
from structllm.output import SequenceState, fan_out
from structllm.protocol import LoraRef, StructuredOutputs
from structllm.server import requests as rq
from structllm.server.errors import APIError
from structllm.server.pipeline import GenerationPipeline, Receive, Scope, Send
from structllm.server.responses import ChatBuilder, TextBuilder
from structllm.tools import ToolRequest


async def chat_completions(
    app: GenerationPipeline, scope: Scope, receive: Receive, send: Send
) -> None:
    response_id = ChatBuilder.new_id()
    app.tracer.event("received", response_id, path="/v1/chat/completions")
    req = rq.decode_body(await app.read_body(receive), rq.ChatCompletionRequest)
    lora = app.check_model(req.model)
    client = app.generating_engine("Chat Completions")
    seqs = with_adapter(await chat_sequences(app, req, response_id, "chat", client), lora)
    builder = ChatBuilder(
        seqs,
        app.tokenizer,
        model=app.model_name if lora is None else lora.name,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
        prompt_logprobs=req.prompt_logprobs is not None,
        response_id=response_id,
    )
    await app.generate(receive, send, client, seqs, builder)


async def chat_sequences(
    app: GenerationPipeline,
    req: rq.ChatCompletionRequest,
    response_id: str,
    kind: str,
    client: EngineClient,
) -> list[SequenceState]:
    """The chat path's preparation (``pipeline.ChatPipeline``): images, template,
    tokens, constraint, context, sampling; one sequence per choice."""
    rq.check_priority(req.priority, app.config.engine.scheduling_policy)
    pre = app.pre
    tools = pre.tool_request(req)
    media = await app.vision.load(rq.image_urls(req.messages), "messages")
    text, ids, images = await app.in_worker(pre.chat_prompt, req, tools, response_id, media)
    constraint = await app.constraint(req, tools)
    requested, param = rq.requested_max_tokens(req)
    max_tokens = rq.max_tokens_for([len(ids)], requested, param, client.ready.max_model_len)
    new_id = client.new_request_id
    if pre.harmony:
        return harmony_sequences(app, req, ids, max_tokens, constraint, tools, client, kind)
    mode, reasoning = pre.reasoning(text) or (None, None)
    sp = rq.sampling_params(
        req, max_tokens, client.ready.vocab_size, constraint, reasoning, app.sampling_defaults
    )
    return fan_out(
        [ids],
        sp,
        app.tokenizer,
        lambda _p, _j: new_id(kind),
        tools,
        mode,
        [images],
        req.priority,
        reasoning_tags=pre.reasoning_tags,
    )


def harmony_sequences(
    app: GenerationPipeline,
    req: rq.ChatCompletionRequest,
    ids: list[int],
    max_tokens: int,
    constraint: StructuredOutputs | None,
    tools: ToolRequest | None,
    client: EngineClient,
    kind: str,
) -> list[SequenceState]:
    """The chat path's sequences for gpt-oss's harmony format: ``reasoning_effort``
    went into the prompt; ``<|call|>`` and ``<|return|>`` end the reply; one
    ``HarmonyParser`` per sequence (``structllm.harmony``)."""
    req = msgspec.structs.replace(req, reasoning_effort=None)  # rendered, not sampled
    vocab = client.ready.vocab_size
    sp = rq.sampling_params(req, max_tokens, vocab, constraint, None, app.sampling_defaults)
    sp = for_harmony(sp, app.tokenizer)
    names = frozenset(t["function"]["name"] for t in tools.tools) if tools else frozenset()
    allowed = tools is not None and tools.calls_allowed

    def parser() -> HarmonyParser:
        return HarmonyParser(names, allowed)

    new_id = client.new_request_id
    return fan_out(
        [ids],
        sp,
        app.tokenizer,
        lambda _p, _j: new_id(kind),
        priority=req.priority,
        harmony=parser,
    )


async def completions(app: GenerationPipeline, scope: Scope, receive: Receive, send: Send) -> None:
    response_id = TextBuilder.new_id()
    app.tracer.event("received", response_id, path="/v1/completions")
    req = rq.decode_body(await app.read_body(receive), rq.CompletionRequest)
    lora = app.check_model(req.model)
    rq.check_priority(req.priority, app.config.engine.scheduling_policy)
    client = app.generating_engine("Completions")
    prompts = await app.in_worker(app.pre.completion, req, response_id)
    if len(prompts) * req.n > rq.MAX_SEQUENCES:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={req.n} exceeds {rq.MAX_SEQUENCES} sequences per request",
            param="prompt",
        )
    constraint = await app.constraint(req)
    requested, param = rq.requested_max_tokens(req)
    max_tokens = rq.max_tokens_for(
        [len(p) for p in prompts], requested, param, client.ready.max_model_len
    )
    sp = rq.sampling_params(
        req, max_tokens, client.ready.vocab_size, constraint, None, app.sampling_defaults
    )
    new_id = client.new_request_id
    seqs = fan_out(
        prompts, sp, app.tokenizer, lambda _pi, _j: new_id("text"), priority=req.priority
    )
    with_adapter(seqs, lora)
    builder = TextBuilder(
        seqs,
        app.tokenizer,
        model=app.model_name if lora is None else lora.name,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
        echo=req.echo,
        prompt_logprobs=req.prompt_logprobs is not None,
        response_id=response_id,
    )
    await app.generate(receive, send, client, seqs, builder)


def with_adapter(seqs: list[SequenceState], lora: LoraRef | None) -> list[SequenceState]:
    """``seqs``, each set to run with ``lora``."""
    for seq in seqs:
        seq.lora = lora
    return seqs
