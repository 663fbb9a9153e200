"""The checks every vision-language family's engine tests run, written once: images and
what the front end sends for them, greedy generation on the engine and in
transformers, and the drivers of "generate equals transformers", "different images
never share cached blocks", "chunked prefill at several budgets equals one run", "a
causal family's spans split across chunks equal one run" (also preempted inside a
span) and "the default format agrees with the exact one". A family's test file builds
its requests (``expected``: ``{rid: (prompt ids, ImageInputs, transformers' tokens)}``,
``r0`` and ``r1`` the same tokens over other images) and calls these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.request import Request
from structllm.engine.runner import ModelRunner
from structllm.engine.scheduler import SchedulerOutput
from structllm.multimodal.processor import image_hash, image_inputs
from structllm.protocol import AddRequest, ImageInput, SamplingParams
from tests.support.models import EXACT, hf_logits, image_prompt_logits, prefill_logits

# {request id: (prompt ids, its images, transformers' greedy tokens)}
Expected = dict[str, tuple[list[int], list[ImageInput], list[int]]]


def picture(width: int, height: int, seed: int) -> Any:
    """A colour of the seed's plus noise (noise alone averages out in so small a model:
    two such images would give the same tokens); a ``PIL.Image``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    colour = rng.integers(0, 192, 3)
    noise = rng.integers(0, 64, (height, width, 3))
    return Image.fromarray((colour + noise).astype(np.uint8))


def image_input(processor: Any, image: Any) -> ImageInput:
    """What the front end sends for ``image`` alone (at offset 0)."""
    raw, shape = processor.pixels(image)
    width, height = image.size
    n = processor.num_tokens(width, height)
    return ImageInput(image_hash(raw, width, height, processor.settings), 0, n, n, shape, raw)


def vision_engine(model_dir: Path, **kw: object) -> EngineCore:
    """The exact (float32) engine over ``model_dir`` with a 32 MiB cache."""
    return EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20, **EXACT, **kw))  # type: ignore[arg-type]


def assert_refused(vision: Any, good: ImageInput, bad: list[tuple[ImageInput, str]]) -> None:
    """``vision.check`` passes ``good`` and refuses each of ``bad`` with its message."""
    vision.check(good)
    for image, match in bad:
        with pytest.raises(ValueError, match=match):
            vision.check(image)


def hf_generate(hf_model: Any, inputs: Any, max_tokens: int) -> list[int]:
    """transformers' greedy tokens after the prompt of ``inputs`` (its processor's)."""
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def expected_greedy(
    hf_model: Any, requests: dict[str, tuple[list[int], list[ImageInput], Any]], max_tokens: int
) -> Expected:
    """Each request with transformers' greedy tokens for its ``inputs``; checks the
    premise of comparing tokens: the image decides them (r0 and r1 differ only there)."""
    out = {
        rid: (ids, spans, hf_generate(hf_model, inputs, max_tokens))
        for rid, (ids, spans, inputs) in requests.items()
    }
    assert out["r0"][0] == out["r1"][0] and out["r0"][2] != out["r1"][2]
    return out


