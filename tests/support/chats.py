"""The fixed chat set of the default model's agreement tests (test_quant_model.py,
test_gguf_kquants.py): a text for perplexity, 32 chat prompts, and float32's greedy
continuations of them (teacher forcing: every format is scored on the tokens the
float32 model chose), generated once and kept in the structllm cache (fixture
``chat_sequences``)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "those used for wine. Books became cheaper, literacy spread across Europe, and ideas "
    "travelled faster than ever before. Scientists could share their results, reformers "
    "their arguments, and merchants their prices. Within fifty years, presses were working "
    "in more than two hundred cities."
)
CHATS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a ten year old.",
    "How do I boil an egg?",
    "Tell me a short story about a dragon.",
    "What are the benefits of exercise?",
    "List three programming languages and their uses.",
    "Why is the sky blue?",
    "How does a car engine work?",
    "Give me a recipe for pancakes.",
    "What is machine learning?",
    "Summarize the plot of Romeo and Juliet.",
    "What causes earthquakes?",
    "Write a haiku about autumn.",
    "How do vaccines work?",
    "Explain the water cycle.",
    "Describe the rules of chess briefly.",
    "What is the difference between weather and climate?",
    "Write a limerick about a cat.",
    "How do airplanes stay in the air?",
    "Give three tips for better sleep.",
    "What is the Pythagorean theorem?",
    "Explain how a rainbow forms.",
    "What do bees do in winter?",
    "Write a SQL query that counts rows in a table.",
    "Why do leaves change color in the fall?",
    "What is inflation in economics?",
    "Tell me a joke about computers.",
    "How does the internet work?",
    "Name the planets of the solar system.",
    "What is the role of the heart?",
    "Suggest a name for a bakery.",
]  # 32 x N_GREEDY = 1280 scored tokens: one token is 0.08% of agreement. At 16 chats
# the int8 MLP's Q4_0 figure moved between 96.9% and 97.7% with the attention kernel's
# summation order alone; 48 chats gave 97.55% under either kernel.
N_GREEDY = 40


def teacher_forced_chats(llm: Any, tokenizer: Any) -> list[tuple[list[int], int]]:
    """``(ids, start)``: the fixed text (``start`` 0), then each chat prompt followed by
    ``llm``'s greedy continuation of ``N_GREEDY`` tokens, which starts at ``start``."""
    from structllm import SamplingParams

    prompts = [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=N_GREEDY, ignore_eos=True)
    )
    text = tokenizer.encode(TEXT)
    return [(text, 0)] + [(p + o.token_ids, len(p)) for p, o in zip(prompts, outs, strict=True)]


def cached_teacher_forced_chats(
    tokenizer: Any, model_key: str, make_llm: Callable[[], Any]
) -> list[tuple[list[int], int]]:
    """``teacher_forced_chats`` of the exact float32 model ``make_llm()`` builds, read from
    the structllm cache when this model file (``model_key``: its cache key), these
    prompts as tokenized and this torch made them before; the model is built only on a
    miss. The continuations are only the text every format is scored on (each test
    computes its own reference logits on them), so a cached copy claims nothing less."""
    import torch

    from structllm.paths import cache_root

    prompts = [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    ident = json.dumps([model_key, torch.__version__, N_GREEDY, tokenizer.encode(TEXT), prompts])
    out = (
        cache_root()
        / "test-models"
        / f"chats-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
    )
    if out.is_file():
        return [(ids, start) for ids, start in json.loads(out.read_text())]
    seqs = teacher_forced_chats(make_llm(), tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(seqs))
    os.replace(tmp, out)  # whole or absent, whichever process writes it
    return seqs
