"""Mapped shards under races: writers in place while inference threads read the tensors, while
the load hashes them, two writers at once, two runtimes mapping one file, tensors dropped while
a writer waits; leases that cannot be taken (another user's files, a ``SIGIO`` that cannot be
handled) and a host's own ``SIGIO`` handler.

Each writer is another process; every wait has a timeout; a lease nobody gives up would hold a
writer for ``fs.lease-break-time`` (45 s), past the timeouts here, so a missed move fails.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from runtime_helpers import (
    WAIT_S,
    ModelDir,
    Q,
    fresh_logits,
    logits,
    one_thread,
    open_runtime,
)

from ggufswap.config import MapShards
from ggufswap.runtime import HotSwapRuntime, PlanState, Storage, _libc
from ggufswap.runtime.loading import Loader, LoadJob
from ggufswap.runtime.models import Transformer
from ggufswap.shards import FileChangedError, Layout, TensorRecord

if TYPE_CHECKING:
    from zygote import Zygote

pytestmark = [pytest.mark.process, pytest.mark.usefixtures(one_thread.__name__)]

TESTS = Path(__file__).parent
WRITER_S = 20.0  # a writer that waits this long was not let in by a move (the kernel's is 45 s)


@pytest.fixture
def own_model(tmp_path: Path) -> ModelDir:
    return ModelDir.write(tmp_path / "model")


@contextlib.contextmanager
def mapped(model_dir: ModelDir) -> Iterator[tuple[HotSwapRuntime, Transformer]]:
    runtime, model = open_runtime(model_dir.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
    try:
        yield runtime, model
    finally:
        runtime.close()


def _shards(runtime: HotSwapRuntime) -> list[str]:
    return sorted({s.record.path for s in runtime.store.slots.values()})


def _writer(paths: list[str], *, truncate: bool) -> subprocess.Popen[bytes]:
    """Another process that rewrites ``paths`` in place, one after the other: garbage over the
    whole file, or truncation to nothing."""
    code = textwrap.dedent(
        f"""
        import os, sys
        for path in sys.argv[1:]:
            if {truncate!r}:
                open(path, "wb").close()
            else:
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.write(b"\\xa5" * size)
        """
    )
    return subprocess.Popen([sys.executable, "-c", code, *paths])


def _wait(process: subprocess.Popen[bytes]) -> None:
    try:
        assert process.wait(timeout=WRITER_S) == 0
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=WAIT_S)
        pytest.fail(f"a writer waited {WRITER_S} s: no move let it in")


def _open_for_writing_without_waiting(path: str) -> bool:
    """Whether ``path`` can be opened for writing now (no lease held on it: with one, a
    non-blocking open fails with EWOULDBLOCK)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except BlockingIOError:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("truncate", [False, True], ids=["overwrite", "truncate"])
def test_inference_threads_keep_their_logits_while_a_writer_rewrites_every_shard(
    own_model: ModelDir, truncate: bool
) -> None:
    """Logits in a loop in one thread while another process overwrites (or truncates) every
    served shard in place: every result equals the first, bit for bit, and nothing faults."""
    with mapped(own_model) as (runtime, model):
        paths = _shards(runtime)
        before = logits(model)
        stop = threading.Event()
        results: list[bool] = []
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                while not stop.is_set():
                    results.append(torch.equal(logits(model), before))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        reader = threading.Thread(target=loop, name="test-inference", daemon=True)
        reader.start()
        try:
            _wait(_writer(paths, truncate=truncate))
        finally:
            stop.set()
            reader.join(WAIT_S)
        assert not reader.is_alive()
        assert errors == []
        assert results
        assert all(results), f"{results.count(False)} of {len(results)} changed"
        assert runtime.store.maps.moved == len(paths)
        assert runtime.store.maps.mapped_files == 0
        assert torch.equal(logits(model), before)


def test_two_writers_at_once_wait_for_one_move(own_model: ModelDir) -> None:
    with mapped(own_model) as (runtime, model):
        before = logits(model)
        path = runtime.store.slots["blk.0.ffn_down_exps.weight"].record.path
        writers = [_writer([path], truncate=False), _writer([path], truncate=True)]
        for writer in writers:
            _wait(writer)
        assert runtime.store.maps.moved == 1
        assert torch.equal(logits(model), before)


