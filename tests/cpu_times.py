"""The CPU time of each test, for measuring the suite on a busy machine, where wall-clock
durations (``--durations``) say more about the neighbours than about the test.

``GGUFSWAP_TEST_CPU_TOP=N`` lists the N tests that used the most CPU: the test's own process
(setup, call and teardown) plus the child processes it waited for (``subprocess.run``, a
``Popen`` it waited on) and the zygote's children whose exit it read (the zygote reaps them and
writes their CPU time beside their exit status). A second list ranks the tests by the time
they waited (wall-clock minus CPU, children included): sleeps, timeouts and processes started
but not waited for, which hold a worker as much as work does. Under pytest-xdist the workers send
their figures to the controller.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator

import pytest

ENV = "GGUFSWAP_TEST_CPU_TOP"
_PROPERTY = "ggufswap_cpu_s"


def _cpu_s() -> tuple[float, float, float]:
    """CPU seconds of this process and of its waited-for children so far, and the monotonic
    clock."""
    import zygote

    t = os.times()
    children = t.children_user + t.children_system + zygote.Child.reaped_cpu_s
    return t.user + t.system, children, time.monotonic()


class CpuTimes:
    """The plugin (registered by tests/conftest.py when ``GGUFSWAP_TEST_CPU_TOP`` is set)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.started: dict[str, tuple[float, float, float]] = {}
        self.seconds: dict[str, tuple[float, float, float]] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.started[item.nodeid] = _cpu_s()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """The teardown's report carries the test's figures (to the controller, under xdist)."""
        report = yield
        if report.when == "teardown" and item.nodeid in self.started:
            own, children, clock = self.started.pop(item.nodeid)
            own_now, children_now, clock_now = _cpu_s()
            figures = (own_now - own, children_now - children, clock_now - clock)
            report.user_properties.append((_PROPERTY, figures))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == _PROPERTY:
                self.seconds[report.nodeid] = (float(value[0]), float(value[1]), float(value[2]))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if hasattr(terminalreporter.config, "workerinput"):
            return
        total = sum(own + children for own, children, _ in self.seconds.values())
        terminalreporter.section(f"CPU time of {len(self.seconds)} tests: {total:.1f} s", sep="=")
        ranked = sorted(self.seconds.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[: self.top]
        for nodeid, (own, children, _) in ranked:
            terminalreporter.line(f"{own + children:7.2f}s  ({children:6.2f}s children)  {nodeid}")
        waits = {
            nodeid: wall - own - children for nodeid, (own, children, wall) in self.seconds.items()
        }
        total_wait = sum(max(0.0, w) for w in waits.values())
        terminalreporter.section(f"waiting (wall minus CPU): {total_wait:.1f} s", sep="-")
        for nodeid, wait in sorted(waits.items(), key=lambda kv: -kv[1])[: self.top]:
            terminalreporter.line(f"{wait:7.2f}s  {nodeid}")
        modules: dict[str, float] = {}
        for nodeid, (own, children, _) in self.seconds.items():
            module = nodeid.split("::", 1)[0]
            modules[module] = modules.get(module, 0.0) + own + children
        terminalreporter.section("CPU time by module", sep="-")
        for module, seconds in sorted(modules.items(), key=lambda kv: -kv[1])[: self.top]:
            terminalreporter.line(f"{seconds:7.2f}s  {module}")
