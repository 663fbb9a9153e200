"""One sequence's state inside the engine."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from structllm.engine.mrope import MRopePositions
from structllm.protocol import FinishReason, ImageInput, PoolingParams, SamplingParams

if TYPE_CHECKING:
    from structllm.structured import Matcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """``token_ids`` is prompt + output; the KV of ``token_ids[:num_computed_tokens]`` is in
    the cache. After a step the newest sampled token is not computed yet, so a running
    request in decode has ``num_computed_tokens == len(token_ids) - 1``.

    ``block_ids[i]`` holds positions ``i*BS .. i*BS+BS-1``, except the first
    ``num_released_blocks``, given back once behind every layer's window (each then
    names the first block still held; see ``KVCacheManager.release_behind_window``).
    ``chain_ids[i]`` is the prefix cache's identity of full block ``i`` (see
    ``KVCacheManager``). ``state_slot``: the row of every recurrent layer's state that
    this request holds while it runs (hybrid models, ``engine.state_cache``; -1: none);
    ``state_load``/``state_save``: the saved state it resumes from and where it saves
    one, in the step being scheduled (``StateCacheManager.load``/``plan_save``).
    ``grammar``: the
    matcher of a constrained request while it lives (see ``engine.grammar``);
    ``in_reasoning``: the output is still in its reasoning part (``sampling.reasoning``),
    which the grammar does not constrain.

    ``draft_token_ids``: speculative drafts to follow ``token_ids`` in the step being
    scheduled (see ``engine.speculative``); never part of ``token_ids``, dropped after
    the step that verifies them and on preemption. ``spec_drafted``/``spec_accepted``:
    this request's recent drafted and accepted counts (the drafting policy's).

    ``images``: the prompt's images (``protocol.ImageInput``, in prompt order, spans
    disjoint); a prefill chunk splits a span only where the model's image attention is
    causal (``Scheduler.split_spans``), and the prefix cache keys a block over a span
    with its image (``block_images``). ``mrope``: with an
    M-RoPE text model (Qwen2.5-VL), the positions the images give the prompt's and the
    output's tokens (``engine.mrope``); None: a token's position is its index.

    ``priority``: lower runs earlier under the priority policy (vLLM's polarity; see
    ``Scheduler``); ``arrival``: the scheduler's count of requests added before this
    one, which breaks ties between equal priorities (first come, first served).
    ``lora_uid``: the load of the LoRA adapter it runs with (``engine.adapters``; 0:
    none); its blocks' chain starts from ``-lora_uid`` instead of 0 (``kv_cache``).
    ``pooling``: a pooling runner's request (``engine.pooling``): prefill only, its
    vector pooled from the step that computes its last prompt token.

    ``num_prompt_logprobs`` counts the prompt positions already scored and sent (with
    ``sampling.prompt_logprobs``): position ``p``'s logits score prompt token ``p + 1``,
    so positions ``0 .. prompt_len - 2`` are scored, each once, even across preemption.
    """

    __slots__ = (
        "arrival",
        "block_ids",
        "chain_ids",
        "draft_token_ids",
        "finish_reason",
        "grammar",
        "images",
        "in_reasoning",
        "lora_uid",
        "max_tokens",
        "mrope",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_logprobs",
        "num_released_blocks",
        "pooling",
        "priority",
        "prompt_len",
        "request_id",
        "sampling",
        "spec_accepted",
        "spec_drafted",
        "spec_resume_at",
        "state_load",
        "state_save",
        "state_slot",
        "status",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        images: list[ImageInput] | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.arrival = 0  # set by Scheduler.add_request
        self.images = images or []
        # 3-D rotary positions (set by the engine for an M-RoPE model with images)
        self.mrope: MRopePositions | None = None
        self.token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache; -1 until admitted
        self.num_prompt_logprobs = 0
        self.block_ids: list[int] = []
        self.chain_ids: list[int] = []
        self.num_released_blocks = 0  # leading blocks given back behind the window
        self.state_slot = -1  # hybrid models: its recurrent state's slot while running
        # hybrid models, for the step being scheduled: the saved state's row copied into
        # the slot first (-1: none), and (position, row) where the state is saved
        self.state_load = -1
        self.state_save: tuple[int, int] | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.grammar: Matcher | None = None
        self.in_reasoning = sampling.reasoning is not None
        self.draft_token_ids: list[int] = []
        self.pooling: PoolingParams | None = None  # a pooling runner's request (prefill only)
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_resume_at = 0  # output tokens before drafting (again)
        # its LoRA adapter's load (engine.adapters; 0: the base model): the prefix cache
        # keys its blocks by it, the scheduler counts distinct ones per step
        self.lora_uid = 0

    @property
    def urgency(self) -> tuple[int, int]:
        """The priority policy's order: ``(priority, arrival)``, most urgent first."""
        return self.priority, self.arrival

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def drafts_before(self) -> list[int]:
        """As ``speculative.DraftRow``'s: a request's own sampling row follows no draft."""
        return []

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions remain to be scored."""
        asked = self.sampling.prompt_logprobs is not None
        return asked and self.num_prompt_logprobs < self.prompt_len - 1

    def prompt_logprob_span(self, num_new_tokens: int) -> tuple[int, int]:
        """``(first, count)``: the prompt positions a chunk of ``num_new_tokens`` from
        ``num_computed_tokens`` scores that were not sent before (``count`` may be 0)."""
        if not self.wants_prompt_logprobs:
            return 0, 0
        first = max(self.num_computed_tokens, self.num_prompt_logprobs)
        end = min(self.num_computed_tokens + num_new_tokens, self.prompt_len - 1)
        return first, max(0, end - first)

    def samples_after(self, num_new_tokens: int) -> bool:
        """Whether a chunk of ``num_new_tokens`` ends with a token to sample (it reaches
        the end of the known tokens, and the request may generate)."""
        known = self.num_tokens + len(self.draft_token_ids)
        return self.num_computed_tokens + num_new_tokens == known and self.max_tokens > 0

    def block_images(self, first: int, end: int) -> tuple[tuple[str, int], ...]:
        """``(hash, first - offset)`` of each image whose span overlaps positions
        ``first .. end - 1`` (a KV block): what the prefix cache keys the block with
        besides its tokens, so identical placeholder tokens over different images never
        share a block (and over the same image, at the same place, do)."""
        return tuple(
            (im.hash, first - im.offset)
            for im in self.images
            if im.offset < end and first < im.offset + im.length
        )

    def open_images(self) -> list[str]:
        """Hashes of the images whose span the computed tokens end inside of (a split
        span, causal families): their encoder output is still needed."""
        done = self.num_computed_tokens
        return [im.hash for im in self.images if im.offset < done < im.offset + im.length]

    def span_chunk(self, start: int, n: int) -> int:
        """``n`` new tokens from ``start``, adjusted so the chunk splits no image span:
        cut before a span it would not finish, or, when it starts inside or at a span,
        extended to that span's end (a span is computed in one step: its tokens attend
        to each other, Gemma 3's rule, and its encoder rows are scattered at once)."""
        for im in self.images:
            end = im.offset + im.length
            if end <= start:
                continue
            if im.offset >= start + n:
                break
            if start >= im.offset:  # starts at or inside the span: take it whole
                n = max(n, end - start)
            elif start + n < end:  # the span begins after start: stop before it
                return im.offset - start
        return n

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
