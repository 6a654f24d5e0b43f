"""Which libggml the sweep's ggml numerics multiply with (``--ggml``, sweep/libggml.py) and the
process's one library (runtime/kernels/_ggml.py's ``select``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ggufswap.shards.ggml_types import GGMLType
from ggufswap.sweep import libggml
from ggufswap.sweep.libggml import choose

MAINLINE_TYPES = (int(GGMLType.Q5_0), int(GGMLType.Q4_K), int(GGMLType.F32))
WITH_IK = (*MAINLINE_TYPES, int(GGMLType.IQ4_KS))


@pytest.mark.parametrize(
    ("option", "installed", "env", "types", "expected"),
    [
        ("auto", {"mainline", "ik"}, "", MAINLINE_TYPES, "mainline"),
        ("auto", {"mainline", "ik"}, "", WITH_IK, "ik"),
        ("auto", {"ik"}, "", MAINLINE_TYPES, "ik"),
        ("auto", {"mainline"}, "", WITH_IK, "auto"),
        ("auto", set(), "", MAINLINE_TYPES, "auto"),
        ("auto", {"mainline", "ik"}, "off", MAINLINE_TYPES, "auto"),
        ("ik", {"mainline", "ik"}, "", MAINLINE_TYPES, "ik"),
        ("/x/libggml.so", set(), "", WITH_IK, "/x/libggml.so"),
    ],
)
def test_auto_takes_mainline_for_mainline_types_and_ik_for_ik_types(
    monkeypatch: pytest.MonkeyPatch,
    option: str,
    installed: set[str],
    env: str,
    types: tuple[int, ...],
    expected: str,
) -> None:
    """``auto`` asks for mainline's libggml when llama-cpp-python is installed and no type is
    ik's, else ik's when installed; an explicit choice or a set $GGUFSWAP_GGML is kept."""
    monkeypatch.setattr(libggml, "installed", lambda which: which in installed)
    monkeypatch.setenv(libggml.ENV, env)
    assert choose(option, types) == expected


SELECT = textwrap.dedent(
    """
    import json, os
    from ggufswap.runtime.errors import GgmlLibraryError
    from ggufswap.runtime.kernels import _ggml
    out = {}
    try:
        _ggml.resolve("mainline")
        out["mainline"] = "installed"
    except GgmlLibraryError as exc:
        out["mainline"] = str(exc)
    path = _ggml.package_library("ik")
    if path is not None:
        library = _ggml.select("ik")
        out["ik"] = library.ik
        out["env"] = os.environ[_ggml.ENV] == str(path.resolve())
        out["again"] = _ggml.select("ik") is library
        out["preferred"] = _ggml.select("off", preferred=True) is library
        try:
            _ggml.select("off")
        except GgmlLibraryError as exc:
            out["second"] = str(exc)
    print(json.dumps(out))
    """
)


@pytest.mark.process  # a fresh process: the library is the process's, chosen once
def test_select_makes_one_library_the_processs_and_refuses_another() -> None:
    """``select`` loads the chosen package's libggml and writes it to $GGUFSWAP_GGML for child
    processes; asking again for it is a no-op, a preferred wish keeps it, another choice is
    refused naming both; an absent package is refused naming it."""
    env = {k: v for k, v in os.environ.items() if k != "GGUFSWAP_GGML"}
    done = subprocess.run(
        [sys.executable, "-c", SELECT],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    if out["mainline"] != "installed":
        assert "llama-cpp-python is not installed" in out["mainline"]
    if "ik" not in out:
        pytest.skip("ik-llama-cpp-python is not installed (the ggml extra)")
    assert out["ik"], "ik_llama.cpp's fork loaded"
    assert out["env"], "$GGUFSWAP_GGML names it for child processes"
    assert out["again"], "asking again is a no-op"
    assert out["preferred"], "a preferred wish keeps the loaded library"
    for said in ("one libggml a process", "'off'", "ik_llama.cpp"):
        assert said in out["second"]
