"""What the engine loop read from its rings while a step ran (``process.engine_loop``
peeks between layers and applies it all once the step ends), summed up for the one
decision taken mid-step: whether the running step is worth finishing
(``EngineCore.step``, ``StepCutShort``).

A step is cut short when every one of its requests has been aborted (nobody wants what
it computes), or, under the priority policy, when a held ``AddRequest`` is strictly more
urgent than every request of the step: finishing the step would only make the newcomer
wait, and its requests lose nothing by being cut (nothing is sampled; they run again
from where they were). Equal priorities never cut, and under fcfs every priority is 0.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from structllm.protocol import Abort, AddRequest, ToEngine


@dataclass
class Held:
    aborts: set[str] = field(default_factory=set)  # request ids the held aborts name
    most_urgent: int | None = None  # the smallest priority of the held AddRequests

    def add(self, msgs: Iterable[ToEngine]) -> None:
        for msg in msgs:
            if isinstance(msg, Abort):
                self.aborts.update(msg.request_ids)
            elif isinstance(msg, AddRequest):
                p = msg.priority
                self.most_urgent = p if self.most_urgent is None else min(self.most_urgent, p)

    def clear(self) -> None:
        """Every held message has been applied."""
        self.aborts.clear()
        self.most_urgent = None

    def cut_reason(self, ids: Collection[str], floor: int | None) -> str | None:
        """Why the step of requests ``ids`` should stop now (``"abort"``, ``"urgent"``) or
        None. ``floor``: the smallest priority among them under the priority policy
        (None under fcfs: arrivals never cut)."""
        if all(rid in self.aborts for rid in ids):
            return "abort"
        if floor is not None and self.most_urgent is not None and self.most_urgent < floor:
            return "urgent"
        return None