def engine_generate(
    engine: EngineCore,
    requests: dict[str, tuple[list[int], list[ImageInput]]],
    max_tokens: int,
    steps: list[int] | None = None,
) -> dict[str, list[int]]:
    """Greedy tokens of ``requests`` run together to the end (the step count appended to
    ``steps``); every block is free again after."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for rid, (ids, images) in requests.items():
        engine.add_request(AddRequest(rid, ids, params, images))
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    n = 0
    while engine.has_work:
        n += 1
        for d in engine.step().outputs:
            assert d.error is None, d.error
            out[d.request_id] += d.new_token_ids
    assert engine.kv.num_free_blocks == engine.num_blocks
    if steps is not None:
        steps.append(n)
    return out


def check_generate_equals_transformers(
    engine: EngineCore, expected: Expected, max_tokens: int
) -> None:
    """Each request alone, then all in one batch. With the prefix cache on: r1 follows
    r0 with the same tokens over another image, so sharing a block over the image
    would show; the batch repeats every image, so its blocks come from the cache."""
    for rid, (ids, spans, want) in expected.items():
        assert engine_generate(engine, {rid: (ids, spans)}, max_tokens)[rid] == want, rid
    got = engine_generate(
        engine, {rid: (ids, spans) for rid, (ids, spans, _) in expected.items()}, max_tokens
    )
    assert got == {rid: want for rid, (_, _, want) in expected.items()}


def check_different_images_never_share_blocks(engine: EngineCore, expected: Expected) -> None:
    """r1 after r0 (the same tokens, another image) reuses only the blocks before the
    image; r0 again reuses every full block of its prompt but the last (whose last
    position is computed again to sample)."""
    bs = engine.config.block_size
    ids, spans0, _ = expected["r0"]
    _, spans1, _ = expected["r1"]
    hits = []
    for rid, spans in [("a", spans0), ("b", spans1), ("c", spans0)]:
        engine.add_request(AddRequest(rid, ids, SamplingParams(max_tokens=1), spans))
        while engine.has_work:
            engine.step()
        hits.append(engine.scheduler.kv.num_hit_tokens)
    assert hits[0] == 0
    assert hits[1] - hits[0] == spans0[0].offset // bs * bs  # only the text before it
    assert hits[2] - hits[1] == bs * ((len(ids) - 1) // bs) > spans0[0].offset


def check_chunked_prefill_equals_one_run(
    model_dir: Path, expected: Expected, budget: int, max_tokens: int
) -> None:
    """Prompts cut into chunks of ``budget`` tokens (never inside an image's span) give
    the tokens of one run; no prefix cache, so every chunk is computed."""
    engine = vision_engine(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    for rid, (ids, spans, want) in expected.items():
        steps: list[int] = []
        assert engine_generate(engine, {rid: (ids, spans)}, max_tokens, steps)[rid] == want, rid
        # more steps than one prefill and the decodes exactly when the prompt was cut
        assert (len(ids) > budget) == (steps[0] > max_tokens)


def greedy_with_logprobs(engine: EngineCore, request: AddRequest) -> tuple[list[int], list[float]]:
    """``request``'s tokens and their logprobs (its ``logprobs=0``), run to its end."""
    engine.add_request(request)
    tokens: list[int] = []
    lps: list[float] = []
    while engine.has_work:
        for d in engine.step().outputs:
            tokens += d.new_token_ids
            lps += [x.logprob for x in d.logprobs or []]
    return tokens, lps


def check_default_format_agrees(
    model_dir: Path, expected: Expected, rids: tuple[str, ...], max_tokens: int
) -> None:
    """The default format on CPU (float16 weights through the fused CPU ops; the tower in
    float32): transformers' greedy tokens, logprobs within 1e-3 of the exact path's."""
    default = EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20))
    assert default.model is not None and default.model.cpu_ops is not None
    exact = vision_engine(model_dir)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    for rid in rids:
        ids, spans, want = expected[rid]
        request = AddRequest(rid, ids, sp, spans)
        exact_tokens, exact_lps = greedy_with_logprobs(exact, request)
        tokens, lps = greedy_with_logprobs(default, request)
        assert exact_tokens == tokens == want, rid
        assert max(abs(a - b) for a, b in zip(lps, exact_lps, strict=True)) < 1e-3


def image_prefill_logits(engine: EngineCore, ids: list[int], ims: list[ImageInput]) -> torch.Tensor:
    """Logits ``[len(ids), V]`` of every prompt position through the engine's runner."""
    req = Request("probe", ids, SamplingParams(max_tokens=1), 1, ims)
    assert engine.kv.allocate(req, len(ids)) and isinstance(engine.runner, ModelRunner)
    assert engine.states is None or engine.states.allocate(req)  # a hybrid model's slot
    try:
        batch = engine.runner.prepare(SchedulerOutput([(req, len(ids))]))
        batch.step = msgspec.structs.replace(batch.step, logit_rows=list(range(len(ids))))
        logits = engine.runner.run(batch)
        assert logits is not None
        return logits
    finally:
        engine.kv.free_blocks(req)
        if engine.states is not None:
            engine.states.free_slot(req)
        engine.kv.reset_prefix_cache()


def assert_prompt_logits_equal(
    engine: EngineCore, hf_model: Any, ids: list[int], spans: list[ImageInput], inputs: Any
) -> None:
    """Every prompt position's logits with images within 1e-4 of transformers' on
    ``inputs`` (its processor's for the same prompt)."""
    with torch.no_grad():
        want = hf_model(**inputs).logits[0]
    torch.testing.assert_close(image_prompt_logits(engine, ids, spans), want, atol=1e-4, rtol=1e-4)


def image_spans(processor: Any, ids: list[int], images: list[Any]) -> list[ImageInput]:
    """The ``ImageInput`` of each of ``images`` over its span of ``ids`` (already expanded
    by ``processor``), hashed by its pixels as the front end sends them."""
    prepared = []
    for im in images:
        raw, shape = processor.pixels(im)
        width, height = im.size
        digest = image_hash(raw, width, height, processor.settings)
        prepared.append((digest, processor.num_tokens(width, height), raw, shape))
    return image_inputs(ids, processor.image_token_id, prepared)


def expand_images(processor: Any, text: str, placeholder: str, images: list[Any]) -> str:
    """``text`` with each ``placeholder`` replaced by ``processor``'s expansion for the
    next of ``images`` (as many of them as placeholders)."""
    parts = text.split(placeholder)
    return parts[0] + "".join(
        processor.expand(*im.size) + rest for im, rest in zip(images, parts[1:], strict=True)
    )


