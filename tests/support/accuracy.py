"""Teacher-forced accuracy of a GGUF file's quantised paths, scored as llama.cpp's
``llama-perplexity --kl-divergence`` scores them, so that structllm's figures and
llama.cpp's are of the same token windows and positions.

The text (``tests/data/accuracy_text.txt``) is cut into windows of ``N_CTX`` token ids,
one after the other from its first token (llama-perplexity's chunks: it tokenizes the
whole text once, without a BOS for this vocabulary, and puts the BOS in a window's first
place where the vocabulary asks for one). In each window the logits at positions
``N_CTX/2 .. N_CTX-2`` are scored (they predict tokens ``N_CTX/2+1 .. N_CTX-1``): per
position the KL divergence ``sum_v p(v) (log p(v) - log q(v))`` of the quantised path's
distribution ``q`` from the float32 model's ``p`` (the same file dequantised), and
whether both put the same token first. Figures are means over all scored positions.

``llama-perplexity`` stores the base distribution as 16-bit log-probabilities and drops
the terms with ``p < e^-16``; here both are exact (float64). What those differences
amount to is what ``reference_gap`` measures: structllm's float32 model against
llama.cpp's stored base distribution of the same file, which should be ~0.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from structllm.config import EngineConfig
from structllm.engine.core import EngineCore
from structllm.kernels import packed
from tests.support.models import prefill_logits

TEXT = Path(__file__).resolve().parents[1] / "data" / "accuracy_text.txt"
N_CTX = 512
FIRST = N_CTX // 2  # the first scored position (llama-perplexity's ``first``)
SCORED = N_CTX - 1 - FIRST  # scored positions per window


@dataclass
class Score:
    """Running sums of a path's KL divergence and top-1 agreement."""

    kl_sum: float = 0.0
    same_top: int = 0
    count: int = 0
    floor: float | None = None  # leave out the terms whose reference log-prob is below it

    @property
    def kl(self) -> float:
        return self.kl_sum / self.count

    @property
    def top1(self) -> float:
        """Top-1 agreement, in percent (llama-perplexity's "Same top p")."""
        return 100.0 * self.same_top / self.count

    def add(self, ref_logp: torch.Tensor, logits: torch.Tensor) -> None:
        """``ref_logp [S, V]`` float64 log-probabilities of the float32 model, ``logits
        [S, V]`` the path's, at the same scored positions."""
        logq = torch.log_softmax(logits.double(), dim=-1)
        terms = ref_logp.exp() * (ref_logp - logq)  # [S, V]
        if self.floor is not None:
            terms = terms.masked_fill(ref_logp <= self.floor, 0.0)
        kl = terms.sum(dim=-1)  # [S]
        self.kl_sum += kl.sum().item()
        self.same_top += int((ref_logp.argmax(-1) == logq.argmax(-1)).sum().item())
        self.count += ref_logp.shape[0]


def windows(ids: list[int], n: int, bos: int | None = None) -> list[list[int]]:
    """The first ``n`` windows of ``N_CTX`` ids (the BOS in each first place if given)."""
    if len(ids) < n * N_CTX:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {n} x {N_CTX}")
    out = [ids[i * N_CTX : (i + 1) * N_CTX] for i in range(n)]
    return [[bos, *w[1:]] if bos is not None else w for w in out]


def windows_digest(ws: list[list[int]]) -> str:
    """A short hash of the windows' ids (int32, in order): the same windows, or not."""
    return hashlib.sha256(np.asarray(ws, dtype=np.int32).tobytes()).hexdigest()[:16]


def scored(logits: torch.Tensor) -> torch.Tensor:
    """A window's logits ``[N_CTX, V]`` -> the scored rows ``[SCORED, V]``."""
    return logits[FIRST : N_CTX - 1]


@dataclass
class BaseFile:
    """What ``llama-perplexity --kl-divergence-base`` wrote: the ids it scored and, per
    window, the base model's log-probabilities at the scored positions."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: list[int]

    @classmethod
    def read(cls, path: Path) -> BaseFile:
        with open(path, "rb") as f:
            if f.read(8) != b"_logits_":
                raise ValueError(f"{path} is not a llama-perplexity logits file")
            n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", f.read(12))
            tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32).tolist()
        return cls(path, n_ctx, n_vocab, n_chunk, tokens)

    def log_probs(self) -> Iterator[torch.Tensor]:
        """Per window, the stored log-probabilities ``[SCORED, n_vocab]`` float64
        (each row: float32 scale and minimum, then uint16 steps above the minimum)."""
        nv = 2 * ((self.n_vocab + 1) // 2) + 4  # uint16s per row
        rows = self.n_ctx - 1 - self.n_ctx // 2
        with open(self.path, "rb") as f:
            f.seek(8 + 12 + 4 * self.n_ctx * self.n_chunk)
            for _ in range(self.n_chunk):
                raw = np.frombuffer(f.read(2 * rows * nv), dtype=np.uint16).reshape(rows, nv)
                head = np.ascontiguousarray(raw[:, :4]).view(np.float32)  # [rows, 2]
                steps = raw[:, 4 : 4 + self.n_vocab].astype(np.float64)
                yield torch.from_numpy(head[:, 1:2] + head[:, 0:1] * steps)


@contextmanager
def float_path() -> Iterator[None]:
    """structllm's exact float path: weights dequantised in registers, float32 math."""
    saved = packed.INT16_MIN_M, packed.INT8_MIN_M
    packed.INT16_MIN_M, packed.INT8_MIN_M = 0, 0
    try:
        yield
    finally:
        packed.INT16_MIN_M, packed.INT8_MIN_M = saved


def structllm_scores(
    path: Path, ws: list[list[int]], paths: list[str], base: BaseFile | None = None
) -> dict[str, Score]:
    """Per ``--cpu-activations`` path, the scores of the windows ``ws`` against the exact
    float path with a float32 KV cache; with a base file also ``float32-vs-llamacpp``:
    that float32 model against llama.cpp's (its stored distribution, its cut-off)."""
    scores = {p: Score() for p in paths}
    gap = Score(floor=-16.0)
    stored = base.log_probs() if base is not None else None
    with ExitStack() as stack:
        stack.callback(packed.set_cpu_activations, "auto")
        ref = engine(stack, path, kv_cache_dtype="float32")
        eng = engine(stack, path)
        for ids in ws:
            packed.set_cpu_activations("auto")
            with float_path():
                ref_logp = torch.log_softmax(scored(prefill_logits(ref, ids)).double(), -1)
            for p in paths:
                packed.set_cpu_activations(p)  # the path of the next matmuls in this process
                scores[p].add(ref_logp, scored(prefill_logits(eng, ids)))
            if stored is not None:
                gap.add(next(stored), ref_logp)
    if base is not None:
        scores["float32-vs-llamacpp"] = gap
    return scores


def engine(stack: ExitStack, path: Path, **kw: str) -> EngineCore:
    eng = EngineCore(EngineConfig(model=str(path), kv_cache_memory=64 << 20, **kw))  # type: ignore[arg-type]
    stack.callback(eng.close)
    return eng


def own_tokens(path: Path) -> list[int]:
    """The text's ids by structllm's tokenizer of ``path`` (no special tokens added)."""
    from structllm.model.loader import prepare_model
    from structllm.tokenizer import Tokenizer

    tok = Tokenizer.from_files(prepare_model(str(path)))
    return tok.encode(TEXT.read_text(), add_special_tokens=False)
