"""The spin policy (``ipc.channel.SpinBudget``, ``spin_window``), on a fake clock: a
ping-pong between two sides on a machine whose wake-ups cost ``wake`` seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from structllm.ipc import channel
from structllm.ipc.channel import SPIN_CAP_S, SpinBudget, spin_window, wake_latency

US = 1e-6


@dataclass
class Side:
    budget: SpinBudget
    waiting_since: float = 0.0

    def receive(self, arrival: float, wake: float) -> tuple[float, bool]:
        """When this side, waiting since ``waiting_since``, has a message that arrives at
        ``arrival`` in hand, and whether it slept: a spin catches it if it arrives
        within the budget; otherwise the side slept and wakes ``wake`` after it."""
        spun = self.budget.current
        caught = arrival - self.waiting_since <= spun
        ready = arrival if caught else arrival + wake
        self.budget.observe(ready - self.waiting_since)
        return ready, not caught


def ping_pong(
    window: float,
    wake: float,
    rounds: int,
    front_turnaround: float = 10 * US,
    engine_turnaround: float = 3 * US,
) -> tuple[list[float], list[int]]:
    """Round-trip times and sleeps per round, starting from the state a hiccup leaves:
    both budgets at their floor."""
    front, engine = Side(SpinBudget(window)), Side(SpinBudget(window))
    for side in (front, engine):
        side.budget.current = side.budget.min_s
    t = 0.0
    rtts, sleeps = [], []
    for _ in range(rounds):
        front.waiting_since = t  # sends, then waits for the reply
        got, engine_slept = engine.receive(t, wake)
        reply = got + engine_turnaround
        engine.waiting_since = reply
        ready, front_slept = front.receive(reply, wake)
        rtts.append(ready - t)
        sleeps.append(engine_slept + front_slept)
        t = ready + front_turnaround
    return rtts, sleeps


VM_WAKE = 78 * US  # issue 13's AVX2 VM
CONFIGURED = 50 * US


def test_spinning_recovers_after_a_hiccup_where_wake_ups_are_slow() -> None:
    window = spin_window(CONFIGURED, VM_WAKE)
    rtts, sleeps = ping_pong(window, VM_WAKE, 40)
    assert sum(sleeps[-30:]) == 0  # both sides catch each other again, by spinning
    no_spin, _ = ping_pong(0.0, VM_WAKE, 40)
    assert all(s <= n for s, n in zip(rtts, no_spin, strict=True))  # never slower than sleeping
    assert rtts[-1] < VM_WAKE / 5


def test_the_old_policy_stayed_asleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the configured window whatever a wake-up cost, halved by any wait over
    one window. After a hiccup every round trip slept twice, for good."""
    monkeypatch.setattr(channel, "IDLE_WAIT_WINDOWS", 1)
    _, sleeps = ping_pong(CONFIGURED, VM_WAKE, 40)
    assert sleeps[-30:] == [2] * 30


@pytest.mark.parametrize("wake_us", [5, 13, 30, 78, 200, 400])
def test_recovery_on_any_machine(wake_us: float) -> None:
    wake = wake_us * US
    _, sleeps = ping_pong(spin_window(CONFIGURED, wake), wake, 40)
    assert sum(sleeps[-20:]) == 0


def test_an_idle_peer_shrinks_the_budget_and_traffic_restores_it() -> None:
    b = SpinBudget(CONFIGURED)
    for _ in range(10):
        b.observe(0.25)  # the idle engine's poll timeouts
    assert b.current == pytest.approx(CONFIGURED / 64)
    rounds = 0
    while b.current < CONFIGURED:
        b.observe(3 * CONFIGURED)  # a busy peer (a wake-up in the wait): not idle
        rounds += 1
    assert rounds == 6
    b.observe(channel.IDLE_WAIT_WINDOWS * CONFIGURED + US)
    assert b.current == CONFIGURED / 2
    assert SpinBudget(0.0).current == 0.0


def test_spin_window() -> None:
    assert spin_window(0.0, VM_WAKE) == 0.0  # spinning off stays off
    assert spin_window(CONFIGURED, 13 * US) == CONFIGURED  # fast wake-ups: as configured
    assert spin_window(CONFIGURED, VM_WAKE) == pytest.approx(channel.WAKE_SPIN_FACTOR * VM_WAKE)
    assert spin_window(CONFIGURED, 1.0) == SPIN_CAP_S  # never more than the cap
    assert spin_window(2 * SPIN_CAP_S, 1.0) == 2 * SPIN_CAP_S  # unless configured so


def test_wake_latency_is_measured_once() -> None:
    w = wake_latency()
    assert math.isfinite(w) and 0 < w < 1.0
    assert wake_latency() == w  # cached: once per process
