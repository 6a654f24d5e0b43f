"""The package layout the design promises: import names, no torch on the agent side."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest

TORCH_FREE = ["ggufswap", "ggufswap.shards", "ggufswap.config", "ggufswap.ipc", "ggufswap.agent"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_agent_side_packages_do_not_import_torch(module: str) -> None:
    """Importing an agent-side package never imports torch (the agent must start fast)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"{module} imports torch"


def test_agent_package_tree_does_not_import_torch() -> None:
    """Importing every agent-side module, submodules included, leaves torch unimported."""
    code = (
        "import pkgutil, importlib, sys\n"
        "import ggufswap.agent, ggufswap.shards, ggufswap.config, ggufswap.ipc\n"
        "for pkg in (ggufswap.agent, ggufswap.shards, ggufswap.config, ggufswap.ipc):\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_command_line_parser_does_not_import_torch() -> None:
    """Building the ``ggufswap`` parser (every subcommand registered) leaves torch unimported."""
    code = "import sys, ggufswap.main as m; m.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_installed_import_names_are_namespaced() -> None:
    """The distribution installs only ``ggufswap.*`` packages, never bare ``config``/``runtime``."""
    top = importlib.metadata.distribution("ggufswap").read_text("top_level.txt")
    names = set((top or "ggufswap").split())
    assert names <= {"ggufswap"}, names
    for bare in ("config", "runtime", "agent", "ipc", "shards"):
        spec = importlib.util.find_spec(bare)
        assert spec is None or "site-packages" not in str(spec.origin), bare


def test_one_console_script() -> None:
    """One console script, ``ggufswap``, with subcommands."""
    scripts = [
        ep
        for ep in importlib.metadata.distribution("ggufswap").entry_points
        if ep.group == "console_scripts"
    ]
    assert [ep.name for ep in scripts] == ["ggufswap"]
    out = subprocess.run(
        [sys.executable, "-m", "ggufswap", "--help"], capture_output=True, text=True, check=True
    )
    for command in (
        "inspect",
        "diff",
        "make-model",
        "requant",
        "runtime",
        "status",
        "check-config",
    ):
        assert command in out.stdout, command
