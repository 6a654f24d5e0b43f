"""Weight updates over HTTP, waiting for a version, and commits under continuous traffic (issue
29, items 3 and 4)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import ModelDir, Q, one_thread
from test_http import PROMPT, SWAPPED, WAIT_S, complete, spec, start_server

from ggufswap.runtime import PlanState

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def post(port: int, path: str, body: object) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("POST", path, body=json.dumps(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_a_weight_update_over_http_commits_and_names_the_version(tmp_path: Path) -> None:
    """POST /v1/weights/update reloads what changed on disk (or the tensors named) and answers
    the plan's outcome with the new weight_version; unchanged files answer "unchanged"; a
    request with min_weight_version is served on that version or later."""
    models = ModelDir.write(tmp_path / "model", spec())
    name = SWAPPED[2]
    for served in start_server(models.first):
        status, same = post(served.port, "/v1/weights/update", {})
        assert (status, same["outcome"], same["weight_version"]) == (200, "unchanged", 0), same
        models.put(name, models.variant(name, Q.Q4_0, tmp_path / "variants"))
        status, done = post(served.port, "/v1/weights/update", {"model_path": str(models.first)})
        assert (status, done["outcome"], done["weight_version"]) == (200, "committed", 1), done
        assert done["tensors"] == [name]
        assert complete(served.port, max_tokens=2, temperature=0)["weight_version"] == 1
        status, named = post(served.port, "/update_weights_from_disk", {"tensors": [name]})
        assert (status, named["success"], named["changed"]) == (200, True, []), named
        assert named["weight_version"] == 1, "the same bytes reloaded change no version"
        models.put(name, models.save(name, tmp_path / "again"))
        models.put(name, models.variant(name, Q.Q8_0, tmp_path / "variants8"))
        status, done = post(served.port, "/v1/weights/update", {})
        assert (status, done["weight_version"], done["changed"]) == (200, 2, [name]), done
        status, waited = get(served.port, "/v1/weights?min_weight_version=2&timeout_s=5")
        assert (status, waited["weight_version"]) == (200, 2)
        reply = complete(served.port, max_tokens=2, temperature=0, min_weight_version=2)
        assert reply["weight_version"] == 2
        status, late = get(served.port, "/v1/weights?min_weight_version=9&timeout_s=0.2")
        assert (status, late["error"]["code"]) == (503, "weight_version_not_reached"), late
        status, bad = post(served.port, "/v1/weights/update", {"tensors": ["no.such.tensor"]})
        assert (status, bad["error"]["code"]) == (400, "unknown_tensor"), bad


def test_a_commit_lands_while_a_client_posts_continuously(tmp_path: Path) -> None:
    """With a client posting 8-token completions back to back, each submitted plan commits
    within the longest request in flight plus a margin (no request starts while a plan is in
    flight), and every answer names the one version that produced it."""
    models = ModelDir.write(tmp_path / "model", spec())
    name = SWAPPED[0]
    saved = models.save(name, tmp_path / "saved")
    variant = models.variant(name, Q.Q4_0, tmp_path / "variants")
    for served in start_server(models.first):
        done = threading.Event()
        answers: list[tuple[int, float, float]] = []  # version, started, latency
        failures: list[str] = []

        def client() -> None:
            while not done.is_set():
                started = time.monotonic()
                try:
                    reply = complete(served.port, prompt=PROMPT, max_tokens=8, temperature=0)
                except Exception as exc:  # noqa: BLE001 (recorded, fails the test)
                    failures.append(repr(exc))
                    continue
                answers.append((reply["weight_version"], started, time.monotonic() - started))

        poster = threading.Thread(target=client, name="poster")
        poster.start()
        waits = []
        try:
            for i in range(6):
                while len(answers) < 2 * (i + 1):  # traffic is flowing before each plan
                    time.sleep(0.01)
                models.put(name, variant if i % 2 == 0 else saved)
                submitted = time.monotonic()
                ticket = served.runtime.submit(models.plan(uuid.uuid4().hex, [name]))
                assert ticket.wait(WAIT_S) is PlanState.COMMITTED, ticket.reasons
                waits.append(time.monotonic() - submitted)
            deadline = time.monotonic() + WAIT_S
            while answers[-1][0] != 6 and time.monotonic() < deadline:  # served on the last
                time.sleep(0.01)
        finally:
            done.set()
            poster.join(WAIT_S)
        assert not failures, failures
        longest = max(latency for _, _, latency in answers)
        versions = [v for v, _, _ in answers]
        assert versions == sorted(versions), "answers never go back to an older version"
        assert set(versions) >= {0, 6}
        # A commit waits at most for the request in flight (and the plan's staging): never for
        # the requests that keep arriving.
        assert max(waits) < 2 * longest + 1.0, (waits, longest)
        print(
            f"\n{len(answers)} answers; submit -> committed max {max(waits) * 1e3:.0f} ms, "
            f"longest request {longest * 1e3:.0f} ms"
        )
