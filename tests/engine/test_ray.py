"""``--distributed-executor-backend ray``: rank 1 as a Ray actor in a placement group on
a local two-node Ray cluster (``ray.cluster_utils.Cluster``, one CPU per node, so the
two bundles land on different nodes); greedy tokens equal one process on the exact
float32 path. Without Ray the flag is refused with the command that installs it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from structllm import LLM
from tests.support.models import EXACT, SPLIT_PROMPTS, assert_same_greedy_as
from tests.support.procs import ROOT, python_env


def test_without_ray_the_flag_is_refused_naming_the_extra() -> None:
    script = (
        "import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
        "from structllm.config import EngineConfig\n"
        "try:\n"
        "    EngineConfig(tensor_parallel_size=2, distributed_executor_backend='ray')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=python_env(), capture_output=True, text=True
    )
    assert "pip install 'structllm[ray]'" in out.stdout, out.stderr


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'structllm[ray]')")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_tp2_over_ray_actors_on_two_nodes_matches_one_process(
    ray_cluster: Any, tiny_llama_dir: Path
) -> None:
    tiny = str(tiny_llama_dir)
    engine_kw: dict[str, Any] = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=48, **EXACT)
    ref = LLM(tiny, **engine_kw)
    with LLM(tiny, tensor_parallel_size=2, distributed_executor_backend="ray", **engine_kw) as tp:
        workers = tp.engine.workers
        assert workers is not None and workers.pids == []  # no process of ours: an actor
        nodes = workers.ray_bundle_nodes()
        assert len(set(nodes)) == 2  # one bundle per rank, on the cluster's two nodes
        assert_same_greedy_as(ref, tp, [*SPLIT_PROMPTS, SPLIT_PROMPTS[1]], logprob_atol=1e-4)
