"""Which model families structllm runs, and by what names a checkpoint asks for them
(vLLM's registry, in small): a Hugging Face ``config.json``'s ``architectures`` (or its
``model_type``), a GGUF file's ``general.architecture``. No torch here: the front end
and the CLI read this to refuse an unsupported model at start and to list what is
supported.

A family is a ``ModelConfig`` reading of its config (``config.FAMILY_OPTIONS``), its
GGUF metadata and tensor names (``gguf``), and a module ``structllm.model.<module>`` that
holds its model class (``MODEL``) and its Hugging Face tensor names (``hf_to_native``),
imported only by the engine (``model_class``). Adding one is a module, an entry here and
its tests; see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    module: str  # structllm.model.<module>
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]  # config.json's model_type, when architectures is absent
    gguf_architectures: tuple[str, ...]


FAMILIES: tuple[Family, ...] = (
    # Idefics3ForConditionalGeneration (SmolVLM): its text model (config.TEXT_MODELS)
    Family(
        "llama",
        "llama",
        ("LlamaForCausalLM", "Idefics3ForConditionalGeneration"),
        ("llama",),
        ("llama",),
    ),
    # Mistral3ForConditionalGeneration (Mistral Small 3.1, 3.2): its text model
    Family(
        "mistral",
        "llama",
        ("MistralForCausalLM", "Mistral3ForConditionalGeneration"),
        ("mistral",),
        ("mistral", "mistral3"),  # mistral3: Mistral 3.1's text model (llama.cpp's name)
    ),
    # Qwen2_5_VLForConditionalGeneration: its text model (config.TEXT_MODELS), M-RoPE
    Family(
        "qwen2",
        "llama",
        ("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"),
        ("qwen2",),
        ("qwen2", "qwen2vl"),  # qwen2vl: Qwen2(.5)-VL's text model, with M-RoPE sections
    ),
    # Qwen3VLForConditionalGeneration: its text model (config.TEXT_MODELS), interleaved
    # M-RoPE; qwen3vl: llama.cpp's name for it
    Family("qwen3", "qwen3", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3", "qwen3vl")),
    Family("gemma", "gemma", ("GemmaForCausalLM",), ("gemma",), ("gemma",)),
    Family("gemma2", "gemma", ("Gemma2ForCausalLM",), ("gemma2",), ("gemma2",)),
    # Gemma3ForConditionalGeneration (4B and up): its text model (config.TEXT_MODELS)
    Family(
        "gemma3",
        "gemma",
        ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        ("gemma3_text",),
        ("gemma3", "gemma-embedding"),  # (EmbeddingGemma's: model.gguf)
    ),
    # Gemma4ForConditionalGeneration: its text model (config.TEXT_MODELS)
    Family(
        "gemma4",
        "gemma4",
        ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
        ("gemma4_text",),
        ("gemma4",),
    ),
    # Gemma 3n: Gemma 4's per-layer inputs and KV sharing, AltUp's streams, LAuReL;
    # Gemma3nForConditionalGeneration (as published): its text model (config.TEXT_MODELS)
    Family(
        "gemma3n",
        "gemma3n",
        ("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration"),
        ("gemma3n_text",),
        ("gemma3n",),
    ),
    Family("phi3", "phi3", ("Phi3ForCausalLM",), ("phi3",), ("phi3",)),
    Family("olmo2", "olmo2", ("Olmo2ForCausalLM",), ("olmo2",), ("olmo2",)),
    # llama.cpp writes OLMo 3 as "olmo2" with a sliding window (gguf.model_config)
    Family("olmo3", "olmo2", ("Olmo3ForCausalLM",), ("olmo3",), ()),
    Family("granite", "granite", ("GraniteForCausalLM",), ("granite",), ("granite",)),
    Family("glm4", "glm4", ("Glm4ForCausalLM",), ("glm4",), ("glm4",)),
    Family("ernie4_5", "ernie4_5", ("Ernie4_5ForCausalLM",), ("ernie4_5",), ("ernie4_5",)),
    Family("exaone4", "exaone4", ("Exaone4ForCausalLM",), ("exaone4",), ("exaone4",)),
    Family("smollm3", "smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), ("smollm3",)),
    # classic layouts: LayerNorms with biases, parallel blocks (model/classic.py)
    Family("stablelm", "stablelm", ("StableLmForCausalLM",), ("stablelm",), ("stablelm",)),
    Family("phi", "phi", ("PhiForCausalLM",), ("phi",), ("phi2",)),
    Family("gpt_neox", "gpt_neox", ("GPTNeoXForCausalLM",), ("gpt_neox",), ("gptneox",)),
    Family(
        "starcoder2", "starcoder2", ("Starcoder2ForCausalLM",), ("starcoder2",), ("starcoder2",)
    ),
    Family("cohere", "cohere", ("CohereForCausalLM",), ("cohere",), ("command-r",)),
    # Command R7B: windowed layers with rotary, global ones without
    Family("cohere2", "cohere", ("Cohere2ForCausalLM",), ("cohere2",), ("cohere2",)),
    Family("nemotron", "nemotron", ("NemotronForCausalLM",), ("nemotron",), ("nemotron",)),
    # learned absolute positions, no rotary
    Family("gpt2", "gpt2", ("GPT2LMHeadModel",), ("gpt2",), ("gpt2",)),
    Family("gpt_bigcode", "gpt2", ("GPTBigCodeForCausalLM",), ("gpt_bigcode",), ("starcoder",)),
    Family("falcon", "falcon", ("FalconForCausalLM",), ("falcon",), ("falcon",)),
    # mixtures of experts (llama.cpp writes Mixtral as "llama" with an expert_count,
    # which gguf.model_config reads as this family)
    Family("mixtral", "moe", ("MixtralForCausalLM",), ("mixtral",), ()),
    Family("qwen3_moe", "moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",)),
    Family("qwen2_moe", "moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), ("qwen2moe",)),
    # GLM-4.5/4.6(-Air): DeepSeek-V3's grouped sigmoid routing, shared experts
    Family("glm4_moe", "glm4_moe", ("Glm4MoeForCausalLM",), ("glm4_moe",), ("glm4moe",)),
    # Llama 4: chunked local attention with rotary, global NoPE layers, a shared expert
    # (Llama4ForConditionalGeneration: its text model, config.TEXT_MODELS)
    Family(
        "llama4",
        "llama4",
        ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
        ("llama4_text",),
        ("llama4",),
    ),
    # multi-head latent attention (a latent KV cache), grouped routing, shared experts
    # (llama.cpp's deepseek2 is both: V3 by its sigmoid gating, gguf.model_config)
    Family("deepseek_v2", "deepseek", ("DeepseekV2ForCausalLM",), ("deepseek_v2",), ("deepseek2",)),
    Family("deepseek_v3", "deepseek", ("DeepseekV3ForCausalLM",), ("deepseek_v3",), ()),
    # attention sinks, alternating windows, biased experts with a clamped SwiGLU
    Family("gpt_oss", "gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), ("gpt-oss",)),
    # hybrid models: recurrent layers beside attention (engine.state_cache)
    Family("lfm2", "lfm2", ("Lfm2ForCausalLM",), ("lfm2",), ("lfm2",)),
    # Qwen3_5(Moe)ForConditionalGeneration: their text model (config.TEXT_MODELS)
    Family(
        "qwen3_5",
        "qwen3_5",
        ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
        ("qwen3_5_text",),
        ("qwen35",),
    ),
    Family(
        "qwen3_5_moe",
        "qwen3_5",
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        ("qwen3_5_moe_text",),
        ("qwen35moe",),
    ),
    # Qwen3-Next: Qwen3.5-MoE's layers, its DeltaNet projections fused per key head
    Family("qwen3_next", "qwen3_5", ("Qwen3NextForCausalLM",), ("qwen3_next",), ("qwen3next",)),
    # Granite 4 (dense: its shared MLP; Mamba-2 layers beside NoPE attention)
    Family(
        "granitemoehybrid",
        "granite_hybrid",
        ("GraniteMoeHybridForCausalLM",),
        ("granitemoehybrid",),
        ("granitehybrid",),
    ),
    # Nemotron-H: Mamba-2, NoPE attention and relu-squared MLP layers, one operation
    # each; Nemotron 3: experts in place of the MLPs (llama.cpp's nemotron_h_moe)
    Family(
        "nemotron_h",
        "nemotron_h",
        ("NemotronHForCausalLM",),
        ("nemotron_h",),
        ("nemotron_h", "nemotron_h_moe"),
    ),
    # encoders (model/bert.py): attend both ways, pool only; an embedder is the bare
    # model, a cross-encoder its one-label sequence classifier
    Family("bert", "bert", ("BertModel", "BertForSequenceClassification"), ("bert",), ()),
    Family(
        "xlm_roberta",
        "bert",
        ("XLMRobertaModel", "XLMRobertaForSequenceClassification"),
        ("xlm-roberta",),
        (),
    ),
    Family("nomic_bert", "nomic_bert", ("NomicBertModel",), ("nomic_bert",), ()),
)
# the families that are encoders (only the pooling runner runs them)
ENCODERS = frozenset({"bert", "xlm_roberta", "nomic_bert"})

BY_NAME = {f.name: f for f in FAMILIES}


def supported_hf() -> list[str]:
    """Every Hugging Face architecture name we run, sorted (for error messages, --help)."""
    return sorted(a for f in FAMILIES for a in f.hf_architectures)


def supported_gguf() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.gguf_architectures)


def family_for_hf(cfg: dict[str, Any]) -> Family:
    """The family a parsed ``config.json`` asks for; ``ValueError`` naming the
    architecture and listing the supported ones otherwise."""
    archs = cfg.get("architectures") or []
    for a in archs:
        for f in FAMILIES:
            if a in f.hf_architectures or base_model_head(a) in f.hf_architectures:
                return f
    if not archs:
        for f in FAMILIES:
            if cfg.get("model_type") in f.model_types:
                return f
    raise ValueError(
        f"unsupported architecture {archs or cfg.get('model_type')!r}; "
        f"expected one of {supported_hf()}"
    )


# bare decoders whose causal LM is not named after them
_BARE_ALIASES = {"Gemma3TextModel": "Gemma3ForCausalLM"}  # (EmbeddingGemma's)


def base_model_head(arch: str) -> str | None:
    """The causal LM a bare decoder (``Qwen3Model``: no head, an embedding model's
    checkpoint) or a sequence classifier (``Qwen3ForSequenceClassification``: a
    reranker's) is the body of (``Qwen3ForCausalLM``); see ``model.pooler_config``."""
    if arch in _BARE_ALIASES:
        return _BARE_ALIASES[arch]
    for tail in ("ForSequenceClassification", "Model"):
        if arch.endswith(tail) and not arch.endswith("PreTrainedModel"):
            return arch[: -len(tail)] + "ForCausalLM"
    return None


def headless(arch: str) -> bool:
    """``arch`` is a bare decoder or a sequence classifier over a causal LM we run (not
    itself one we run: GPT-2's ``GPT2LMHeadModel`` is a causal LM), or an encoder's."""
    if any(arch in BY_NAME[f].hf_architectures for f in ENCODERS):
        return True
    known = {a for f in FAMILIES for a in f.hf_architectures}
    return arch not in known and base_model_head(arch) in known


def family_for_gguf(arch: object) -> Family:
    for f in FAMILIES:
        if arch in f.gguf_architectures:
            return f
    raise ValueError(f"unsupported GGUF architecture {arch!r}; expected one of {supported_gguf()}")


def model_class(name: str) -> Any:
    """The model class of family ``name`` (imports torch: the engine's side only)."""
    return import_module(f"structllm.model.{BY_NAME[name].module}").MODEL


def hf_to_native(name: str) -> Any:
    """The family's ``hf_to_native(state, cfg)``: Hugging Face tensor names -> ours."""
    return import_module(f"structllm.model.{BY_NAME[name].module}").hf_to_native
