"""The runtime's control server: the ZeroMQ face of :class:`HotSwapRuntime`.

A thin layer. The request server validates each message once and hands the handler what that
read (a ``plan`` arrives as a :class:`~ggufswap.ipc.Plan`). A plan goes to
:meth:`HotSwapRuntime.submit`, which has the plan's ticket followed by an answer
(:mod:`.control_answers`) for the peer that sent it: the answer's first reply (``accepted``, or
the outcome of a plan already decided) is the handler's return, and each later move of the
ticket (``staged``, then ``committed`` or ``rejected``) is queued with ``send_to``. Either way
every frame leaves from the request server's thread, the only one that touches its socket. The
runtime's events are published on the PUB socket. ``state`` reports the loaded table (whole, or
only the slots a commit stamped after the version the client holds: :meth:`ControlServer.state`),
``status`` the runtime's health. The wire format is in docs/protocol.md.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, Final

from ggufswap.config import Config
from ggufswap.ipc import (
    Event,
    Fields,
    MessageType,
    Plan,
    Process,
    Publisher,
    Reason,
    Rejected,
    Request,
    RequestServer,
    RuntimeState,
    SocketOptions,
    TensorEntry,
    make_reply,
    new_id,
    rejected_to_wire,
    state_to_wire,
    supervisor,
)
from ggufswap.ipc.bodies import StateRequest
from ggufswap.ipc.codec import STATUS_MAX_REQUEST_SIZE
from ggufswap.ipc.errors import UnknownMessageType
from ggufswap.ipc.supervisor import Supervised
from ggufswap.logs import get_logger
from ggufswap.runtime.control_answers import Answer, Fanout
from ggufswap.runtime.engine import HotSwapRuntime
from ggufswap.runtime.plans import PlanState, another_plan
from ggufswap.runtime.store import Slot

log = get_logger(__name__)

Reply = Mapping[str, Any]

# Plans one client may have queued or staging at once (the agent has one in flight); past it a
# plan is ``rejected`` (stale: retry later). A client is a process on ipc:// (SO_PEERCRED: all
# its connections count together), a connection on tcp:// (``peer_identity``).
MAX_PLANS_IN_FLIGHT_PER_PEER = 4
# Plans handed to the runtime at once: one staging or staged, one queued behind it so that the
# stager never waits for the dispatcher. Every further plan waits in its client's queue here,
# and the clients' queues are served round-robin: a plan waits behind at most this many plans
# plus one of each other client with plans waiting.
RUNTIME_WINDOW: Final = 2
# The answer to a plan that waited here when the runtime stopped: the client re-plans.
_SHUTTING_DOWN: Final = Reason("*", "runtime shutting down before this plan's turn", stale=True)


def peer_identity(request: Request, *, ipc: bool) -> str:
    """Who sent ``request``, for the per-client limit and the round-robin.

    On an ``ipc://`` endpoint: the connecting process, from the credentials the kernel gives
    the socket (SO_PEERCRED, which libzmq reports as the ``Peer-Address`` ``host:UID:GID:PID``):
    every connection a process opens is the same client, so more connections buy no more
    turns, and no client can claim another's identity. Elsewhere (``tcp://``), the ZeroMQ
    routing id, one per connection: an IP address would merge every client of one host (the
    agent with whoever floods), and a CURVE key may be shared, so a connection is the finest
    identity that cannot be forged.
    """
    address = request.peer_address
    if ipc and address is not None:
        parts = address.rsplit(":", 3)
        if len(parts) == 4 and parts[1].isdigit() and parts[3].isdigit():
            return f"uid {parts[1]} pid {parts[3]}"
    return f"connection {request.peer.hex()}"


@dataclasses.dataclass(eq=False)
class _Handed:
    """A plan handed to the runtime, one per hand-off: its release frees the room it took, and
    not the room of a later hand-off under the same id."""

    plan: Plan


@dataclasses.dataclass
class _Waiting:
    """A plan admitted and answered ``accepted``, waiting for its client's turn."""

    plan: Plan
    identity: str
    answers: list[Answer]


