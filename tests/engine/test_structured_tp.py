"""Constrained decoding on a tiny random-weight model: with tensor and pipeline
parallelism (rank 0 holds the matchers; with pipeline stages the masks go to the last
stage, which samples; forced tokens reach the workers as input ids) and with a model
vocabulary padded past the tokenizer's (the padded ids must never be sampled)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from structllm import LLM, SamplingParams
from structllm.protocol import StructuredOutputs
from tests.support.models import make_tiny_hf_dir

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,8}( [0-9]{1,3}){2}"
SPECS = [
    StructuredOutputs(json=WEATHER),
    StructuredOutputs(regex=REGEX),
    StructuredOutputs(choice=["alpha", "beta", "gamma"]),
]


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory, default_files) -> Path:  # type: ignore[no-untyped-def]
    # 3 KV groups over 2 ranks, and one vocabulary id past the tokenizer's 49152
    return make_tiny_hf_dir(
        tmp_path_factory.mktemp("grammar-tp"), default_files, "qwen2",
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=101,
        vocab_size=49153, tie_word_embeddings=True,
    )  # fmt: skip


def test_constrained_tp2_matches_one_process_and_stays_in_the_tokenizer(padded_dir: Path) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=s) for s in SPECS]
    params.append(
        SamplingParams(temperature=1.0, seed=5, max_tokens=80, structured_outputs=SPECS[0])
    )
    prompts = ["Weather please:", "Code:", "Pick one:", "Again:"]
    ref = LLM(str(padded_dir), kv_cache_memory=8 << 20)
    assert ref.engine.vocab_size == 49153  # one id past the tokenizer
    want = ref.generate(prompts, params)
    with LLM(str(padded_dir), kv_cache_memory=8 << 20, tensor_parallel_size=2) as tp:
        got = tp.generate(prompts, params)
        assert tp.engine.num_live_matchers == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # pipeline stages, two batches in flight: masks taken at submission and applied on
    # the last stage, the matchers advanced when each batch completes
    with LLM(str(padded_dir), kv_cache_memory=8 << 20, pipeline_parallel_size=2) as pp:
        got = pp.generate(prompts, params)
        assert pp.engine.num_live_matchers == 0 and pp.engine.max_in_flight == 2
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o in want:
        assert o.finish_reason == "stop" and max(o.token_ids) < 49152
    jsonschema.validate(json.loads(want[0].text), WEATHER)
    jsonschema.validate(json.loads(want[3].text), WEATHER)
    assert re.fullmatch(REGEX, want[1].text)
    assert want[2].text in ("alpha", "beta", "gamma")
