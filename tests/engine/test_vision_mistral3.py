"""Mistral 3.1 (``Mistral3ForConditionalGeneration``) on the engine, against
transformers on a tiny seeded checkpoint (``tests/support/mistral3.py``): its Mistral
text model and its vision side (``model/mistral3.py``: the Pixtral tower with 2-D
rotary, the projector's patch merger, normalisation of the front end's uint8 image),
from both checkpoint namings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.model.loader import prepare_model
from structllm.multimodal.mistral3 import Mistral3Processor
from structllm.multimodal.processor import image_hash, image_inputs
from structllm.protocol import AddRequest, ImageInput, SamplingParams
from tests.support.mistral3 import IMAGE_TOKEN_ID, hf_processor, tiny_mistral3_dir
from tests.support.models import EXACT, hf_logits, image_prompt_logits, prefill_logits

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137))]
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=[False, True], ids=["transformers5", "released"])
def model_dir(default_files, request) -> Path:  # type: ignore[no-untyped-def]
    return tiny_mistral3_dir(default_files, legacy=request.param)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.Mistral3ForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def processors(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    ours = Mistral3Processor.from_model_dir(model_dir, tokenizer.get_vocab().get)
    return ours, hf_processor(), tokenizer


def vision_engine(model_dir: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20, **EXACT, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EngineCore:
    return vision_engine(model_dir)


def test_text_model_is_its_mistral(model_dir: Path, hf_model, engine: EngineCore) -> None:  # type: ignore[no-untyped-def]
    cfg = prepare_model(str(model_dir)).config
    assert cfg.architecture == "mistral" and cfg.vocab_size == 49155
    assert not cfg.tie_word_embeddings and not cfg.layer_windows
    assert engine.vision is not None and engine.vision.image_token_id == IMAGE_TOKEN_ID
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4
        )


def picture(width: int, height: int, seed: int):  # type: ignore[no-untyped-def]
    """A colour of the seed's plus noise (noise alone averages out in so small a model)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    colour = rng.integers(0, 192, 3)
    noise = rng.integers(0, 64, (height, width, 3))
    return Image.fromarray((colour + noise).astype(np.uint8))


def image_input(processor: Mistral3Processor, image: Any) -> ImageInput:
    raw, shape = processor.pixels(image)
    n = processor.num_tokens(*image.size)
    return ImageInput(image_hash(raw, *image.size, processor.settings), 0, n, n, shape, raw)


SIZES = [(30, 50), (64, 20), (16, 16), (48, 48), (100, 7)]


