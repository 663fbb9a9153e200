"""Mamba-2's native prefill scan (``cpu_recurrent.cpp``'s ``ssm_prefill``, through
``Mamba2._native_scan``) against torch's ``ssd`` (the chunked form, ``Mamba2._torch_scan``):
fresh and resumed slots, decode rows beside prefill rows, prefix caching's state saves at a
block boundary inside a chunk and at a chunk's end (the saved row's state the reference's
state after that row), fresh slots holding another sequence's state, the time step's
clamp, state shapes off whole vectors. Float32, within 1e-5 relative. Run under
``STRUCTLLM_CPU_ISA=avx2`` too for the AVX2 build."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import Tensor

from structllm.model.mamba2 import Mamba2
from structllm.model.recurrent import RecurrentBatch
from tests.support.recurrent import batch, close

CHUNK = 16  # the torch path's chunk: the layouts below cut chunks and end inside them
NUM_SLOTS = 8
# (heads, groups, head_dim, d_state): the tests' small shape and one with P and N off
# whole vectors and four-row blocks (the token-by-token form and its tails), the bench
# models' head and one with N off the tiles' four columns (the tiled form, both ISAs)
SHAPES = [(4, 2, 8, 16), (3, 1, 6, 20), (2, 1, 64, 128), (2, 1, 64, 18)]
LIMITS = [(0.0, math.inf), (0.05, 0.8)]


def layer(shape: tuple[int, int, int, int], limit: tuple[float, float], seed: int) -> Mamba2:
    """A Mamba-2 layer (only the scan's parameters matter here), seeded: decay rates
    e^{A_log} in [0.5, 8] as in the other tests, time step biases around 0."""
    h, g, p, n = shape
    m = Mamba2(32, h, p, g, n, 4, CHUNK, 1e-5, dt_limit=limit)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.dt_bias.copy_(torch.randn(h, generator=gen))
        m.A_log.copy_(torch.empty(h).uniform_(0.5, 8, generator=gen).log())
        m.D.copy_(torch.randn(h, generator=gen))
    return m


def step_inputs(m: Mamba2, t: int, seed: int) -> tuple[Tensor, Tensor]:
    """``xbc [t, C]`` (contiguous, as the convolution leaves it) and raw ``dt [t, H]`` as
    ``in_proj``'s last columns (a strided view, as the kernels read it)."""
    gen = torch.Generator().manual_seed(seed)
    xbc = torch.randn(t, m.conv_dim, generator=gen)
    proj = torch.randn(t, m.inner + m.num_heads, generator=gen)
    return xbc, proj[:, m.inner :]


def native() -> Any:
    from structllm.kernels import cpu_ext

    nat = cpu_ext.load_recurrent()
    if nat is None:
        pytest.skip("the recurrent kernels do not build here")
    return nat


def check(m: Mamba2, rb: RecurrentBatch, seed: int) -> None:
    """One step through both paths from the same (random, finite) states: the rows, every
    slot's state and every saved row equal."""
    xbc, dt = step_inputs(m, rb.starts[-1], seed)
    states = torch.randn(NUM_SLOTS, m.num_heads, m.head_dim, m.d_state) * 3
    want_states, got_states = states.clone(), states.clone()
    want = m._torch_scan(xbc, dt, want_states, rb)
    got = m._native_scan(xbc, dt, got_states, dataclasses.replace(rb, native=native()))
    close(got, want)
    for slot in range(NUM_SLOTS):
        close(got_states[slot], want_states[slot])


# (rows, slot, fresh) per sequence, decodes first; how many decodes; saves (sequence,
# rows into its chunk, saved row)
LAYOUTS: list[tuple[list[tuple[int, int, bool]], int, tuple[tuple[int, int, int], ...]]] = [
    ([(100, 1, True)], 0, ()),  # one fresh prompt: whole chunks and a partial one
    ([(37, 2, False)], 0, ()),  # a resumed slot (a later chunk of a chunked prefill)
    ([(1, 0, False), (1, 3, True), (1, 4, False), (50, 1, True), (9, 2, False)], 3, ()),
    ([(70, 1, True)], 0, ((0, 24, 5),)),  # saved 24 rows in: inside the second chunk
    ([(1, 0, False), (40, 2, False), (33, 1, True)], 1, ((1, 40, 6), (2, 1, 7))),
    ([(5, 4, True), (1, 3, False)], 0, ((1, 1, 5),)),  # a 1-row prefill (not a decode)
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("case", range(len(LAYOUTS)))
@torch.no_grad()
def test_prefill_matches_chunked(
    shape: tuple[int, int, int, int], limit: tuple[float, float], case: int
) -> None:
    seqs, nd, saves = LAYOUTS[case]
    rb = dataclasses.replace(batch(seqs, nd), saves=saves)
    check(layer(shape, limit, seed=case), rb, seed=10 + case)


@torch.no_grad()
def test_saved_row_is_state_after_boundary() -> None:
    """The saved row holds the state after the boundary's row: what a step of just the
    rows up to it leaves in the slot (the reference's state at that row)."""
    m = layer(SHAPES[0], LIMITS[0], seed=3)
    xbc, dt = step_inputs(m, 45, seed=4)
    states = torch.randn(NUM_SLOTS, m.num_heads, m.head_dim, m.d_state)
    nat = native()
    saved = states.clone()
    rb = dataclasses.replace(batch([(45, 1, True)], 0), saves=((0, 21, 6),), native=nat)
    m._native_scan(xbc, dt, saved, rb)
    upto = states.clone()
    m._torch_scan(xbc[:21], dt[:21], upto, batch([(21, 1, True)], 0))
    close(saved[6], upto[1])
    assert not torch.equal(saved[6], saved[1])  # the rows after it moved the slot on


@torch.no_grad()
def test_fresh_slot_never_read() -> None:
    """A fresh sequence's slot may hold anything (here NaN): the kernel never reads it."""
    m = layer(SHAPES[1], LIMITS[0], seed=5)
    xbc, dt = step_inputs(m, 30, seed=6)
    states = torch.full((NUM_SLOTS, m.num_heads, m.head_dim, m.d_state), math.nan)
    clean = torch.zeros_like(states)
    nat = native()
    rb = dataclasses.replace(batch([(30, 2, True)], 0), native=nat)
    got = m._native_scan(xbc, dt, states, rb)
    want = m._native_scan(xbc, dt, clean, rb)
    assert torch.equal(got, want) and torch.equal(states[2], clean[2])


def test_prefill_checks_shapes() -> None:
    """A mismatched state shape is refused, not read out of bounds."""
    m = layer(SHAPES[0], LIMITS[0], seed=0)
    xbc, dt = step_inputs(m, 8, seed=0)
    states = torch.zeros(NUM_SLOTS, m.num_heads, m.head_dim, m.d_state + 1)
    segs = batch([(8, 1, True)], 0).segments()
    y = torch.empty(8, m.inner)
    nat = native()
    with pytest.raises(RuntimeError, match="ssm_prefill"):
        nat.ssm_prefill(
            xbc, dt, m.dt_bias, m.A_log, m.D, states, segs, m.n_groups, 0.0, math.inf, y
        )
