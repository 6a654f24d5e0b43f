"""ggml's own CPU products, through a libggml found at run time (``csrc/ggmlcall.c``).

ggml is a kernel library: its CPU backend quantizes the activations to each weight type's
``vec_dot_type`` (q8_0, q8_K...) and takes integer dot products (AVX2, AVX-512/VNNI as its build
and the CPU allow). :class:`Library` multiplies our weights, where native storage holds them, by
float32 activations through it, one tiny graph per product (``ggml_mul_mat``, or
``ggml_mul_mat_id`` for the experts a token is routed to): the results are ggml's own, what
llama.cpp computes on that libggml. Which libggml:

- ``GGUFSWAP_GGML=/path/to/libggml.so`` (mainline's ``libggml-cpu.so`` or ik_llama.cpp's
  ``libggml.so``), ``GGUFSWAP_GGML=mainline`` or ``ik`` (the installed package's), or
  ``GGUFSWAP_GGML=off`` for none;
- else (``auto``) ik_llama.cpp's, from the ``ik-llama-cpp-python`` wheel
  (``ik_llama_cpp/lib/libggml.so``: every mainline type and ik's own, with its iqk kernels);
- else mainline's, from ``llama-cpp-python`` (``llama_cpp/lib/libggml-cpu.so``).

One libggml a process: the glue holds one, loaded on first use. :func:`select` chooses it before
that (the sweep's ``--ggml``) and writes the choice to ``$GGUFSWAP_GGML``, so the processes this
one starts multiply with the same library; asking for another once one is loaded is an error.
(Both libraries do load side by side, ``RTLD_LOCAL``, their sonames differ: ``libggml.so``
against ``libggml-base.so.0`` + ``libggml-cpu.so.0``; one a process keeps a process's figures
one library's arithmetic.)

The packages are found, never imported (they would load their own llama library too). Without
one, or without the compiled glue (no compiler at install), :func:`library` is None and the
products fall back to the compiled float kernels or the torch ones (:mod:`.qmatmul`).

A type goes through ggml only where the golden data of ``tests/fixtures/ggml_golden`` was
recorded for that library's family (:data:`MAINLINE_TYPES`, :data:`IK_TYPES`) and ggml's row
size agrees with the file's. ggml's products do not depend on the thread count (each output is
computed whole by one thread), so a process computes the same bits whatever its threads.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import torch

from ggufswap.runtime.errors import GgmlLibraryError
from ggufswap.shards.ggml_types import LAYOUTS, GGMLType, row_nbytes

__all__ = [
    "CHOICES",
    "ENV",
    "IK_TYPES",
    "MAINLINE_TYPES",
    "Library",
    "float_products",
    "library",
    "package_library",
    "select",
]

ENV: Final = "GGUFSWAP_GGML"
OFF: Final = "off"
AUTO: Final = "auto"
MAINLINE: Final = "mainline"
IK: Final = "ik"
CHOICES: Final = (AUTO, MAINLINE, IK, OFF)  # or a library's path

T = GGMLType
# Mainline types with a CPU vec_dot in both libraries (ik's fork keeps them).
MAINLINE_TYPES: Final = frozenset(
    {
        T.Q4_0,
        T.Q4_1,
        T.Q5_0,
        T.Q5_1,
        T.Q8_0,
        T.Q2_K,
        T.Q3_K,
        T.Q4_K,
        T.Q5_K,
        T.Q6_K,
        T.IQ2_XXS,
        T.IQ2_XS,
        T.IQ2_S,
        T.IQ3_XXS,
        T.IQ3_S,
        T.IQ1_S,
        T.IQ1_M,
        T.IQ4_NL,
        T.IQ4_XS,
        T.MXFP4,
    }
)
# ik_llama.cpp's own types (its libggml only).
IK_TYPES: Final = frozenset(
    {
        T.Q6_0,
        T.IQ2_K,
        T.IQ3_K,
        T.IQ4_K,
        T.IQ5_K,
        T.IQ6_K,
        T.IQ2_KS,
        T.IQ3_KS,
        T.IQ4_KS,
        T.IQ5_KS,
        T.IQ4_KSS,
        T.IQ2_KL,
        T.IQ1_KT,
        T.IQ2_KT,
        T.IQ3_KT,
        T.IQ4_KT,
    }
)
# ik_llama.cpp's batched products of these types (32 activation rows or more, 64 weight rows or
# more) go wrong where a row is not a multiple of 128 values (measured on ik-llama-cpp-python
# 0.1.5: outputs of zeros at 64 values, off by 30-60 % at 160-288; mainline's are right): such
# matrices multiply with the float kernels there.
IK_ROW_MULTIPLE: Final = {T.Q4_1: 128, T.Q5_1: 128}
del T

# Off within a block of code (this thread / context): a decoder with exact numerics multiplies
# in float even where ggml could.
_FLOAT_ONLY: ContextVar[bool] = ContextVar("ggufswap_float_products", default=False)


def float_only() -> bool:
    """True inside :func:`float_products`."""
    return _FLOAT_ONLY.get()


@contextmanager
def float_products() -> Iterator[None]:
    """Within the block (this thread / context), products never go through ggml."""
    token = _FLOAT_ONLY.set(True)
    try:
        yield
    finally:
        _FLOAT_ONLY.reset(token)


@dataclass(frozen=True, eq=False)
class Library:
    """A loaded libggml: ``path``, whether it is ik_llama.cpp's fork (``ik``), the types it
    multiplies here (``types``)."""

    path: Path
    ik: bool
    types: frozenset[GGMLType]
    module: Any
    package: str | None = None  # "ik-llama-cpp-python 0.1.5": the wheel it came from, if known

    @property
    def name(self) -> str:
        return "ggml (ik_llama.cpp)" if self.ik else "ggml"

    def multiplies(self, ggml_type: int, cols: int, device: torch.device) -> bool:
        """Whether ggml multiplies ``ggml_type`` rows of ``cols`` values on ``device`` (the
        static part of :meth:`handles`: a matrix asks once)."""
        multiple = IK_ROW_MULTIPLE.get(GGMLType(ggml_type), 1) if self.ik else 1
        return (
            device.type == "cpu"
            and ggml_type in self.types
            and cols % LAYOUTS[GGMLType(ggml_type)].block_size == 0
            and cols % multiple == 0
        )

    def handles(self, ggml_type: int, cols: int, device: torch.device) -> bool:
        """Whether ``ggml_type`` rows of ``cols`` values on ``device`` multiply through ggml
        here and now (not inside :func:`float_products`)."""
        return not float_only() and self.multiplies(ggml_type, cols, device)

    def mul_mat(
        self, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int], x: torch.Tensor
    ) -> torch.Tensor:
        """``x [..., cols] @ W.T`` for ``W`` ``[rows, cols]`` in its blocks ``raw`` (uint8, CPU,
        contiguous): float32 ``[..., rows]``."""
        rows, cols = shape
        flat = _activations(x, cols)  # [N, cols]
        out = torch.empty(flat.shape[0], rows, dtype=torch.float32)
        self.module.mul_mat(
            _ptr(raw),
            int(ggml_type),
            rows,
            cols,
            flat.data_ptr(),
            flat.shape[0],
            out.data_ptr(),
            threads(flat.shape[0] * raw.numel()),
        )
        return out.view(*x.shape[:-1], rows)

    def mul_mats(
        self, x: torch.Tensor, matrices: list[tuple[torch.Tensor, int, int]]
    ) -> list[torch.Tensor]:
        """``[x [..., cols] @ W.T]`` for several matrices ``(raw, ggml_type, rows)`` of the same
        row length, in one graph (ggml quantizes ``x`` once where it can): float32 each."""
        cols = x.shape[-1]
        flat = _activations(x, cols)  # [N, cols]
        outs = [torch.empty(flat.shape[0], rows, dtype=torch.float32) for _, _, rows in matrices]
        self.module.mul_mats(
            flat.data_ptr(),
            flat.shape[0],
            cols,
            threads(flat.shape[0] * sum(raw.numel() for raw, _, _ in matrices)),
            [
                (_ptr(raw), int(t), rows, out.data_ptr())
                for (raw, t, rows), out in zip(matrices, outs, strict=True)
            ],
        )
        return [out.view(*x.shape[:-1], out.shape[1]) for out in outs]

    def mul_mat_id(
        self,
        raw: torch.Tensor,
        ggml_type: int,
        shape: tuple[int, int, int],
        x: torch.Tensor,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts' products, one call: ``y[t, j] = W[ids[t, j]] @ x[t, j]`` for a
        stack ``W`` ``[E, rows, cols]`` in its blocks ``raw``; ``x`` is ``[N, cols]`` (the same
        input for every slot) or ``[N, k, cols]``, ``ids`` ``[N, k]``. float32 ``[N, k, rows]``."""
        n_expert, rows, cols = shape
        n_tokens, n_used = ids.shape
        per_token = 1 if x.dim() == 2 else x.shape[1]
        flat = _activations(x, cols)  # [N * per_token, cols]
        picked = _expert_ids(ids, n_expert)
        out = torch.empty(n_tokens, n_used, rows, dtype=torch.float32)
        self.module.mul_mat_id(
            _ptr(raw),
            int(ggml_type),
            n_expert,
            rows,
            cols,
            flat.data_ptr(),
            per_token,
            n_tokens,
            picked.data_ptr(),
            n_used,
            out.data_ptr(),
            threads(picked.numel() * raw.numel() // n_expert),
        )
        return out


# A copy of the ids last checked and their int32 form: a layer's projections share one routing,
# so a step converts and checks it once. Matched by content (a copy, compared with torch.equal),
# not identity: a buffer reused and written in place is checked again (inference tensors, what a
# served step makes, keep no version counter).
_LAST_IDS: list[tuple[torch.Tensor, int, torch.Tensor]] = []


def _expert_ids(ids: torch.Tensor, n_expert: int) -> torch.Tensor:
    """``ids`` as contiguous int32, each checked to be in ``[0, n_expert)`` (ggml would abort
    the process on another), or ValueError."""
    last = _LAST_IDS[0] if _LAST_IDS else None
    if (
        last is not None
        and last[1] == n_expert
        and last[0].shape == ids.shape
        and last[0].dtype == ids.dtype
        and last[0].device == ids.device
        and torch.equal(last[0], ids)
    ):
        return last[2]
    picked = ids.to(torch.int32).contiguous()
    if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= n_expert):
        raise ValueError(f"expert ids outside [0, {n_expert}): {ids.tolist()}")
    _LAST_IDS[:] = [(ids.clone(), n_expert, picked)]
    return picked


