"""Shared fixtures (helpers live in ``tests/support``). Real-model fixtures are
session-scoped: loading costs seconds."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without CUDA the Triton kernels run in Triton's interpreter, chosen when triton and its
# language module are first imported (test_triton_kernels.py): set it before any test
# module is collected, since some import transformers' modeling code at the top, which
# imports triton (its standard library's jit functions then refuse to be interpreted).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    from tests.support.models import EXACT

    return LLM(kv_cache_memory=256 << 20, **EXACT)


@pytest.fixture(scope="session")
def hf_model():  # type: ignore[no-untyped-def]
    """transformers' own float32 model from the same GGUF file (its own dequantiser)."""
    import torch
    from transformers import AutoModelForCausalLM

    from structllm.model.files import default_model_path
    from tests.support.models import quick_gguf_for_transformers

    path = default_model_path()
    with quick_gguf_for_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_files) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    from tests.support.models import make_tiny_hf_dir

    yield make_tiny_hf_dir(tmp_path_factory.mktemp("tiny"), default_files)


@pytest.fixture(scope="session")
def lltok(default_files):  # type: ignore[no-untyped-def]
    """The default model's tokenizer as llguidance sees it."""
    from structllm.structured import load_tokenizer

    return load_tokenizer(
        str(default_files.tokenizer_json), tuple(default_files.generation_eos_ids)
    )


@pytest.fixture
def no_shm_leaks() -> Iterator[None]:
    """Fails the test if it leaves shared memory in /dev/shm."""
    from tests.support.procs import shm_entries

    before = shm_entries()
    yield
    assert shm_entries() == before, "shared memory left in /dev/shm"


@pytest.fixture(scope="session")
def chat_sequences(request, default_files, tokenizer) -> list[tuple[list[int], int]]:  # type: ignore[no-untyped-def]
    """The fixed chat set with the exact float32 default model's greedy continuations
    (tests/support/chats.py), generated once for every agreement test and kept in the
    structllm cache (the ``llm`` fixture is loaded only to generate them)."""
    from structllm.model.files import cache_key, default_model_path
    from tests.support.chats import cached_teacher_forced_chats

    return cached_teacher_forced_chats(
        tokenizer, cache_key(default_model_path()), lambda: request.getfixturevalue("llm")
    )
