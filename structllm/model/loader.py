"""Preparing a model's files and loading its weights (the engine's side; torch and
transformers are imported only where needed).

``prepare_model`` is ``model.files.find_model_files`` after converting what the cache
lacks: a GGUF file's first use writes its config and tokenizer (rebuilt by
transformers, with the chat template) into a cache directory keyed by the file's path,
size and mtime and the converting code (``files.cache_key``); its weights are read from
the file itself when they run as blocks, and dequantised into a float32 safetensors copy
there only the first time a float path (``--quantization none``, CUDA) needs them. A
Hugging Face directory without a ``tokenizer.json`` gets one built by transformers.
Nothing here downloads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from structllm.model.files import (
    ModelFiles,
    NotConverted,
    TokenizerMeta,
    find_model_files,
    gguf_cache_dir,
    tokenizer_cache_path,
)

if TYPE_CHECKING:
    import torch

    from structllm.kernels.packed import BlockWeight
    from structllm.model.formats import WeightFormat
    from structllm.model.llama import LlamaModel
    from structllm.model.sharding import ShardPlan


class Progress:
    """A progress line on stderr that appears only if the work takes more than a moment."""

    def __init__(self, what: str, delay: float = 0.5) -> None:
        self.what, self.delay, self.start = what, delay, time.monotonic()
        self.shown, self.last = False, 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.start < self.delay or (now - self.last < 0.1 and done < total):
            return
        self.shown, self.last = True, now
        end = "\n" if done >= total else ""
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{self.what}: {done}/{total} ({100 * done // max(total, 1)}%){end}")
        elif done >= total or done * 4 // total != (done - 1) * 4 // total:
            sys.stderr.write(f"{self.what}: {done}/{total}\n")
        sys.stderr.flush()


def prepare_model(model: str | None) -> ModelFiles:
    """Resolve ``model`` to its files, converting a GGUF file (or building a Hugging
    Face directory's missing ``tokenizer.json``) on first use.

    Raises ``FileNotFoundError`` or ``ValueError`` that say what was expected.
    """
    try:
        return find_model_files(model)
    except NotConverted as missing:
        if missing.gguf:
            _convert_gguf(missing.source, gguf_cache_dir(missing.source))
        else:
            build_tokenizer_json(missing.source, None)
    return find_model_files(model)


# ---------------------------------------------------------------------------------------
# conversion


def build_tokenizer_json(path: Path, gguf_file: str | None) -> Path:
    """Build ``tokenizer.json`` with transformers (slow) and cache it (where
    ``files.tokenizer_cache_path`` looks)."""
    out = tokenizer_cache_path(path, gguf_file)
    if out.is_file():
        return out
    if gguf_file is not None and _encoder_vocab_file(path / gguf_file, out):
        return out
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(
            f"{path} has no tokenizer.json, and transformers is needed to build one: {e}"
        ) from e
    if gguf_file is not None and _config_unreadable_by_transformers(path / gguf_file):
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import gguf_tokenizer_mapping as tokenizers

        # the tokenizer fields alone, without the config AutoTokenizer reads first;
        # Gemma 3n's SentencePiece vocabulary read as Gemma 3's (transformers' builder
        # for Gemma's files, which it knows by their architecture)
        builders = tokenizers.GGUF_SENTENCEPIECE_BUILDERS
        builders.setdefault("gemma3n", builders["gemma3"])
        tok = PreTrainedTokenizerFast.from_pretrained(str(path), gguf_file=gguf_file)
    else:
        if gguf_file is not None:
            _let_transformers_read_the_tokenizer(path / gguf_file)
        with _without_gpt_oss_rope_fields(path / gguf_file if gguf_file else None):
            tok = AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tok.backend_tokenizer.save(str(tmp))
    os.replace(tmp, out)
    return out


def _encoder_vocab_file(gguf_path: Path, out: Path) -> bool:
    """A BERT file's WordPiece or Unigram vocabulary (which transformers does not read)
    written to ``out`` by ``gguf_encoder_vocab``; False for any other vocabulary."""
    from structllm.model import gguf, gguf_encoder_vocab

    reader = gguf.open_gguf(gguf_path)
    meta = gguf.metadata(reader)
    if not gguf_encoder_vocab.is_encoder_vocab(meta):
        return False
    for key in ("tokens", "token_type", "scores", "precompiled_charsmap"):  # (long arrays)
        key = f"tokenizer.ggml.{key}"
        if key in reader.fields:
            meta[key] = reader.fields[key].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    gguf_encoder_vocab.write_tokenizer_json(meta, tmp)
    os.replace(tmp, out)
    return True


# GGUF architectures whose config transformers' reader refuses while AutoTokenizer
# reads it to pick a tokenizer class: Gemma 4's per-layer feed_forward_length (and
# head_count_kv) lists, which its config takes as one number. Their tokenizer is built
# from the file's tokenizer fields alone (transformers' builder for the file's
# tokenizer.ggml.model, as AutoTokenizer's class would use).
_TOKENIZER_FIELDS_ONLY = ("gemma4", "gemma3n")


def _config_unreadable_by_transformers(gguf_path: Path) -> bool:
    from structllm.model import gguf

    arch = gguf.metadata(gguf.open_gguf(gguf_path)).get("general.architecture")
    return arch in _TOKENIZER_FIELDS_ONLY


def _let_transformers_read_the_tokenizer(gguf_path: Path) -> None:
    """transformers reads a GGUF file's tokenizer only for the architectures whose
    weights it can load too, though the tokenizer fields (``tokenizer.ggml.*``) are the
    same for all: a family it lacks (e.g. ``granite``, ``smollm3``) is registered, for
    this process, with llama's config keys, which the tokenizer does not use."""
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    from transformers.integrations import ggml

    from structllm.model import gguf

    meta = gguf.metadata(gguf.open_gguf(gguf_path))
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch in hf_gguf.GGUF_SUPPORTED_ARCHITECTURES:
        return
    from transformers import AutoConfig, LlamaConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # transformers takes the GGUF name as the config's model type: one it has no config
    # class for (llama.cpp's "granitehybrid", "qwen3next") gets llama's under that name,
    # and none of the file's keys (hybrid files' per-layer lists fit no llama field);
    # a hybrid one it has a class for ("nemotron_h") gets none of them either
    keys = ggml.GGUF_CONFIG_MAPPING["llama"]
    if isinstance(meta.get(f"{arch}.attention.head_count_kv"), list):
        keys = {}
    if arch not in CONFIG_MAPPING:
        AutoConfig.register(arch, type(f"GGUF_{arch}_Config", (LlamaConfig,), {"model_type": arch}))
        keys = {}
    ggml.GGUF_CONFIG_MAPPING.setdefault(arch, keys)
    hf_gguf.GGUF_SUPPORTED_ARCHITECTURES.append(
        arch
    )  # as transformers' GGUF_TO_TRANSFORMERS_MAPPING


@contextlib.contextmanager
def _without_gpt_oss_rope_fields(gguf_path: Path | None) -> Iterator[None]:
    """transformers (5.25) fails on a gpt-oss GGUF file's ``gpt-oss.rope.scaling.*``
    fields while it reads the file's config (it converts each field's first part, the
    key's length as a one-element array, with ``float()``, which numpy 2 refuses); the
    tokenizer needs none of them, so while it is built from such a file the gguf
    package's reader leaves them out. Other files: nothing changes."""
    if gguf_path is None:
        yield
        return
    import gguf as gguf_package

    from structllm.model import gguf

    if gguf.metadata(gguf.open_gguf(gguf_path)).get("general.architecture") != "gpt-oss":
        yield
        return
    saved = gguf_package.GGUFReader

    class Reader(saved):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith("gpt-oss.rope.scaling.")]:
                del self.fields[key]

    gguf_package.GGUFReader = Reader  # type: ignore[misc]
    try:
        yield
    finally:
        gguf_package.GGUFReader = saved  # type: ignore[misc]


