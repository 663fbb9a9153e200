"""Gemma 3 with images, on a tiny seeded checkpoint with its vision tower
(``tests.support.vision``): the front end's processor against transformers'; the image
features and greedy generation of the exact float32 path against transformers' (its
bidirectional image attention included, past the sliding window); chunked prefill,
prefix caching keyed by image, the encoder cache and preemption each leaving outputs
unchanged; bad image spans refused as error deltas."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.engine.runner import ModelRunner
from structllm.protocol import AddRequest, ImageInput, SamplingParams
from tests.support.models import EXACT, tiny_family_dir
from tests.support.vision import (
    gemma3_vision_dir,
    hf_processor,
    processor_for,
    prompt_with_images,
    random_image,
)
from tests.support.vision_checks import (
    greedy_with_logprobs,
    hf_vision_model,
    image_prefill_logits,
    run_requests,
)

IMAGE_ID = 49153
# text before the image longer than a 16-token block, so block 0 is text only
ONE = (
    "You are looking at a photograph taken on a sunny day, describe it: "
    "<start_of_image> What is in it?"
)
TWO = "First <start_of_image> then <start_of_image> which differs, and how?"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def path(default_files: Any) -> Path:
    return gemma3_vision_dir(default_files)


@pytest.fixture(scope="module")
def hf(path: Path) -> Any:
    return hf_vision_model(path, "Gemma3ForConditionalGeneration")


def engine_for(path: Path, **kw: Any) -> EngineCore:
    config: dict[str, Any] = {"kv_cache_memory": 16 << 20, **EXACT, **kw}
    return EngineCore(EngineConfig(model=str(path), **config))


def errors(engine: EngineCore, request: AddRequest) -> str:
    engine.add_request(request)
    (d,) = engine.step().outputs
    assert d.finish_reason == "error" and d.error is not None
    return d.error


def hf_generate(hf: Any, path: Path, text: str, images: list[Any], n: int = 10) -> list[int]:
    """transformers' greedy generate from what its processor makes of ``text`` and
    ``images`` (pixel values, token_type_ids), with our BOS in front."""
    inputs = hf_processor(path)(text=text, images=images, return_tensors="pt")
    ids = torch.cat([torch.tensor([[1]]), inputs["input_ids"]], dim=1)
    types = torch.cat([torch.zeros(1, 1, dtype=torch.long), inputs["token_type_ids"]], dim=1)
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            pixel_values=inputs["pixel_values"],
            token_type_ids=types,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
        )
    return out[0, ids.shape[1] :].tolist()  # type: ignore[no-any-return]


# -- the front end's processor -------------------------------------------------------


@pytest.mark.parametrize("size", [(80, 50), (64, 64), (20, 90)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_processor_equals_transformers(path: Path, size: tuple[int, int], mode: str) -> None:
    image = random_image(3, size).convert(mode)
    ids, (im,) = prompt_with_images(path, ONE, [image])
    want = hf_processor(path)(text=ONE, images=[image], return_tensors="pt")
    assert ids == [1, *want["input_ids"][0].tolist()]  # expand: boi, 16 soft tokens, eoi
    types = want["token_type_ids"][0].tolist()
    assert [i for i, t in enumerate(types) if t] == list(range(im.offset - 1, im.offset - 1 + 16))
    assert (im.num_tokens, im.length, im.shape) == (16, 16, (1, 64, 64, 3))
    pixels = torch.frombuffer(bytearray(im.pixels), dtype=torch.uint8).view(64, 64, 3)
    normalised = ((pixels.permute(2, 0, 1).double() / 255).float() - 0.5) / 0.5
    assert torch.equal(normalised, want["pixel_values"][0])  # before rescale: equal


def test_processor_refuses_pan_and_scan(path: Path, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "processor_config.json"):
        shutil.copyfile(path / name, tmp_path / name)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**pre, "do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="pan-and-scan"):
        processor_for(tmp_path)


# -- the model against transformers --------------------------------------------------


@pytest.fixture(scope="module")
def engine(path: Path) -> EngineCore:
    return engine_for(path)


def test_image_features_equal_transformers(engine: EngineCore, hf: Any, path: Path) -> None:
    images = [random_image(1), random_image(2, (33, 77))]
    _, ims = prompt_with_images(path, TWO, images)
    pixel_values = hf_processor(path)(text=TWO, images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values).pooler_output  # [2, 16, 64]
    assert engine.vision is not None
    for im, w in zip(ims, want, strict=True):
        got = engine.vision.encode(im)
        assert got.shape == (16, 64) and (got - w).abs().max().item() < 1e-4


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_equals_transformers(engine: EngineCore, hf: Any, path: Path, backend: str) -> None:
    if backend != "auto":  # auto: the C++ kernels, which send image chunks to the reference
        engine = engine_for(path, attention_backend=backend)
    cases = [(ONE, [random_image(1)]), (TWO, [random_image(1), random_image(2, (33, 77))])]
    for k, (text, images) in enumerate(cases):
        ids, ims = prompt_with_images(path, text, images)
        assert len(ids) > 2 * 8  # the prompt crosses the sliding window (8)
        got = run_requests(engine, [AddRequest(f"g{k}", ids, GREEDY, ims)])[f"g{k}"]
        assert got == hf_generate(hf, path, text, images)


def test_prompt_logits_equal_transformers_and_need_the_rule(
    engine: EngineCore, hf: Any, path: Path
) -> None:
    """Every prompt position's logits within 1e-4 of transformers' forward pass; with
    the image attended causally they differ (so the tests above would catch its
    absence)."""
    text, images = TWO, [random_image(1), random_image(2, (33, 77))]
    ids, ims = prompt_with_images(path, text, images)
    inputs = hf_processor(path)(text=text, images=images, return_tensors="pt")
    types = torch.tensor([[0, *inputs["token_type_ids"][0].tolist()]])
    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor([ids]),
            pixel_values=inputs["pixel_values"],
            token_type_ids=types,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        ).logits[0]
    both = image_prefill_logits(engine, ids, ims)
    assert (both - want).abs().max().item() < 1e-4
    assert engine.vision is not None and engine.vision.bidirectional
    engine.vision.bidirectional = False  # type: ignore[misc]
    try:
        causal = image_prefill_logits(engine, ids, ims)
    finally:
        engine.vision.bidirectional = True  # type: ignore[misc]
    assert (both - causal).abs().max().item() > 1e-3


# -- chunking, caches, preemption ------------------------------------------------------


@pytest.fixture(scope="module")
def two_images(path: Path) -> tuple[list[int], list[ImageInput]]:
    return prompt_with_images(path, TWO, [random_image(1), random_image(2, (33, 77))])


@pytest.mark.parametrize("budget", [3, 7, 16, 20])
def test_chunked_prefill_equals_one_run(
    engine: EngineCore, path: Path, two_images: tuple[list[int], list[ImageInput]], budget: int
) -> None:
    ids, ims = two_images
    want = run_requests(engine, [AddRequest("whole", ids, GREEDY, ims)])["whole"]
    chunked = engine_for(path, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert not chunked.scheduler.split_spans  # bidirectional image attention
    steps: list[list[tuple[int, int]]] = []
    sched = chunked.scheduler.schedule
    chunked.scheduler.schedule = lambda *a, **k: record(sched(*a, **k), steps)  # type: ignore[method-assign]
    assert run_requests(chunked, [AddRequest("chunked", ids, GREEDY, ims)])["chunked"] == want
    for chunk in [c for s in steps for c in s]:  # no chunk splits an image's span
        for im in ims:
            inside = [im.offset < p < im.offset + im.length for p in chunk]
            assert not any(inside), (chunk, im.offset)


def record(out: Any, steps: list[list[tuple[int, int]]]) -> Any:
    """The scheduler's output, noting each prefill chunk's cut points (start, end)."""
    steps.append([(r.num_computed_tokens, r.num_computed_tokens + n) for r, n in out.scheduled])
    return out


def test_prefix_cache_keys_blocks_by_image(path: Path) -> None:
    engine = engine_for(path)
    a, b = random_image(1), random_image(5)
    ids_a, ims_a = prompt_with_images(path, ONE, [a])
    ids_b, ims_b = prompt_with_images(path, ONE, [b])
    assert ids_a == ids_b and ims_a[0].hash != ims_b[0].hash  # same tokens, other pixels
    first = ims_a[0].offset
    assert first > 16 and first + 16 > 32  # block 0 text only, blocks 1-2 over the image
    fresh_b = run_requests(engine_for(path), [AddRequest("b", ids_b, GREEDY, ims_b)])["b"]
    hits = []
    for rid, ids, ims in [("a", ids_a, ims_a), ("b", ids_b, ims_b), ("a2", ids_a, ims_a)]:
        out = run_requests(engine, [AddRequest(rid, ids, GREEDY, ims)])[rid]
        hits.append(engine.scheduler.kv.num_hit_tokens)
        if rid == "b":
            assert out == fresh_b  # no KV of image a behind b's placeholders
    assert hits[0] == 0
    assert hits[1] - hits[0] == 16  # only the text block before the image
    assert hits[2] - hits[1] == 16 * ((len(ids_a) - 1) // 16)  # all but the last: same image


def test_encoder_cache_hit_equals_miss(path: Path) -> None:
    engine = engine_for(path, enable_prefix_caching=False)  # the encoder cache alone
    assert isinstance(engine.runner, ModelRunner)
    cache = engine.runner.encoder_cache
    ids, ims = prompt_with_images(path, ONE, [random_image(1)])
    miss = run_requests(engine, [AddRequest("miss", ids, GREEDY, ims)])["miss"]
    assert (cache.num_hits, cache.num_misses, len(cache)) == (0, 1, 1)
    hit = run_requests(engine, [AddRequest("hit", ids, GREEDY, ims)])["hit"]
    assert cache.num_hits == 1 and cache.num_misses == 1 and hit == miss


def test_encoder_cache_is_bounded(path: Path) -> None:
    one = 16 * 64 * 4  # an image's rows: 16 x hidden 64, float32
    engine = engine_for(path, encoder_cache_memory=one)
    assert isinstance(engine.runner, ModelRunner)
    cache = engine.runner.encoder_cache
    ids, ims = prompt_with_images(path, TWO, [random_image(1), random_image(2)])
    want = run_requests(engine_for(path), [AddRequest("w", ids, GREEDY, ims)])["w"]
    assert run_requests(engine, [AddRequest("x", ids, GREEDY, ims)])["x"] == want  # both pinned
    assert cache.num_bytes <= one and len(cache) == 1  # the older one went after the step


def test_preemption_recomputes_exactly(path: Path) -> None:
    prompts = [prompt_with_images(path, ONE, [random_image(s)]) for s in (1, 2, 3, 4)]
    reqs = [
        AddRequest(f"r{k}", ids, SamplingParams(temperature=0.0, max_tokens=24), ims)
        for k, (ids, ims) in enumerate(prompts)
    ]
    want = run_requests(engine_for(path), reqs)
    # room for ~2.5 of the 4 requests' blocks: some are preempted and recomputed
    block = 2 * 6 * 2 * 16 * 16 * 4  # K and V, 6 layers, 2 KV heads of 16, 16 tokens
    tight = engine_for(path, kv_cache_memory=9 * block)
    got = run_requests(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    assert got == want
    assert isinstance(tight.runner, ModelRunner)  # recomputes took the encoder's rows kept
    assert tight.runner.encoder_cache.num_misses == 4


def test_default_format_agrees(engine: EngineCore, path: Path) -> None:
    """The default format of a directory on CPU (float16 weights through the fused CPU
    ops): the same greedy tokens as the exact path, logprobs within 1e-3."""
    default = EngineCore(EngineConfig(model=str(path), kv_cache_memory=16 << 20))
    assert default.model is not None and default.model.cpu_ops is not None
    ids, ims = prompt_with_images(path, TWO, [random_image(1), random_image(2, (33, 77))])
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)
    want, want_lp = greedy_with_logprobs(engine, AddRequest("d", ids, sp, ims))
    tokens, lps = greedy_with_logprobs(default, AddRequest("d", ids, sp, ims))
    assert tokens == want
    assert max(abs(a - b) for a, b in zip(lps, want_lp, strict=True)) < 1e-3


# -- refusals ------------------------------------------------------------------------


def test_bad_spans_are_error_deltas(engine: EngineCore, path: Path) -> None:
    ids, (im,) = prompt_with_images(path, ONE, [random_image(1)])
    bad = {
        "not within": (ids, [msgspec.structs.replace(im, offset=len(ids) - 4)]),
        "holds 15 image tokens": (ids, [msgspec.structs.replace(im, length=15)]),
        "start and end on one": (ids, [msgspec.structs.replace(im, offset=im.offset - 1)]),
        "bytes of pixels": (ids, [msgspec.structs.replace(im, pixels=im.pixels[:-1])]),
        "pan-and-scan": (ids, [msgspec.structs.replace(im, shape=(2, 64, 32, 3))]),
        "overlaps": (ids, [im, im]),
        "the prompt has 17 image tokens": ([*ids, IMAGE_ID], [im]),
    }
    for k, (what, (tokens, images)) in enumerate(bad.items()):
        assert what in errors(engine, AddRequest(f"bad{k}", tokens, GREEDY, images))
    good = run_requests(engine, [AddRequest("good", ids, GREEDY, [im])])["good"]
    assert len(good) == 10  # the engine still serves


def test_images_on_a_text_model_are_refused(path: Path, default_files: Any) -> None:
    ids, ims = prompt_with_images(path, ONE, [random_image(1)])
    ids = [t if t < 49152 else 7 for t in ids]  # within the text model's vocabulary...
    text = engine_for(tiny_family_dir("gemma3", default_files))
    assert "takes no images: it has no vision tower" in errors(
        text, AddRequest("t", ids, GREEDY, ims)
    )
    null = engine_for(path, null_model=True)  # no forward pass: it carries them
    assert "not within" in errors(null, AddRequest("n", ids[:20], GREEDY, ims))
    assert len(run_requests(null, [AddRequest("n", ids, GREEDY, ims)])["n"]) == 10


@pytest.mark.parametrize(
    ("tower", "projector"),
    [
        ("model.vision_tower.vision_model.", "model.multi_modal_projector."),
        ("vision_tower.vision_model.", "multi_modal_projector."),  # the released checkpoints'
        ("model.vision_tower.", "model.multi_modal_projector."),  # transformers 5 in memory
    ],
)
def test_every_tower_naming_loads(
    engine: EngineCore, path: Path, tmp_path: Path, tower: str, projector: str
) -> None:
    from safetensors.torch import load_file, save_file

    from structllm.model import gemma3_vision

    (weights,) = path.glob("*.safetensors")
    renamed = {
        name.replace("vision_tower.", tower, 1).replace("multi_modal_projector.", projector, 1): t
        for name, t in load_file(weights).items()
        if name.startswith(("vision_tower.", "multi_modal_projector."))
    }
    save_file(renamed, tmp_path / "model.safetensors")
    shutil.copyfile(path / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    raw = json.loads((path / "config.json").read_text())
    vision = gemma3_vision.load_vision(
        tmp_path, raw, [tmp_path / "model.safetensors"], torch.device("cpu")
    )
    _, (im,) = prompt_with_images(path, ONE, [random_image(4)])
    assert engine.vision is not None
    assert torch.equal(vision.encode(im), engine.vision.encode(im))


def test_llm_chat_with_an_image_equals_transformers(hf: Any, path: Path) -> None:
    """The offline API end to end: ``LLM.chat`` with an image part (the front end's
    decoding, placeholders and spans, then this engine) against transformers' generate
    on the prompt it built, with its own image processor's pixels."""
    import transformers

    from structllm.llm import LLM

    llm = LLM(model=str(path), kv_cache_memory=16 << 20, **EXACT)
    image = random_image(6)
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_pil", "image_pil": image}]
    (out,) = llm.chat([{"role": "user", "content": content}], GREEDY)
    ids = out.prompt_token_ids
    assert ids.count(IMAGE_ID) == 16
    processor = transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    prompt = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(
            input_ids=prompt,
            pixel_values=pixels,
            token_type_ids=(prompt == IMAGE_ID).long(),
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=10,
            do_sample=False,
        )[0, len(ids) :].tolist()
    assert out.outputs[0].token_ids == want
