"""The Ray sweep's workers as the driver sees them (:mod:`.ray_driver`), and what became of them:
the replacements Ray started, the workers out of restarts, the rounds Ray retried; each told on
the console with the fleet's state (workers alive, restarted, dead; rounds retried) and kept for
``ray.json``.

Ray gives the driver no event when it restarts an actor: a replacement is seen when it answers
(its first round, or the driver's question after a round failed), by its new pid; a retried
round by the attempt the replacement counted (:meth:`.ray_worker.SweepWorker.run_round`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ggufswap.logs import get_logger
from ggufswap.sweep.errors import SweepError
from ggufswap.sweep.ray_worker import WorkerInfo
from ggufswap.sweep.recipe import Round

log = get_logger(__name__)


@dataclass
class Worker:
    actor: Any  # the actor handle
    info: WorkerInfo  # as it last reported itself


@dataclass
class Fleet:
    """The workers and what became of them: restarts, deaths, rounds retried (progress lines)."""

    workers: list[Worker]
    announce: Callable[[str], None]
    call_timeout_s: float
    restarts: list[dict[str, Any]] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    retried: list[dict[str, Any]] = field(default_factory=list)

    def line(self) -> str:
        alive = len(self.workers) - len(self.dead)
        return (
            f"workers: {alive} alive, {len(self.restarts)} restarted, {len(self.dead)} dead; "
            f"rounds retried: {len(self.retried)}"
        )

    def tell(self, event: str, **fields: Any) -> None:
        log.warning(event, **fields)
        self.announce(f"{fields['what']}; {self.line()}")

    def saw(self, w: Worker, about: dict[str, Any], r: Round | None) -> None:
        """A round came back (or ``w`` answered): note a replacement Ray started and a round it
        retried."""
        info = WorkerInfo(**about["worker"])
        if info.pid != w.info.pid:
            self.restarts.append({"worker": w.info.name, "host": info.host,
                                  "pid_before": w.info.pid, "pid": info.pid})  # fmt: skip
            before, w.info = w.info, info
            self.tell("sweep.ray.worker_restarted", worker=info.name, what=(
                f"worker {info.name} was restarted by Ray on {info.host} "
                f"(pid {before.pid} -> {info.pid})"
            ))  # fmt: skip
        if r is not None and about["attempt"] > 1:
            self.retried.append({"key": r.key, "worker": w.info.name, "attempt": about["attempt"]})
            self.tell("sweep.ray.round_retried", worker=w.info.name, round=r.key, what=(
                f"round {r.key} retried by Ray on worker {w.info.name}, attempt {about['attempt']}"
            ))  # fmt: skip

    def still_alive(self, w: Worker) -> bool:
        """Whether Ray restarted ``w`` (True) or it is out of restarts (False: it is dead)."""
        try:
            info = ray.get(w.actor.info.remote(), timeout=self.call_timeout_s)
            self.saw(w, {"worker": asdict(info), "attempt": 1}, None)
            return True
        except GetTimeoutError:
            raise SweepError(
                f"worker {w.info.name} on {w.info.host} died and its replacement did not answer "
                f"within {self.call_timeout_s:.0f} s"
            ) from None
        except RayActorError:
            self.dead.append(w.info.name)
            self.tell("sweep.ray.worker_dead", worker=w.info.name, what=(
                f"worker {w.info.name} on {w.info.host} is dead (out of Ray restarts)"
            ))  # fmt: skip
            return False