def _convert_gguf(path: Path, cache: Path) -> None:
    """The config and tokenizer of GGUF file ``path`` into ``cache`` (no weights: see
    ``load_weights`` for the float32 copy a float path writes on first use)."""
    from structllm.model import gguf, gguf_gemma4

    t0 = time.monotonic()
    sys.stderr.write(f"Reading {path.name} (first use; config and tokenizer cached in {cache})\n")
    reader = gguf.open_gguf(path)
    meta = gguf.metadata(reader)
    cfg = gguf.model_config(meta)
    shapes = {t.name: [int(s) for s in reversed(t.shape)] for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    cfg = msgspec.structs.replace(
        cfg,
        vocab_size=shapes["token_embd.weight"][0],
        tie_word_embeddings="output.weight" not in shapes,
    )
    cfg = gguf.options_from_tensors(cfg, shapes)
    del reader
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        sys.stderr.write("  building the tokenizer\n")
        tok_json = build_tokenizer_json(path.parent, path.name)
        shutil.copyfile(tok_json, tmp / "tokenizer.json")
        from transformers import PreTrainedTokenizerFast

        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_json))
        if cfg.architecture == "gemma4":  # (the image tokens' per-layer inputs: the pad's)
            cfg = gguf_gemma4.with_multimodal_tokens(cfg, hf_tok.get_vocab())
        tokens_bos = meta.get("tokenizer.ggml.bos_token_id")
        tokens_eos = meta.get("tokenizer.ggml.eos_token_id")
        tok_meta = TokenizerMeta(
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token=str(hf_tok.convert_ids_to_tokens(int(tokens_bos)))
            if tokens_bos is not None
            else None,
            eos_token=str(hf_tok.convert_ids_to_tokens(int(tokens_eos)))
            if tokens_eos is not None
            else None,
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )
        info = {"config": msgspec.to_builtins(cfg), "tokenizer": msgspec.to_builtins(tok_meta)}
        (tmp / "model.json").write_text(json.dumps(info, indent=1))
        (tmp / "source").write_text(str(path.resolve()))
        (tmp / "complete").write_text("")
        shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in prune_stale_caches(path, cache):
        sys.stderr.write(f"  removed {stale.name} (an older conversion of it, or of a file gone)\n")
    sys.stderr.write(f"  done in {time.monotonic() - t0:.1f}s\n")


