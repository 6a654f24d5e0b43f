"""What a runtime's start does before it imports torch, so that it is ready sooner.

``import torch`` is most of a start (about 2 s of 4 on a 2-core host, issue 29). Three things
here shorten it or overlap it; the command line (``_cmd_runtime``) calls them in this order:

- :func:`quiet_torch_import`: ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` unless the environment sets
  it. torch's import otherwise asks ``importlib.metadata`` for ``torch.backends`` entry points,
  reading every installed distribution's metadata (0.1-0.2 s with ~220 installed), to load
  out-of-tree device backends; a pool's device is cpu, cuda, mps or xpu (the configuration
  refuses others), all in-tree. The switch is torch's (``_is_device_backend_autoload_enabled`` in
  ``torch/__init__.py``; https://docs.pytorch.org/docs/stable/accelerator/autoload.html).
- :func:`preload_torch_library`: ``libtorch_cpu.so`` (430 MB; its load and static initialisers
  are 0.3-0.6 s of torch's import) is ``dlopen``-ed from a thread, through ctypes' foreign call
  to libc's ``dlopen``, which releases the GIL (ctypes.CDLL's documented behaviour), while the
  main thread goes on in Python; ``import torch`` then finds it loaded (``torch._C``'s own load
  drops from ~0.4 s to ~0.05 s). CPython's import of an extension module holds the GIL across
  its ``dlopen``, and glibc holds its loader lock across a library's initialisers: work that
  overlaps must be pure Python with its extension modules already imported, or it waits.
- The overlapping work, in http mode: the HTTP server's modules and its thread's start
  (0.15-0.2 s, once the port answers), then :func:`early_tokenizer`, the tokenizer (0.3-0.5 s
  for Gemma's 262k tokens) built from the configured file's header; the daemon uses it when the
  loaded first shard is the same file (path and identity), and builds another after the load
  otherwise. The extension modules this work needs are imported before the preload starts
  (:func:`import_extensions`).

Garbage collection is paused for the whole start (``ggufswap.main``; resumed at ready by
:func:`~ggufswap.runtime.serving.startup.collect_from_now`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import os
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ggufswap.logs import get_logger
from ggufswap.runtime.serving.errors import ServingError
from ggufswap.runtime.serving.startup import Phase, Startup
from ggufswap.runtime.serving.tokenizer import GgufTokenizer
from ggufswap.runtime.serving.tokenizer_cache import cache_dir
from ggufswap.shards import HeaderCache, ShardError
from ggufswap.shards.reader import ShardHeader

log = get_logger(__name__)

# The optional compiled string decoder the tokenizer uses, imported with this module, before any
# preload: an extension module imported while the loader is busy waits for it, holding the GIL.
with contextlib.suppress(ImportError):
    importlib.import_module("ggufswap.shards._strings")

# Extension modules that the work beside the preload imports (the HTTP server's modules and its
# thread's, the tokenizer's): imported by :func:`import_extensions` before the preload starts.
# tests/test_prestart.py keeps the list whole by starting a server and building a tokenizer.
EXTENSIONS: Final = (
    "_blake2",  # hashlib
    "_hashlib",
    "_multiprocessing",  # uvicorn's supervisors
    "httptools.parser.parser",  # uvicorn's HTTP protocol, imported by the server's thread
    "httptools.parser.url_parser",
    "markupsafe._speedups",  # jinja2: chat templates
    "mmap",
    "resource",
)

AUTOLOAD_ENV: Final = "TORCH_DEVICE_BACKEND_AUTOLOAD"
TORCH_LIBRARY: Final = "libtorch_cpu.so"  # torch/lib/: the CPU kernels, most of torch's load


def quiet_torch_import(environ: MutableMapping[str, str] = os.environ) -> None:
    """No out-of-tree device backend search at torch's import, unless the environment asks."""
    environ.setdefault(AUTOLOAD_ENV, "0")


def import_extensions() -> None:
    """Import :data:`EXTENSIONS` (those not installed are skipped: their importer reports it)."""
    for name in EXTENSIONS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def torch_library() -> Path | None:
    """torch's CPU library, found without importing torch (None: torch is not installed or has
    no such file, as on other platforms)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "lib" / TORCH_LIBRARY
    return path if path.is_file() else None


def preload_torch_library() -> threading.Thread | None:
    """Start loading :func:`torch_library` in a thread that does not hold the GIL; None when
    there is none to load. A failed load is logged and left to torch's import to report."""
    library = torch_library()
    if library is None:
        return None
    thread = threading.Thread(
        target=_dlopen, args=(library,), name="ggufswap-torch-preload", daemon=True
    )
    thread.start()
    return thread


def _dlopen(library: Path) -> None:
    libc = ctypes.CDLL(None)  # the process's global scope: libc's (or libdl's) dlopen
    dlopen = libc.dlopen
    dlopen.restype = ctypes.c_void_p
    dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    started = time.monotonic()
    # RTLD_LOCAL, as torch's own import loads it (as torch._C's dependency); never closed.
    handle = dlopen(os.fsencode(library), os.RTLD_NOW | os.RTLD_LOCAL)
    log.info(
        "startup.torch_preloaded",
        library=str(library),
        loaded=handle is not None,
        seconds=round(time.monotonic() - started, 3),
    )


@dataclass(frozen=True)
class EarlyTokenizer:
    """A tokenizer built before the load, the header (file version) it was built from, and the
    cache holding that header (the load parses it again only if the file changed)."""

    header: ShardHeader
    tokenizer: GgufTokenizer
    headers: HeaderCache

    def serves(self, loaded: ShardHeader) -> bool:
        """Whether the loaded first shard is the file this tokenizer was built from."""
        return (loaded.path, loaded.identity) == (self.header.path, self.header.identity)


def early_tokenizer(model: Path, startup: Startup) -> EarlyTokenizer | None:
    """The tokenizer of ``model`` (phase ``tokenizer``), or None where the file is not the one
    that holds it (a later shard of a split set) or cannot be read or built now: the daemon then
    builds it after the load, where a fault is reported as it always was."""
    headers = HeaderCache()
    try:
        header = headers.get(model)
        if header.split_no != 0:
            return None
        startup.enter(Phase.TOKENIZER)
        tokenizer = GgufTokenizer.from_header(header, cache=cache_dir())
        return EarlyTokenizer(header, tokenizer, headers)
    except (ShardError, ServingError) as exc:
        log.info("startup.tokenizer_deferred", model=str(model), reason=str(exc))
        return None
