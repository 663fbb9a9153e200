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
