"""ggufswap: live, per-tensor hot-swap of GGUF model weights into a running PyTorch process.

The subpackages are the architecture: ``ggufswap.shards`` (file format), ``ggufswap.config``,
``ggufswap.ipc`` (the wire contract), ``ggufswap.agent`` (the watcher sidecar) and
``ggufswap.runtime`` (the inference side), over ``ggufswap.logs`` (the loggers every subpackage
uses). This top-level package holds the command line.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
