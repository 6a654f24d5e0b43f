"""What a runtime's start does before it imports torch (runtime/serving/prestart.py) and the
start's pause of garbage collection (startup.collect_from_now, ggufswap.main)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_tokenizer import spm_md, write_vocabulary

from ggufswap.main import build_parser
from ggufswap.runtime.serving.prestart import (
    AUTOLOAD_ENV,
    EarlyTokenizer,
    early_tokenizer,
    quiet_torch_import,
    torch_library,
)
from ggufswap.runtime.serving.startup import Phase, Startup, collect_from_now
from ggufswap.shards import read_header


def test_torch_backend_autoload_is_off_unless_the_environment_sets_it() -> None:
    """The out-of-tree backend search is turned off by default; an operator's value stays."""
    environ: dict[str, str] = {}
    quiet_torch_import(environ)
    assert environ == {AUTOLOAD_ENV: "0"}
    environ = {AUTOLOAD_ENV: "1"}
    quiet_torch_import(environ)
    assert environ == {AUTOLOAD_ENV: "1"}


def test_torch_library_is_found_without_importing_torch() -> None:
    """The library to preload is torch's own CPU library, found by its package's location."""
    library = torch_library()
    assert library is not None, "torch is installed with the runtime extra"
    assert library.name == "libtorch_cpu.so", library
    assert library.parent.name == "lib", library
    assert library.parent.parent.joinpath("__init__.py").is_file(), library


PRELOAD = """
import sys, threading, time
from ggufswap.runtime.serving.prestart import preload_torch_library

def loaded():
    with open("/proc/self/maps") as maps:
        return "libtorch_cpu.so" in maps.read()

assert not loaded() and "torch" not in sys.modules
spins, started = 0, time.thread_time()
rate_spins = 0
while time.thread_time() - started < 0.05:  # this thread's Python speed, alone
    rate_spins += 1
rate = rate_spins / (time.thread_time() - started)
loading = time.monotonic()
thread = preload_torch_library()
while thread.is_alive():
    spins += 1
took = time.monotonic() - loading
assert loaded() and "torch" not in sys.modules
import torch
assert float(torch.ones(2, 2).matmul(torch.ones(2, 2)).sum()) == 8.0
print(spins / rate, took)
"""


@pytest.mark.process
def test_the_torch_library_loads_in_a_thread_that_leaves_python_running() -> None:
    """The preload maps libtorch_cpu before torch is imported, from a thread that does not hold
    the GIL (the main thread runs Python meanwhile), and torch then imports and computes."""
    out = subprocess.run(
        [sys.executable, "-c", PRELOAD], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    ran_s, took_s = map(float, out.stdout.split())
    # Held across the load, the GIL would leave the main thread ~0 s of Python in it (0.01 of
    # the load's time measured with ctypes.PyDLL, which holds it); released, the main thread's
    # share of a core (all of one on an idle host).
    assert ran_s >= 0.05 * took_s, (ran_s, took_s)


WINDOW = """
import sys, urllib.error, urllib.request
from importlib.machinery import ExtensionFileLoader
from pathlib import Path
import ggufswap._cmd_runtime  # imported before the preload starts, as by the command line
from ggufswap.runtime.serving import prestart

def extensions():
    return {name for name, module in list(sys.modules.items())
            if isinstance(getattr(module, "__loader__", None), ExtensionFileLoader)}

from ggufswap.runtime.serving.early import EarlyHealth, listen
from ggufswap.runtime.serving.startup import Startup

early = EarlyHealth(listen("127.0.0.1", 0, 16), Startup("m")).start()  # the port first
prestart.import_extensions()
before = extensions()
from ggufswap.runtime.serving.http import CompletionServer, HttpOptions

server = CompletionServer(
    options=HttpOptions(host="127.0.0.1", port=0), model_name="m", startup=early.startup,
    sock=early.handover(),
).start()
assert prestart.early_tokenizer(Path(sys.argv[1]), server.startup) is not None
try:
    urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=30)
except urllib.error.HTTPError as exc:
    assert exc.code == 503, exc.code
server.close()
print(" ".join(sorted(extensions() - before)))
"""


@pytest.mark.process
def test_what_runs_beside_the_preload_imports_no_extension_module_of_its_own(
    tmp_path: Path,
) -> None:
    """The HTTP server (its modules, its thread's start, a request) and the tokenizer, which run
    while torch's library loads, import no extension module that ``import_extensions`` did not
    import before: one imported while the loader is busy would wait for it, holding the GIL."""
    path = write_vocabulary(tmp_path / "vocab.gguf", spm_md())
    out = subprocess.run(
        [sys.executable, "-c", WINDOW, str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], f"add to prestart.EXTENSIONS: {out.stdout}"


def test_an_early_tokenizer_serves_only_the_file_version_it_was_built_from(
    tmp_path: Path,
) -> None:
    """The tokenizer built before the load is the loaded model's only when the loaded first shard
    is the same file, unchanged (the load is given the header it parsed): a file replaced at the
    same path is not, and is parsed again."""
    path = write_vocabulary(tmp_path / "vocab.gguf", spm_md())
    startup = Startup("m")
    early = early_tokenizer(path, startup)
    assert isinstance(early, EarlyTokenizer)
    assert startup.phase is Phase.TOKENIZER
    assert early.tokenizer.decode(early.tokenizer.encode("the cat")) == "the cat"
    assert early.serves(read_header(path))
    assert early.headers.get(path) is early.header
    replaced = write_vocabulary(tmp_path / "other.gguf", spm_md())
    os.replace(replaced, path)
    assert not early.serves(read_header(path))
    assert not early.serves(early.headers.get(path))


def test_an_early_tokenizer_is_left_to_the_daemon_when_it_cannot_be_built_now(
    tmp_path: Path,
) -> None:
    """A file without a readable vocabulary (missing, or another tokenizer model) gives no early
    tokenizer, without raising: the daemon builds it after the load and reports what is wrong."""
    startup = Startup("m")
    assert early_tokenizer(tmp_path / "missing.gguf", startup) is None
    assert startup.phase is Phase.STARTING
    bad = write_vocabulary(tmp_path / "bad.gguf", spm_md(**{"tokenizer.ggml.model": "nope"}))
    assert early_tokenizer(bad, startup) is None


def test_collection_resumes_at_ready_with_the_start_frozen() -> None:
    """After a start with collection paused, collection resumes and what the start made is moved
    out of the collector's way; with collection running, nothing changes."""
    assert gc.isenabled()
    collect_from_now()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    gc.disable()
    try:
        collect_from_now()
        assert gc.isenabled()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()


def test_only_the_runtime_command_keeps_collection_paused_until_ready() -> None:
    """``ggufswap runtime`` asks ggufswap.main to keep collection paused while it starts; the
    other commands run with it."""
    parser = build_parser()
    runtime = parser.parse_args(["runtime", "--config", "x.yaml"])
    assert runtime.gc_paused_until_ready is True
    agent = parser.parse_args(["agent", "--config", "x.yaml"])
    assert not getattr(agent, "gc_paused_until_ready", False)
