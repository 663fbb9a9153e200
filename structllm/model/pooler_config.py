"""Which runner a model gets and how its pooling runner pools, without torch.

``--runner auto`` picks the pooling runner (``engine.pooling``) for an embedding
checkpoint: a sentence-transformers directory (``modules.json``), or a ``config.json``
whose architecture is a bare ``*Model`` (no head) or a ``*ForSequenceClassification``.
A GGUF file is one when llama.cpp's converter wrote its ``pooling_type`` (from the
sentence-transformers files it was made from). The pooler is read, later sources over
earlier ones, from: the model's defaults (last token, normalised: a decoder's
embedding; a GGUF file's ``pooling_type``), then the sentence-transformers files
(``1_Pooling/config.json``, the ``Dense`` modules, ``Normalize``, the default prompt
of ``config_sentence_transformers.json``), then ``--pooler-config``. Matryoshka
(``dimensions``) is allowed where ``config.json`` (or ``--hf-overrides``) says
``is_matryoshka`` or lists ``matryoshka_dimensions``, as in vLLM; a GGUF file carries
neither (llama.cpp's converter writes nothing of it), so it is Matryoshka only through
``--hf-overrides``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

from structllm.config import RUNNERS, PoolerConfig, PoolingType
from structllm.model.files import ModelFiles
from structllm.model.registry import ENCODERS, headless
from structllm.protocol import PoolerInfo, PoolingTask

# sentence-transformers' pooling modes -> ours (older files: pooling_mode_<mode>: true)
_ST_MODES: dict[str, PoolingType] = {"lasttoken": "LAST", "mean_tokens": "MEAN", "cls_token": "CLS"}
_ST_MODES_NEW: dict[str, PoolingType] = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
# Dense modules' activations (sentence-transformers writes the class's import path)
_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh"}


class Dense(msgspec.Struct, frozen=True):
    """A sentence-transformers ``Dense`` module: ``y = act(x @ W.T + b)``, ``W``
    ``[out_features, in_features]`` in ``weights`` (``linear.weight``/``linear.bias``),
    or in a GGUF file (``tensor``: ``dense_2.weight``, no bias)."""

    weights: str
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "identity" or "tanh"
    tensor: str = "linear.weight"


class PoolerSpec(msgspec.Struct, frozen=True):
    """How the pooling runner turns a prompt's last hidden states into its vector.

    A reranker (``task == "score"``) has a ``classifier``: ``"yes_no"`` (Qwen3-Reranker:
    the causal LM's logits of ``classifier_tokens`` ``[no, yes]`` at the last token, the
    score ``sigmoid(yes - no)``, vLLM's ``is_original_qwen3_reranker``) or ``"score"``
    (a ``*ForSequenceClassification`` checkpoint's one-label ``score.weight``, then a
    sigmoid, as sentence-transformers' ``CrossEncoder`` with one label) or ``"rank"``
    (a GGUF file's ``cls.output`` rows, llama.cpp's RANK pooling: Qwen3-Reranker's
    ``yes``/``no`` rows as its converter cuts them from the head, or one label)."""

    task: PoolingTask
    pooling_type: PoolingType
    normalize: bool
    dense: list[Dense] = []
    prompt: str = ""
    matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None
    classifier: Literal["yes_no", "score", "rank"] | None = None
    classifier_tokens: list[str] = []
    keep_head: bool = False  # an encoder's: truncation keeps the head (PoolerInfo.cut)

    def info(self, hidden_size: int) -> PoolerInfo:
        if self.task == "score":
            return PoolerInfo("score", 1, keep_head=self.keep_head)
        size = self.dense[-1].out_features if self.dense else hidden_size
        return PoolerInfo(
            self.task,
            size,
            self.matryoshka,
            self.matryoshka_dimensions,
            self.prompt,
            self.keep_head,
        )

    def describe(self, hidden_size: int) -> str:
        """The start-up line's account of it."""
        if self.task == "score":
            where = "first" if self.pooling_type == "CLS" else "last"
            how = (
                f"the logits of {self.classifier_tokens} at the last token"
                if self.classifier == "yes_no"
                else f"a one-label classifier on the {where} token"
            )
            return f"score: {how}, then a sigmoid"
        size = self.info(hidden_size).size
        parts = [
            f"{self.pooling_type.lower()}-token pooling"
            if self.pooling_type != "MEAN"
            else "mean pooling"
        ]
        parts += [f"{len(self.dense)} Dense layers"] if self.dense else []
        parts += ["normalised"] if self.normalize else []
        parts += ["Matryoshka"] if self.matryoshka else []
        return f"{self.task}: {', '.join(parts)}, {size} dimensions"


def model_dir(files: ModelFiles) -> Path | None:
    """A Hugging Face directory's path (None for a GGUF file)."""
    return files.weights[0].parent if files.source is None and files.weights else None


def _raw_config(files: ModelFiles, overrides: dict[str, Any] | None) -> dict[str, Any]:
    d = model_dir(files)
    raw = _read_json(d / "config.json") if d is not None else {}
    return {**raw, **(overrides or {})}


def is_pooling_model(files: ModelFiles, overrides: dict[str, Any] | None = None) -> bool:
    """What ``--runner auto`` picks the pooling runner for (see the module's doc)."""
    d = model_dir(files)
    if d is None:  # a GGUF file: its pooling_type
        return files.config.pooling_type is not None
    if (d / "modules.json").is_file():
        return True
    archs = _raw_config(files, overrides).get("architectures") or []
    return any(headless(a) for a in archs)


def resolve_runner(
    runner: str, files: ModelFiles, overrides: dict[str, Any] | None = None
) -> Literal["generate", "pooling"]:
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if runner == "auto":
        return "pooling" if is_pooling_model(files, overrides) else "generate"
    return "pooling" if runner == "pooling" else "generate"


def read_pooler(
    files: ModelFiles,
    config: PoolerConfig | None = None,
    overrides: dict[str, Any] | None = None,
) -> PoolerSpec:
    """The pooling runner's pooler for ``files`` (see the module's doc for the order)."""
    spec = _read_pooler(files, config, overrides)
    if files.config.architecture in ENCODERS:
        return msgspec.structs.replace(spec, keep_head=True)
    return spec


def _read_pooler(
    files: ModelFiles, config: PoolerConfig | None, overrides: dict[str, Any] | None
) -> PoolerSpec:
    raw = _raw_config(files, overrides)
    # an encoder's own summary is its first token's row ([CLS], <s>); a decoder's its last
    first: PoolingType = "CLS" if files.config.architecture in ENCODERS else "LAST"
    if any(a.endswith("ForSequenceClassification") for a in raw.get("architectures") or []):
        return _reranker(raw, config, first)
    if files.config.pooling_type == "RANK":  # a GGUF reranker
        return PoolerSpec("score", "LAST", False, classifier="rank")
    d = model_dir(files)
    pooling: PoolingType = first
    if files.config.pooling_type in ("LAST", "MEAN", "CLS"):  # a GGUF file's
        pooling = files.config.pooling_type  # type: ignore[assignment]
    normalize = True  # (a GGUF file: llama-server's default, --embd-normalize 2)
    dense: list[Dense] = []
    prompt = ""
    if d is not None and (d / "modules.json").is_file():
        pooling, normalize, dense = _st_modules(d)
        prompt = _st_prompt(d)
    if files.source is not None:  # a GGUF file's Dense layers (EmbeddingGemma's)
        dense = [
            Dense(str(files.source), i, o, False, "identity", f"dense_{k}.weight")
            for k, (i, o) in enumerate(files.config.pooling_dense, start=2)
        ]
    if config is not None:
        pooling = config.pooling_type or pooling
        normalize = normalize if config.normalize is None else config.normalize
    dims = _matryoshka_dimensions(raw.get("matryoshka_dimensions"))
    return PoolerSpec(
        "embed",
        pooling,
        normalize,
        dense,
        prompt,
        bool(raw.get("is_matryoshka")) or bool(dims),
        dims,
    )


def _matryoshka_dimensions(value: Any) -> list[int] | None:
    """``matryoshka_dimensions`` (config.json's or ``--hf-overrides``'): a list of
    positive ints, or None; ``ValueError`` otherwise."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(type(x) is int and x > 0 for x in value):
        raise ValueError(f"matryoshka_dimensions must be a list of positive ints, got {value!r}")
    return value


def _reranker(raw: dict[str, Any], config: PoolerConfig | None, default: PoolingType) -> PoolerSpec:
    """A ``*ForSequenceClassification`` model's scorer (see ``PoolerSpec``): on the
    last token (a decoder's) or the first (``default`` "CLS": an encoder's)."""
    pooling: PoolingType = (config.pooling_type if config else None) or default
    tokens = raw.get("classifier_from_token")
    if tokens is not None:
        if not raw.get("is_original_qwen3_reranker") or len(tokens) != 2:
            raise ValueError(
                "classifier_from_token is supported as Qwen3-Reranker's: two tokens "
                '(["no", "yes"]) with is_original_qwen3_reranker'
            )
        return PoolerSpec("score", pooling, False, classifier="yes_no", classifier_tokens=tokens)
    labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 1
    if labels != 1:
        raise ValueError(f"a sequence classifier of {labels} labels is not supported (only 1)")
    return PoolerSpec("score", pooling, False, classifier="score")


def _st_modules(d: Path) -> tuple[PoolingType, bool, list[Dense]]:
    """Pooling, normalisation and Dense layers of a sentence-transformers directory."""
    pooling: PoolingType = "LAST"
    normalize = False
    dense: list[Dense] = []
    for m in json.loads((d / "modules.json").read_text()):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        path = d / m.get("path", "")
        if kind == "Pooling":
            pooling = _st_pooling(_read_json(path / "config.json"))
        elif kind == "Normalize":
            normalize = True
        elif kind == "Dense":
            dense.append(_st_dense(path))
        elif kind not in ("Transformer", "Dropout"):
            raise ValueError(f"{d}: sentence-transformers module {kind} is not supported")
    return pooling, normalize, dense


def _st_pooling(cfg: dict[str, Any]) -> PoolingType:
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        if mode not in _ST_MODES_NEW:
            raise ValueError(f"sentence-transformers pooling mode {mode!r} is not supported")
        return _ST_MODES_NEW[mode]
    on = [k for k, v in _ST_MODES.items() if cfg.get(f"pooling_mode_{k}")]
    others = [
        k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k[13:] not in _ST_MODES
    ]
    if len(on) != 1 or others:
        raise ValueError(f"sentence-transformers pooling {cfg} is not supported")
    return _ST_MODES[on[0]]


def _st_dense(path: Path) -> Dense:
    cfg = _read_json(path / "config.json")
    act_name = str(cfg.get("activation_function", "Identity")).rsplit(".", 1)[-1]
    if act_name not in _ACTIVATIONS:
        raise ValueError(f"{path}: Dense activation {act_name} is not supported")
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors")
    return Dense(
        str(weights),
        int(cfg["in_features"]),
        int(cfg["out_features"]),
        bool(cfg.get("bias", True)),
        _ACTIVATIONS[act_name],
    )


def _st_prompt(d: Path) -> str:
    """The prompt sentence-transformers prepends by default (``default_prompt_name``)."""
    cfg = _read_json(d / "config_sentence_transformers.json")
    name = cfg.get("default_prompt_name")
    return str((cfg.get("prompts") or {}).get(name, "")) if name else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    out = json.loads(path.read_text())
    return out if isinstance(out, dict) else {}