# A product that reads fewer weight bytes than this, times its activation rows, runs on one
# thread: waking the other threads (one OpenMP region per call, idle workers asleep under
# OMP_WAIT_POLICY=PASSIVE) costs more than they save on a decode step's small matrices. The
# results do not depend on the thread count (above).
SMALL_PRODUCT_BYTES: Final = 4 << 20


def threads(work: int | None = None) -> int:
    """Threads ggml's products run on: torch's count (the runtime's thread policy sets it), or
    one for a product of ``work`` weight bytes times activation rows under
    :data:`SMALL_PRODUCT_BYTES`."""
    if work is not None and work < SMALL_PRODUCT_BYTES:
        return 1
    return torch.get_num_threads()


def _activations(x: torch.Tensor, cols: int) -> torch.Tensor:
    """``x`` as the contiguous float32 CPU rows ggml reads."""
    if x.dtype is torch.float32 and x.is_cpu and x.is_contiguous():
        return x.view(-1, cols)
    return x.to(device="cpu", dtype=torch.float32).reshape(-1, cols).contiguous()


def _ptr(raw: torch.Tensor) -> int:
    assert raw.dtype == torch.uint8, "weights are bytes"
    assert raw.is_contiguous(), "weights are contiguous"
    assert raw.device.type == "cpu", "ggml multiplies CPU weights"
    return int(raw.data_ptr())


