"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) on the engine, against
transformers on a tiny seeded checkpoint (``tests/support/qwen2_5_vl.py``): its Qwen2
text model with 3-D rotary positions (``engine/mrope.py``), and its vision side
(``model/qwen2_5_vl.py``: the windowed tower with 2-D rotary, the patch merger,
normalisation of the front end's uint8 image), from both checkpoint layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.mrope import MRopePositions
from structllm.engine.runner import ModelRunner
from structllm.model.loader import prepare_model
from structllm.multimodal.processor import image_hash, image_inputs
from structllm.multimodal.qwen2_5_vl import Qwen2_5_VLProcessor
from structllm.protocol import AddRequest, ImageInput, SamplingParams
from tests.support.models import EXACT, hf_logits, image_prompt_logits, prefill_logits
from tests.support.qwen2_5_vl import (
    IMAGE_TOKEN_ID,
    PROCESSOR_SETTINGS,
    hf_processor,
    tiny_qwen2_5_vl_dir,
)

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137))]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=[False, True], ids=["transformers5", "released"])
def model_dir(default_files, request) -> Path:  # type: ignore[no-untyped-def]
    return tiny_qwen2_5_vl_dir(default_files, flat=request.param)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def processors(model_dir: Path):  # type: ignore[no-untyped-def]
    hf = hf_processor(model_dir / "tokenizer.json", **PROCESSOR_SETTINGS)
    ours = Qwen2_5_VLProcessor.from_model_dir(model_dir, hf.tokenizer.get_vocab().get)
    return ours, hf


def vision_engine(model_dir: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20, **EXACT, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EngineCore:
    return vision_engine(model_dir)


def test_text_model_is_its_qwen2(model_dir: Path, hf_model, engine: EngineCore) -> None:  # type: ignore[no-untyped-def]
    cfg = prepare_model(str(model_dir)).config
    assert cfg.architecture == "qwen2" and cfg.qkv_bias and cfg.mrope_section == [2, 3, 3]
    assert cfg.vocab_size == 49156 and cfg.rope_scaling is None and not cfg.layer_windows
    assert engine.vision is not None and engine.vision.image_token_id == IMAGE_TOKEN_ID
    for ids in PROMPTS:  # text alone: (p, p, p) positions are plain rope
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4
        )


