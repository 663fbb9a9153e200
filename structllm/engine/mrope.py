"""A request's 3-D rotary positions (M-RoPE, Qwen2.5-VL's text model): each token has a
(t, h, w) position instead of its index.

As transformers' ``get_rope_index`` assigns them: a text token's is ``(q, q, q)``, ``q``
one past the position before it; an image whose tokens form a ``rows x cols`` grid
(row-major, the merged patches) starting where the next text position ``q0`` would be
has ``(q0, q0 + r, q0 + c)`` for its token in row ``r``, column ``c``; the text after it
continues from ``q0 + max(rows, cols)``. So past an image every token's position is its
index plus a fixed shift (``<= 0``: an image's positions are fewer than its tokens), and
generated tokens continue with the last image's shift. A position never exceeds its
token's index, so the rotary table sized by the sequence length covers them.

The runner lays out the t axis (``flat``) for every row and, for a step with image
rows, the ``[3, T]`` tensor (``mrope_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# (flat row of a chunk's first token, (its h positions, its w positions))
Spatial = tuple[int, tuple[list[int], list[int]]]


@dataclass(frozen=True)
class ImageGrid:
    """An image's tokens ``offset .. offset + rows * cols - 1`` (row-major) and ``t0``,
    the position they start at (their t axis; h and w add the row and column)."""

    offset: int
    rows: int
    cols: int
    t0: int

    @property
    def end(self) -> int:
        return self.offset + self.rows * self.cols

    @property
    def shift_after(self) -> int:
        """Position minus index of the tokens after the image (until the next one)."""
        return self.t0 + max(self.rows, self.cols) - self.end


class MRopePositions:
    """The positions of one request whose prompt holds images (``grids``: each image's
    first token and its token grid, in prompt order, spans disjoint)."""

    def __init__(self, grids: Sequence[tuple[int, int, int]]) -> None:
        self.images: list[ImageGrid] = []
        shift = 0
        for offset, rows, cols in grids:
            if rows < 1 or cols < 1:
                raise ValueError(f"an image grid of {rows}x{cols} tokens")
            if self.images and offset < self.images[-1].end:
                raise ValueError("image grids overlap or are out of order")
            grid = ImageGrid(offset, rows, cols, offset + shift)
            self.images.append(grid)
            shift = grid.shift_after

    def flat(self, start: int, end: int) -> list[int]:
        """The t-axis positions of tokens ``start .. end - 1``: all three axes' outside an
        image's tokens."""
        out = list(range(start, end))
        for im in self._after(start):
            lo, hi = max(im.offset, start), min(im.end, end)
            for p in range(lo, hi):
                out[p - start] = im.t0
            for p in range(max(hi, start), end):  # past it: its shift (until a later one's)
                out[p - start] = p + im.shift_after
        return out

    def spatial(self, start: int, end: int) -> tuple[list[int], list[int]] | None:
        """The h and w positions of tokens ``start .. end - 1`` when an image token is
        among them (elsewhere they equal ``flat``'s), else None."""
        inside = [im for im in self.images if im.offset < end and start < im.end]
        if not inside:
            return None
        t = self.flat(start, end)
        h, w = list(t), list(t)
        for im in inside:
            for p in range(max(im.offset, start), min(im.end, end)):
                r, c = divmod(p - im.offset, im.cols)
                h[p - start], w[p - start] = im.t0 + r, im.t0 + c
        return h, w

    def _after(self, start: int) -> list[ImageGrid]:
        """The images from the last one starting at or before ``start`` on (its shift
        applies from ``start``), in order."""
        first = 0
        for k, im in enumerate(self.images):
            if im.offset <= start:
                first = k
        return self.images[first:]


def mrope_rows(flat: Tensor, spatial: list[Spatial]) -> Tensor:
    """A step's ``[3, T]`` (t, h, w) positions (the runner's, for a step with image
    rows): ``flat`` on every axis, then each ``(row0, (h, w))`` of ``spatial`` (a chunk
    over image tokens at flat rows ``row0 ..``, ``MRopePositions.spatial``) in place on
    the h and w axes. Rank 0 only (images run without parallelism), so it
    stays off the wire: ``StepInput.positions`` keeps the t axis."""
    out = flat.expand(3, -1).clone()
    for row0, (h, w) in spatial:
        out[1, row0 : row0 + len(h)] = torch.tensor(h, dtype=out.dtype)
        out[2, row0 : row0 + len(w)] = torch.tensor(w, dtype=out.dtype)
    return out
