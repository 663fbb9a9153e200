"""Ranks 1..N-1 as Ray actors (``--distributed-executor-backend ray``, vLLM's flag), for
users who already run a Ray cluster.

Rank 0 stays in the engine process (the Ray driver). The pool reserves a placement
group of one bundle per rank (``{"CPU": 1}``, ``PACK``: as few nodes as fit), and starts
one actor per rank 1..N-1 in its bundle. The rendezvous address is rank 0's node address
as Ray sees it, with a port the kernel picks. Each actor then runs the same code as a
rank on another host (``worker.run_remote``): it meets the store there, loads its shard,
and gets its steps over TCP; its collectives bind to its own node's address. So an
actor's death is noticed as a remote rank's is (its connections close), and the engine
ends as after any rank's death.

Ray is imported only here, and only when the flag asks for it (``pip install
'structllm[ray]'``; ``config.EngineConfig`` refuses the flag without it).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import msgspec
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from structllm.protocol import WorkerLaunch

READY_TIMEOUT = datetime.timedelta(minutes=10)  # the placement group's resources


def node_ip() -> str:
    """This process's node address as Ray sees it (connects to the cluster first:
    ``RAY_ADDRESS``, else ``auto``, the cluster this host is part of)."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
    return str(ray.util.get_node_ip_address())


@ray.remote
class RankActor:
    """One rank in its own Ray worker process."""

    def run(self, launch_json: bytes) -> int:
        from structllm.engine.worker import run_remote

        launch = msgspec.json.decode(launch_json, type=WorkerLaunch)
        here = str(ray.util.get_node_ip_address())
        return run_remote(msgspec.structs.replace(launch, node_addr=here))


ACTOR: Any = RankActor  # a Ray actor class: ``options``/``remote`` are added at run time


class RayRanks:
    """The placement group and the actors of ranks 1..``world_size``-1; ``close`` kills
    the actors and removes the group (idempotent)."""

    def __init__(self, launches: list[WorkerLaunch]) -> None:
        world = len(launches) + 1
        self.pg: Any = placement_group([{"CPU": 1}] * world, strategy="PACK")
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        try:
            ray.get(self.pg.ready(), timeout=READY_TIMEOUT.total_seconds())
            for launch in launches:
                actor = ACTOR.options(
                    num_cpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=launch.rank
                    ),
                ).remote()
                self.actors.append(actor)
                self.runs.append(actor.run.remote(msgspec.json.encode(launch)))
        except BaseException:
            self.close()
            raise

    def bundle_nodes(self) -> list[str]:
        """The node id of each bundle, in rank order."""
        from ray.util import placement_group_table

        table = placement_group_table(self.pg)["bundles_to_node_id"]
        return [table[i] for i in range(len(table))]

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.runs = [], []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