def test_two_runtimes_in_one_process_map_one_file_and_both_move_it(own_model: ModelDir) -> None:
    """Two leases on one file (one per runtime): a writer waits for both; each runtime moves
    its own mapping, and dropping one leaves the other's tensors as they were."""
    first, first_model = open_runtime(
        own_model.first, storage=Storage.NATIVE, map_shards=MapShards.ON
    )
    with mapped(own_model) as (second, second_model):
        try:
            before = logits(first_model)
            assert torch.equal(logits(second_model), before)
            paths = _shards(first)
            _wait(_writer(paths[:3], truncate=True))
            assert first.store.maps.moved == second.store.maps.moved == 3
        finally:
            first.close()
        del first, first_model
        gc.collect()
        assert torch.equal(logits(second_model), before)
        _wait(_writer(paths[3:6], truncate=False))
        assert second.store.maps.moved == 6
        assert torch.equal(logits(second_model), before)


def test_a_closed_runtime_whose_tensors_are_still_held_lets_writers_in(
    own_model: ModelDir,
) -> None:
    """``close()`` while the host still holds the runtime (or its model): the files stay
    mapped, and leased, while tensors view them, so a writer must still be let in after a
    move, not held for ``fs.lease-break-time`` and then let in under the served tensors."""
    runtime, model = open_runtime(own_model.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
    try:
        before = logits(model)
        path = runtime.store.slots["blk.0.ffn_down_exps.weight"].record.path
    finally:
        runtime.close()
    _wait(_writer([path], truncate=True))
    assert runtime.store.maps.moved == 1
    assert torch.equal(logits(model), before)


def test_tensors_dropped_while_writers_wait_unmap_once_and_let_them_in(
    own_model: ModelDir,
) -> None:
    """The finalizer that unmaps a file (in whatever thread drops its last tensor) against the
    watcher moving it for a writer: writers into every shard while the runtime's tensors are
    dropped in another thread; every writer gets in, no descriptor or mapping stays."""
    runtime, model = open_runtime(own_model.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
    paths = _shards(runtime)
    holder = [runtime, model]
    del runtime, model
    writer = _writer(paths, truncate=True)

    def drop() -> None:
        holder[0].close()
        holder.clear()
        gc.collect()

    dropper = threading.Thread(target=drop, name="test-drop")
    dropper.start()
    dropper.join(WAIT_S)
    _wait(writer)
    gc.collect()
    assert not any(p in _mapped_paths() for p in paths)
    assert not _open_paths() & set(paths)
    assert all(_open_for_writing_without_waiting(p) for p in paths)


def _open_paths() -> set[str]:
    """What this process's descriptors name."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
    return found


def _mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split()) > 5}


def test_a_writer_during_the_load_never_changes_what_is_hashed(
    own_model: ModelDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer truncates a shard while the load faults in and hashes the mapped tensors (the
    writer runs from inside the first hash task, and is let in by a move): the load fails
    naming the changed file, as a copied load does, and leaves it unmapped and unleased."""
    victim = str(own_model.shard_of("blk.1.ffn_up_exps.weight"))
    first = str(own_model.first)
    assert first < victim
    hash_one = Loader._hash_one
    wrote = threading.Event()

    def hash_and_write(self: Loader, job: LoadJob) -> tuple[TensorRecord, str]:
        if job.record.path == first:  # the first task lets the writer in, then hashes
            try:
                _wait(_writer([victim], truncate=True))
            finally:
                wrote.set()
        else:  # the others wait for that: every tensor is hashed after the write
            assert wrote.wait(WAIT_S)
        return hash_one(self, job)

    monkeypatch.setattr(Loader, "_hash_one", hash_and_write)
    with pytest.raises(FileChangedError, match=f"{victim}: .*file identity changed"):
        open_runtime(own_model.first, storage=Storage.NATIVE, map_shards=MapShards.ON)
    assert wrote.is_set()
    gc.collect()
    assert victim not in _mapped_paths()
    assert _open_for_writing_without_waiting(victim)


def test_a_shard_whose_size_is_not_a_page_multiple_moves_with_its_last_bytes(
    tmp_path: Path,
) -> None:
    """A single-file model whose size is not a multiple of the page: its mapping's last page is
    partly past the end of the file; the move copies up to the end, and the tensor that ends
    there reads the same after the file is truncated."""
    model_dir = ModelDir.write(tmp_path / "model", layout=Layout.SINGLE)
    size = model_dir.first.stat().st_size
    if size % mmap.PAGESIZE == 0:  # pad the writer's output to make it not a multiple
        pytest.skip("the single-file model happens to be page-aligned")
    with mapped(model_dir) as (runtime, model):
        last = max(runtime.store.slots.values(), key=lambda s: s.record.offset)
        tail = last.active.tensor.clone()
        before = logits(model)
        _wait(_writer([str(model_dir.first)], truncate=True))
        assert runtime.store.maps.moved == 1
        assert torch.equal(last.active.tensor, tail)
        assert torch.equal(logits(model), before)


# -- processes of their own: another user, SIGIO handlers ------------------------------------


def _run(code: str, *args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    prefix = (
        [] if user is None else ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups"]
    )
    return subprocess.run(
        [*prefix, sys.executable, "-c", code, *args],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )


_LOAD = textwrap.dedent(
    """
    import sys, threading
    from ggufswap.config import MapShards
    from ggufswap.runtime import HotSwapRuntime, PlanState, Storage, mapping
    from ggufswap.runtime import MapRefused

    def load(policy):
        try:
            r = HotSwapRuntime.open(sys.argv[1], storage=Storage.NATIVE, map_shards=policy)
        except MapRefused as exc:
            print("REFUSED", exc)
        else:
            s = r.store.maps.snapshot()
            print("LOADED", s["mapped"], s["copied"], s["copied_why"])
    """
)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="root + setpriv")
@pytest.mark.parametrize("policy", ["AUTO", "ON"])
def test_another_users_files_are_copied_by_auto_and_refused_by_true(policy: str) -> None:
    """Without ``CAP_LEASE`` (a process running as ``nobody``) no lease is granted on root's
    files: ``auto`` copies them, saying why; ``true`` refuses, naming the file."""
    public = Path(tempfile.mkdtemp(prefix="ggufswap-other-user-"))  # pytest's is private
    try:
        public.chmod(0o755)
        _check_another_user(ModelDir.write(public / "model"), policy)
    finally:
        shutil.rmtree(public)


def _check_another_user(model_dir: ModelDir, policy: str) -> None:
    done = _run(_LOAD + f"load(MapShards.{policy})", str(model_dir.first), user="nobody")
    assert done.returncode == 0, done.stderr
    if policy == "AUTO":
        assert "LOADED 0 51 no read lease can be taken on it (EACCES)" in done.stdout
    else:
        assert f"REFUSED {model_dir.root}/" in done.stdout
        assert "no read lease" in done.stdout


@pytest.mark.parametrize("policy", ["AUTO", "ON"])
def test_a_load_off_the_main_thread_with_sigio_default_copies_or_refuses(
    model_dir_shared: ModelDir, policy: str
) -> None:
    """``SIGIO`` at its default action (terminate) and a load in another thread, which cannot
    install a handler: ``auto`` copies with the reason, ``true`` refuses."""
    code = _LOAD + textwrap.dedent(
        f"""
        t = threading.Thread(target=load, args=(MapShards.{policy},))
        t.start(); t.join(60)
        """
    )
    done = _run(code, str(model_dir_shared.first))
    assert done.returncode == 0, done.stderr
    if policy == "AUTO":
        assert "LOADED 0 51 SIGIO has its default action" in done.stdout
    else:
        assert "REFUSED" in done.stdout
        assert "SIGIO has its default action" in done.stdout


@pytest.fixture(scope="module")
def model_dir_shared(tmp_path_factory: pytest.TempPathFactory) -> ModelDir:
    return ModelDir.write(tmp_path_factory.mktemp("mapped-races") / "model")


def test_a_hosts_own_sigio_handler_is_kept_and_the_poll_moves_files(own_model: ModelDir) -> None:
    """A host that handles ``SIGIO`` itself keeps its handler; the watcher's poll alone moves a
    file a writer opens, in time, and the logits stay."""
    code = """
    import signal, subprocess, sys
    import torch
    from runtime_helpers import logits, open_runtime
    from ggufswap.config import MapShards
    from ggufswap.runtime import Storage
    seen = []
    def host(signum, frame):
        seen.append(signum)
    signal.signal(signal.SIGIO, host)
    runtime, model = open_runtime(sys.argv[1], storage=Storage.NATIVE, map_shards=MapShards.ON)
    before = logits(model)
    path = runtime.store.slots["blk.0.attn_q.weight"].record.path
    subprocess.run([sys.executable, "-c", f"open({path!r}, 'wb').close()"], check=True, timeout=20)
    assert signal.getsignal(signal.SIGIO) is host
    assert runtime.store.maps.moved == 1
    assert torch.equal(logits(model), before)
    print("OK", len(seen) > 0)
    """
    done = _run(textwrap.dedent(code), str(own_model.first))
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout


_C_HANDLER = """
#include <signal.h>
volatile int sigio_seen = 0;
static void on_sigio(int signum) { (void)signum; sigio_seen++; }
__attribute__((constructor)) static void install(void) { signal(SIGIO, on_sigio); }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_sigio_handler_installed_in_c_before_python_started_is_kept(
    own_model: ModelDir, tmp_path: Path
) -> None:
    """A host whose C code handles ``SIGIO`` before the interpreter starts (Python reports
    such a handler as ``None``): the runtime keeps it, and the watcher's poll moves the file."""
    source = tmp_path / "host.c"
    source.write_text(_C_HANDLER)
    library = tmp_path / "libhost.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=WAIT_S
    )
    code = """
    import ctypes, signal, subprocess, sys
    import torch
    from runtime_helpers import logits, open_runtime
    from ggufswap.config import MapShards
    from ggufswap.runtime import Storage
    assert signal.getsignal(signal.SIGIO) is None
    runtime, model = open_runtime(sys.argv[1], storage=Storage.NATIVE, map_shards=MapShards.ON)
    before = logits(model)
    path = runtime.store.slots["blk.0.attn_q.weight"].record.path
    subprocess.run([sys.executable, "-c", f"open({path!r}, 'wb').close()"], check=True, timeout=20)
    assert runtime.store.maps.moved == 1
    assert torch.equal(logits(model), before)
    seen = ctypes.c_int.in_dll(ctypes.CDLL(sys.argv[2]), "sigio_seen").value
    print("HOST", signal.getsignal(signal.SIGIO), seen)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(own_model.first), str(library)],
        cwd=TESTS,
        env={**os.environ, "LD_PRELOAD": str(library)},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "HOST None 1" in done.stdout


class _PausingLibc:
    """libc, whose ``mremap`` (the last step of a move) first waits for the test: the move has
    copied the file's pages and not yet put the copy in place."""

    def __init__(self, lib: object) -> None:
        self._lib = lib
        self.copied = threading.Event()
        self.go_on = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    def mremap(self, *args: object) -> object:
        self.copied.set()
        assert self.go_on.wait(WAIT_S)
        return self._lib.mremap(*args)  # type: ignore[attr-defined]


def test_a_commit_into_a_mapped_original_during_a_move_is_not_lost(
    own_model: ModelDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stable pointers: a commit copies the new bytes into the original buffer, which is a view
    of the old file's mapping (the new shard came by rename; the old inode is still reachable
    through a hard link, and a writer opens it). The commit lands while that file is being
    moved, after the copy and before the mremap; the served weights must be the new ones."""
    name = "blk.0.ffn_gate_exps.weight"  # Q4_0 -> IQ4_NL: the same size, copied in place
    variant = own_model.variant(name, Q.IQ4_NL, tmp_path / "variants")
    old = own_model.shard_of(name)
    link = tmp_path / "old-inode.gguf"
    os.link(old, link)
    libc = _PausingLibc(_libc.Libc.get())
    runtime, model = open_runtime(
        own_model.first, storage=Storage.NATIVE, stable_pointers=True, map_shards=MapShards.ON
    )
    try:
        own_model.put(name, variant)
        expected = fresh_logits(own_model.first, storage=Storage.NATIVE)
        ticket = runtime.submit(own_model.plan("swap", [name]))
        assert runtime.wait_staged(timeout=WAIT_S)
        monkeypatch.setattr(_libc.Libc, "lib", libc)
        writer = _writer([str(link)], truncate=False)  # opens the old inode: a move starts
        committer = threading.Thread(target=runtime.at_batch_boundary)
        try:
            assert libc.copied.wait(WAIT_S)
            committer.start()  # the commit, while the move waits to mremap
            committer.join(0.5)
            assert committer.is_alive(), "the commit wrote while the file was being moved"
        finally:
            libc.go_on.set()
            _wait(writer)
            committer.join(WAIT_S)
        assert ticket.state is PlanState.COMMITTED, ticket.summary()
        assert runtime.store.maps.moved == 1
        served = logits(model)
    finally:
        runtime.close()
    del runtime, model  # a failure below leaves no mapping for the leak checks
    assert torch.equal(served, expected)


def test_a_forked_child_keeps_its_weights_when_a_writer_truncates_the_shards(
    own_model: ModelDir,
) -> None:
    """A host that forks after loading (a pre-fork server, ``multiprocessing`` with fork): the
    child inherits the mappings but not the watcher thread, and the leases are the parent's. A
    writer truncating every shard is let in once the parent has moved its own mappings; the
    child's logits in a loop meanwhile must stay as they were, and the child must not fault."""
    code = """
    import os, subprocess, sys, time
    import torch
    from runtime_helpers import logits, open_runtime
    from ggufswap.config import MapShards
    from ggufswap.runtime import Storage
    torch.set_num_threads(1)
    runtime, model = open_runtime(sys.argv[1], storage=Storage.NATIVE, map_shards=MapShards.ON)
    before = logits(model)
    paths = sorted({s.record.path for s in runtime.store.slots.values()})
    ready, done = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready)
        os.write(done, b"s")
        same, end = True, time.monotonic() + 2.0
        while time.monotonic() < end:
            same = torch.equal(logits(model), before) and same
        os.write(done, b"1" if same else b"0")
        os._exit(0)
    os.close(done)
    assert os.read(ready, 1) == b"s"
    write = "import sys\\nfor p in sys.argv[1:]: open(p, 'wb').close()"
    subprocess.run([sys.executable, "-c", write, *paths], check=True, timeout=20)
    assert runtime.store.maps.moved == len(paths)
    assert torch.equal(logits(model), before)
    same = os.read(ready, 1)
    _, status = os.waitpid(pid, 0)
    print("CHILD", same, os.waitstatus_to_exitcode(status))
    """
    done = _run(textwrap.dedent(code), str(own_model.first))
    assert done.returncode == 0, done.stderr
    assert "CHILD b'1' 0" in done.stdout


@pytest.mark.parametrize("policy", ["OFF", "ON"])
def test_a_daemon_thread_reading_the_weights_at_exit_does_not_fault(
    model_dir_shared: ModelDir, policy: str, zygote: Zygote, tmp_path: Path
) -> None:
    """The interpreter exits while a daemon thread reads a tensor's bytes with the GIL
    released (a host's inference thread): mapped weights must stay mapped until the process is
    gone, as copied ones stay allocated (no ``munmap`` from an exit hook). Each program is forked
    from the zygote and exits as its interpreter would, module teardown included."""
    code = f"""
    import sys, threading, zlib
    from runtime_helpers import open_runtime
    from ggufswap.config import MapShards
    from ggufswap.runtime import Storage
    runtime, model = open_runtime(
        sys.argv[1], storage=Storage.NATIVE, map_shards=MapShards.{policy}
    )
    slot = max(runtime.store.slots.values(), key=lambda s: s.record.nbytes)
    view = slot.active.tensor.numpy().data
    reading = threading.Event()
    def read():
        while True:
            zlib.crc32(view)  # releases the GIL while it reads
            reading.set()
    threading.Thread(target=read, daemon=True).start()
    assert reading.wait(20)
    """
    for i in range(3):
        log = tmp_path / f"exit-{i}.log"
        child = zygote.spawn(
            [str(model_dir_shared.first)], code=textwrap.dedent(code), log=log, cwd=TESTS
        )
        assert child.wait(WAIT_S) == 0, log.read_text()
