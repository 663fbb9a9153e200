"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``) on the engine, against
transformers on a tiny seeded checkpoint (``tests/support/qwen3_vl.py``): its hybrid
text model (Gated DeltaNet and gated attention, ``model/qwen3_5.py``; text alone in
``tests/engine/test_hybrid.py``) taking the image rows as its input embeddings and
interleaved 3-D rotary positions on a partial rotary, and Qwen3-VL's tower without
deepstack (``model/qwen3_vl.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structllm.engine.core import EngineCore
from structllm.engine.mrope import MRopePositions
from structllm.engine.runner import ModelRunner
from structllm.model.loader import prepare_model
from structllm.multimodal.qwen2_5_vl import Qwen2_5_VLProcessor
from tests.support.qwen3_vl import (
    CASES,
    PROCESSOR_SETTINGS,
    hf_processor,
    request_for,
    tiny_qwen3_vl_dir,
)
from tests.support.vision_checks import (
    assert_prompt_logits_equal,
    check_generate_equals_transformers,
    check_split_spans_equal_one_run,
    engine_generate,
    expected_greedy,
    hf_vision_model,
    image_input,
    picture,
    vision_engine,
)

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(default_files) -> Path:  # type: ignore[no-untyped-def]
    return tiny_qwen3_vl_dir(default_files, qwen3_5=True)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    return hf_vision_model(model_dir, "Qwen3_5ForConditionalGeneration")


@pytest.fixture(scope="module")
def processors(model_dir: Path):  # type: ignore[no-untyped-def]
    hf = hf_processor(model_dir / "tokenizer.json", **PROCESSOR_SETTINGS)
    ours = Qwen2_5_VLProcessor.from_model_dir(model_dir, hf.tokenizer.get_vocab().get)
    return ours, hf


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EngineCore:
    return vision_engine(model_dir)


def test_features_and_positions_equal_transformers(
    model_dir: Path,
    engine: EngineCore,
    processors,  # type: ignore[no-untyped-def]
    hf_model,  # type: ignore[no-untyped-def]
) -> None:
    cfg = prepare_model(str(model_dir)).config
    assert cfg.architecture == "qwen3_5" and cfg.mrope_interleaved
    assert cfg.mrope_section == [2, 1, 1] and cfg.rotary_dim == 8
    assert engine.vision is not None and engine.vision.deepstack == 0
    ours, hf = processors
    image = picture(30, 50, seed=1)
    inputs = hf(images=[image], text=[ours.placeholder], return_tensors="pt")
    with torch.no_grad():
        want = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output[0]
    got = engine.vision.encode(image_input(ours, image))
    assert got.shape == want.shape == (ours.num_tokens(30, 50), 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for sizes, seed in CASES:
        ids, spans, inputs = request_for(processors, sizes, seed)
        pos, _ = hf_model.model.get_rope_index(
            input_ids=inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
        )
        mrope = engine._mrope(spans)
        assert isinstance(mrope, MRopePositions)
        hw = mrope.spatial(0, len(ids))
        assert hw is not None
        assert torch.equal(torch.tensor([mrope.flat(0, len(ids)), *hw]), pos[:, 0]), sizes


def test_prompt_logits_equal_transformers(engine: EngineCore, processors, hf_model) -> None:  # type: ignore[no-untyped-def]
    ids, spans, inputs = request_for(processors, *CASES[2])
    assert_prompt_logits_equal(engine, hf_model, ids, spans, inputs)


@pytest.fixture(scope="module")
def expected(processors, hf_model):  # type: ignore[no-untyped-def]
    requests = {
        f"r{k}": request_for(processors, sizes, seed) for k, (sizes, seed) in enumerate(CASES)
    }
    return expected_greedy(hf_model, requests, MAX_TOKENS)


def test_generate_equals_transformers(engine: EngineCore, expected) -> None:  # type: ignore[no-untyped-def]
    check_generate_equals_transformers(engine, expected, MAX_TOKENS)


def test_encoder_cache_hit_equals_miss(engine: EngineCore, expected) -> None:  # type: ignore[no-untyped-def]
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    ids, spans, want = expected["r2"]
    runner.encoder_cache.clear()
    misses = runner.encoder_cache.num_misses
    assert engine_generate(engine, {"a": (ids, spans)}, MAX_TOKENS)["a"] == want
    engine.kv.reset_prefix_cache()
    assert engine_generate(engine, {"b": (ids, spans)}, MAX_TOKENS)["b"] == want
    assert runner.encoder_cache.num_misses == misses + 2  # the second run: hits only


def test_split_spans_equal_one_run(model_dir: Path, expected) -> None:  # type: ignore[no-untyped-def]
    """r0's image in chunks of 8: the recurrent states carried across a cut span."""
    check_split_spans_equal_one_run(model_dir, expected, "r0", 8, MAX_TOKENS)


def test_moe_with_an_image_equals_transformers(default_files) -> None:  # type: ignore[no-untyped-def]
    """Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``): the same tower beside its
    experts; every prompt position's logits with two images within 1e-4 of
    transformers' (the dense model's tests cover the rest of the path)."""
    model_dir = tiny_qwen3_vl_dir(default_files, moe=True)
    hf_model = hf_vision_model(model_dir, "Qwen3_5MoeForConditionalGeneration")
    hf = hf_processor(model_dir / "tokenizer.json", **PROCESSOR_SETTINGS)
    ours = Qwen2_5_VLProcessor.from_model_dir(model_dir, hf.tokenizer.get_vocab().get)
    engine = vision_engine(model_dir)
    assert prepare_model(str(model_dir)).config.num_experts == 4
    ids, spans, inputs = request_for((ours, hf), *CASES[2])
    assert_prompt_logits_equal(engine, hf_model, ids, spans, inputs)