def prune_stale_caches(path: Path, keep: Path) -> list[Path]:
    """Remove the converted copies that no start can use again: those of GGUF file
    ``path`` other than ``keep`` (made by other converter code, or before the file
    changed) and those whose file is gone. A converted copy names its file in
    ``source``; one without (older than that file) is left alone. Returns what went.

    (A copy holds the float32 weights once a float path asked for them, and each
    converter change made a new copy beside the old: without this the cache grew by
    the model's float32 size per upgrade.)
    """
    src = str(path.resolve())
    gone: list[Path] = []
    for d in keep.parent.iterdir():
        marker = d / "source"
        if d == keep or ".tmp" in d.name or not marker.is_file():
            continue  # (``.tmp``: another process's conversion under way)
        try:
            named = marker.read_text()
        except OSError:  # (being removed by another process's prune)
            continue
        if named == src or not Path(named).exists():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _dequantised_copy(files: ModelFiles) -> Path:
    """The float32 safetensors copy of GGUF file ``files.source``'s weights (our names),
    written into its cache directory the first time a float path asks for it."""
    from safetensors.torch import save_file

    from structllm.model import gguf

    out = files.weights[0]
    if out.is_file():
        return out
    assert files.source is not None
    t0 = time.monotonic()
    sys.stderr.write(
        f"Dequantising {files.source.name} to float32 for a float path (once; cached in "
        f"{out.parent})\n"
    )
    tensors: dict[str, Any] = dict(
        gguf.load_tensors(
            gguf.open_gguf(files.source),
            files.config,
            Progress("  dequantising tensors", delay=0.0),
        )
    )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    sys.stderr.write(f"  dequantised in {time.monotonic() - t0:.1f}s\n")
    return out


# ---------------------------------------------------------------------------------------
# weights


