"""The codebase's own rules, each checked on the real tree and failing on a planted offender:
one error hierarchy per package, no module or function past its size without a reason, and no
Triton kernel reading a global Triton would refuse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import error_rules
import layout_rules
import pytest
import size_rules
import triton_rules

REPO = Path(__file__).resolve().parent.parent


# -- one error hierarchy per package -----------------------------------------------------------


@pytest.mark.parametrize("package", sorted(error_rules.FOLDERS))
def test_every_exception_a_package_defines_is_in_its_errors_module_under_its_base(
    package: str,
) -> None:
    """Every exception class a package defines (its modules all imported) lives in the package's
    errors module and derives from the package's one base class."""
    broken = error_rules.check([package])
    assert broken == [], "\n".join(broken)


def test_the_walker_finds_the_classes_of_every_package() -> None:
    """The walk reads real classes: each package's base and a few subclasses, nested packages
    apart from their parents (a model error belongs to the models, not to the core)."""
    found = error_rules.defined_exceptions(error_rules.FOLDERS)
    names = {p: {c.__qualname__ for c in classes} for p, classes in found.items()}
    assert {"ShardError", "RequantError"} <= names["ggufswap.shards"]
    assert {"ConfigError", "Invalid"} <= names["ggufswap.config"]
    assert {"IpcError", "PeerTimeout"} <= names["ggufswap.ipc"]
    assert {"AgentError", "WatchLimitError"} <= names["ggufswap.agent"]
    assert {"RuntimeLibraryError", "MapRefused"} <= names["ggufswap.runtime"]
    assert "ModelError" in names["ggufswap.runtime.models"]
    assert "ModelError" not in names["ggufswap.runtime"]
    assert {"ServingError", "ChatTemplateError"} <= names["ggufswap.runtime.serving"]
    assert {"CliError", "DemoError", "DemoSweepError"} <= names["ggufswap"]


PLANTED_ERRORS = [
    (
        "agent/watch.py",
        "class PlantedError(Exception):\n    pass\n",
        "ggufswap.agent",
        "ggufswap.agent.watch.PlantedError: defined outside ggufswap.agent.errors",
    ),
    (
        "agent/watch.py",
        "from ggufswap.agent.errors import AgentError\n\n\n"
        "class PlantedError(AgentError):\n    pass\n",
        "ggufswap.agent",
        "ggufswap.agent.watch.PlantedError: defined outside ggufswap.agent.errors",
    ),
    (
        "shards/errors.py",
        "class PlantedError(ValueError):\n    pass\n",
        "ggufswap.shards",
        "ggufswap.shards.errors: expected one base class that every other derives from, "
        "found 2 roots",
    ),
    # A class made at import and bound to no name still counts (the walk is over the classes
    # alive in the interpreter, not over module attributes).
    (
        "ipc/codec.py",
        "_PLANTED = [type('PlantedError', (RuntimeError,), {})]\n",
        "ggufswap.ipc",
        "ggufswap.ipc.codec.PlantedError: defined outside ggufswap.ipc.errors (move it there); "
        "does not derive "
        "from IpcError",
    ),
]


def _run_in_copy(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run Python with ``root`` (a copied ggufswap tree) first on its import path."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
        cwd=root.parent,
        check=False,
        timeout=60,
    )


@pytest.mark.process
@pytest.mark.parametrize(
    ("path", "code", "package", "expected"),
    PLANTED_ERRORS,
    ids=["outside-errors", "outside-errors-under-base", "second-root", "unnamed-class"],
)
def test_a_planted_exception_breaks_the_error_rule(
    tmp_path: Path, path: str, code: str, package: str, expected: str
) -> None:
    """A copy of the tree with one exception class out of place fails the rule, naming the
    class and what is wrong; the untouched copy passes."""
    root = tmp_path / "site"
    layout_rules.copy_installed_layout(REPO, root)
    script = str(REPO / "tests" / "error_rules.py")
    clean = _run_in_copy(root, script, package)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    target = root / layout_rules.installed_path(path)
    target.write_text(target.read_text() + "\n\n" + code)
    out = _run_in_copy(root, script, package)
    assert out.returncode == 1, out.stdout + out.stderr
    assert any(line.startswith(expected) for line in out.stdout.splitlines()), out.stdout


# -- sizes -------------------------------------------------------------------------------------


