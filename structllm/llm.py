"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

Runs the same ``EngineCore`` that the server drives, in this process, and the same
detokenizer and stop-string handling as the front end.
"""

from __future__ import annotations

import datetime
import itertools
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import msgspec

from structllm.config import EngineConfig, hf_overrides, pooler_config, speculative_config
from structllm.embeddings import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    pairs,
    pool,
    truncate,
    vector,
)
from structllm.engine.core import EngineCore
from structllm.harmony import chat as harmony_chat
from structllm.harmony import uses_harmony
from structllm.harmony.parser import HarmonyParser
from structllm.harmony.render import encode_parts
from structllm.harmony.sampling import for_harmony
from structllm.lora import LoRARequest, read_adapter
from structllm.model.files import generation_defaults, model_path
from structllm.model.loader import prepare_model
from structllm.multimodal.mmproj import pair_processor
from structllm.multimodal.processor import ImageProcessor
from structllm.multimodal.registry import processor_for
from structllm.output import SequenceState, fan_out
from structllm.protocol import (
    AddRequest,
    ImageInput,
    LoraRef,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)
from structllm.reasoning import Mode, check_parser, engine_spec, mode_for, tags_of
from structllm.server.images import DEFAULT_MAX_PIXELS
from structllm.tokenizer import Message, Tokenizer, check_template_kwargs
from structllm.tools import (
    ToolCall,
    ToolError,
    ToolRequest,
    constraint,
    detect_format,
    format_named,
    prompt_messages,
    tool_request,
)

Prompt: TypeAlias = str | Sequence[int] | Sequence[Message]
"""A text prompt, a list of token ids, or a chat (a list of ``{"role", "content"}``)."""


class CompletionOutput(msgspec.Struct):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    tool_calls: list[ToolCall] | None = None  # ``LLM.chat`` with tools: the calls the text holds
    # ``LLM.chat`` with a reasoning parser: the reasoning part (``text`` is the answer);
    # None when the output has none
    reasoning_content: str | None = None
    num_reasoning_tokens: int = 0


class RequestOutput(msgspec.Struct):
    """One prompt's result. ``num_cached_tokens`` counts prompt tokens served from the
    prefix cache. ``text``, ``token_ids``, ``finish_reason`` and ``logprobs`` are those of
    the first (with ``n == 1``, the only) completion.

    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``): one entry per prompt
    token, aligned with ``prompt_token_ids``: ``None`` for the first, then the token's
    logprob given those before it and the top alternatives there."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


TRACE_FILE = "structllm-trace.jsonl"


