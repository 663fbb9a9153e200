"""A step's image rows: which rows of the flat batch take encoder rows instead of their
token's embedding, those rows, and what each row sees ahead (Gemma 3's images attend to
themselves in both directions).

The runner lays a step out (``ModelRunner.prepare``) and hands the prefill chunks that
hold image tokens here. Each image's encoder output comes from the encoder cache
(``engine.encoder_cache``, by ``ImageInput.hash``) or is computed and put there, pinned
until the step ends (``EncoderCache.unpin_all`` after the forward pass), and held
after it while a request is still inside its span (``EncoderCache.hold``). Each chunk
takes the encoder rows of its own image tokens only. For a bidirectional model (Gemma
3) the scheduler never splits an image's span across chunks, so a chunk that holds one
of an image's tokens holds every one from there to the span's end: the rows it attends
to ahead are in the same step, stored in the KV cache before any query of the layer
attends. A causal model's span may be split (``Scheduler.split_spans``): its rows see
nothing ahead, so a chunk needs no later row of its image.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from structllm.engine.encoder_cache import EncoderCache
from structllm.engine.request import Request
from structllm.model.deepstack import Deepstack
from structllm.model.vision import VisionModel
from structllm.protocol import ImageInput


@dataclass
class ImageRows:
    rows: Tensor  # [M] int64: flat batch rows whose embedding an encoder row replaces
    embeds: Tensor  # [M, hidden]: those encoder rows
    ahead: Tensor | None  # [T] int64: keys past its own position each row sees, or None
    ahead_seqs: frozenset[int]  # sequences (batch indices) with rows that see ahead
    deepstack: Deepstack | None = None  # Qwen3-VL's rows for its first layers, or None

    def embed(self, x: Tensor) -> Tensor:
        """The input embeddings ``x: [T, hidden]`` (the token embeddings, scaled as the
        family scales them) with the encoder rows in place."""
        x[self.rows] = self.embeds.to(x.dtype)
        return x


@dataclass(frozen=True)
class Chunk:
    """One prefill chunk of the step: ``req``'s positions ``start .. start + n - 1`` at
    flat rows ``row0 ..``, sequence ``seq`` of the batch."""

    req: Request
    start: int
    n: int
    row0: int
    seq: int


def image_rows(
    chunks: list[Chunk],
    num_rows: int,
    vision: VisionModel,
    cache: EncoderCache[Tensor],
    device: torch.device,
) -> ImageRows | None:
    """The image rows of ``chunks`` in a batch of ``num_rows`` rows, or None if they hold
    no image token. Encodes the images the cache lacks."""
    rows: list[int] = []
    parts: list[Tensor] = []
    ahead = [0] * num_rows if vision.bidirectional else []
    seqs: set[int] = set()
    token = vision.image_token_id
    for c in chunks:
        end = c.start + c.n
        for im in c.req.images:
            if im.offset >= end or im.offset + im.length <= c.start:
                continue
            span = range(im.offset, im.offset + im.length)
            where = [p for p in span if c.req.token_ids[p] == token]  # k-th -> encoder row k
            mine = [k for k, p in enumerate(where) if c.start <= p < end]
            if not mine:
                continue
            encoded = encoder_output(im, vision, cache)
            rows += [c.row0 + where[k] - c.start for k in mine]
            parts.append(encoded[mine[0] : mine[-1] + 1])
            if vision.bidirectional and where[mine[0]] < where[-1]:
                for k in mine:
                    ahead[c.row0 + where[k] - c.start] = where[-1] - where[k]
                seqs.add(c.seq)
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=device)
    embeds = torch.cat(parts).to(device)  # [M, (1 + k) * hidden]
    seen = torch.tensor(ahead, dtype=torch.long, device=device) if seqs else None
    deep = None
    if vision.deepstack:  # the encoder's rows: the embeddings, then a row per layer
        split = embeds.view(len(rows), 1 + vision.deepstack, -1).transpose(0, 1)
        embeds, deep = split[0], Deepstack(index, split[1:])  # [M, hidden], [k, M, hidden]
    return ImageRows(index, embeds, seen, frozenset(seqs), deep)


def encoder_output(image: ImageInput, vision: VisionModel, cache: EncoderCache[Tensor]) -> Tensor:
    """``image``'s encoder rows from ``cache``, else encoded and put there; pinned."""
    hit = cache.get(image.hash)
    if hit is not None:
        cache.pin(image.hash)
        return hit
    out = vision.encode(image)
    cache.put(image.hash, out, out.numel() * out.element_size())
    return out