def load_weights(
    files: ModelFiles, dtype: torch.dtype, device: torch.device, plan: ShardPlan | None = None
) -> dict[str, torch.Tensor | BlockWeight]:
    """All weights under our names, in ``dtype`` on ``device`` (a family's block weights,
    gpt-oss's MXFP4 experts, as they are: see ``load_model``); with ``plan``, only that
    tensor-parallel rank's slices (cut on the host, so the device holds just the shard)."""
    import torch
    from safetensors.torch import load_file

    from structllm.model.sharding import shard_weights

    if files.source is not None:
        _dequantised_copy(files)
    state: dict[str, torch.Tensor] = {}
    for f in files.weights:
        state.update(load_file(str(f)))
    if "embed_tokens.weight" in state:  # a bare decoder's (Qwen3Model): the causal LM's names
        state = {f"model.{k}": v for k, v in state.items()}
    if not files.native_names:
        from structllm.model.registry import hf_to_native

        try:
            state = hf_to_native(files.config.architecture)(state, files.config)
        except KeyError as e:
            raise ValueError(f"checkpoint is missing tensor {e.args[0]!r}") from None
    if plan is not None:
        state = shard_weights(state, files.config, plan)
    # (a family may map some tensors to blocks, gpt-oss's MXFP4 experts: load_model's)
    return {
        k: v.to(device=device, dtype=dtype) if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


def load_block_weights(
    files: ModelFiles, dtype: torch.dtype, half: str = "file"
) -> dict[str, torch.Tensor | BlockWeight]:
    """The GGUF file's weights under our names, block matrices kept as ``BlockWeight``
    (read from the file itself); plain tensors in ``dtype`` except float16 matrices,
    kept for ``pack_weights`` to run as float16 (``half``: ``WeightFormat.half``). A
    float16 embedding stays float16 (``HalfRows``: looked up into float32, and packed
    for fbgemm if it is also the LM head). Says on stderr which format each kind of
    matrix runs in, and what was dequantised."""
    import torch

    from structllm.kernels.packed import HalfRows
    from structllm.model import gguf

    assert files.source is not None
    reader = gguf.open_gguf(files.source)
    for line in gguf.format_report(reader, keep_blocks=True, half=half):
        sys.stderr.write(f"structllm: {files.source.name}: {line}\n")
    out: dict[str, torch.Tensor | BlockWeight] = {}
    for name, w in gguf.load_tensors(reader, files.config, keep_blocks=True):
        if not isinstance(w, torch.Tensor):
            out[name] = w
        elif w.dtype == torch.float16 and w.dim() == 2:
            table = name in ("embed_tokens", "per_layer_inputs.embed")
            if table and half != "none":
                out[name] = HalfRows(w)
            else:  # (the token table becomes dtype with the head: LlamaModel.pack_weights)
                out[name] = w.to(dtype) if name == "per_layer_inputs.embed" else w
        else:
            out[name] = w.to(dtype)
    return out


def load_model(
    files: ModelFiles,
    dtype: torch.dtype,
    device: torch.device,
    plan: ShardPlan | None = None,
    fmt: WeightFormat | None = None,
    layers: range | None = None,
) -> LlamaModel:
    """A ``LlamaModel`` with its weights (one rank's shard with ``plan``; only the
    decoder ``layers`` of a pipeline stage, renumbered from 0, with ``layers``), ready
    for inference, its matmul weights held as ``fmt`` says (default: plain ``dtype``); a
    sharded model still needs its ``tp`` group set."""
    import torch

    from structllm.model.registry import model_class

    if fmt is not None and fmt.blocks:
        weights: dict[str, torch.Tensor | BlockWeight] = dict(
            load_block_weights(files, dtype, fmt.half)
        )
        if plan is not None:
            from structllm.model.sharding import shard_weights

            weights = shard_weights(weights, files.config, plan)
    else:
        weights = dict(load_weights(files, dtype, device, plan))
        keep = fmt is not None and not fmt.exact and device.type == "cpu" and dtype == torch.float32
        weights = {k: _float_unless(v, keep, dtype, device) for k, v in weights.items()}
    if layers is not None:
        weights = stage_weights(weights, layers)
    with torch.device("meta"):
        model = model_class(files.config.architecture)(files.config, dtype, plan, layers)
    model.assign_weights(weights)
    del weights
    model.pack_weights(fmt.half if fmt is not None else "none")
    if fmt is not None and not fmt.exact:
        model.use_cpu_ops()
    return model.eval()


def _float_unless(
    w: torch.Tensor | BlockWeight, keep: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | BlockWeight:
    """A directory's block weight (gpt-oss's MXFP4 experts) as it is when ``keep`` (the
    CPU's block kernels run it), else its float values in ``dtype`` on ``device`` (the
    exact path; other devices)."""
    import torch

    if keep or isinstance(w, torch.Tensor):
        return w
    from structllm.kernels.packed import mxfp4_values

    if w.type_name != "MXFP4":
        raise ValueError(f"a {w.type_name} block weight from a directory is not supported")
    return mxfp4_values(w).to(device=device, dtype=dtype)


def stage_weights(weights: dict[str, Any], layers: range) -> dict[str, Any]:
    """The weights a pipeline stage holds: its decoder layers' (``layers.{i}.*`` for i in
    ``layers``, renamed ``layers.{i - layers.start}.*``) and every non-layer weight."""
    out: dict[str, Any] = {}
    for name, w in weights.items():
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            if int(index) not in layers:
                continue
            name = f"layers.{int(index) - layers.start}.{rest}"
        out[name] = w
    return out