class ControlServer:
    """Serves ``plan``, ``state`` and ``status`` for one runtime; publishes its events."""

    def __init__(
        self,
        runtime: HotSwapRuntime,
        *,
        control_endpoint: str,
        status_endpoint: str | None = None,
        events_endpoint: str | None = None,
        options: SocketOptions | None = None,
        extra_status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        options = options if options is not None else SocketOptions()
        self.runtime = runtime
        # Names this server's weight history on the wire: a ``since`` from another instance (a
        # restarted runtime counts from 0 again) gets the full state.
        self.instance = new_id()
        self._extra_status = extra_status
        self.control = RequestServer(
            control_endpoint,
            self._handle,
            name="runtime",
            options=options,
            types=(MessageType.PLAN, MessageType.STATE, MessageType.STATUS),
        )
        self.status_server = (
            RequestServer(
                status_endpoint,
                self._handle_status,
                name="runtime-status",
                # `ggufswap status` by members of the socket directory's group (docs/operations.md)
                options=dataclasses.replace(options, group_access=True),
                types=(MessageType.STATUS,),
                max_request_size=STATUS_MAX_REQUEST_SIZE,
            )
            if status_endpoint and status_endpoint != control_endpoint
            else None
        )
        self.publisher = Publisher(events_endpoint, options) if events_endpoint else None
        self._ipc = control_endpoint.startswith("ipc://")
        # The fair queue: guarded by one condition, which also wakes the dispatcher thread.
        self._fair = threading.Condition()
        self._peer_plans: dict[str, set[str]] = {}  # client -> plan ids queued here or handed
        self._queues: dict[str, deque[_Waiting]] = {}  # client -> its plans waiting here
        self._turns: deque[str] = deque()  # clients with plans waiting, in round-robin order
        self._waiting: dict[str, _Waiting] = {}  # plan id -> where it waits
        self._handed: dict[str, _Handed] = {}  # plans handed to the runtime, not yet final
        self._reused = 0  # plans refused here because their id names another plan
        self._stopping = False
        self._stopped = threading.Event()  # set with _stopping: ends a restart's backoff
        self._closed = False  # the sockets are closed: events are no longer published
        self._dispatcher: Supervised | None = None
        self.dispatched: list[tuple[str, str]] = []  # (client, plan id) of the last handed plans
        runtime.on_event(self._publish)

    @classmethod
    def from_config(
        cls,
        runtime: HotSwapRuntime,
        config: Config,
        *,
        extra_status: Callable[[], dict[str, Any]] | None = None,
    ) -> ControlServer:
        """The control server of a config's ``runtime`` section, with its security settings."""
        rc = config.require_runtime()
        return cls(
            runtime,
            control_endpoint=rc.control_endpoint,
            status_endpoint=rc.status_endpoint,
            events_endpoint=rc.events_endpoint,
            options=SocketOptions.of(config.security),
            extra_status=extra_status,
        )

    def start(self) -> ControlServer:
        self.control.start()
        if self.status_server is not None:
            self.status_server.start()
        self._dispatcher = Supervised(
            "ggufswap-control-fair", self._dispatch, stop=self._stopped
        ).start()
        return self

    def stop_intake(self) -> None:
        """First step of a shutdown: no plan is handed to the runtime any more, and each plan
        still waiting here is answered ``rejected`` (stale: the client re-plans from the next
        runtime's state, which it never changed), not left undecided. The sockets still run,
        so that closing the runtime next tells the clients of the plans it held."""
        with self._fair:
            self._stopping = True
            waiting = list(self._waiting.values())
            self._waiting.clear()
            self._queues.clear()
            self._turns.clear()
            self._peer_plans.clear()
            self._fair.notify_all()
        self._stopped.set()
        if self._dispatcher is not None:
            self._dispatcher.join(5.0)
            self._dispatcher = None
        for plan in waiting:
            for answer in plan.answers:
                answer.refuse(plan.plan.plan_id, _SHUTTING_DOWN)

    def close(self) -> None:
        """Stop taking plans (:meth:`stop_intake`, if not done yet), then the sockets; events
        published after this (the runtime rejecting what it held) are dropped."""
        self.stop_intake()
        self._closed = True
        self.control.stop()
        if self.status_server is not None:
            self.status_server.stop()
        if self.publisher is not None:
            self.publisher.close()

    # -- requests (the request server's thread) --------------------------------------------

    def _handle(self, request: Request) -> Reply | None:
        if request.type is MessageType.PLAN:
            return self._plan(request)
        if request.type is MessageType.STATE:
            asked = request.body
            assert isinstance(asked, StateRequest), "the request server parses a state message"
            state = self.state(since=asked.since, instance=asked.instance)
            return make_reply(request.msg, MessageType.STATE_REPLY, **state_to_wire(state))
        if request.type is MessageType.STATUS:
            return self._status_reply(request.msg)
        raise UnknownMessageType(f"the runtime does not serve {request.type.value!r} requests")

    def _handle_status(self, request: Request) -> Reply | None:
        if request.type is MessageType.STATUS:
            return self._status_reply(request.msg)
        raise UnknownMessageType("this endpoint serves only status; send plans to the control one")

    def _status_reply(self, msg: Mapping[str, Any]) -> Reply:
        return make_reply(
            msg, MessageType.STATUS_REPLY, process=Process.RUNTIME.value, status=self.status()
        )

    def _plan(self, request: Request) -> Reply:
        plan = request.body
        assert isinstance(plan, Plan), "the request server parses a plan message into a Plan"
        msg_id = str(request.msg[Fields.ID])
        known = self.runtime.ticket(plan.plan_id)
        if known is not None and known.state is not PlanState.REJECTED:
            # A re-send of a plan the runtime has: answered with its state, counted once.
            answer = Answer(self.control, request.peer, msg_id)
            self.runtime.submit(plan, follow=answer)
            assert answer.first is not None, "submit follows the ticket, which answers at once"
            return answer.first
        identity = peer_identity(request, ipc=self._ipc)
        accepted = make_reply(request.msg, MessageType.ACCEPTED, **{Fields.PLAN_ID: plan.plan_id})
        with self._fair:
            waiting = self._waiting.get(plan.plan_id)
            given = self._handed.get(plan.plan_id)
            held = waiting.plan if waiting is not None else given.plan if given else None
            if held is not None and not held.same_as(plan):  # another plan under a held id
                state = "handed to the runtime" if waiting is None else "waiting"
                self._reused += 1
                log.warning("plan.id_reused", plan_id=plan.plan_id, known=state)
                outcome = another_plan(plan.plan_id, state)
                return make_reply(request.msg, MessageType.REJECTED, **rejected_to_wire(outcome))
            if waiting is not None:  # a re-send of a plan waiting here: one more to answer
                waiting.answers.append(
                    Answer(self.control, request.peer, msg_id, said_accepted=True)
                )
                return accepted
            plans = self._peer_plans.setdefault(identity, set())
            if len(plans) >= MAX_PLANS_IN_FLIGHT_PER_PEER:
                return self._busy(request, plan, identity)
            plans.add(plan.plan_id)
            direct = not self._turns and len(self._handed) < RUNTIME_WINDOW
            if direct:
                handed = self._handed[plan.plan_id] = _Handed(plan)
                self._note_dispatched(identity, plan.plan_id)
            else:
                answer = Answer(self.control, request.peer, msg_id, said_accepted=True)
                self._enqueue(_Waiting(plan, identity, [answer]))
                return accepted
        # The runtime has room and no one waits: handed over now, validated as it is.
        answer = Answer(
            self.control,
            request.peer,
            msg_id,
            on_final=lambda: self._release(identity, plan.plan_id, handed),
        )
        try:
            self.runtime.submit(plan, follow=answer)
        except BaseException:  # a bug (answered INTERNAL): its room is not held forever
            self._release(identity, plan.plan_id, handed)
            raise
        assert answer.first is not None, "submit follows the ticket, which answers at once"
        return answer.first

    def _busy(self, request: Request, plan: Plan, identity: str) -> Reply:
        busy = Rejected(
            plan_id=plan.plan_id,
            stale=True,
            reasons=(
                Reason(
                    "*",
                    f"this client ({identity}) already has {MAX_PLANS_IN_FLIGHT_PER_PEER} plans "
                    "in flight; resend after one of them is committed or rejected",
                    stale=True,
                ),
            ),
        )
        log.warning("control.peer_busy", plan_id=plan.plan_id, client=identity)
        return make_reply(request.msg, MessageType.REJECTED, **rejected_to_wire(busy))

    def _enqueue(self, waiting: _Waiting) -> None:
        """Queue ``waiting`` behind its client's earlier plans (``_fair`` held)."""
        queue = self._queues.get(waiting.identity)
        if queue is None:
            queue = self._queues[waiting.identity] = deque()
            self._turns.append(waiting.identity)
        queue.append(waiting)
        self._waiting[waiting.plan.plan_id] = waiting
        self._fair.notify_all()

    def _note_dispatched(self, identity: str, plan_id: str) -> None:
        self.dispatched.append((identity, plan_id))
        del self.dispatched[:-64]

    def _dispatch(self) -> None:
        """The dispatcher thread: hands the next client's next plan to the runtime whenever it
        has room (round-robin over the clients with plans waiting)."""
        while True:
            with self._fair:
                self._fair.wait_for(
                    lambda: self._stopping or (bool(self._turns) and self._room()), timeout=1.0
                )
                if self._stopping:
                    return
                if not (self._turns and self._room()):
                    continue
                identity = self._turns.popleft()
                queue = self._queues[identity]
                waiting = queue.popleft()
                if queue:
                    self._turns.append(identity)  # its next plan after everyone else's
                else:
                    del self._queues[identity]
                plan_id = waiting.plan.plan_id
                del self._waiting[plan_id]
                handed = self._handed[plan_id] = _Handed(waiting.plan)
                self._note_dispatched(identity, plan_id)
            release = partial(self._release, identity, plan_id, handed)
            fanout = Fanout(waiting.answers, on_final=release)
            try:
                self.runtime.submit(waiting.plan, follow=fanout)
            except Exception:  # a bug: the plan is dropped, its client re-plans
                log.exception("control.dispatch_failed", plan_id=plan_id)
                release()

    def _room(self) -> bool:
        return len(self._handed) < RUNTIME_WINDOW

    def _release(self, identity: str, plan_id: str, handed: _Handed) -> None:
        """``handed`` reached a final state: its client and the runtime have room again (unless
        a later hand-off holds its id: that one's release frees the room)."""
        with self._fair:
            if self._handed.get(plan_id, handed) is not handed:
                return
            self._handed.pop(plan_id, None)
            plans = self._peer_plans.get(identity)
            if plans is not None:
                plans.discard(plan_id)
                if not plans:
                    del self._peer_plans[identity]
            self._fair.notify_all()

    def fairness(self) -> dict[str, Any]:
        """The fair queue, for ``status``: plans waiting per client and handed to the runtime."""
        with self._fair:
            return {
                "waiting": {identity: len(q) for identity, q in self._queues.items()},
                "handed": len(self._handed),
                "clients_in_flight": {i: len(p) for i, p in self._peer_plans.items()},
                "id_reused": self._reused,
            }

    # -- events ----------------------------------------------------------------------------

    def _publish(self, event: Event) -> None:
        if self.publisher is not None and not self._closed:
            self.publisher.publish(event)

    # -- reports ---------------------------------------------------------------------------

    def state(self, *, since: int | None = None, instance: str | None = None) -> RuntimeState:
        """The loaded table; with ``since`` (a weight version of this ``instance``, not past
        the current one) a delta: only the slots stamped after it (``Slot.changed_at``).

        The version is read before the slots: a commit that runs meanwhile stamps what it
        changes with a later version, so the next delta from this reply's version has it.
        """
        version = self.runtime.weight_version
        slots: Iterable[Slot] = self.runtime.slots().values()
        if since is not None and instance == self.instance and since <= version:
            slots = [slot for slot in slots if slot.changed_at > since]
        else:
            since = None  # not a version of this instance's history: the full state
        entries = tuple(
            TensorEntry(record=slot.record, fingerprint=slot.fingerprint, slot=slot.state)
            for slot in slots
        )
        return RuntimeState(
            model=self.runtime.model_name,
            weight_version=version,
            tensors=entries,
            instance=self.instance,
            since=since,
            events=self.publisher.endpoint if self.publisher is not None else None,
        )

    def status(self) -> dict[str, Any]:
        status = self.runtime.status()
        status["control_queue"] = self.fairness()
        status["threads"] = supervisor.snapshot()
        status["threads_down"] = supervisor.down()
        status["threads_unsupervised"] = supervisor.unsupervised()
        if self._extra_status is not None:
            status.update(self._extra_status())
        return status
