"""The engine process over real rings: handshake, waiting on both anyio backends,
back-pressure, and faults (kill -9 of either side). Uses the null-model engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import pytest

from structllm.client import EngineClient, EngineDeadError
from structllm.config import EngineConfig
from structllm.launch import EngineStartError, open_engine
from structllm.protocol import PROTOCOL_VERSION, AddRequest, OutputBatch, SamplingParams
from tests.support.procs import HANG_S, ROOT, alive, shm_entries, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_shm_leaks")]

NULL = EngineConfig(null_model=True, kv_cache_memory=64 << 20)


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def collect(ep, request_id: str) -> list[int]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    while True:
        for msg in await ep.recv():
            assert isinstance(msg, OutputBatch)
            for d in msg.outputs:
                if d.request_id == request_id:
                    tokens += d.new_token_ids
                    if d.finish_reason:
                        return tokens


async def test_handshake_then_a_request_round_trip() -> None:
    async with open_engine(NULL) as eng:
        assert eng.ready.protocol_version == PROTOCOL_VERSION and eng.ready.vocab_size == 49152
        assert shm_entries() == set()  # unlinked as soon as created
        await eng.endpoint.send(AddRequest("a", [1, 2, 3], SamplingParams(max_tokens=7)))
        assert len(await collect(eng.endpoint, "a")) == 7
    assert not alive(eng.pid)


async def test_front_end_sleeps_and_is_woken_by_the_doorbell() -> None:
    cfg = EngineConfig(null_model=True, kv_cache_memory=64 << 20, null_step_time=0.02)
    async with open_engine(cfg, front_spin_us=0, spin_us=0) as eng:
        t = time.monotonic()
        await eng.endpoint.send(AddRequest("a", [1, 2, 3], SamplingParams(max_tokens=5)))
        with anyio.fail_after(HANG_S):  # no spinning, no polling: a missed wake-up hangs
            assert len(await collect(eng.endpoint, "a")) == 5
        assert time.monotonic() - t > 0.08  # five 20 ms steps, each a sleep and a wake-up


async def test_full_ring_makes_senders_wait_and_nothing_is_lost() -> None:
    async with open_engine(NULL, ring_capacity=1 << 12) as eng:
        client = EngineClient(eng)
        results: dict[str, list[int]] = {}

        async def one(i: int) -> None:
            prompt = list(range(1, 300))  # ~600 bytes a frame: a handful fill the ring
            async with client.request(f"r{i}", prompt, SamplingParams(max_tokens=3)) as stream:
                toks: list[int] = []
                while not stream.finished:
                    toks += (await stream.get()).token_ids
                results[f"r{i}"] = toks

        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run)
            async with anyio.create_task_group() as reqs:
                for i in range(60):
                    reqs.start_soon(one, i)
            tg.cancel_scope.cancel()
        assert eng.endpoint.space_waits > 0
        assert sorted(results) == sorted(f"r{i}" for i in range(60))
        assert all(len(t) == 3 for t in results.values())


async def test_aborting_every_request_of_a_running_step_cuts_it_short() -> None:
    # null steps of 2 s, in 8 slices with a look for aborts between them (as between a
    # model's layers): a request aborted during its step ends that step at the next look
    cfg = EngineConfig(null_model=True, kv_cache_memory=64 << 20, null_step_time=2.0)
    async with open_engine(cfg) as eng:
        client = EngineClient(eng)
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            stats = client.stats
            # The abort must land after the next step has begun. Sent the moment the
            # token arrives it can win the race to the engine's next read of its rings
            # (a loaded machine may run the woken front end before the engine gets back
            # to its loop) and then ends the request with no step to cut. So the client
            # waits one slice of the step before leaving, and tries again if the abort
            # still came first: a step that is never cut fails.
            for attempt in range(5):
                rid = f"r{attempt}"
                async with client.request(rid, [1, 2, 3], SamplingParams(max_tokens=50)) as s:
                    await s.get()  # the first step's token: the next step starts now
                    await anyio.sleep(cfg.null_step_time / 8)
                # leaving the request aborted it; wait until the engine has let it go
                with anyio.fail_after(HANG_S):
                    while (stats := await client.fresh_stats(HANG_S)).num_running:
                        await anyio.sleep(0.05)
                if stats.num_steps_cut:
                    break
            assert stats.num_steps_cut == 1
            # every full step made its request's token; the cut one made none and is not
            # counted (had the client been slow, the cut is a later step: still true)
            assert stats.num_steps == stats.num_generation_tokens >= attempt + 1
            tg.cancel_scope.cancel()


async def test_kill_9_of_the_engine_fails_streams() -> None:
    cfg = EngineConfig(null_model=True, kv_cache_memory=64 << 20, null_step_time=0.01)
    async with open_engine(cfg) as eng:
        client = EngineClient(eng)
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            async with client.request(
                "long", [1, 2, 3], SamplingParams(max_tokens=100_000, ignore_eos=True)
            ) as stream:
                await stream.get()
                os.kill(eng.pid, signal.SIGKILL)
                # the engine's exit is an event (its pidfd): a missed one hangs
                with anyio.fail_after(HANG_S), pytest.raises(EngineDeadError):
                    while True:
                        await stream.get()
            with pytest.raises(EngineDeadError):
                async with client.request("after", [1], SamplingParams()):
                    pass


async def test_engine_start_failure_is_reported() -> None:
    with pytest.raises(EngineStartError, match="model not found"):
        async with open_engine(EngineConfig(model="/nonexistent/model.gguf")):
            pass


@pytest.mark.parametrize("fails", ["os.pipe", "subprocess.Popen"])
async def test_a_failed_start_closes_what_it_opened(
    fails: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # e.g. the descriptor limit reached midway while the server restarts an engine
    def no_more(*args: object, **kwargs: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(fails, no_more)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Too many open files"):
        async with open_engine(NULL):
            pass
    monkeypatch.undo()
    assert set(os.listdir("/proc/self/fd")) == before


async def test_garbage_from_the_front_end_does_not_stop_the_engine() -> None:
    async with open_engine(NULL) as eng:
        eng.endpoint.ep.try_send_bytes(b"\xc1\xc1 not msgpack")
        await eng.endpoint.send(AddRequest("ok", [5, 6], SamplingParams(max_tokens=2)))
        assert len(await collect(eng.endpoint, "ok")) == 2


PARENT = textwrap.dedent(
    """
    import anyio, sys
    from structllm.config import EngineConfig
    from structllm.launch import open_engine

    async def main():
        async with open_engine(EngineConfig(null_model=True, kv_cache_memory=64 << 20)) as eng:
            print(eng.pid, flush=True)
            await anyio.sleep(60)

    anyio.run(main, backend=sys.argv[1])
    """
)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_kill_9_of_the_parent_takes_the_engine_down(backend: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, backend], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        engine_pid = int(parent.stdout.readline())
        assert alive(engine_pid)
        parent.kill()
        parent.wait()
        # PR_SET_PDEATHSIG and the parent pipe's EOF: events, not polling
        wait_for(lambda: not alive(engine_pid), "engine outlived its parent")
    finally:
        parent.kill()


def test_engine_module_refuses_to_run_by_hand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "structllm.engine"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 2 and "started by the structllm front end" in out.stderr


@pytest.mark.parametrize("anyio_backend", ["trio"])  # the engine side is what is tested
async def test_an_urgent_arrival_cuts_a_running_step_short() -> None:
    # priority policy, null steps of 0.8 s in 8 slices: an urgent request that arrives
    # while a less urgent one's step runs ends that step at the next look, and its own
    # step follows
    cfg = EngineConfig(
        null_model=True,
        kv_cache_memory=64 << 20,
        null_step_time=0.8,
        scheduling_policy="priority",
    )
    async with open_engine(cfg) as eng:
        client = EngineClient(eng)
        async with anyio.create_task_group() as tg:
            await tg.start(client.run)
            low_sp, urgent_sp = SamplingParams(max_tokens=50), SamplingParams(max_tokens=1)
            async with client.request("low", [1, 2, 3], low_sp, priority=5) as low:
                await low.get()  # the first step's token: the next step starts now
                # as with aborts, the urgent request may win the race to the engine's
                # next read of its rings (no step to cut): it tries again
                for attempt in range(5):
                    await anyio.sleep(cfg.null_step_time / 8)
                    rid = f"urgent{attempt}"
                    async with client.request(rid, [4, 5], urgent_sp, priority=0) as s:
                        await s.get()
                    stats = await client.fresh_stats(HANG_S)
                    if stats.num_steps_cut:
                        break
                assert stats.num_steps_cut == 1
            tg.cancel_scope.cancel()