def picture(width: int, height: int, seed: int):  # type: ignore[no-untyped-def]
    """A colour of the seed's plus noise (noise alone averages out in so small a model:
    two such images would give the same tokens)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    colour = rng.integers(0, 192, 3)
    noise = rng.integers(0, 64, (height, width, 3))
    return Image.fromarray((colour + noise).astype(np.uint8))


def image_input(processor: Qwen2_5_VLProcessor, image: Any) -> ImageInput:
    """What the front end sends for ``image`` alone (at offset 0)."""
    raw, shape = processor.pixels(image)
    n = processor.num_tokens(*image.size)
    return ImageInput(image_hash(raw, *image.size, processor.settings), 0, n, n, shape, raw)


# (width, height): windows cut at both edges, a wide image, one window, several whole
# windows, a thin strip scaled up to min_pixels
SIZES = [(30, 50), (64, 20), (16, 16), (48, 48), (100, 7)]


@pytest.mark.parametrize("size", SIZES)
def test_image_features_equal_transformers(size, engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    ours, hf = processors
    image = picture(*size, seed=size[0])
    inputs = hf(images=[image], text=[ours.placeholder], return_tensors="pt")
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output[0]
    assert engine.vision is not None
    got = engine.vision.encode(image_input(ours, image))
    assert got.shape == want.shape == (ours.num_tokens(*size), 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_window_order_is_transformers() -> None:
    """Our window order and sizes against transformers' ``get_vision_window_index``, on
    grids that windows divide and that they do not."""
    from transformers.vision_utils import get_vision_window_index

    from structllm.model.qwen2_5_vl import window_order

    for rows, cols, side in [(6, 6, 2), (5, 7, 2), (1, 9, 4), (8, 3, 3), (4, 4, 8)]:
        grid = torch.tensor([[1, rows * 2, cols * 2]])
        index, cu = get_vision_window_index(grid, 2, side * 2 * 4, 4)
        order, sizes = window_order(rows, cols, side)
        assert torch.equal(order, index), (rows, cols, side)
        assert [4 * s for s in sizes] == torch.diff(cu).tolist(), (rows, cols, side)


def test_bad_images_are_refused(engine: EngineCore) -> None:
    vision = engine.vision
    assert vision is not None
    vision.check(ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(16 * 16 * 3)))
    for bad, match in [
        (ImageInput("h", 0, 4, 4, (2, 16, 16, 3), bytes(2 * 16 * 16 * 3)), r"\[1, H, W, 3\]"),
        (ImageInput("h", 0, 4, 4, (1, 16, 12, 3), bytes(16 * 12 * 3)), "8-pixel merge units"),
        (ImageInput("h", 0, 8, 8, (1, 16, 16, 3), bytes(16 * 16 * 3)), "takes 4 contiguous"),
        (ImageInput("h", 0, 5, 4, (1, 16, 16, 3), bytes(16 * 16 * 3)), "in a span of 5"),
        (ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(10)), "pixel bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            vision.check(bad)


# a ChatML-style turn; "{}" where each image part was
CHAT = "<|im_start|>user\n{} Describe {} briefly.<|im_end|>\n<|im_start|>assistant\n"
# the images of one prompt as (width, height) and the seed of their pixels
CASES: list[tuple[list[tuple[int, int]], int]] = [
    ([(30, 50)], 0),  # a tall image
    ([(30, 50)], 100),  # the same tokens over another image
    ([(64, 20), (48, 48)], 2),  # two images: a wide one, then a square one
    ([(16, 16)], 3),  # one window
]


def request_for(processors, sizes, seed: int):  # type: ignore[no-untyped-def]
    """``(prompt ids, ImageInputs, transformers' inputs)`` for images of ``sizes`` in
    ``CHAT``: our expansion and spans beside transformers' processor's output."""
    ours, hf = processors
    images = [picture(w, h, seed=seed + k) for k, (w, h) in enumerate(sizes)]
    marks = [ours.placeholder] * len(images) + ["it"] * (2 - len(images))
    text = CHAT.format(*marks)
    inputs = hf(images=images, text=[text], return_tensors="pt")
    parts = text.split(ours.placeholder)
    expanded = parts[0] + "".join(
        ours.expand(*im.size) + rest for im, rest in zip(images, parts[1:], strict=True)
    )
    ids = hf.tokenizer(expanded)["input_ids"]
    assert ids == inputs["input_ids"][0].tolist()  # our expansion is transformers'
    prepared = []
    for im in images:
        raw, shape = ours.pixels(im)
        digest = image_hash(raw, *im.size, ours.settings)
        prepared.append((digest, ours.num_tokens(*im.size), raw, shape))
    return ids, image_inputs(ids, ours.image_token_id, prepared), inputs


def test_positions_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    """Every prompt position's (t, h, w) and the shift of what follows, as transformers'
    ``get_rope_index`` gives them."""
    for sizes, seed in CASES:
        ids, spans, inputs = request_for(processors, sizes, seed)
        want, delta = hf_model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
        )
        mrope = engine._mrope(spans)
        assert isinstance(mrope, MRopePositions)
        hw = mrope.spatial(0, len(ids))
        assert hw is not None
        got = torch.tensor([mrope.flat(0, len(ids)), *hw])
        assert torch.equal(got, want[:, 0]), sizes
        n = len(ids)  # generated tokens: the index plus transformers' delta
        assert mrope.flat(n, n + 3) == [n + int(delta) + i for i in range(3)]
        assert mrope.spatial(n, n + 3) is None


def test_prompt_logits_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    for sizes, seed in CASES[::2]:
        ids, spans, inputs = request_for(processors, sizes, seed)
        with torch.no_grad():
            want = hf_model(**inputs).logits[0]
        torch.testing.assert_close(
            image_prompt_logits(engine, ids, spans), want, atol=1e-4, rtol=1e-4
        )


def hf_generate(hf_model, inputs) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def engine_generate(
    engine: EngineCore,
    requests: dict[str, tuple[list[int], list[ImageInput]]],
    steps: list[int] | None = None,
) -> dict[str, list[int]]:
    """Greedy tokens of ``requests`` run together to the end (the step count appended to
    ``steps``)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
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


@pytest.fixture(scope="module")
def expected(processors, hf_model):  # type: ignore[no-untyped-def]
    """Each case's request and transformers' greedy tokens for it."""
    out = {}
    for k, (sizes, seed) in enumerate(CASES):
        ids, spans, inputs = request_for(processors, sizes, seed)
        out[f"r{k}"] = (ids, spans, hf_generate(hf_model, inputs))
    # the premise of comparing tokens: the image decides them (r0 and r1 differ only there)
    assert out["r0"][0] == out["r1"][0] and out["r0"][2] != out["r1"][2]
    return out


def test_generate_equals_transformers(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """Each request alone, then all in one batch. With the prefix cache on: r1 follows
    r0 with the same tokens over another image, so sharing a block over the image
    would show (and it shares none of them); the batch repeats every image, so its
    blocks come from the cache."""
    engine = vision_engine(model_dir)
    for rid, (ids, spans, want) in expected.items():
        assert engine_generate(engine, {rid: (ids, spans)})[rid] == want, rid
    got = engine_generate(engine, {rid: (ids, spans) for rid, (ids, spans, _) in expected.items()})
    assert got == {rid: want for rid, (_, _, want) in expected.items()}


def test_different_images_never_share_blocks(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """r1 after r0 (the same tokens, another image) reuses only the blocks before the
    image; r0 again reuses every full block of its prompt but the last (whose last
    position is computed again to sample)."""
    engine = vision_engine(model_dir)
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


@pytest.mark.parametrize("budget", [5, 16, 37])
def test_chunked_prefill_equals_one_run(model_dir: Path, expected, budget: int) -> None:  # type: ignore[no-untyped-def]
    """Prompts cut into chunks of ``budget`` tokens (never inside an image's span) give
    the tokens of one run; no prefix cache, so every chunk is computed."""
    engine = vision_engine(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    for rid, (ids, spans, want) in expected.items():
        steps: list[int] = []
        assert engine_generate(engine, {rid: (ids, spans)}, steps)[rid] == want, rid
        assert (len(ids) > budget) == (steps[0] > MAX_TOKENS)


def test_default_format_agrees(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """The default format on CPU (float16 weights through the fused CPU ops; the tower in
    float32): transformers' greedy tokens, logprobs within 1e-3 of the exact path's."""
    default = EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20))
    assert default.model is not None and default.model.cpu_ops is not None
    exact = vision_engine(model_dir)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    for rid in ("r0", "r2"):
        ids, spans, want = expected[rid]
        got = []
        for e in (exact, default):
            e.add_request(AddRequest(rid, ids, sp, spans))
            tokens: list[int] = []
            lps: list[float] = []
            while e.has_work:
                for d in e.step().outputs:
                    tokens += d.new_token_ids
                    lps += [x.logprob for x in d.logprobs or []]
            got.append((tokens, lps))
        (exact_tokens, exact_lps), (tokens, lps) = got
        assert exact_tokens == tokens == want, rid
        assert max(abs(a - b) for a, b in zip(lps, exact_lps, strict=True)) < 1e-3


def test_vision_config_is_read(model_dir: Path) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    from structllm.model.qwen2_5_vl import TowerConfig

    cfg = TowerConfig.from_hf(raw["vision_config"])
    assert (cfg.depth, cfg.window, cfg.full_layers, cfg.merge) == (3, 2, frozenset({1}), 2)


def test_llm_chat_with_an_image_equals_transformers(model_dir: Path, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The offline API end to end: ``LLM.chat`` with an image part (the processor the
    registry picks, placeholders and spans, then this engine's M-RoPE path) against
    transformers' generate on the prompt it built, with its own processor's pixels."""
    from structllm.llm import LLM

    _, hf = processors
    llm = LLM(model=str(model_dir), kv_cache_memory=16 << 20, **EXACT)
    image = picture(40, 24, seed=7)
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_pil", "image_pil": image}]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    (out,) = llm.chat([{"role": "user", "content": content}], greedy)
    ids = out.prompt_token_ids
    assert ids.count(IMAGE_TOKEN_ID) == 15  # 40x24 -> 40x24: 5x3 tokens
    pixels = hf.image_processor(images=[image], return_tensors="pt")
    prompt = torch.tensor([ids])
    with torch.no_grad():
        want = hf_model.generate(
            input_ids=prompt,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(prompt == IMAGE_TOKEN_ID).long(),
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids == want


def test_preemption_recomputes_exactly(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """Four requests in a cache with room for about half of them: preempted ones are
    recomputed from their prompts (the positions kept on the request, the encoder's
    rows from its cache) to the same tokens, past the image into decoding."""
    reqs = [
        AddRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=24), spans)
        for rid, (ids, spans, _) in expected.items()
    ]

    def run(engine: EngineCore) -> dict[str, list[int]]:
        for r in reqs:
            engine.add_request(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        while engine.has_work:
            for d in engine.step().outputs:
                assert d.error is None, d.error
                out[d.request_id] += d.new_token_ids
        return out

    want = run(vision_engine(model_dir))
    block = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, 16 tokens, f32
    tight = EngineCore(
        EngineConfig(model=str(model_dir), kv_cache_memory=11 * block, **EXACT)  # type: ignore[arg-type]
    )
    got = run(tight)
    assert tight.scheduler.num_preemptions > 0
    assert got == want
    assert isinstance(tight.runner, ModelRunner)  # recomputes took the encoder's rows kept
    assert tight.runner.encoder_cache.num_misses == 5  # each of the five images once