# The packages that ship a libggml: their import folder and distribution name.
_PACKAGES: Final = (("ik_llama_cpp", "ik_llama_cpp_python"), ("llama_cpp", "llama_cpp_python"))


def package_of(path: Path) -> str | None:
    """``"<distribution> <version>"`` of the wheel a library file came from (``<site>/<package>/
    lib/<file>`` beside ``<site>/<dist>-<version>.dist-info``), or None."""
    lib_dir = path.resolve().parent
    site, folder = lib_dir.parent.parent, lib_dir.parent.name
    for package, dist in _PACKAGES:
        if folder != package:
            continue
        for info in sorted(site.glob(f"{dist}-*.dist-info")):
            version = info.name[len(dist) + 1 : -len(".dist-info")]
            return f"{dist.replace('_', '-')} {version}"
    return None


def _package_lib(package: str, names: tuple[str, ...]) -> Path | None:
    """``package``'s shared library, found without importing the package."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        for name in names:
            path = Path(location) / "lib" / name
            if path.is_file():
                return path
    return None


def package_library(which: str) -> Path | None:
    """The installed package's libggml: ``ik`` (ik-llama-cpp-python's) or ``mainline``
    (llama-cpp-python's); None when that package is not installed."""
    if which == IK:
        return _package_lib("ik_llama_cpp", ("libggml.so",))
    if which == MAINLINE:
        return _package_lib("llama_cpp", ("libggml-cpu.so", "libggml.so"))
    raise ValueError(f"no package library {which!r} (known: {IK}, {MAINLINE})")


def resolve(choice: str) -> Path | None:
    """The library ``choice`` names (:data:`CHOICES` or a path); None for ``off``, or for
    ``auto`` with neither package installed (``auto`` is ``$GGUFSWAP_GGML`` when that is set).
    GgmlLibraryError when ``mainline`` or ``ik`` is asked and its package is not installed."""
    choice = choice.strip()
    if choice in ("", AUTO):
        choice = os.environ.get(ENV, "").strip()
    if choice == OFF:
        return None
    if choice in (MAINLINE, IK):
        path = package_library(choice)
        if path is None:
            package = "ik-llama-cpp-python" if choice == IK else "llama-cpp-python"
            raise GgmlLibraryError(
                f"libggml {choice!r} asked (--ggml / ${ENV}), but {package} is not installed: "
                f"install it, or choose another ({', '.join(CHOICES)}, or a libggml's path)"
            )
        return path
    if choice and choice != AUTO:
        return Path(choice)
    return package_library(IK) or package_library(MAINLINE)


def find() -> Path | None:
    """The libggml to load: ``$GGUFSWAP_GGML`` (:func:`resolve`), by default ik's wheel's, else
    llama-cpp-python's."""
    return resolve(AUTO)


def _glue() -> ModuleType | None:
    try:
        from ggufswap.runtime.kernels import _ggmlcall  # type: ignore[attr-defined]
    except ImportError:
        return None
    module: ModuleType = _ggmlcall
    return module


# ik's wheel brings its own OpenMP runtime, beside torch's: idle workers spinning on a few cores
# take them from the thread doing the work. The library's runtime reads its wait policy when it
# is loaded (torch's, when torch is imported: the ggufswap command sets it for both, cli/main.py).
_OPENMP_ENV: Final = {"OMP_WAIT_POLICY": "PASSIVE"}


@contextmanager
def _passive_openmp() -> Iterator[None]:
    """``OMP_WAIT_POLICY=PASSIVE`` while the library (and an OpenMP runtime of its own) loads,
    unless the environment says otherwise; the environment as it was afterwards."""
    before = {key: os.environ.get(key) for key in _OPENMP_ENV}
    for key, value in _OPENMP_ENV.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, was in before.items():
            if was is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = was


def _load() -> tuple[Library | None, str]:
    """The library and a line saying which (or why none)."""
    try:
        path = find()
    except GgmlLibraryError as exc:
        return None, str(exc)
    if path is None:
        return None, f"no libggml ({ENV}=off, or neither ik-llama-cpp-python nor llama-cpp-python)"
    module = _glue()
    if module is None:
        return None, "the ggml glue (runtime/kernels/csrc/ggmlcall.c) was not built"
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort must not start gdb
    try:
        with _passive_openmp():
            ik = bool(module.load(str(path)))
    except OSError as exc:
        return None, f"{path}: {exc}"
    candidates = MAINLINE_TYPES | (IK_TYPES if ik else frozenset())
    # ggml's row size must be the file's (a library whose type table differs is not used for it)
    types = frozenset(
        t
        for t in candidates
        if module.row_size(int(t), 4096) == row_nbytes(t, 4096)
        and module.block_size(int(t)) == LAYOUTS[t].block_size
    )
    package = package_of(path)
    where = f"{path} ({package or 'no package'}, {len(types)} types)"
    return Library(path, ik, types, module, package), where


_STATE: dict[str, tuple[Library | None, str]] = {}


def library() -> Library | None:
    """The process's libggml, loaded on first use (None: products fall back)."""
    if "loaded" not in _STATE:
        _STATE["loaded"] = _load()
    return _STATE["loaded"][0]


def select(choice: str, *, preferred: bool = False) -> Library | None:
    """Make ``choice`` (:data:`CHOICES` or a path) this process's libggml, before its first
    product, and ``$GGUFSWAP_GGML`` say so for the processes it starts. GgmlLibraryError when
    the package asked for is not installed, or when another libggml (or none) is already this
    process's: one a process, chosen up front. ``preferred``: a wish, not an order (the sweep's
    ``auto``): the library already loaded, if any, stays without an error."""
    if preferred and "loaded" in _STATE:
        return _STATE["loaded"][0]
    path = resolve(choice)
    wanted = None if path is None else path.resolve()
    if "loaded" in _STATE:
        current = _STATE["loaded"][0]
        if (None if current is None else current.path.resolve()) == wanted:
            return current
        whose = "no libggml" if current is None else current.name
        raise GgmlLibraryError(
            f"libggml {choice!r} ({wanted or 'none'}) asked, but this process already multiplies "
            f"with {whose} ({describe()}): one libggml a process, chosen before the first "
            f"product; set "
            f"{ENV}={choice} (or --ggml {choice}) when the process starts"
        )
    os.environ[ENV] = OFF if wanted is None else str(wanted)
    return library()


def describe() -> str:
    """Which libggml the products use, or why none (for status and logs)."""
    library()
    return _STATE["loaded"][1]
