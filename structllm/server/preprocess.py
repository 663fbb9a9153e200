"""Requests -> prompt token ids: chat template, tokenization and the prompt checks.

Synchronous and CPU-bound (a 2 MB prompt takes seconds to tokenize), so the app runs
every call here in a bounded worker pool, never on the event loop. Text that could not
fit in the context even if every token were the vocabulary's longest is refused before
it is tokenized. A chat prompt's images arrive as bytes (``vision.Vision.load``) and are
decoded here (``images.decode_image``), hashed, expanded into the model's image tokens
and located in the token ids (``multimodal.prompt``). With gpt-oss's harmony format
(``harmony``: ``--tool-call-parser openai`` or ``--reasoning-parser openai_gptoss``) the
prompt is ``structllm.harmony.chat``'s, not the chat template's.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from structllm import reasoning, structured, tools
from structllm.harmony import chat as harmony_chat
from structllm.harmony.render import encode_parts
from structllm.multimodal import prompt as image_prompt
from structllm.multimodal.processor import ImageProcessor
from structllm.protocol import ImageInput, Reasoning, StructuredOutputs
from structllm.server.errors import APIError
from structllm.server.images import DEFAULT_MAX_PIXELS, ImageError, content_hash, decode_image
from structllm.server.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    chat_messages,
    check_token_ids,
    template_kwargs,
)
from structllm.tokenizer import Tokenizer
from structllm.trace import OFF, Tracer

if TYPE_CHECKING:  # Pillow's type only
    from PIL.Image import Image


HARMONY_PARSER = "openai_gptoss"  # vLLM's name of gpt-oss's reasoning parser


class Preprocessor:
    """Bound to one tokenizer and the engine's limits (``max_model_len``, None before an
    engine is ready; ``vocab_size``, which may exceed the tokenizer's). Each method
    raises ``APIError`` (400) naming the field on bad input."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int | None,
        vocab_size: int,
        tool_format: tools.Format | None = None,
        tracer: Tracer = OFF,
        reasoning_parser: str | None = None,
        image_processor: ImageProcessor | None = None,
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.max_image_pixels = max_image_pixels
        self.tracer = tracer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # gpt-oss's harmony: its own prompt, and one parser for reasoning and calls
        self.harmony = tool_format == "openai" or reasoning_parser == HARMONY_PARSER
        # how tool calls are prompted and parsed: from the chat template unless given
        self.tool_format: tools.Format = (
            "openai"
            if self.harmony
            else tool_format or tools.detect_format(tokenizer.meta.chat_template)
        )
        self.reasoning_parser = None if self.harmony else reasoning_parser
        self.reasoning_tags = reasoning.tags_of(self.reasoning_parser or "")
        # the reasoning's end tag as the engine will see it generated (harmony's
        # constraint start: harmony.sampling)
        self.reasoning_end = (
            tokenizer.encode(self.reasoning_tags.end, add_special_tokens=False)
            if self.reasoning_parser
            else []
        )
        tokenizer.min_tokens_for("")  # measure the vocabulary now, not in a request

    @property
    def grammar_tokenizer(self) -> structured.llg.LLTokenizer:
        """llguidance's view of the tokenizer, as the engine builds it (so a grammar that
        validates here builds there); made on first use, in a worker thread, and cached."""
        tok = self.tokenizer
        return structured.load_tokenizer(
            tok.path, tuple(tok.eos_token_ids), max(self.vocab_size, tok.vocab_size)
        )

    def tool_request(self, req: ChatCompletionRequest) -> tools.ToolRequest | None:
        """The request's tools, checked for shape (cheap; ``constraint`` compiles their
        schemas). ``None`` without tools."""
        try:
            return tools.tool_request(
                req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_format
            )
        except tools.ToolError as e:
            raise APIError(400, str(e), param=e.param) from None

    def chat(
        self,
        req: ChatCompletionRequest | TokenizeRequest,
        tool_req: tools.ToolRequest | None = None,
        trace_id: str = "",
        media: Sequence[bytes] = (),
    ) -> list[int]:
        """The prompt's token ids; with ``trace_id``, ``rendered`` and ``tokenized``
        are traced under it."""
        return self.chat_prompt(req, tool_req, trace_id, media)[1]

    def chat_prompt(
        self,
        req: ChatCompletionRequest | TokenizeRequest,
        tool_req: tools.ToolRequest | None = None,
        trace_id: str = "",
        media: Sequence[bytes] = (),
    ) -> tuple[str, list[int], list[ImageInput]]:
        """``chat``, with the rendered prompt's text and its images (``media``: the
        bytes of its image parts in order, ``requests.image_urls``)."""
        assert req.messages is not None
        if self.harmony:
            return self.harmony_prompt(req, tool_req, trace_id, media)
        messages, variables = tools.prompt_messages(
            chat_messages(req.messages), tool_req, self.tool_format
        )
        kwargs = template_kwargs(req)

        def template(msgs: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=req.add_generation_prompt, **kwargs, **variables
            )

        images = self.decode_images(media)
        proc = self.image_processor
        try:
            if images:
                assert proc is not None, "vision.Vision.check refuses images for a text model"
                text = image_prompt.expand(
                    image_prompt.render(template, messages, proc), proc, images
                )
            else:
                text = template(messages)
        except ValueError as e:  # ChatTemplateError, or the placeholders do not add up
            raise APIError(400, str(e), param="messages") from None
        self.tracer.event("rendered", trace_id, chars=len(text))
        ids = self.encode(text, add_special_tokens=False, param="messages")
        self.tracer.event("tokenized", trace_id, tokens=len(ids))
        if not images:
            return text, ids, []
        assert proc is not None
        digests = [content_hash(im, proc.settings) for im in images]
        try:
            return text, ids, image_prompt.spans(ids, proc, images, digests)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    def harmony_prompt(
        self,
        req: ChatCompletionRequest | TokenizeRequest,
        tool_req: tools.ToolRequest | None,
        trace_id: str,
        media: Sequence[bytes],
    ) -> tuple[str, list[int], list[ImageInput]]:
        """``chat_prompt`` in the harmony format (today's date in UTC, the request's
        ``reasoning_effort``); gpt-oss reads no images."""
        assert req.messages is not None
        if media:
            raise APIError(400, "this model takes no images", param="messages")
        offered = tool_req.tools if tool_req is not None and tool_req.calls_allowed else []
        effort = req.reasoning_effort if isinstance(req, ChatCompletionRequest) else None
        today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        try:
            parts = harmony_chat.prompt_parts(chat_messages(req.messages), offered, effort, today)
        except ValueError as e:
            param = "reasoning_effort" if "reasoning_effort" in str(e) else "messages"
            raise APIError(400, str(e), param=param) from None
        if not req.add_generation_prompt:  # the conversation alone
            parts = parts[:-2]  # (without <|start|>assistant)
        text = "".join(parts)
        self.tracer.event("rendered", trace_id, chars=len(text))
        self.check_fits(text, "messages")
        tok = self.tokenizer
        try:  # (a marker spelled in a message's text stays text)
            ids = encode_parts(parts, tok.token_id, tok.encode_plain)
        except Exception as e:  # e.g. lone surrogates from JSON escapes
            raise APIError(400, f"the text cannot be tokenized: {e}", param="messages") from None
        self.tracer.event("tokenized", trace_id, tokens=len(ids))
        return text, ids, []

    def decode_images(self, media: Sequence[bytes]) -> list[Image]:
        out = []
        for i, data in enumerate(media):
            try:
                out.append(decode_image(data, self.max_image_pixels))
            except ImageError as e:
                raise APIError(
                    400,
                    f"image {i + 1} of {len(media)}: {e}",
                    param="messages",
                    code="invalid_image",
                ) from None
        return out

    def reasoning(self, prompt: str) -> tuple[reasoning.Mode, Reasoning | None] | None:
        """With a reasoning parser: where the output of the chat ``prompt`` (its text)
        starts, and what the engine is told of it; ``None`` without a parser."""
        if self.reasoning_parser is None:
            return None  # (harmony: harmony.sampling)
        return (
            reasoning.mode_for(self.reasoning_parser, prompt),
            reasoning.engine_spec(prompt, self.reasoning_end, self.reasoning_tags),
        )

    def completion(self, req: CompletionRequest, trace_id: str = "") -> list[list[int]]:
        """The request's prompts (``prompt`` is a string, a list of strings, a list of
        token ids or a list of token-id lists), each non-empty and in the vocabulary."""
        out = []
        for p in _prompt_items(req.prompt):
            ids = self.encode(p) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "prompt must not be empty", param="prompt")
            check_token_ids(ids, self.vocab_size, "prompt")
            out.append(ids)
        self.tracer.event("tokenized", trace_id, tokens=sum(len(ids) for ids in out))
        return out

    def constraint(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        tool_req: tools.ToolRequest | None = None,
    ) -> StructuredOutputs | None:
        """The output constraint of ``response_format``, vLLM's ``structured_outputs``
        or the tools (at most one of them), compiled once to check it (bounded by
        ``structured.LIMITS``): a 400 naming the field if it is unknown, malformed or
        does not compile."""
        if tool_req is not None:
            return self.tool_constraint(req, tool_req)
        spec, field = None, None
        if req.structured_outputs is not None:
            try:
                spec = msgspec.convert(req.structured_outputs, StructuredOutputs)
            except (msgspec.ValidationError, ValueError) as e:
                raise APIError(
                    400, f"structured_outputs: {e}", param="structured_outputs"
                ) from None
        try:
            from_format = structured.response_format_spec(req.response_format)
        except structured.GrammarError as e:
            raise APIError(400, str(e), param="response_format") from None
        if from_format is not None:
            if spec is not None:
                raise APIError(
                    400,
                    "give response_format or structured_outputs, not both",
                    param="response_format",
                )
            spec, field = from_format, f"response_format.{from_format.kind}"
            if from_format.kind == "json":
                field = "response_format.json_schema.schema"
        if spec is None:
            return None
        error = structured.validate(spec, self.grammar_tokenizer, field=field)
        if error is not None:
            raise APIError(400, error, param=(field or "structured_outputs").split(".")[0])
        return spec

    def tool_constraint(
        self, req: ChatCompletionRequest | CompletionRequest, tool_req: tools.ToolRequest
    ) -> StructuredOutputs | None:
        error = tools.validate_tools(tool_req.tools, self.grammar_tokenizer)
        if error is not None:
            raise APIError(400, error, param="tools")
        if self.harmony and tool_req.forced:  # as vLLM's gpt-oss path
            raise APIError(
                400,
                f"tool_choice {tool_req.choice!r} is not supported with gpt-oss's harmony "
                'format; use "auto" (or "none")',
                param="tool_choice",
            )
        if self.harmony:  # calls are free: the request's own constraint, if any, applies
            return self.constraint(req)
        spec = tools.constraint(tool_req)
        if tool_req.calls_allowed and (
            req.response_format is not None or req.structured_outputs is not None
        ):
            fmt = req.response_format or {}
            if spec is not None or fmt.get("type") != "text":
                raise APIError(
                    400,
                    "response_format and structured_outputs cannot be combined with tools unless "
                    'tool_choice is "none"',
                    param="response_format",
                )
        if not tool_req.calls_allowed:
            return self.constraint(req)
        if spec is not None and (
            error := structured.validate(spec, self.grammar_tokenizer, field="tools")
        ):
            raise APIError(400, error, param="tools")
        return spec  # tool_choice none: the reply may still be constrained

    def tokenize(self, req: TokenizeRequest, media: Sequence[bytes] = ()) -> list[int]:
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            return self.chat(req, media=media)
        assert req.prompt is not None
        return self.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    def detokenize(self, ids: list[int]) -> str:
        check_token_ids(ids, self.vocab_size, "tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        self.check_fits(text, param)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # e.g. lone surrogates from JSON escapes
            raise APIError(400, f"the text cannot be tokenized: {e}", param=param) from None

    def check_fits(self, text: str, param: str) -> None:
        """400 (``context_length_exceeded``) for text that cannot fit in the context even
        if every token were the vocabulary's longest."""
        least = self.tokenizer.min_tokens_for(text)
        if self.max_model_len is not None and least >= self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"{param} has at least {least} tokens",
                param=param,
                code="context_length_exceeded",
            )


def _prompt_items(prompt: str | list[Any]) -> list[Any]:
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        items: list[Any] = [prompt]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        items = list(prompt)
    else:
        raise APIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            param="prompt",
        )
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return items