class LLM:
    """Offline generation. Keyword arguments are ``EngineConfig`` fields, e.g.
    ``LLM(max_num_seqs=64, kv_cache_memory=512 << 20)``; ``trace=True`` (or a path)
    records every request's lifecycle (``structllm.trace``) in ``structllm-trace.jsonl``.

    With ``tensor_parallel_size=N`` this process is rank 0 and N-1 worker processes run
    beside it until ``close()`` (or the end of a ``with`` block); an ``LLM`` that is
    never closed stops them when it is garbage collected or at interpreter exit.

    ``reasoning_parser="deepseek_r1"``, ``"qwen3"`` or another of ``reasoning.PARSERS``
    (``structllm.reasoning``): ``chat`` splits each reply's ``<think>`` part into
    ``CompletionOutput.reasoning_content``, and a constraint applies to the answer after
    it. ``tool_call_parser`` (vLLM's names, ``tools.FORMATS``; default ``"auto"``: from the
    chat template, ``tools.detect_format``) is how ``chat`` prompts tools and parses calls.
    gpt-oss (its vocabulary with harmony's markers), or
    ``reasoning_parser="openai_gptoss"``: ``chat`` renders and parses the harmony format
    as the server does (``structllm.harmony``; ``chat_template_kwargs``'
    ``reasoning_effort`` as gpt-oss's own template takes it).
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        parser = engine_kwargs.pop("reasoning_parser", None)
        self.tool_format = format_named(str(engine_kwargs.pop("tool_call_parser", "auto")))
        if self.tool_format == "openai":  # gpt-oss's harmony parses calls and reasoning
            parser = "openai_gptoss"
        max_image_pixels = int(engine_kwargs.pop("max_image_pixels", DEFAULT_MAX_PIXELS))
        self.harmony = parser == "openai_gptoss"
        self.reasoning_parser = None if parser is None or self.harmony else check_parser(parser)
        if (
            engine_kwargs.get("trace") is True
        ):  # trace=True: the default file, in the working directory
            engine_kwargs["trace"] = TRACE_FILE
        if "speculative_config" in engine_kwargs:  # JSON text or a dict of vLLM's keys
            engine_kwargs["speculative_config"] = speculative_config(
                engine_kwargs["speculative_config"]
            )
        if "hf_overrides" in engine_kwargs:  # JSON text or a dict of config.json keys
            engine_kwargs["hf_overrides"] = hf_overrides(engine_kwargs["hf_overrides"])
        if "pooler_config" in engine_kwargs:  # JSON text or a dict of vLLM's keys
            engine_kwargs["pooler_config"] = pooler_config(engine_kwargs["pooler_config"])
        self.config = EngineConfig(model=model, **engine_kwargs)
        files = prepare_model(model)
        if files.template_note is not None:  # a GGUF file without a chat template
            sys.stderr.write(f"structllm: {files.template_note}\n")
        self.tokenizer = Tokenizer.from_files(files)
        if parser is None and uses_harmony(files.config.architecture, self.tokenizer.token_id):
            self.harmony = True
        elif self.harmony and not uses_harmony("gpt_oss", self.tokenizer.token_id):
            raise ValueError("reasoning_parser='openai_gptoss' needs harmony's tokens")
        self._defaults = generation_defaults(files, self.config.generation_config)
        path = model_path(model)  # a checkpoint's image processor (None: text only)
        self.image_processor: ImageProcessor | None
        if self.config.mmproj is not None:  # a GGUF model's: from its mmproj file (checked)
            cfg = files.config
            self.image_processor = pair_processor(
                Path(self.config.mmproj),
                path,
                cfg.architecture,
                cfg.hidden_size,
                self.tokenizer.token_id,
            )
        else:
            self.image_processor = processor_for(
                path if path.is_dir() else None, self.tokenizer.token_id
            )
        self.engine = EngineCore(self.config, files)
        self._ids = itertools.count()
        self.max_image_pixels = max_image_pixels

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without ``sampling_params``: the API's
        defaults, with the model's ``generation_config.json`` settings over them unless
        ``generation_config="vllm"`` (vLLM's method and option)."""
        return msgspec.convert(self._defaults, SamplingParams)

    def close(self) -> None:
        """Stop the engine's worker processes, if any. Idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one or many prompts in one continuously batched run. Returns one
        ``RequestOutput`` per prompt, in order. Raises ``ValueError`` naming the prompt
        if one can never run (empty, too long, ids outside the vocabulary) or its
        ``structured_outputs`` does not compile. A constrained request whose grammar
        fails in the engine ends alone with ``finish_reason == "error"``. ``priority``:
        one per prompt, lower runs earlier (vLLM's argument; non-zero values need
        ``scheduling_policy="priority"``). ``lora_request`` (with ``enable_lora=True``):
        the LoRA adapter of every prompt, or one per prompt (None: the base model); a bad
        adapter is a ``ValueError``."""
        items = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(items), self.get_default_sampling_params())
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority has {len(priority)} values for {len(items)} prompts")
        loras = self._loras(lora_request, len(items))
        encoded = [self._encode(p) for p in items]
        return self._run(items, encoded, params, priorities=priority, loras=loras)

    def _loras(
        self, lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[LoraRef | None]:
        """One adapter (or None) per prompt, each checked (``lora.read_adapter``)."""
        out = list(lora) if isinstance(lora, Sequence) else [lora] * n
        if len(out) != n:
            raise ValueError(f"got {len(out)} LoRA requests for {n} prompts")
        for r in out:
            if r is not None and not self.config.enable_lora:
                raise ValueError(f"LoRA adapter {r.lora_name!r} given, but enable_lora is off")
            if r is not None:
                read_adapter(r.lora_path, self.engine.files.config, self.config.max_lora_rank)
        return [None if r is None else r.ref() for r in out]

    def _run(
        self,
        items: list[Prompt],
        encoded: list[list[int]],
        params: list[SamplingParams],
        tools: ToolRequest | None = None,
        modes: Sequence[Mode | None] | None = None,
        images: Sequence[list[ImageInput]] | None = None,
        priorities: Sequence[int] | None = None,
        harmony: Callable[[], HarmonyParser] | None = None,
        loras: Sequence[LoraRef | None] | None = None,
    ) -> list[RequestOutput]:
        priorities = priorities or [0] * len(items)
        for i, (ids, sp) in enumerate(zip(encoded, params, strict=True)):
            try:
                self.engine.check_request(ids, sp)
                self.engine.check_priority(priorities[i])
                self._check_structured(sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        results: list[RequestOutput] = []
        live: dict[str, tuple[SequenceState, RequestOutput]] = {}
        for p, ids, sp, mode, prompt_images, prio, lora in zip(
            items,
            encoded,
            params,
            modes or [None] * len(items),
            images or [[]] * len(items),
            priorities,
            loras or [None] * len(items),
            strict=True,
        ):
            res = RequestOutput(str(next(self._ids)), p if isinstance(p, str) else None, ids, 0, [])
            if sp.prompt_logprobs is not None:
                res.prompt_logprobs = [None]
            results.append(res)
            name = res.request_id
            seqs = fan_out(
                [ids],
                sp,
                self.tokenizer,
                lambda _, j: f"{name}-{j}",  # noqa: B023
                tools,
                mode,
                [prompt_images],
                priority=prio,
                harmony=harmony,
                reasoning_tags=tags_of(self.reasoning_parser or ""),
            )
            for seq in seqs:
                res.outputs.append(
                    CompletionOutput(
                        seq.index, "", [], None, logprobs=[] if sp.logprobs is not None else None
                    )
                )
                live[seq.request_id] = (seq, res)
                self.engine.tracer.event("sent", seq.request_id)
                self.engine.add_request(
                    AddRequest(seq.request_id, ids, seq.sampling, seq.images, seq.priority, lora)
                )
        try:
            while live:
                for delta in self.engine.step().outputs:
                    if delta.request_id not in live:
                        continue  # e.g. the abort echo of a stop-string finish
                    seq, res = live[delta.request_id]
                    if delta.error is not None and seq.sampling.structured_outputs is None:
                        raise RuntimeError(f"engine refused request: {delta.error}")
                    update = seq.process(
                        delta.new_token_ids,
                        delta.logprobs,
                        delta.finish_reason,
                        delta.stop_reason,
                        delta.num_cached_tokens,
                        delta.prompt_logprobs,
                    )
                    res.num_cached_tokens = seq.num_cached_tokens
                    if res.prompt_logprobs is not None:
                        res.prompt_logprobs += update.prompt_logprobs
                    out = res.outputs[seq.index]
                    out.text += update.text
                    out.token_ids += update.token_ids
                    if out.logprobs is not None:
                        out.logprobs += update.logprobs
                    tracer = self.engine.tracer
                    if tracer.enabled and update.text:
                        tracer.event("detokenized", seq.request_id, chars=len(update.text))
                    if update.abort:
                        tracer.event("aborted", seq.request_id, why="a stop string ended it")
                        self.engine.abort([seq.request_id])
                    if seq.finished:
                        tracer.event("finished", seq.request_id, reason=seq.finish_reason)
                        out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
                        if seq.tools is not None:
                            out.text, out.tool_calls = seq.tools.content or "", seq.tools.calls
                        if seq.reasoning is not None and seq.reasoning.has_reasoning:
                            out.reasoning_content = seq.reasoning.reasoning
                            out.num_reasoning_tokens = seq.num_reasoning_tokens
                        if seq.harmony is not None:
                            _harmony_result(out, seq)
                        del live[seq.request_id]
        finally:
            if live:  # interrupted: leave nothing running in the engine
                self.engine.abort(list(live))
        return results

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """``generate`` for one chat or a list of chats. With OpenAI-style ``tools`` (and
        ``tool_choice``, ``parallel_tool_calls``), as the server serves them: the tools go
        into the prompt, the output is constrained where the choice demands it, and each
        completion's ``tool_calls`` holds the calls it made (its ``text`` the rest, and
        ``finish_reason`` is ``tool_calls``). ``chat_template_kwargs`` are extra variables
        for the chat template (e.g. ``{"enable_thinking": False}``). A user message's
        content may hold image parts (``image_url`` with a data: URL, a file URL or a path;
        ``image_pil`` with a Pillow image) for a model that takes images. Raises
        ``ValueError`` for bad tools, template variables or images."""
        chats: list[Any] = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        )
        kwargs = check_template_kwargs(chat_template_kwargs)
        if self.harmony:
            choice = (tools, tool_choice, parallel_tool_calls)
            return self._chat_harmony(chats, sampling_params, choice, kwargs)
        fmt = self.tool_format or detect_format(self.tokenizer.meta.chat_template)
        try:
            req = tool_request(tools, tool_choice, parallel_tool_calls, fmt)
        except ToolError as e:
            raise ValueError(str(e)) from None
        params = _as_params_list(sampling_params, len(chats), self.get_default_sampling_params())
        if req is not None:
            from structllm.tools import validate_tools

            error = validate_tools(req.tools, self.engine.grammar.tokenizer)
            if error is not None:
                raise ValueError(error)
            spec = constraint(req)
            if spec is not None:
                if any(sp.structured_outputs is not None for sp in params):
                    raise ValueError(
                        "structured_outputs cannot be combined with tools that may be called"
                    )
                params = [msgspec.structs.replace(sp, structured_outputs=spec) for sp in params]
        encoded: list[list[int]] = []
        modes: list[Mode | None] = []
        images: list[list[ImageInput]] = []
        tags = tags_of(self.reasoning_parser or "")
        end_ids = self.tokenizer.encode(tags.end, add_special_tokens=False)
        for i, chat in enumerate(chats):
            text, ids, prompt_images = self._chat_prompt(chat, req, fmt, kwargs)
            encoded.append(ids)
            images.append(prompt_images)
            if self.reasoning_parser is None:
                modes.append(None)
                continue
            modes.append(mode_for(self.reasoning_parser, text))
            starts = engine_spec(text, end_ids, tags)
            params[i] = msgspec.structs.replace(params[i], reasoning=starts)
        return self._run(chats, encoded, params, req, modes, images)

    def _chat_harmony(
        self,
        chats: list[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        choice: tuple[Sequence[Mapping[str, Any]] | None, Any, bool | None],
        kwargs: dict[str, Any],
    ) -> list[RequestOutput]:
        """``chat`` in gpt-oss's harmony format (``structllm.harmony``), as the server's
        chat path: the prompt of ``harmony.chat`` (today's date in UTC), free calls
        (``tool_choice`` ``auto`` or ``none``), one ``HarmonyParser`` per sequence."""
        try:
            req = tool_request(*choice, "openai")
        except ToolError as e:
            raise ValueError(str(e)) from None
        if req is not None and req.forced:
            raise ValueError(f"tool_choice {req.choice!r} is not supported with harmony")
        offered = req.tools if req is not None and req.calls_allowed else []
        today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        effort = kwargs.get("reasoning_effort")
        tok = self.tokenizer
        encoded = [
            encode_parts(
                harmony_chat.prompt_parts([dict(m) for m in chat], offered, effort, today),
                tok.token_id,
                tok.encode_plain,
            )
            for chat in chats
        ]
        default = self.get_default_sampling_params()
        params = [
            for_harmony(sp, self.tokenizer)
            for sp in _as_params_list(sampling_params, len(chats), default)
        ]
        names = frozenset(t["function"]["name"] for t in req.tools) if req else frozenset()
        allowed = req is not None and req.calls_allowed

        def parser() -> HarmonyParser:
            return HarmonyParser(names, allowed)

        return self._run(chats, encoded, params, harmony=parser)

    def _chat_prompt(
        self, chat: Sequence[Message], req: ToolRequest | None, fmt: Any, kwargs: dict[str, Any]
    ) -> tuple[str, list[int], list[ImageInput]]:
        """One chat's prompt text, token ids and images (as the server's preprocessor)."""
        msgs: list[dict[str, Any]] = [dict(m) for m in chat]
        pictures: list[Any] = []
        if any(isinstance(m.get("content"), list) for m in msgs):
            from structllm.multimodal.chat_images import split_images

            msgs, pictures = split_images(msgs, self.max_image_pixels)
        msgs, variables = prompt_messages(msgs, req, fmt)

        def template(m: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(m, **kwargs, **variables)

        proc = self.image_processor
        if not pictures:
            text = template(msgs)
            return text, self.tokenizer.encode(text, add_special_tokens=False), []
        if proc is None:
            raise ValueError(f"the model `{self.config.model or 'default'}` takes no images")
        from structllm.multimodal import prompt as image_prompt
        from structllm.server.images import content_hash

        text = image_prompt.expand(image_prompt.render(template, msgs, proc), proc, pictures)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        digests = [content_hash(p, proc.settings) for p in pictures]
        return text, ids, image_prompt.spans(ids, proc, pictures, digests)

    def embed(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        normalize: bool | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text, or token ids), in order, from a model that
        runs the pooling runner (``runner="pooling"``, or ``"auto"`` on an embedding
        checkpoint). Text gets the model's default prompt (sentence-transformers')
        prepended. ``dimensions``: a Matryoshka model's first N entries, normalised as
        the model normalises; ``truncate_prompt_tokens``: keep each prompt's last N
        tokens (-1: ``max_model_len``). ``ValueError`` naming the prompt if one can
        never run."""
        info = self.engine.pooler_info
        if info is None:
            raise ValueError(
                f"this model ({self.engine.files.name}) runs the generate runner: "
                'embed needs runner="pooling"'
            )
        if info.task != "embed":
            raise ValueError(f"this model ({self.engine.files.name}) scores: use score")
        items: list[str | Sequence[int]] = (
            [prompts]  # type: ignore[list-item]
            if isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
            else list(prompts)  # type: ignore[arg-type]
        )
        if not items:
            raise ValueError("embed needs at least one prompt")
        encoded = [
            truncate(
                self.tokenizer.encode(info.prompt + p)
                if isinstance(p, str)
                else [int(t) for t in p],
                truncate_prompt_tokens,
                self.engine.max_model_len,
                info,
            )
            for p in items
        ]
        params = PoolingParams("embed", dimensions, normalize)
        vecs = pool(self.engine, encoded, params, f"embed-{next(self._ids)}")
        return [
            EmbeddingRequestOutput(str(i), ids, EmbeddingOutput(vector(v)))
            for i, (ids, v) in enumerate(zip(encoded, vecs, strict=True))
        ]

    def score(
        self, text_1: str | Sequence[str], text_2: str | Sequence[str]
    ) -> list[ScoringRequestOutput]:
        """A reranker's relevance of each pair (one ``text_1`` against every ``text_2``,
        or the lists pairwise), in order: each pair tokenized as a cross-encoder's input
        (``Tokenizer.encode_pair``) and scored by the model's classifier (see
        ``model.pooler_config.PoolerSpec``). Needs a model whose pooler scores."""
        info = self.engine.pooler_info
        if info is None or info.task != "score":
            raise ValueError(
                f"this model ({self.engine.files.name}) does not score: score needs a "
                "reranker (a *ForSequenceClassification architecture) on the pooling runner"
            )
        encoded = [self.tokenizer.encode_pair(a, b) for a, b in pairs(text_1, text_2)]
        vecs = pool(self.engine, encoded, PoolingParams("score"), f"score-{next(self._ids)}")
        return [
            ScoringRequestOutput(str(i), ids, ScoringOutput(vector(v)[0]))
            for i, (ids, v) in enumerate(zip(encoded, vecs, strict=True))
        ]

    def _check_structured(self, sp: SamplingParams) -> None:
        """Raise ``ValueError`` if ``sp.structured_outputs`` does not compile."""
        if sp.structured_outputs is None:
            return
        from structllm.structured import validate

        error = validate(sp.structured_outputs, self.engine.grammar.tokenizer)
        if error is not None:
            raise ValueError(error)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], Mapping):
            return self.tokenizer.encode_chat(prompt)  # type: ignore[arg-type]
        return [int(t) for t in prompt]  # type: ignore[arg-type]


def _harmony_result(out: CompletionOutput, seq: SequenceState) -> None:
    """A finished harmony sequence's answer, calls and reasoning in ``out``."""
    assert seq.harmony is not None
    out.text = seq.harmony.content
    out.tool_calls = seq.harmony.calls or None
    out.reasoning_content = seq.harmony.reasoning if seq.harmony.has_reasoning else None
    out.num_reasoning_tokens = seq.num_reasoning_tokens


def _is_single(p: Any) -> bool:
    """One prompt: text, or a non-empty list of token ids or of chat messages."""
    return isinstance(p, str) or (
        isinstance(p, Sequence) and bool(p) and isinstance(p[0], Mapping | int)
    )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if _is_single(prompts):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            "prompts must be a string, token ids, chat messages or a list of them, "
            f"got {type(prompts).__name__}"
        )
    out = list(prompts)
    for i, p in enumerate(out):
        if not _is_single(p):
            raise TypeError(
                f"prompt {i} is not a string, a non-empty list of token ids or a chat: {p!r:.80}"
            )
    return out  # type: ignore[return-value]


def _as_params_list(
    sp: SamplingParams | Sequence[SamplingParams] | None, n: int, default: SamplingParams
) -> list[SamplingParams]:
    if sp is None:
        return [default] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    out = list(sp)
    if len(out) != n:
        raise ValueError(f"got {len(out)} SamplingParams for {n} prompts")
    return out
