"""Shared fixtures. Real-model fixtures are session-scoped: loading costs seconds."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from structllm.model.files import ModelFiles

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The exact float32 path (today's, token for token equal to transformers); the default
# formats (--dtype/--quantization auto) run GGUF blocks or float16 weights on CPU.
EXACT = {"dtype": "float32", "quantization": "none"}


@pytest.fixture(scope="session")
def default_files():  # type: ignore[no-untyped-def]
    from structllm.model.loader import prepare_model

    return prepare_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_files):  # type: ignore[no-untyped-def]
    from structllm.tokenizer import Tokenizer

    return Tokenizer.from_files(default_files)


@pytest.fixture(scope="session")
def llm():  # type: ignore[no-untyped-def]
    from structllm import LLM

    return LLM(kv_cache_memory=256 << 20, **EXACT)


@pytest.fixture(scope="session")
def hf_model():  # type: ignore[no-untyped-def]
    """transformers' own float32 model from the same GGUF file (its own dequantiser)."""
    import torch
    from transformers import AutoModelForCausalLM

    from structllm.model.files import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def make_tiny_hf_dir(root: Path, files: ModelFiles, arch: str = "llama", **overrides: object) -> Path:
    """A random-weight Hugging Face checkpoint of a tiny model, saved by transformers,
    with the default model's tokenizer and chat template."""
    import torch
    import transformers

    torch.manual_seed(0)
    kw: dict[str, object] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # random biases, so a missing bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    out = root / f"tiny-{arch}"
    model.save_pretrained(out, safe_serialization=True)
    shutil.copyfile(files.tokenizer_json, out / "tokenizer.json")
    meta = files.tokenizer_meta
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": meta.bos_token, "eos_token": meta.eos_token, "chat_template": meta.chat_template})
    )
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_files) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    yield make_tiny_hf_dir(tmp_path_factory.mktemp("tiny"), default_files)