def test_no_module_or_function_is_too_long_without_a_reason() -> None:
    """No package module over 500 lines and no function over 60 (docstring not counted) without
    a ``Size:`` line in its docstring saying why it stays whole."""
    found = size_rules.offenders(REPO)
    assert found == [], "\n".join(found)


def _offenders_of_copy(tmp_path: Path, path: str, code: str) -> list[str]:
    """The size offenders of a copy of one package module with ``code`` appended (those the
    original has are left out: the planted code alone is named)."""
    before = list(size_rules.module_offenders(REPO / path, path))
    target = tmp_path / Path(path).name
    target.write_text((REPO / path).read_text() + code)
    return [line for line in size_rules.module_offenders(target, path) if line not in before]


def _long_function(name: str, lines: int, docstring: str = "") -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    doc = f'    """{docstring}"""\n' if docstring else ""
    return f"\n\ndef {name}() -> int:\n{doc}{body}    return 0\n"


@pytest.mark.parametrize(
    ("path", "code", "expected"),
    [
        (
            "agent/index.py",
            _long_function("planted", 61),
            "function planted of 61 lines",
        ),
        (
            "runtime/commit.py",
            "\n\nclass Planted:\n    def method(self) -> int:\n"
            + "".join(f"        x{i} = {i}\n" for i in range(60))
            + "        return 0\n",
            "function method of 62 lines",
        ),
        ("shards/atomic.py", "\n" * 520, "module of"),
    ],
    ids=["function", "method", "module"],
)
def test_a_planted_long_function_or_module_is_named(
    tmp_path: Path, path: str, code: str, expected: str
) -> None:
    """A copy of a module with one function (or method) over 60 lines, or grown over 500 lines,
    fails the size rule, naming the file, the line and the size."""
    start = len((REPO / path).read_text().splitlines())
    found = _offenders_of_copy(tmp_path, path, code)
    assert len(found) == 1, found
    assert found[0].startswith(f"{path}:"), found
    assert expected in found[0], found
    if expected.startswith("function"):
        line = int(found[0].split(":")[1])
        assert line > start, f"names the planted function's line: {found[0]}"


def test_a_size_line_states_the_reason_and_docstrings_do_not_count(tmp_path: Path) -> None:
    """A ``Size:`` line in a long function's docstring is its stated reason; a long docstring
    on a short function is not a long function; 60 lines of code are still under the rule."""
    reason = "A table.\n\n    Size: a table, one row per line, read as one."
    long_doc = "Many words.\n" + "    More.\n" * 80
    code = (
        _long_function("with_reason", 80, reason)
        + _long_function("long_docstring", 20, long_doc)
        + _long_function("at_the_limit", 60)
    )
    assert _offenders_of_copy(tmp_path, "runtime/errors.py", code) == []
    found = _offenders_of_copy(tmp_path, "runtime/errors.py", code + _long_function("one_more", 61))
    assert [line.split(": ", 1)[1].split(" of")[0] for line in found] == ["function one_more"]


# -- Triton kernels' globals -------------------------------------------------------------------


def test_triton_kernels_read_only_constexpr_globals() -> None:
    """Every module global a ``@triton.jit`` function reads is a ``tl.constexpr`` (a GPU host's
    first compile refuses any other; this suite has no GPU and may have no Triton)."""
    assert triton_rules.check(REPO) == [], "\n".join(triton_rules.check(REPO))
    assert (REPO / "runtime/kernels/triton_qmatmul.py").read_text().count("@triton.jit") > 5


def test_a_planted_plain_global_in_a_kernel_is_named() -> None:
    """A plain ``OFFSET = 16`` read by a kernel is named with its line; a constexpr, a parameter
    or a local of the same name, and a plain global the kernel does not read, are not."""
    source = (
        "import triton\nimport triton.language as tl\n"
        "OFFSET = 16\nSCALE = tl.constexpr(2)\nUNUSED = 3\n"
        "@triton.jit\ndef kernel(x, UNUSED):\n    return x + OFFSET * SCALE + UNUSED\n"
        "@triton.jit\ndef shadowed(x):\n    OFFSET = 1\n    return x + OFFSET\n"
        "def host(x):\n    return x + OFFSET\n"
    )
    found = list(triton_rules.offenders(source, "k.py"))
    assert len(found) == 1, found
    assert found[0].startswith("k.py:8: jit function kernel reads the global OFFSET"), found