@pytest.mark.parametrize("size", SIZES)
def test_image_features_equal_transformers(size, engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    ours, hf, _ = processors
    image = picture(*size, seed=size[0])
    inputs = hf(images=[image], return_tensors="pt")
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_sizes"]
        ).pooler_output[0]
    assert engine.vision is not None
    got = engine.vision.encode(image_input(ours, image))
    assert got.shape == want.shape == (ours.num_tokens(*size), 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_images_are_refused(engine: EngineCore) -> None:
    vision = engine.vision
    assert vision is not None
    vision.check(ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(16 * 16 * 3)))
    for bad, match in [
        (ImageInput("h", 0, 4, 4, (2, 16, 16, 3), bytes(2 * 16 * 16 * 3)), r"\[1, H, W, 3\]"),
        (ImageInput("h", 0, 4, 4, (1, 16, 12, 3), bytes(16 * 12 * 3)), "8-pixel tokens"),
        (ImageInput("h", 0, 8, 8, (1, 16, 16, 3), bytes(16 * 16 * 3)), "takes 4 image tokens"),
        (ImageInput("h", 0, 4, 4, (1, 16, 16, 3), bytes(10)), "pixel bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            vision.check(bad)


# a Mistral-style turn; "{}" where each image part was
CHAT = "<s>[INST]{} Describe {} briefly.[/INST]"
CASES: list[tuple[list[tuple[int, int]], int]] = [
    ([(30, 50)], 0),  # a tall image: rows with breaks
    ([(30, 50)], 100),  # the same tokens over another image
    ([(64, 20), (48, 48)], 2),  # two images
    ([(16, 16)], 3),  # two rows of two
]


def request_for(processors, sizes, seed: int):  # type: ignore[no-untyped-def]
    """``(prompt ids, ImageInputs, transformers' inputs)`` for images of ``sizes``."""
    ours, hf, tokenizer = processors
    images = [picture(w, h, seed=seed + k) for k, (w, h) in enumerate(sizes)]
    marks = [ours.expand(*im.size) for im in images] + ["it"] * (2 - len(images))
    ids = tokenizer(CHAT.format(*marks), add_special_tokens=False)["input_ids"]
    inputs = dict(hf(images=images, return_tensors="pt"))
    inputs["input_ids"] = torch.tensor([ids])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    prepared = []
    for im in images:
        raw, shape = ours.pixels(im)
        prepared.append(
            (image_hash(raw, *im.size, ours.settings), ours.num_tokens(*im.size), raw, shape)
        )
    return ids, image_inputs(ids, ours.image_token_id, prepared), inputs


def hf_generate(hf_model, inputs) -> list[int]:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def engine_generate(
    engine: EngineCore,
    requests: dict[str, tuple[list[int], list[ImageInput]]],
    steps: list[int] | None = None,
) -> dict[str, list[int]]:
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
    out = {}
    for k, (sizes, seed) in enumerate(CASES):
        ids, spans, inputs = request_for(processors, sizes, seed)
        out[f"r{k}"] = (ids, spans, hf_generate(hf_model, inputs))
    # the premise of comparing tokens: the image decides them (r0 and r1 differ only there)
    assert out["r0"][0] == out["r1"][0] and out["r0"][2] != out["r1"][2]
    return out


def test_prompt_logits_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    for sizes, seed in CASES[::2]:
        ids, spans, inputs = request_for(processors, sizes, seed)
        with torch.no_grad():
            want = hf_model(**inputs).logits[0]
        torch.testing.assert_close(
            image_prompt_logits(engine, ids, spans), want, atol=1e-4, rtol=1e-4
        )


def test_generate_equals_transformers(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """Each request alone, then all in one batch, with the prefix cache on (r1 follows
    r0 with the same tokens over another image)."""
    engine = vision_engine(model_dir)
    for rid, (ids, spans, want) in expected.items():
        assert engine_generate(engine, {rid: (ids, spans)})[rid] == want, rid
    got = engine_generate(engine, {rid: (ids, spans) for rid, (ids, spans, _) in expected.items()})
    assert got == {rid: want for rid, (_, _, want) in expected.items()}


def test_different_images_never_share_blocks(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
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
    engine = vision_engine(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    for rid, (ids, spans, want) in expected.items():
        steps: list[int] = []
        assert engine_generate(engine, {rid: (ids, spans)}, steps)[rid] == want, rid
        assert (len(ids) > budget) == (steps[0] > MAX_TOKENS)


def test_default_format_agrees(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
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


def test_llm_chat_with_an_image_equals_transformers(model_dir: Path, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    """The offline API end to end: ``LLM.chat`` with an image part (the processor the
    registry picks, the ``[IMG]`` placeholder expanded with its row breaks, the span)
    against transformers' generate on the prompt it built, with its own pixels."""
    from structllm.llm import LLM

    _, hf, _ = processors
    llm = LLM(model=str(model_dir), kv_cache_memory=16 << 20, **EXACT)
    image = picture(40, 24, seed=7)
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_pil", "image_pil": image}]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    (out,) = llm.chat([{"role": "user", "content": content}], greedy)
    ids = out.prompt_token_ids
    assert ids.count(IMAGE_TOKEN_ID) == 15  # 40x24: 5x3 tokens, in 3 rows
    pixels = hf(images=[image], return_tensors="pt")
    prompt = torch.tensor([ids])
    with torch.no_grad():
        want = hf_model.generate(
            input_ids=prompt,
            pixel_values=pixels["pixel_values"],
            image_sizes=pixels["image_sizes"],
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids == want
