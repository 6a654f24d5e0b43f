"""What the agent holds of the runtime's state: one full ``state_reply``, kept current by deltas.

After a plan's outcome the link asks only for the tensors whose slots changed after the weight
version it holds (``state`` with ``since`` and the runtime ``instance``); the delta's entries
replace the held ones, and the result equals the full state the runtime would send. Every other
sync asks for the full state, and so does the link when a delta does not start from exactly what
it holds (another model or runtime instance, another version, a tensor it does not know).
"""

from __future__ import annotations

from ggufswap.ipc import RuntimeState, TensorEntry
from ggufswap.ipc.bodies import StateRequest


class ActualState:
    """The runtime's state as last reported (always a full one), and its tensors by name."""

    def __init__(self) -> None:
        self.state: RuntimeState | None = None
        self.by_name: dict[str, TensorEntry] = {}

    def request(self, *, model: str, delta: bool) -> StateRequest:
        """What to ask: a delta from the held version when ``delta`` and the held state can be
        the base of one (from a runtime that names its instance, of ``model``), else it all."""
        held = self.state
        if not delta or held is None or held.instance is None or held.model != model:
            return StateRequest()
        return StateRequest(since=held.weight_version, instance=held.instance)

    def take(self, reply: RuntimeState, asked: StateRequest) -> str | None:
        """Hold ``reply``: a full state as it is, a delta applied to the held state. Returns
        why not when ``reply`` is a delta that does not apply (nothing changes then)."""
        if reply.since is None:
            self.state, self.by_name = reply, reply.by_name()
            return None
        why = self._mismatch(reply, asked)
        if why is not None:
            return why
        held = self.state
        assert held is not None, "a delta applies only to a held state (_mismatch)"
        self.by_name.update((entry.record.name, entry) for entry in reply.tensors)
        tensors = tuple(self.by_name.values())  # updated keys keep their place: the full order
        self.state = RuntimeState(held.model, reply.weight_version, tensors, held.instance)
        return None

    def _mismatch(self, delta: RuntimeState, asked: StateRequest) -> str | None:
        held = self.state
        if asked.since is None or held is None or delta.since is None:
            return "a delta answers a request for the full state"
        if (delta.model, delta.instance) != (held.model, held.instance):
            return (
                f"the delta is of model {delta.model!r}, runtime instance {delta.instance!r}; "
                f"the state held of {held.model!r}, instance {held.instance!r}"
            )
        if not asked.since == held.weight_version == delta.since <= delta.weight_version:
            return (
                f"the delta goes from weight version {delta.since} to {delta.weight_version}; "
                f"asked from {asked.since}, holding {held.weight_version}"
            )
        unknown = sorted(e.record.name for e in delta.tensors if e.record.name not in self.by_name)
        if unknown:
            return f"the delta names tensors the runtime never reported: {unknown[:10]}"
        return None
