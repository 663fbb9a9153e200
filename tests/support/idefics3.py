"""SmolVLM's vocabulary for the tests: the default model's tokenizer with the tokens
SmolVLM's tokenizer adds (``<image>``, ``<fake_token_around_image>``, ``<global-img>``,
``<end_of_utterance>``, the 36 ``<row_r_col_c>`` tile markers), and transformers'
``Idefics3Processor`` over it (the PIL image processor: torchvision is not installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from structllm.model.files import ModelFiles

SPECIAL_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
VOCAB_SIZE = 49152 + len(SPECIAL_TOKENS)  # the default model's 49152, then these


def write_tokenizer(files: ModelFiles, out_dir: Path) -> Path:
    """``out_dir/tokenizer.json``: the default model's with ``SPECIAL_TOKENS`` added
    (ids 49152 on, in that order), as SmolVLM's tokenizer has them."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(files.tokenizer_json))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir / "tokenizer.json"


def hf_processor(tokenizer_json: Path, image_seq_len: int, **image_kwargs: Any) -> Any:
    """transformers' ``Idefics3Processor`` with ``Idefics3ImageProcessorPil(**image_kwargs)``."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3 import Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    return Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(**image_kwargs),
        tokenizer=tokenizer,
        image_seq_len=image_seq_len,
    )
