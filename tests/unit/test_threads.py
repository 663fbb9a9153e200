"""The OpenMP wait settings the engine's processes start with (``structllm.threads``)."""

from __future__ import annotations

import os
import subprocess
import sys

from structllm.threads import GOMP_SPINCOUNT, omp_wait_defaults


def test_a_short_barrier_spin_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    omp_wait_defaults(env)
    assert env == {"GOMP_SPINCOUNT": GOMP_SPINCOUNT}
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(mine)
        omp_wait_defaults(env)
        assert env == mine


def test_the_offline_llm_sets_it_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = (
        "import os, sys, structllm; structllm.LLM; "
        "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == [GOMP_SPINCOUNT, "True"]
