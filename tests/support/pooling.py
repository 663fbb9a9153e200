"""Tiny seeded embedding models saved by sentence-transformers (no hub): a Qwen3
decoder (``Qwen3Model``) with a tokenizer that appends its end token, as
Qwen3-Embedding's does, then sentence-transformers' modules over it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from structllm.model.files import ModelFiles
from structllm.paths import cache_root
from tests.support.checkpoints import built_once, cache_key, write_tokenizer_config

END_TOKEN = "<|endoftext|>"  # id 0 in the default model's tokenizer
QWEN3: dict[str, object] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=0,
    pad_token_id=0,
)


def tiny_st_qwen3(
    files: ModelFiles,
    pooling: str = "lasttoken",
    dense: tuple[int, ...] = (),
    matryoshka: bool = False,
    plain: bool = False,
    **shape: object,
) -> Path:
    """A Qwen3-Embedding in small, saved by sentence-transformers: the seeded decoder
    (``QWEN3``, with ``shape`` over it: bench/embeddings.py's larger ones), ``pooling``
    (``"lasttoken"``, ``"mean"``, ``"cls"``), a Tanh ``Dense`` layer to each size in
    ``dense``, ``Normalize``; ``matryoshka``: its config says ``is_matryoshka``;
    ``plain``: the default model's tokenizer as it is (no end token appended), which
    llama.cpp's converter recognises. Built once, cached by its settings."""
    cfg = {**QWEN3, **shape}
    parts = (
        QWEN3 if not shape else cfg,
        pooling,
        dense,
        matryoshka,
        *(["plain2"] if plain else []),
    )
    key = cache_key(files, "st-qwen3", *parts, 1)
    out = cache_root() / "test-models" / f"tiny-st-qwen3-{key}"
    return built_once(out, lambda tmp: _build(files, tmp, cfg, pooling, dense, matryoshka, plain))


def _build(
    files: ModelFiles,
    out: Path,
    cfg: dict[str, object],
    pooling: str,
    dense: tuple[int, ...],
    matryoshka: bool,
    plain: bool = False,
) -> None:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(0)
    body = out.with_name(out.name + ".body")
    model = transformers.Qwen3Model(transformers.Qwen3Config(**cfg))
    with torch.no_grad():  # random norm weights, so a misplaced one would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(body)
    if plain:  # (the converter loads it through AutoTokenizer: the BPE as it is)
        shutil.copyfile(files.tokenizer_json, body / "tokenizer.json")
        _converter_tokenizer_config(files, body)
    else:
        _end_token_tokenizer(files, body)
    size = int(cfg["hidden_size"])  # type: ignore[call-overload]
    modules: list[torch.nn.Module] = [Transformer(str(body)), Pooling(size, pooling_mode=pooling)]
    for n in dense:
        modules.append(Dense(size, n, activation_function=torch.nn.Tanh()))
        size = n
    modules.append(Normalize())
    SentenceTransformer(modules=modules).save(str(out))
    if matryoshka:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}))
    shutil.rmtree(body)


