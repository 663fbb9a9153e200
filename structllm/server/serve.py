"""``structllm run``: the supervisor task tree of a server.

    Supervisor.run
    ├── signals        SIGINT/SIGTERM -> graceful stop (a second one: stop now)
    ├── http           hypercorn on our socket (answers /health with 503 until ready)
    └── engine         open_engine -> EngineClient.run (dispatcher + process watch)

Shutdown, in order: stop accepting; in-flight requests get ``shutdown_timeout`` seconds
to finish, then are cancelled (their engine requests aborted); the engine gets
``Shutdown`` and, after a grace period, SIGKILL; exit 0. If the engine dies, /health
turns 503, in-flight requests fail with 503, and the engine is restarted (with backoff,
a bounded number of times); if it cannot be, the server stops with exit code 1.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

from structllm.client import EngineClient, EngineDeadError
from structllm.harmony import uses_harmony
from structllm.harmony.render import MARKERS
from structllm.ipc import shm
from structllm.ipc.async_process import ChildProcess
from structllm.ipc.parent import die_with_parent
from structllm.ipc.spawn import spawn
from structllm.launch import (
    DEFAULT_RING_CAPACITY,
    IMAGE_RING_CAPACITY,
    ChannelHandoff,
    EngineStartError,
    attach_engine,
    open_engine,
)
from structllm.model.files import ModelFiles, find_model_files, generation_defaults, model_path
from structllm.multimodal.mmproj import pair_processor
from structllm.multimodal.processor import ImageProcessor
from structllm.multimodal.registry import processor_for
from structllm.server.app import App
from structllm.server.config import ServerConfig
from structllm.server.lora import ServedAdapters
from structllm.server.metrics import SLOT_SIZE, Metrics
from structllm.tokenizer import Tokenizer
from structllm.tools import FAMILY_FORMATS, detect_format

log = logging.getLogger("structllm.server")
FD_HEADROOM = 128  # descriptors beyond connections: model files, rings, doorbells, pipes


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted sockets inherit it
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def say(msg: str) -> None:
    print(f"structllm: {msg}", file=sys.stderr, flush=True)


class ApiServerSpec(msgspec.Struct, frozen=True):
    """What an extra front-end process gets (JSON argument; the descriptors inherited)."""

    config: ServerConfig
    listen_fd: int
    metrics_fd: int
    metrics_size: int
    handoff: ChannelHandoff
    parent_pid: int


_PREPARE = """
import sys
from structllm.model.loader import prepare_model
try:
    prepare_model(sys.argv[1] or None)
except (ValueError, FileNotFoundError) as e:
    print(e)
    sys.exit(2)
