"""The package layout the design promises: import names, no torch on the agent side."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import layout_rules
import pytest

REPO = Path(__file__).resolve().parent.parent

TORCH_FREE = ["ggufswap", "ggufswap.shards", "ggufswap.config", "ggufswap.ipc", "ggufswap.agent"]


@pytest.mark.process
@pytest.mark.parametrize("module", TORCH_FREE)
def test_agent_side_packages_do_not_import_torch(module: str) -> None:
    """Importing an agent-side package never imports torch (the agent must start fast)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"{module} imports torch"


@pytest.mark.process
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


@pytest.mark.process
def test_the_sweeps_light_half_does_not_import_torch() -> None:
    """The sweep package, its recipes, sources and child processes import no torch (the demo's
    parent process only starts a runtime and an agent); its drivers load it on first use."""
    code = (
        "import sys, ggufswap.sweep, ggufswap.sweep.children, ggufswap.sweep.sources\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.process
def test_command_line_parser_does_not_import_torch() -> None:
    """Building the ``ggufswap`` parser (every subcommand registered) leaves torch, numpy and
    gguf-py unimported (a runtime opens its port after that, before any of them)."""
    code = (
        "import sys, ggufswap.main as m; m.build_parser(); "
        "print(sorted(n for n in ('torch', 'numpy', 'gguf') if n in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# What serving a model must not import: gguf-py (its package import pulls in its writer,
# quantizers and vocabulary tools), the project's writer, and (for a SentencePiece vocabulary)
# Hugging Face's tokenizers.
NOT_ON_THE_START_PATH = (
    "ggufswap.shards.writer",
    "ggufswap.shards._synth",
    "ggufswap.shards.kquants",
    "ggufswap.shards._kq_numpy",
    "ggufswap.shards._gguf_encode",
    "ggufswap.shards._roles",
    "ggufswap.shards._planned",
    "ggufswap.shards._arch_spec",
    "ggufswap.shards._model_spec",
    "ggufswap.shards.presets",
    "tokenizers",  # Hugging Face's: byte-level BPE vocabularies only
)
SERVE_A_MODEL = """
import sys
from pathlib import Path

import torch

import ggufswap.main
from ggufswap.runtime import HotSwapRuntime
from ggufswap.runtime.models.hparams import HParams
from ggufswap.runtime.models.registry import build_model
from ggufswap.runtime.serving import daemon, http, serve
from ggufswap.runtime.serving.tokenizer import GgufTokenizer

ggufswap.main.build_parser()
runtime = HotSwapRuntime.open(sys.argv[1])
hparams = HParams.from_metadata(runtime.shards.metadata)
model = build_model(hparams, runtime.store, store=runtime.store)
assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()
runtime.close()
for _ in range(2):  # an SPM vocabulary: built each time, never cached
    tokenizer = GgufTokenizer.from_file(sys.argv[2], cache=Path(sys.argv[3]))
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"
print(sorted(n for n in sys.modules if n.split(".")[0] == "gguf" or n in sys.argv[4:]))
"""


@pytest.mark.process
def test_serving_a_model_imports_neither_gguf_py_nor_the_writer(tmp_path: Path) -> None:
    """A fresh process that does what a runtime's start does (the command line, the daemon and
    HTTP modules, a model opened, built and run, a SentencePiece tokenizer built twice with the
    cache given) never imports gguf-py, the project's writer, or Hugging Face's tokenizers."""
    from test_tokenizer import spm_md, write_vocabulary

    from ggufswap.shards.presets import tiny_dense
    from ggufswap.shards.writer import write_model

    model = write_model(tiny_dense(), tmp_path / "model")[0]
    vocabulary = write_vocabulary(tmp_path / "vocab.gguf", spm_md())
    argv = [sys.executable, "-c", SERVE_A_MODEL, str(model), str(vocabulary), str(tmp_path / "tok")]
    out = subprocess.run(
        [*argv, *NOT_ON_THE_START_PATH], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", f"imported on the start path: {out.stdout.strip()}"


@pytest.mark.process
def test_installed_import_names_are_namespaced(tmp_path: Path) -> None:
    """The distribution installs only ``ggufswap.*`` packages, never bare ``config``/``runtime``."""
    top = importlib.metadata.distribution("ggufswap").read_text("top_level.txt")
    names = set((top or "ggufswap").split())
    assert names <= {"ggufswap"}, names
    # Outside the checkout (the repository root is not on sys.path there), a bare folder name
    # must not import: only the ggufswap tree is installed.
    code = (
        "import importlib.util\n"
        "for bare in ('config', 'runtime', 'agent', 'ipc', 'shards', 'cli'):\n"
        "    print(bare, importlib.util.find_spec(bare) is not None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    importable = [line.split()[0] for line in out.stdout.splitlines() if line.endswith("True")]
    assert importable == [], f"bare package names importable: {importable}"


def test_folders_map_to_the_installed_packages() -> None:
    """The package map has one place (pyproject's ``[tool.ggufswap.packages]``): every package
    folder of the checkout is in it, and the installation holds exactly its packages."""
    for name, folder in layout_rules.FOLDERS.items():
        assert (REPO / folder / "__init__.py").is_file(), folder
        spec = importlib.util.find_spec(name)
        assert spec is not None, name
        assert spec.origin is not None, name
        assert Path(spec.origin).name == "__init__.py", name
    on_disk = {
        str(init.parent.relative_to(REPO))
        for init in REPO.glob("**/__init__.py")
        if not {".venv", "build", ".git", "tests", "bench", "crosscheck"} & set(init.parts)
        and not any(part.startswith(".venv") for part in init.parts)
    }
    mapped = set(layout_rules.FOLDERS.values())
    assert on_disk == mapped, on_disk ^ mapped
    makefile = (REPO / "Makefile").read_text()
    assert '["tool"]["ggufswap"]["packages"]' in makefile, "the Makefile lists its own"
    assert "package-dir" not in (REPO / "pyproject.toml").read_text(), "a second copy of the map"


def test_import_graph_tool_reads_the_real_graph() -> None:
    """grimp sees every module of every folder, and real edges between them."""
    graph = layout_rules.build_graph()
    on_disk = set(layout_rules.modules_on_disk(REPO))
    assert on_disk <= graph.modules, sorted(on_disk - graph.modules)
    assert len(on_disk) > 80
    assert graph.direct_import_exists(
        importer="ggufswap.runtime.engine", imported="ggufswap.runtime.staging"
    )
    assert graph.direct_import_exists(
        importer="ggufswap.runtime.serving.daemon", imported="ggufswap.runtime.models.registry"
    )
    assert "torch" in graph.find_upstream_modules("ggufswap.runtime.store")


def test_package_map_rules_hold() -> None:
    """Every one-way rule of the package map holds in the checkout."""
    broken = layout_rules.check(layout_rules.build_graph())
    assert broken == [], "\n".join(broken)


PLANTED = [
    ("agent/watch.py", "import torch", "the agent side never imports torch"),
    ("ipc/codec.py", "import ggufswap.agent.link", "shards, config and ipc never import"),
    ("agent/index.py", "import ggufswap.runtime", "the agent never imports the runtime"),
    (
        "runtime/staging.py",
        "from ggufswap.runtime.serving import http",
        "the core never imports the models or serving",
    ),
    (
        "runtime/store.py",
        "from ggufswap.runtime.models import registry",
        "the core never imports the models or serving",
    ),
    (
        "runtime/models/kv_cache.py",
        "import ggufswap.runtime.serving.errors",
        "the models never import serving",
    ),
    (
        "runtime/models/gemma3.py",
        "from ggufswap.runtime.store import TensorStore",
        "the models use only the core's public names",
    ),
    ("sweep/sweep.py", "import ray", "only the Ray sweep imports ray"),
    # the sweep: only the command line imports it, it never imports the command line
    (
        "runtime/serving/perplexity.py",
        "import ggufswap.sweep.kld",
        "nothing but the command line imports the sweep",
    ),
    (
        "runtime/staging.py",
        "import ggufswap.sweep",
        "nothing but the command line imports the sweep",
    ),
    (
        "runtime/models/gemma3.py",
        "from ggufswap.sweep import recipe",
        "nothing but the command line imports the sweep",
    ),
    ("sweep/recipe.py", "import ggufswap.main", "nothing but the command line imports the command"),
    ("sweep/procs.py", "import ray", "the single-host sweep never reaches ray"),
    (
        "shards/reader.py",
        "import ggufswap.main",
        "nothing but the command line imports the command line",
    ),
    # ggufswap.main loads its subcommands by name; the graph counts them (one reaches torch).
    ("agent/watch.py", "import ggufswap.main", "the agent side never imports torch"),
    (
        "runtime/kernels/dequant.py",
        "from ggufswap.runtime import store",
        "the kernels never import the rest of the core",
    ),
    (
        "runtime/kernels/qmatmul.py",
        "import ggufswap.runtime.models",
        "the kernels never import the models or serving",
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
    )


@pytest.mark.process
@pytest.mark.parametrize(("path", "statement", "rule"), PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_violation_is_caught(
    tmp_path: Path, path: str, statement: str, rule: str
) -> None:
    """A copy of the tree with one forbidden import (inside a function, as lazy imports are)
    fails the rule it breaks, naming the module chain."""
    root = tmp_path / "site"
    layout_rules.copy_installed_layout(REPO, root)
    target = root / layout_rules.installed_path(path)
    target.write_text(
        target.read_text() + f"\n\ndef _planted() -> None:\n    {statement}  # noqa\n"
    )
    out = _run_in_copy(root, str(REPO / "tests" / "layout_rules.py"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert any(line.startswith(rule) for line in out.stdout.splitlines()), out.stdout


@pytest.mark.process
def test_the_untouched_copy_passes(tmp_path: Path) -> None:
    """Paired with the planted violations: the copy itself breaks no rule (the checks read it)."""
    root = tmp_path / "site"
    layout_rules.copy_installed_layout(REPO, root)
    where = _run_in_copy(root, "-c", "import ggufswap; print(ggufswap.__file__)")
    assert where.stdout.strip().startswith(str(root)), where.stdout + where.stderr
    out = _run_in_copy(root, str(REPO / "tests" / "layout_rules.py"))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.process
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


LAZY_PACKAGES = (
    "ggufswap.shards",
    "ggufswap.runtime",
    "ggufswap.runtime.serving",
    "ggufswap.sweep",
)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_a_lazily_exported_name_is_never_shadowed_by_a_submodule(package: str) -> None:
    """Every name a package exports on first use (PEP 562) is the object it names, whatever was
    imported before: a submodule of the same name, once imported, would otherwise replace it."""
    module = importlib.import_module(package)
    for info in pkgutil.iter_modules(module.__path__):
        with contextlib.suppress(ImportError):  # an optional extra (triton) not installed
            importlib.import_module(f"{package}.{info.name}")
    shadowed = [name for name in module.__all__ if inspect.ismodule(getattr(module, name))]
    assert shadowed == [], f"{package}: {shadowed} give the submodule, not the exported name"