def chat_with_an_image(model_dir: Path, image: Any, max_tokens: int) -> Any:
    """The offline API on one user turn, "What is this?" and ``image`` (a ``PIL.Image``):
    ``LLM.chat``'s greedy output on the exact path."""
    from structllm.llm import LLM

    llm = LLM(model=str(model_dir), kv_cache_memory=16 << 20, **EXACT)
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_pil", "image_pil": image}]
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    (out,) = llm.chat([{"role": "user", "content": content}], greedy)
    return out


def run_requests(engine: EngineCore, requests: list[AddRequest]) -> dict[str, list[int]]:
    """Every request to its end; their tokens (an error delta fails the test)."""
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        for d in engine.step().outputs:
            assert d.error is None, d.error
            out[d.request_id] += d.new_token_ids
    return out


def hf_vision_model(model_dir: Path, arch: str) -> Any:
    """transformers' ``arch`` (a ``...ForConditionalGeneration``) from ``model_dir``, in
    float32, for evaluation."""
    import transformers

    return getattr(transformers, arch).from_pretrained(str(model_dir), dtype=torch.float32).eval()


def assert_text_logits_equal(engine: EngineCore, hf_model: Any, prompts: list[list[int]]) -> None:
    """Each of ``prompts`` (text alone) gives transformers' logits within 1e-4."""
    for ids in prompts:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4
        )


def record_chunks(engine: EngineCore) -> list[tuple[int, int]]:
    """A list the engine's scheduler appends each scheduled chunk's ``(start, n)`` to."""
    chunks: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recorded(*a: Any, **k: Any) -> SchedulerOutput:
        out = schedule(*a, **k)
        chunks.extend((r.num_computed_tokens, n) for r, n in out.scheduled)
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    return chunks


def check_split_spans_equal_one_run(
    model_dir: Path, expected: Expected, rid: str, budget: int, max_tokens: int
) -> None:
    """A causal family cuts an image's span like text: with a ``budget`` below the
    span, chunks end inside it, never pass the budget but where one token runs beside
    the encoder, and take between ``ceil(len / budget)`` prefill steps and two more per
    image; the greedy tokens are one whole prefill's, their logprobs within 1e-4; each
    image is encoded once though the encoder cache's 1-byte bound keeps only what a
    running request is inside of."""
    ids, spans, want = expected[rid]
    assert max(im.length for im in spans) > budget
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    whole = vision_engine(model_dir, enable_prefix_caching=False)
    tokens, lps = greedy_with_logprobs(whole, AddRequest(rid, ids, sp, spans))
    assert tokens == want
    split = vision_engine(
        model_dir,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        encoder_cache_memory=1,
    )
    assert split.scheduler.split_spans
    chunks = record_chunks(split)
    got, got_lps = greedy_with_logprobs(split, AddRequest(rid, ids, sp, spans))
    assert got == want
    assert max(abs(a - b) for a, b in zip(got_lps, lps, strict=True)) < 1e-4
    ends = [s + n for s, n in chunks]
    assert any(im.offset < e < im.offset + im.length for e in ends for im in spans)
    assert all(n <= budget for _, n in chunks)
    prefill = sum(1 for s, _ in chunks if s < len(ids))
    least = -(-len(ids) // budget)
    assert least <= prefill <= least + 2 * len(spans), (prefill, least)
    assert split.num_steps == prefill + len(want) - 1
    assert isinstance(split.runner, ModelRunner)
    assert split.runner.encoder_cache.num_misses == len({im.hash for im in spans})


def check_preempted_inside_a_span(
    model_dir: Path, expected: Expected, rid: str, budget: int, max_tokens: int
) -> None:
    """A request preempted part-way through an image's span (prefix cache on, blocks
    of 4) resumes from a prefix-cache hit that ends inside the span, takes the rest of
    the image's rows from the encoder cache (one encoder run per image) and gives the
    tokens of an uninterrupted run."""
    ids, spans, want = expected[rid]
    im = spans[0]
    engine = vision_engine(model_dir, max_num_batched_tokens=budget, block_size=4)
    chunks = record_chunks(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.add_request(AddRequest(rid, ids, greedy, spans))
    req = engine.scheduler.requests[rid]
    while req.num_computed_tokens < im.offset + 5:
        assert not engine.step().outputs
    assert req.num_computed_tokens < im.offset + im.length  # inside the span
    engine.scheduler.running.remove(req)
    engine.scheduler._preempt(req)  # as memory pressure would, at this point
    resumed = len(chunks)
    tokens: list[int] = []
    while engine.has_work:
        for d in engine.step().outputs:
            assert d.error is None, d.error
            tokens += d.new_token_ids
    start = chunks[resumed][0]
    assert im.offset < start < im.offset + im.length and start % 4 == 0  # the hit
    assert tokens == want
    assert isinstance(engine.runner, ModelRunner)
    assert engine.runner.encoder_cache.num_misses == len({i.hash for i in spans})