"""


def front_end_files(model: str | None) -> ModelFiles:
    """The model's files, for a process that must never import torch or transformers
    (they would stay resident for its whole life): a short-lived child converts what a
    cold cache lacks (GGUF weights, a tokenizer without ``tokenizer.json``), then the
    lookup here finds everything cached. Raises ``ValueError`` with the child's message
    if the model cannot be prepared."""
    child = subprocess.run(
        [sys.executable, "-c", _PREPARE, model or ""],
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if child.returncode != 0:
        raise ValueError(
            child.stdout.strip() or f"preparing the model failed (exit code {child.returncode})"
        )
    return find_model_files(model)


def make_app(
    config: ServerConfig, files: ModelFiles, metrics_table: Any = None, slot: int = 0
) -> App:
    name = config.served_model_name or files.name
    tokenizer = Tokenizer.from_files(files)
    auto = (  # (a chat template given is the user's choice of format)
        config.tool_call_parser == "auto"
        and config.reasoning_parser is None
        and config.chat_template is None
    )
    wanted = config.tool_call_parser == "openai" or config.reasoning_parser == "openai_gptoss"
    if wanted and not all(tokenizer.token_id(m) is not None for m in MARKERS):
        raise ValueError(
            "the harmony format (--tool-call-parser openai, --reasoning-parser openai_gptoss) "
            f"needs its markers as tokens; this vocabulary lacks some of {' '.join(MARKERS)}"
        )
    if auto and uses_harmony(files.config.architecture, tokenizer.token_id):
        config = dataclasses.replace(
            config, tool_call_parser="openai", reasoning_parser="openai_gptoss"
        )
        if slot == 0:
            say(
                "gpt-oss: the harmony format (--tool-call-parser openai, --reasoning-parser "
                "openai_gptoss)"
            )
    if config.chat_template is not None:
        tokenizer.set_chat_template(config.chat_template)
    elif files.template_note is not None and slot == 0:  # the extra front ends say nothing
        say(files.template_note)
    if config.tool_call_parser == "auto" and slot == 0:
        fmt = detect_format(tokenizer.meta.chat_template)
        if fmt in FAMILY_FORMATS:  # (hermes and generic, the long-standing ones, go unsaid)
            say(f"tool calls: the {fmt} syntax, whose tags the chat template writes")
    defaults = generation_defaults(files, config.engine.generation_config)
    if defaults:
        log.warning(
            "default sampling parameters from the model's generation_config.json: %s "
            "(--generation-config vllm keeps the API's own)",
            defaults,
        )
    model_dir = model_path(config.engine.model)
    mmproj = config.engine.mmproj
    processor: ImageProcessor | None
    if mmproj is not None:  # a GGUF model's images: the processor from its mmproj file
        cfg = files.config
        processor = pair_processor(
            Path(mmproj), model_dir, cfg.architecture, cfg.hidden_size, tokenizer.token_id
        )
    else:
        processor = processor_for(
            model_dir if model_dir.is_dir() else None, tokenizer.token_id, config.image_processor
        )
    adapters = ServedAdapters(
        config.engine.enable_lora,
        name,
        files.config,
        config.engine.max_lora_rank,
        config.lora_modules,
    )
    return App(
        config, name, tokenizer, Metrics(name, metrics_table, slot), defaults, processor, adapters
    )


def limit_connections(max_connections: int) -> None:
    """Cap open connections through the descriptor limit: every connection is a
    descriptor, and when none is left the servers' accept loops pause and retry (trio
    and asyncio both do), leaving further clients in the kernel's backlog. The
    headroom covers this process's own files, rings and pipes."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_HEADROOM
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def run(config: ServerConfig) -> int:
    """Blocking entry point for the CLI; returns the exit code."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    limit_connections(config.max_connections)
    try:
        sock = bind(config.host, config.port)
    except OSError as e:
        say(f"error: cannot listen on {config.host}:{config.port}: {e.strerror}")
        return 2
    t0 = time.monotonic()
    metrics_mem = None
    metrics_fd = -1
    table = None
    if config.api_server_count > 1:
        # counters of all front ends, one slot each, summed by whoever answers /metrics
        metrics_mem, metrics_fd = shm.create(config.api_server_count * SLOT_SIZE * 8)
        table = memoryview(metrics_mem).cast("d")
    app: App | None = None
    try:
        app = make_app(config, front_end_files(config.engine.model), table, 0)
        return int(
            anyio.run(Supervisor(config, app, sock, metrics_fd, t0).run, backend=config.backend)
        )
    except KeyboardInterrupt:
        return 130
    finally:
        if app is not None:
            app.close()
        sock.close()
        if metrics_mem is not None:
            assert table is not None
            table.release()  # the one view the metrics hold; then the mapping can close
            metrics_mem.close()
            os.close(metrics_fd)


class Supervisor:
    """The task tree of the main server process (see the module docstring). It owns
    the engine of each generation and the extra front-end processes started with it;
    the listening socket and the metrics table belong to ``run``. ``run`` returns the
    exit code: 0 after a requested stop, 1 when the engine cannot be kept up."""

    def __init__(
        self, config: ServerConfig, app: App, sock: socket.socket, metrics_fd: int, t0: float
    ) -> None:
        self.config, self.app, self.sock, self.metrics_fd, self.t0 = (
            config,
            app,
            sock,
            metrics_fd,
            t0,
        )

    async def run(self) -> int:
        self.stop = anyio.Event()  # a stop was requested (signal) or the engine is given up
        self.http_done = anyio.Event()
        code = 0  # what a second signal (stop now, cancelling everything) leaves
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_signals, self.stop, tg.cancel_scope)
            tg.start_soon(serve_http, self.config, self.app, self.sock, self.stop, self.http_done)
            tg.start_soon(self.app.collect_garbage_when_idle)
            tg.start_soon(
                self.app.responses.serve_background, self.stop, self.config.shutdown_timeout
            )
            code = await self.keep_engine_up()
            self.stop.set()
            with anyio.move_on_after(self.config.shutdown_timeout + 5):
                await self.http_done.wait()
            tg.cancel_scope.cancel()
        return code

    async def keep_engine_up(self) -> int:
        """Run engines until ``stop``: when one dies, in-flight requests have already
        failed (503) and /health says 503; restart with exponential backoff, up to
        ``max_engine_restarts`` deaths in a row (a run of 60 s resets the count)."""
        cfg = self.config
        failures = 0
        while True:
            started = time.monotonic()
            try:
                await self.run_engine()
            except EngineStartError as e:
                say(f"error: {e}")
                if self.app.client is None:  # never came up: nothing to restart
                    return 1
            if self.stop.is_set():
                return 0
            failures = 1 if time.monotonic() - started > 60 else failures + 1
            if not cfg.restart_engine or failures > cfg.max_engine_restarts:
                say(
                    "the engine is down and will not be restarted"
                    + ("" if cfg.restart_engine else " (--no-restart-engine)")
                )
                return 1
            delay = min(30.0, 0.5 * 2 ** (failures - 1))
            say(
                f"restarting the engine in {delay:.1f}s "
                f"(restart {failures} of {cfg.max_engine_restarts})"
            )
            with anyio.move_on_after(delay):
                await self.stop.wait()
            if self.stop.is_set():
                return 0
            self.t0 = time.monotonic()

    async def run_engine(self) -> None:
        """One engine's life (and with it the extra front-end processes'): returns after
        ``stop`` (everything shut down) or a death, which the caller treats alike."""
        cfg = self.config
        say(f"loading {cfg.engine.model or 'the default model'} ...")
        images = self.app.vision.processor is not None
        async with open_engine(
            cfg.engine,
            channels=cfg.api_server_count,
            ring_capacity=IMAGE_RING_CAPACITY if images else DEFAULT_RING_CAPACITY,
            shutdown_timeout=5.0,
        ) as engine:
            client = EngineClient(engine, id_prefix="c0-")
            async with anyio.create_task_group() as tg:

                async def dispatcher() -> None:
                    await client.run()  # returns only when the engine process is gone
                    if not self.stop.is_set():
                        say(f"error: {client.dead}")
                    tg.cancel_scope.cancel()

                tg.start_soon(dispatcher)
                api_servers: list[
                    ChildProcess
                ] = []  # each owned (stopped, reaped) from its spawn on
                try:
                    for h in engine.handoffs:
                        api_servers.append(self.spawn_api_server(h))
                        tg.start_soon(
                            self.watch_api_server, api_servers[-1], tg.cancel_scope, client
                        )
                    self.app.attach(client)
                    self.say_ready(
                        engine.ready.max_model_len,
                        engine.ready.num_kv_blocks,
                        engine.ready.block_size,
                    )
                    await self.stop.wait()
                    # Let the HTTP sides drain (in-flight requests still need the engine),
                    # then stop.
                    for w in api_servers:
                        w.terminate()
                    with anyio.move_on_after(cfg.shutdown_timeout + 2):
                        await self.http_done.wait()
                        closed = self.app.responses.background_closed
                        if closed is not None:  # background runs, cancelled and recorded
                            await closed.wait()
                        for w in api_servers:
                            await w.wait()
                    tg.cancel_scope.cancel()
                finally:
                    with anyio.CancelScope(shield=True):
                        for w in api_servers:
                            w.kill()
                            await w.wait()
                            w.close()
        if self.stop.is_set():
            say("engine stopped")

    def say_ready(self, max_model_len: int, blocks: int, block_size: int) -> None:
        host, port = self.sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        say(
            f"serving {self.app.model_name} at http://{shown}:{port}/v1 "
            f"(ready in {time.monotonic() - self.t0:.1f}s; "
            f"max_model_len {max_model_len}, {blocks} KV blocks of {block_size})"
        )
        if self.config.web_ui:
            say(f"chat page at http://{shown}:{port}/")

    def spawn_api_server(self, handoff: ChannelHandoff) -> ChildProcess:
        cfg = self.config
        spec = ApiServerSpec(
            cfg,
            self.sock.fileno(),
            self.metrics_fd,
            cfg.api_server_count * SLOT_SIZE * 8,
            handoff,
            os.getpid(),
        )
        return ChildProcess(
            spawn(
                "structllm.server.api_server",
                spec,
                (self.sock.fileno(), self.metrics_fd, *handoff.fds),
            )
        )

    async def watch_api_server(
        self, child: ChildProcess, scope: anyio.CancelScope, client: EngineClient
    ) -> None:
        """A front-end process that dies is handled like the engine dying: everything of
        this generation is torn down (its requests fail) and the restart loop brings it
        back."""
        code = await child.wait()
        if not self.stop.is_set():
            say(f"error: front-end process {child.pid} exited (code {code})")
            client.fail(EngineDeadError(f"front-end process {child.pid} exited"))
            scope.cancel()


def run_api_server(spec: ApiServerSpec) -> int:
    """A front-end process besides the main one (``--api-server-count``): same app, its
    own channel to the shared engine, the same listening socket."""
    cfg = spec.config
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    die_with_parent(spec.parent_pid)
    limit_connections(cfg.max_connections)
    sock = socket.socket(fileno=spec.listen_fd)
    mapping = shm.attach(spec.metrics_fd, spec.metrics_size)
    os.close(spec.metrics_fd)
    table = memoryview(mapping).cast("d")
    # the main process prepared the files before it started the engine: all cached now
    app = make_app(cfg, find_model_files(cfg.engine.model), table, spec.handoff.index)

    async def main() -> int:
        code = 0
        stop, http_done = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_signals, stop, tg.cancel_scope)
            tg.start_soon(app.collect_garbage_when_idle)
            tg.start_soon(app.responses.serve_background, stop, cfg.shutdown_timeout)
            async with attach_engine(spec.handoff) as engine, anyio.create_task_group() as etg:
                client = EngineClient(engine, id_prefix=f"c{spec.handoff.index}-")

                async def dispatcher() -> None:
                    nonlocal code
                    await client.run()  # returns only when the engine is gone
                    if not stop.is_set():
                        code = 1
                        stop.set()

                etg.start_soon(dispatcher)
                app.attach(client)
                # Accept only once ready: until then the main process takes every connection.
                tg.start_soon(serve_http, cfg, app, sock, stop, http_done)
                await stop.wait()
                with anyio.move_on_after(cfg.shutdown_timeout + 2):
                    await http_done.wait()  # in-flight requests still need the engine
                    closed = app.responses.background_closed
                    if closed is not None:  # so do background runs, until recorded
                        await closed.wait()
                etg.cancel_scope.cancel()
            tg.cancel_scope.cancel()
        return code

    try:
        return int(anyio.run(main, backend=cfg.backend))
    except KeyboardInterrupt:
        return 0
    finally:
        app.close()
        app.metrics.table = None
        table.release()
        mapping.close()


async def serve_http(
    config: ServerConfig, app: App, sock: socket.socket, stop: anyio.Event, done: anyio.Event
) -> None:
    from hypercorn.config import Config

    hc = Config()
    hc.bind = [f"fd://{os.dup(sock.fileno())}"]  # hypercorn owns (and closes) the duplicate
    hc.graceful_timeout = config.shutdown_timeout
    hc.accesslog = "-" if config.log_level.lower() == "debug" else None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.loglevel = config.log_level.upper()
    hc.keep_alive_timeout = 5
    hc.h11_max_incomplete_size = 64 * 1024
    serve: Any
    if config.backend == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve
    closing = anyio.Event()  # hypercorn's shutdown trigger: the drain is over
    async with anyio.create_task_group() as tg:

        async def drain_then_close() -> None:
            # On `stop` the server keeps accepting: /health answers 503, so a router sees
            # the drain on a fresh connection (had hypercorn stopped accepting, the probe
            # would wait in the listen backlog until the process exits), and requests
            # that still arrive are served. Once the requests in flight are done (or
            # shutdown_timeout has passed: then they are cancelled) hypercorn stops
            # accepting. On trio it keeps idle keep-alive connections until
            # graceful_timeout, so everything is closed here; on asyncio hypercorn
            # closes idle connections itself.
            await stop.wait()
            app.draining = True
            with anyio.move_on_after(config.shutdown_timeout) as timer:
                await app.drained()
            closing.set()
            # past the timeout asyncio's hypercorn would wait graceful_timeout again
            if config.backend == "trio" or timer.cancel_called:
                tg.cancel_scope.cancel()

        tg.start_soon(drain_then_close)
        try:
            await serve(app, hc, shutdown_trigger=closing.wait)
        except Exception:
            if not stop.is_set():
                raise
            # hypercorn's asyncio worker can trip over its own clean-up when it is
            # cancelled mid-drain (InvalidStateError); the server is going down anyway.
            log.debug("http server raised while stopping", exc_info=True)
        finally:
            tg.cancel_scope.cancel()
            done.set()


async def watch_signals(stop: anyio.Event, scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            if stop.is_set():
                say("stopping now")
                scope.cancel()
                return
            say(
                f"{signal.Signals(sig).name}: finishing in-flight requests, then stopping "
                "(again to stop now)"
            )
            stop.set()
