"""The offline API's inputs, outputs and errors (tiny random model: fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structllm import LLM, SamplingParams
from structllm.config import EngineConfig
from structllm.protocol import AddRequest


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), kv_cache_memory=16 << 20, max_model_len=256)


GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_accepts_string_ids_chat_and_lists_of_them(tiny: LLM) -> None:
    chat = [{"role": "user", "content": "hi"}]
    one_str = tiny.generate("hello", GREEDY)
    one_ids = tiny.generate(tiny.tokenizer.encode("hello"), GREEDY)
    one_chat = tiny.generate(chat, GREEDY)
    many = tiny.generate(["hello", tiny.tokenizer.encode("hello"), chat], GREEDY)
    assert len(one_str) == len(one_ids) == len(one_chat) == 1 and len(many) == 3
    assert one_str[0].token_ids == one_ids[0].token_ids == many[0].token_ids == many[1].token_ids
    assert one_chat[0].token_ids == many[2].token_ids
    assert one_chat[0].prompt_token_ids == tiny.tokenizer.encode_chat(chat)
    assert tiny.chat(chat, GREEDY)[0].token_ids == one_chat[0].token_ids


def test_output_fields(tiny: LLM) -> None:
    out = tiny.generate("hello", GREEDY)[0]
    assert out.prompt == "hello"
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.text == tiny.tokenizer.decode(out.token_ids)
    assert out.num_cached_tokens == 0 and out.logprobs is None


def test_n_returns_n_completions(tiny: LLM) -> None:
    out = tiny.generate(
        "hello", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_per_prompt_sampling_params(tiny: LLM) -> None:
    outs = tiny.generate(
        ["a", "b"],
        [
            SamplingParams(max_tokens=2, ignore_eos=True),
            SamplingParams(max_tokens=4, ignore_eos=True),
        ],
    )
    assert [len(o.token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        tiny.generate(["a"], [GREEDY, GREEDY])


def test_max_tokens_is_capped_by_max_model_len(tiny: LLM) -> None:
    ids = list(range(10, 250))
    out = tiny.generate(ids, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(ids) + len(out.token_ids) == 256 and out.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([5] * 256, "max_model_len is 256"),
        ([1, 2, 10**9], "outside the vocabulary"),
        ([1, -1], "outside the vocabulary"),
        ("", "prompt is empty"),
    ],
)
def test_bad_prompts_raise_and_leave_the_engine_clean(
    tiny: LLM, prompt: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tiny.generate(["fine", prompt], GREEDY)  # type: ignore[list-item]
    assert not tiny.engine.has_work
    assert tiny.generate("still works", GREEDY)[0].finish_reason == "length"


def test_n_is_fanned_out_before_the_engine_which_refuses_n_above_one(tiny: LLM) -> None:
    sp = SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True)
    assert len(tiny.generate("hello", sp)[0].outputs) == 2
    tiny.engine.add_request(AddRequest("n2", [1, 2], sp))
    (delta,) = tiny.engine.step().outputs
    assert delta.finish_reason == "error" and "SamplingParams.n is 2" in (delta.error or "")
    assert not tiny.engine.has_work


def test_wrong_prompt_types_raise_type_error(tiny: LLM) -> None:
    with pytest.raises(TypeError):
        tiny.generate(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompt 1"):
        tiny.generate(["ok", {"role": "user"}])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 12}, "power of two"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"device": "tpu"}, "device"),
        ({"attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_bad_engine_config_is_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_max_model_len_beyond_the_kv_cache_is_rejected(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM(str(tiny_llama_dir), kv_cache_memory=1 << 16, max_model_len=512)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        LLM(str(tiny_llama_dir), max_model_len=100_000)


UNIT_TOOL = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
        },
    },
}


def test_chat_with_tools_returns_calls(tiny: LLM) -> None:
    import json

    chat = [{"role": "user", "content": "Use Celsius."}]
    [out] = tiny.chat(
        chat,
        SamplingParams(temperature=0, max_tokens=60),
        tools=[UNIT_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert out.finish_reason == "tool_calls" and out.text == ""
    [call] = out.outputs[0].tool_calls or []
    assert call.name == "set_unit" and json.loads(call.arguments)["unit"] in (
        "celsius",
        "fahrenheit",
    )
    assert "set_unit" in tiny.tokenizer.decode(out.prompt_token_ids)  # described in the prompt


# a reply in GLM-4.5's and Qwen3-Coder's syntaxes (call_formats), forced on the tiny
# random model by a grammar (the families' auto choice leaves the output free)
FAMILY_REPLIES = {
    "glm45": "Sure.<tool_call>set_unit\n<arg_key>unit</arg_key>\n<arg_value>celsius"
    "</arg_value>\n</tool_call>",
    "qwen3_coder": "Sure.<tool_call>\n<function=set_unit>\n<parameter=unit>\ncelsius\n"
    "</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("fmt", sorted(FAMILY_REPLIES))
def test_chat_parses_a_familys_calls(tiny_llama_dir: Path, fmt: str) -> None:
    from structllm.protocol import StructuredOutputs

    llm = LLM(
        str(tiny_llama_dir), kv_cache_memory=16 << 20, max_model_len=256, tool_call_parser=fmt
    )
    try:
        reply = FAMILY_REPLIES[fmt]
        forced = StructuredOutputs(grammar=f"start: {json.dumps(reply)}\n")
        chat = [{"role": "user", "content": "Use Celsius."}]
        [out] = llm.chat(
            chat,
            SamplingParams(temperature=0, max_tokens=80, structured_outputs=forced),
            tools=[UNIT_TOOL],
        )
        assert out.finish_reason == "tool_calls" and out.outputs[0].text == "Sure."
        [call] = out.outputs[0].tool_calls or []
        assert (call.name, json.loads(call.arguments)) == ("set_unit", {"unit": "celsius"})
        # cut by max_tokens after the name: the call so far, finishing with "length"
        n = len(llm.tokenizer.encode(reply[: reply.index("unit") + 12], add_special_tokens=False))
        [cut] = llm.chat(
            chat,
            SamplingParams(temperature=0, max_tokens=n, structured_outputs=forced),
            tools=[UNIT_TOOL],
        )
        assert cut.finish_reason == "length"
        assert [c.name for c in cut.outputs[0].tool_calls or []] == ["set_unit"]
    finally:
        llm.close()


def test_chat_with_bad_tools_raises(tiny: LLM) -> None:
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="not in tools"):
        tiny.chat(
            chat,
            GREEDY,
            tools=[UNIT_TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters"):
        tiny.chat(chat, GREEDY, tools=[bad])


def test_generation_config_gives_the_default_sampling_params(tmp_path, default_files) -> None:  # type: ignore[no-untyped-def]
    from tests.support.models import EXACT, tiny_family_dir, with_generation_config

    settings = {"temperature": 0.0, "top_k": 20, "eos_token_id": 2}
    path = with_generation_config(tiny_family_dir("qwen3", default_files), tmp_path / "m", settings)
    llm = LLM(str(path), kv_cache_memory=32 << 20, **EXACT)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.top_p) == (0.0, 20, 1.0)
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0))]
    assert [o.token_ids for o in llm.generate(prompts)] == greedy
    api = LLM(str(path), kv_cache_memory=32 << 20, generation_config="vllm", **EXACT)
    assert api.get_default_sampling_params().temperature == 1.0


def test_chat_takes_image_parts_for_a_model_that_takes_images(
    tiny: LLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import base64
    import io

    from PIL import Image

    from tests.support.fake_vision import TOKENS, FakeProcessor

    buf = io.BytesIO()
    Image.new("RGB", (6, 6), (200, 0, 0)).save(buf, "PNG")
    (tmp_path / "red.png").write_bytes(buf.getvalue())
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what colour?"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "image_url", "image_url": {"url": str(tmp_path / "red.png")}},
                {"type": "image_pil", "image_pil": Image.new("RGB", (6, 6), (0, 0, 200))},
            ],
        }
    ]
    assert tiny.image_processor is None  # a text checkpoint
    with pytest.raises(ValueError, match="takes no images"):
        tiny.chat(chat, GREEDY)
    monkeypatch.setattr(
        tiny, "image_processor", FakeProcessor.from_model_dir(None, tiny.tokenizer.token_id)
    )
    sent: list[AddRequest] = []
    add = tiny.engine.add_request

    def record(r: AddRequest) -> None:
        sent.append(r)
        add(r)

    monkeypatch.setattr(tiny.engine, "add_request", record)
    # the engine refuses images on a model without a vision tower (test_vision_gemma3):
    # here it lets them through and, with no vision side, leaves the token embeddings
    monkeypatch.setattr(tiny.engine, "check_images", lambda ids, images: None)
    [out] = tiny.chat(chat, GREEDY)
    assert out.prompt_token_ids.count(6) == 3 * TOKENS and len(out.outputs[0].token_ids) == 5
    [req] = sent
    assert [i.num_tokens for i in req.images] == [TOKENS] * 3
    assert req.images[0].hash == req.images[1].hash != req.images[2].hash  # same pixels
    bad = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
        }
    ]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: .*not an image"):
        tiny.chat(bad, GREEDY)


def test_chat_speaks_harmony_to_gpt_oss(default_files) -> None:  # type: ignore[no-untyped-def]
    # a gpt-oss whose vocabulary has harmony's markers: the prompt is harmony's and the
    # reply (forced by a grammar over the markers) is parsed into reasoning and a call
    from structllm.protocol import StructuredOutputs
    from tests.support.models import tiny_gpt_oss_harmony_dir

    grammar = (
        'start: <|channel|> "analysis" <|message|> "Use f." <|end|> <|start|> '
        '"assistant to=functions.f" <|channel|> "commentary json" <|message|> "{}" <|call|>'
    )
    tool = {"type": "function", "function": {"name": "f", "description": "Do f."}}
    sp = SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputs(grammar=grammar)
    )
    path = tiny_gpt_oss_harmony_dir(default_files)
    with LLM(str(path), kv_cache_memory=16 << 20, max_model_len=256) as llm:
        assert llm.harmony
        [out] = llm.chat(
            [{"role": "user", "content": "hi"}],
            sp,
            tools=[tool],
            chat_template_kwargs={"reasoning_effort": "high"},
        )
        prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    [c] = out.outputs
    assert (c.reasoning_content, c.text, c.finish_reason) == ("Use f.", "", "tool_calls")
    assert [(t.name, t.arguments) for t in c.tool_calls or []] == [("f", "{}")]
    assert c.num_reasoning_tokens > 0
    assert "\n\nReasoning: high\n\n" in prompt and "type f = () => any;" in prompt
    assert prompt.endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
