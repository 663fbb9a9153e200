"""The default per-step token budget on CPU, from the measured cost of a prefill chunk.

A request that arrives while a step runs waits for the whole step, and an abort lands
only between steps; so a step must stay short. On a GPU a 2048-token step takes tens of
milliseconds; on a two-core CPU it took seconds (about 1.2 ms per token for the default
model here), so a storm of prompts held every newcomer for the whole of one huge
prefill. With ``EngineConfig.max_num_batched_tokens`` left unset, the CPU engine times
one prefill chunk at start-up (``PROBE_TOKENS``, after an untimed warm-up forward) and
``auto_token_budget`` turns that into the budget: the most tokens that fit
``TARGET_STEP_S``, on a ``GRANULE`` grid, within ``[MIN_AUTO_TOKENS, MAX_AUTO_TOKENS]``
and never below ``max_num_seqs``.

The rule is pure and deterministic (unit-tested); only its input is measured.
"""

from __future__ import annotations

# A newcomer waits at most about this long for the running step. Before a step could be
# cut short (all of its requests aborted: see ``EngineCore.step``), 0.2 s had left time to
# first token after a storm of aborted prompts at 1.71x the idle one, so the target was
# 0.1 s; now the storm's steps end at the next layer boundary, and at 0.2 s that ratio was
# 0.88-1.03x here. The longer step carries a 128-token prompt in one chunk (idle time to
# first token on AVX2: 242 -> 185-225 ms) and larger GEMMs (concurrency 16 on AVX2: 1.7x
# -> 1.73-1.86x llama.cpp's tokens/s over runs).
TARGET_STEP_S = 0.2
MAX_AUTO_TOKENS = 2048  # the budget when steps are cheap (GPU, or a fast CPU); vLLM's default
DEFAULT_TOKEN_BUDGET = MAX_AUTO_TOKENS  # where nothing is measured (CUDA, the null model)
GRANULE = 16  # budgets on a grid: a noisy measurement moves the budget in coarse steps only
PROBE_TOKENS = 128  # a prefill chunk long enough that per-token cost dominates the step
# Never fewer tokens than this: a start-up measurement slowed by other work on the
# machine (a parallel build took it from 200 to 900 ms here) must not leave the engine
# with steps so small that their fixed cost dominates for its whole life.
MIN_AUTO_TOKENS = 64


def auto_token_budget(
    seconds_per_token: float,
    max_num_seqs: int,
    target_s: float = TARGET_STEP_S,
    cap: int = MAX_AUTO_TOKENS,
) -> int:
    """The per-step token budget for a prefill cost of ``seconds_per_token``.

    ``floor(target_s / seconds_per_token)`` rounded down to a multiple of ``GRANULE``,
    then clamped to ``[max(MIN_AUTO_TOKENS, max_num_seqs), max(cap, max_num_seqs)]``: never
    below ``max_num_seqs``, so that one step can always carry a decode token for every
    running sequence (a smaller budget would leave some out of each step and stretch
    their inter-token latency), and never above ``cap``. A cost of 0 or less (nothing
    measurable) gives the upper bound.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    lo = max(MIN_AUTO_TOKENS, max_num_seqs)
    hi = max(cap, max_num_seqs)
    if seconds_per_token <= 0:
        return hi
    fit = int(target_s / seconds_per_token) // GRANULE * GRANULE
    return min(hi, max(lo, fit))


def budget_upper_bound(max_num_batched_tokens: int | None, max_num_seqs: int) -> int:
    """The largest budget an engine with these settings can end up with (``None``: the
    auto budget). For sizing what must hold a whole step (the tensor-parallel ring)."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    return max(MAX_AUTO_TOKENS, max_num_seqs)