def _end_token_tokenizer(files: ModelFiles, out: Path) -> None:
    """The default model's tokenizer with Qwen3-Embedding's post-processor (the end
    token after the text, or after a pair) and its config (left padding)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(files.tokenizer_json))
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {END_TOKEN}", pair=f"$A $B {END_TOKEN}", special_tokens=[(END_TOKEN, 0)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": END_TOKEN,
                "pad_token": END_TOKEN,
                "padding_side": "left",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def _converter_tokenizer_config(files: ModelFiles, out: Path) -> None:
    """The plain models' tokenizer config: the BPE as it is for llama.cpp's converter
    (through AutoTokenizer), a padding token and no chat template (sentence-transformers
    would chat the texts)."""
    write_tokenizer_config(
        files, out, tokenizer_class="GPT2Tokenizer", pad_token=END_TOKEN, chat_template=None
    )


def _plain_tokenizer(files: ModelFiles, out: Path) -> None:
    """The default model's tokenizer as it is (no end token appended: a reranker's, whose
    scored token is the prompt's last; transformers' Qwen2Tokenizer would split text its
    own way), padding with the end token on the left, no chat template."""
    shutil.copyfile(files.tokenizer_json, out / "tokenizer.json")
    write_tokenizer_config(
        files,
        out,
        tokenizer_class="PreTrainedTokenizerFast",
        pad_token=END_TOKEN,
        padding_side="left",
        chat_template=None,  # (sentence-transformers' CrossEncoder would chat the pair)
    )


def tiny_qwen3_reranker(files: ModelFiles, **shape: object) -> Path:
    """A Qwen3-Reranker in small: the seeded causal LM (untied head; ``shape`` over
    ``QWEN3``: bench/rerank.py's larger one), scored by its ``yes``/``no`` logits once
    loaded with vLLM's overrides (``RERANKER_OVERRIDES``). llama.cpp's converter takes it
    for a reranker by its directory's name."""
    key = cache_key(files, "qwen3-reranker", QWEN3 if not shape else {**QWEN3, **shape}, 3)
    out = cache_root() / "test-models" / f"tiny-qwen3-reranker-{key}"

    def build(tmp: Path) -> None:
        import torch
        import transformers

        torch.manual_seed(1)
        cfg = transformers.Qwen3Config(**{**QWEN3, **shape, "tie_word_embeddings": False})
        model = transformers.Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # a head with larger logits, so the scores spread
            model.lm_head.weight.normal_(0, 0.5)
        model.save_pretrained(tmp)
        _plain_tokenizer(files, tmp)

    return built_once(out, build)


RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def tiny_qwen3_classifier(files: ModelFiles) -> Path:
    """A one-label ``Qwen3ForSequenceClassification`` cross-encoder in small (what
    sentence-transformers' ``CrossEncoder`` loads; transformers scores the last token
    that is not padding: the end token never occurs in its texts)."""
    key = cache_key(files, "qwen3-classifier", QWEN3, 3)
    out = cache_root() / "test-models" / f"tiny-qwen3-classifier-{key}"

    def build(tmp: Path) -> None:
        import torch
        import transformers

        torch.manual_seed(2)
        cfg = transformers.Qwen3Config(**QWEN3, num_labels=1)
        model = transformers.Qwen3ForSequenceClassification(cfg)
        with torch.no_grad():
            model.score.weight.normal_(0, 0.5)
        model.save_pretrained(tmp)
        _plain_tokenizer(files, tmp)

    return built_once(out, build)


GEMMA3: dict[str, object] = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=256,
    query_pre_attn_scalar=32,
    sliding_window=8,  # transformers makes it a symmetric window of 5 either side
    # llama.cpp's own Gemma 3 pattern (not in its GGUF metadata): five local, one global
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    use_bidirectional_attention=True,
    bos_token_id=1,
    eos_token_id=0,
    pad_token_id=0,
)


def tiny_embedding_gemma(files: ModelFiles, plain: bool = False) -> Path:
    """An EmbeddingGemma in small, saved by sentence-transformers: a seeded Gemma 3
    text model attending both ways (``use_bidirectional_attention``, a window shorter
    than the test texts), mean pooling, two Dense layers without bias or activation
    (64 -> 96 -> 64), ``Normalize``; ``plain``: the default model's tokenizer as it is
    (llama.cpp's converter recognises it)."""
    key = cache_key(files, "embedding-gemma", GEMMA3, *(["plain2"] if plain else []), 1)
    out = cache_root() / "test-models" / f"tiny-embedding-gemma-{key}"

    def build(tmp: Path) -> None:
        import torch
        import transformers
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.base.modules import Dense, Normalize, Transformer
        from sentence_transformers.sentence_transformer.modules import Pooling

        torch.manual_seed(3)
        body = tmp.with_name(tmp.name + ".body")
        model = transformers.Gemma3TextModel(transformers.Gemma3TextConfig(**GEMMA3))
        with torch.no_grad():  # random norm weights, so a misplaced one would show
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
        model.save_pretrained(body)
        if plain:
            shutil.copyfile(files.tokenizer_json, body / "tokenizer.json")
            _converter_tokenizer_config(files, body)
        else:
            _end_token_tokenizer(files, body)
        identity = torch.nn.Identity()
        modules: list[torch.nn.Module] = [
            Transformer(str(body)),
            Pooling(64, pooling_mode="mean"),
            Dense(64, 96, bias=False, activation_function=identity),
            Dense(96, 64, bias=False, activation_function=identity),
            Normalize(),
        ]
        SentenceTransformer(modules=modules).save(str(tmp))
        shutil.rmtree(body)

    return built_once(out, build)
