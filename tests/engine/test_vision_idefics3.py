"""SmolVLM (``Idefics3ForConditionalGeneration``) on the engine, against transformers
on a tiny seeded checkpoint (``tests/support/idefics3.py``): its Llama text model, and
its vision side (``model/idefics3.py``: the SigLIP tower with Idefics3's position ids,
the pixel-shuffle connector, normalisation of the front end's uint8 tiles)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.model.loader import prepare_model
from structllm.multimodal.processor import image_hash
from structllm.protocol import ImageInput
from tests.support.idefics3 import IMAGE_TOKEN_ID, tiny_idefics3_dir
from tests.support.models import EXACT, hf_logits, prefill_logits

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7, 49152, 49155, 49160]]


@pytest.fixture(scope="module")
def model_dir(default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_idefics3_dir(default_files)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    import transformers

    return transformers.Idefics3ForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()


def test_text_model_is_its_llama(model_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    files = prepare_model(str(model_dir))
    cfg = files.config
    assert cfg.architecture == "llama" and cfg.vocab_size == 49192
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 100000.0  # LlamaConfig's eps
    assert not cfg.tie_word_embeddings  # the checkpoint has its lm_head
    assert hf_model.config.image_token_id == IMAGE_TOKEN_ID
    engine = EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20, **EXACT))  # type: ignore[arg-type]
    for ids in PROMPTS:
        torch.testing.assert_close(
            prefill_logits(engine, ids), hf_logits(hf_model, ids), atol=1e-4, rtol=1e-4
        )


def picture(width: int, height: int, seed: int):  # type: ignore[no-untyped-def]
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_input(processor, image) -> ImageInput:  # type: ignore[no-untyped-def]
    """What the front end sends for ``image`` alone (span offsets are not used here)."""
    raw, shape = processor.pixels(image)
    n = processor.num_tokens(*image.size)
    return ImageInput(image_hash(raw, *image.size, processor.settings), 0, n, n, shape, raw)


@pytest.fixture(scope="module")
def vision(model_dir: Path):  # type: ignore[no-untyped-def]
    import json

    from structllm.model.idefics3 import load_vision

    raw = json.loads((model_dir / "config.json").read_text())
    return load_vision(model_dir, raw, sorted(model_dir.glob("*.safetensors")), torch.device("cpu"))


@pytest.fixture(scope="module")
def processors(model_dir: Path, hf_model):  # type: ignore[no-untyped-def]
    import transformers

    from structllm.multimodal.idefics3 import Idefics3Processor

    hf = transformers.AutoProcessor.from_pretrained(str(model_dir))
    ours = Idefics3Processor.from_model_dir(model_dir, hf.tokenizer.get_vocab().get)
    return ours, hf


# (width, height): one tile, tall and wide grids, a 2x2 grid, a 1x1 image
SIZES = [(30, 30), (20, 60), (64, 20), (64, 64), (1, 1)]


@pytest.mark.parametrize("size", SIZES)
def test_image_features_equal_transformers(size, vision, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    ours, hf = processors
    image = picture(*size, seed=size[0])
    inputs = hf(images=[[image]], text=[hf.image_token], return_tensors="pt")
    with torch.no_grad():
        want = hf_model.get_image_features(
            inputs["pixel_values"], inputs["pixel_attention_mask"]
        ).pooler_output[0]
        got = vision.encode(image_input(ours, image))
    assert got.shape == want.shape == (ours.num_tokens(*size), 64)
    assert int((inputs["input_ids"][0] == IMAGE_TOKEN_ID).sum()) == len(got)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_normalisation_is_transformers(vision, processors) -> None:  # type: ignore[no-untyped-def]
    ours, hf = processors
    image = picture(50, 40, seed=3)
    want = hf(images=[[image]], text=[hf.image_token], return_tensors="pt")["pixel_values"][0]
    raw, shape = ours.pixels(image)
    tiles = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(shape).permute(0, 3, 1, 2)
    assert torch.equal(vision.normalisation(tiles), want)


def test_position_ids_of_smaller_tiles_are_transformers() -> None:
    """Tiles smaller than the tower's image size: transformers' fractional buckets."""
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    from structllm.model.idefics3 import position_ids

    side = 8
    cfg = Idefics3VisionConfig(hidden_size=4, image_size=side * 4, patch_size=4)
    emb = Idefics3VisionEmbeddings(cfg)
    with torch.no_grad():
        emb.position_embedding.weight.copy_(
            torch.arange(side * side).float()[:, None].expand(-1, 4)
        )
        emb.patch_embedding.weight.zero_()
        emb.patch_embedding.bias.zero_()
        for grid in (side, 5, 3, 1):
            pixels = torch.zeros(1, 3, grid * 4, grid * 4)
            mask = torch.ones(1, grid, grid, dtype=torch.bool)
            want = emb(pixels, mask)[0, :, 0].long()
            assert torch.equal(position_ids(grid, grid, side), want), grid


def test_bad_images_are_refused(vision) -> None:  # type: ignore[no-untyped-def]
    good = ImageInput("h", 0, 4, 4, (1, 32, 32, 3), bytes(32 * 32 * 3))
    vision.check(good)
    for bad, match in [
        (ImageInput("h", 0, 4, 4, (1, 32, 16, 3), bytes(32 * 16 * 3)), "square RGB tiles"),
        (ImageInput("h", 0, 4, 4, (1, 20, 20, 3), bytes(20 * 20 * 3)), "whole number"),
        (ImageInput("h", 0, 8, 8, (1, 32, 32, 3), bytes(32 * 32 * 3)), "take 4 image tokens"),
        (ImageInput("h", 0, 4, 4, (1, 32, 32, 3), bytes(10)), "pixel bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            vision.check(bad)


# a SmolVLM-style chat turn; "{}" where each image part was
CHAT = "<|im_start|>User:{} Describe {} briefly.<end_of_utterance>\nAssistant:"
# the images of one prompt as (width, height), the seed of their pixels, and the
# processor's longest edge (None: the checkpoint's 64)
CASES: list[tuple[list[tuple[int, int]], int, int | None]] = [
    ([(64, 64)], 0, None),  # a 2x2 grid and the global image
    ([(64, 64)], 100, None),  # the same tokens over another image
    ([(30, 30)], 1, 32),  # one tile: the global image alone
    ([(20, 60), (64, 20)], 2, None),  # two images: a tall grid, a wide one
]
MAX_TOKENS = 10


def request_for(processors, sizes, seed: int, longest: int | None = None):  # type: ignore[no-untyped-def]
    """``(prompt ids, ImageInputs, transformers' inputs)`` for images of ``sizes`` in
    ``CHAT``: our expansion and spans beside transformers' processor's output."""
    import dataclasses

    from structllm.multimodal.processor import image_inputs

    ours, hf = processors
    kw = {}
    if longest is not None:
        ours = dataclasses.replace(ours, longest_edge=longest)
        kw = {"size": {"longest_edge": longest}}
    images = [picture(w, h, seed=seed + k) for k, (w, h) in enumerate(sizes)]
    marks = [hf.image_token] * len(images) + ["it"] * (2 - len(images))
    text = CHAT.format(*marks)
    inputs = hf(images=[images], text=[text], return_tensors="pt", **kw)
    parts = text.split(hf.image_token)
    expanded = parts[0] + "".join(
        ours.expand(*im.size) + rest for im, rest in zip(images, parts[1:], strict=True)
    )
    ids = hf.tokenizer(expanded)["input_ids"]
    assert ids == inputs["input_ids"][0].tolist()  # our expansion is transformers'
    pixels = [ours.pixels(im) for im in images]
    spans = image_inputs(
        ids,
        ours.image_token_id,
        [
            (image_hash(raw, *im.size, ours.settings), ours.num_tokens(*im.size), raw, shape)
            for im, (raw, shape) in zip(images, pixels, strict=True)
        ],
    )
    return ids, spans, inputs


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
    from structllm.protocol import AddRequest, SamplingParams

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


def vision_engine(model_dir: Path, **kw: object) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20, **EXACT, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def expected(processors, hf_model):  # type: ignore[no-untyped-def]
    """Each case's request and transformers' greedy tokens for it."""
    out = {}
    for k, (sizes, seed, longest) in enumerate(CASES):
        ids, spans, inputs = request_for(processors, sizes, seed, longest)
        out[f"r{k}"] = (ids, spans, hf_generate(hf_model, inputs))
    # the premise of comparing tokens: the image decides them (r0 and r1 differ only there)
    assert out["r0"][0] == out["r1"][0] and out["r0"][2] != out["r1"][2]
    return out


def test_generate_equals_transformers(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """Each request alone, then all in one batch. With the prefix cache on: r1 follows
    r0 with the same tokens over another image, so sharing a block over the image
    would show; the batch repeats every image, so its blocks come from the cache."""
    engine = vision_engine(model_dir)
    assert engine.vision is not None and not engine.vision.bidirectional
    for rid, (ids, spans, want) in expected.items():
        assert engine_generate(engine, {rid: (ids, spans)})[rid] == want, rid
    got = engine_generate(engine, {rid: (ids, spans) for rid, (ids, spans, _) in expected.items()})
    assert got == {rid: want for rid, (_, _, want) in expected.items()}


@pytest.mark.parametrize("budget", [5, 16, 37])
def test_chunked_prefill_equals_one_run(model_dir: Path, expected, budget: int) -> None:  # type: ignore[no-untyped-def]
    """Prompts cut into chunks of ``budget`` tokens (never inside an image's span) give
    the tokens of one run; no prefix cache, so every chunk is computed."""
    engine = vision_engine(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    for rid, (ids, spans, want) in expected.items():
        steps: list[int] = []
        assert engine_generate(engine, {rid: (ids, spans)}, steps)[rid] == want, rid
        # more steps than one prefill and the decodes exactly when the prompt was cut
        assert (len(ids) > budget) == (steps[0] > MAX_TOKENS)


@pytest.mark.parametrize(("side", "factor"), [(4, 2), (8, 4), (6, 3)])
def test_pixel_shuffle_is_transformers(side: int, factor: int) -> None:
    """SmolVLM-256M/500M shuffle by 4 (32x32 patches -> 64 rows); the tiny model by 2."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    from structllm.model.idefics3 import pixel_shuffle

    x = torch.randn(3, side * side, 5)
    want = Idefics3Connector.pixel_shuffle(None, x, factor)  # type: ignore[arg-type]
    assert torch.equal(pixel_shuffle(x, factor), want)


def test_default_format_agrees(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """The default format on CPU (float16 weights through the fused CPU ops; the tower in
    float32): transformers' greedy tokens, logprobs within 1e-3 of the exact path's."""
    from structllm.protocol import AddRequest, SamplingParams

    default = EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory=32 << 20))
    assert default.model is not None and default.model.cpu_ops is not None
    exact = vision_engine(model_dir)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    for rid in ("r0", "r3"):
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
