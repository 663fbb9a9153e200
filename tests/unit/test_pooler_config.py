"""``model/pooler_config.py`` on hand-written checkpoint files: which runner ``auto``
picks, and the pooler read in its order of precedence (defaults, the
sentence-transformers files in their old and new spellings, ``--pooler-config``), the
rerankers' scorers, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from structllm.config import PoolerConfig, pooler_config
from structllm.model.files import ModelFiles, TokenizerMeta
from structllm.model.pooler_config import is_pooling_model, read_pooler, resolve_runner

CONFIG: dict[str, Any] = dict(
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def checkpoint(tmp: Path, arch: str, files: dict[str, Any] | None = None, **cfg: Any) -> ModelFiles:
    """``ModelFiles`` of a directory holding ``config.json`` and ``files`` (name -> JSON)."""
    from structllm.model.config import ModelConfig

    raw = {**CONFIG, "architectures": [arch], **cfg}
    (tmp / "config.json").write_text(json.dumps(raw))
    (tmp / "model.safetensors").write_bytes(b"")
    for name, body in (files or {}).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(json.dumps(body))
    return ModelFiles(
        "m", ModelConfig.from_hf(raw), [tmp / "model.safetensors"], False, tmp, TokenizerMeta(), []
    )


def st_modules(*kinds: tuple[str, str]) -> list[dict[str, Any]]:
    return [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(kinds)
    ]


def test_auto_runner(tmp_path: Path) -> None:
    assert not is_pooling_model(checkpoint(tmp_path, "Qwen3ForCausalLM"))
    assert resolve_runner("auto", checkpoint(tmp_path, "Qwen3ForCausalLM")) == "generate"
    assert resolve_runner("pooling", checkpoint(tmp_path, "Qwen3ForCausalLM")) == "pooling"
    assert is_pooling_model(checkpoint(tmp_path, "Qwen3Model"))
    assert is_pooling_model(checkpoint(tmp_path, "Qwen3ForSequenceClassification"))
    # as an override: vLLM's way to run Qwen3-Reranker
    files = checkpoint(tmp_path, "Qwen3ForCausalLM")
    assert is_pooling_model(files, {"architectures": ["Qwen3ForSequenceClassification"]})
    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_runner("embed", files)


def test_sentence_transformers_files_then_pooler_config(tmp_path: Path) -> None:
    files = checkpoint(
        tmp_path,
        "Qwen3Model",
        {
            "modules.json": st_modules(
                ("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")
            ),
            "1_Pooling/config.json": {
                "word_embedding_dimension": 8,
                "pooling_mode_mean_tokens": True,
            },
            "2_Dense/config.json": {
                "in_features": 8,
                "out_features": 4,
                "bias": False,
                "activation_function": "torch.nn.modules.activation.Tanh",
            },
            "2_Dense/model.safetensors": {},
            "config_sentence_transformers.json": {
                "prompts": {"query": "query: ", "document": ""},
                "default_prompt_name": "query",
            },
        },
        matryoshka_dimensions=[2, 4],
    )
    spec = read_pooler(files)
    assert (spec.pooling_type, spec.normalize, spec.prompt) == ("MEAN", False, "query: ")
    assert [(d.in_features, d.out_features, d.activation) for d in spec.dense] == [(8, 4, "tanh")]
    info = spec.info(8)
    assert (info.size, info.matryoshka, info.matryoshka_dimensions) == (4, True, [2, 4])
    over = read_pooler(files, PoolerConfig(pooling_type="CLS", normalize=True))
    assert (over.pooling_type, over.normalize) == ("CLS", True)


def test_defaults_and_new_spelling(tmp_path: Path) -> None:
    spec = read_pooler(checkpoint(tmp_path, "Qwen3Model"))
    assert (spec.pooling_type, spec.normalize, spec.matryoshka) == ("LAST", True, False)
    files = checkpoint(
        tmp_path,
        "Qwen3Model",
        {
            "modules.json": st_modules(
                ("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")
            ),
            "1_Pooling/config.json": {"pooling_mode": "cls"},
        },
    )
    assert (read_pooler(files).pooling_type, read_pooler(files).normalize) == ("CLS", True)


def test_rerankers(tmp_path: Path) -> None:
    yes_no = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["no", "yes"],
        "is_original_qwen3_reranker": True,
    }
    spec = read_pooler(checkpoint(tmp_path, "Qwen3ForCausalLM"), None, yes_no)
    assert (spec.task, spec.classifier, spec.classifier_tokens) == (
        "score",
        "yes_no",
        ["no", "yes"],
    )
    assert spec.info(8).size == 1
    spec = read_pooler(checkpoint(tmp_path, "Qwen3ForSequenceClassification"))
    assert (spec.task, spec.classifier, spec.pooling_type) == ("score", "score", "LAST")
    with pytest.raises(ValueError, match="3 labels"):
        read_pooler(checkpoint(tmp_path, "Qwen3ForSequenceClassification", num_labels=3))
    with pytest.raises(ValueError, match="is_original_qwen3_reranker"):
        read_pooler(
            checkpoint(tmp_path, "Qwen3ForCausalLM"),
            None,
            {**yes_no, "is_original_qwen3_reranker": False},
        )


def test_refusals(tmp_path: Path) -> None:
    files = checkpoint(
        tmp_path,
        "Qwen3Model",
        {
            "modules.json": st_modules(("Transformer", ""), ("Pooling", "1_Pooling")),
            "1_Pooling/config.json": {"pooling_mode": "max"},
        },
    )
    with pytest.raises(ValueError, match="pooling mode 'max' is not supported"):
        read_pooler(files)
    with pytest.raises(ValueError, match="pooler_config"):
        pooler_config('{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        pooler_config("{")
    assert pooler_config({"pooling_type": "MEAN"}) == PoolerConfig(pooling_type="MEAN")
