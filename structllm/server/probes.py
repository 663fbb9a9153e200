"""What routers in front of replicas probe (vllm-router, sglang-router): SGLang's
``/health_generate``, ``/get_load``, ``/get_model_info`` and ``/get_server_info``."""

from __future__ import annotations

from collections.abc import Callable

import anyio

from structllm import __version__
from structllm.client import EngineClient, EngineDeadError
from structllm.protocol import SamplingParams
from structllm.server.config import ServerConfig
from structllm.server.errors import APIError
from structllm.server.generation import Transport
from structllm.server.pipeline import Receive, Scope, Send

HEALTH_GENERATE_TIMEOUT_S = 60.0  # a generous bound: the token queues behind running steps


class RouterProbes:
    """The probes of one front end: ``engine()`` is its engine client (or a 503),
    ``draining()`` whether it is stopping."""

    def __init__(
        self,
        config: ServerConfig,
        model_name: str,
        engine: Callable[[], EngineClient],
        draining: Callable[[], bool],
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.engine = engine
        self.draining = draining

    async def health_generate(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Healthy only if the engine generates: one greedy token of a one-token prompt
        (SGLang's ``/health_generate``, which its router forwards to a worker)."""
        client = self.engine()
        if self.draining():
            raise APIError(503, "the server is stopping", type="service_unavailable")
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            with anyio.move_on_after(HEALTH_GENERATE_TIMEOUT_S) as scope_:
                async with client.request(client.new_request_id("health"), [0], sp) as stream:
                    while not stream.finished:
                        await stream.get()
        except EngineDeadError as e:
            raise APIError(
                503, f"the engine is not available: {e}", type="service_unavailable"
            ) from e
        if scope_.cancelled_caught:
            raise APIError(
                503,
                f"the engine did not generate a token within {HEALTH_GENERATE_TIMEOUT_S:.0f}s",
                type="service_unavailable",
            )
        await Transport(send).json(200, {"status": "ok"})

    async def get_load(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The load a router balances by (its ``/get_loads``, ``power_of_two``): requests
        running or waiting in the engine, as of its last step."""
        stats = self.engine().stats
        load = {
            "load": stats.num_running + stats.num_waiting,
            "num_running_reqs": stats.num_running,
            "num_waiting_reqs": stats.num_waiting,
        }
        await Transport(send).json(200, load)

    async def get_model_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        info = {"model_path": self.model_name, "tokenizer_path": self.model_name}
        await Transport(send).json(200, {**info, "is_generation": True})

    async def get_server_info(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The settings a router or an operator may want to see (SGLang's
        ``/get_server_info`` carries its server arguments; these are ours)."""
        client = self.engine()
        engine = self.config.engine
        info = {
            "version": __version__,
            "model_path": self.model_name,
            "served_model_name": self.model_name,
            "max_model_len": client.ready.max_model_len,
            "block_size": engine.block_size,
            "enable_prefix_caching": engine.enable_prefix_caching,
            "tensor_parallel_size": engine.tensor_parallel_size,
            "api_server_count": self.config.api_server_count,
        }
        await Transport(send).json(200, info)
