"""Print the ``uv pip install`` options that give uv the package sources pip has on this machine.

uv reads no pip configuration, so a machine whose pip is told where its packages live (a local
mirror as an extra index, a folder of wheels, a constraints file: pip.conf, ``PIP_*`` variables)
would have uv resolve elsewhere. This reads pip's own view (``pip config list``, the environment's
variables over the files) and prints the same sources as uv options, with pip's rule for choosing
among indexes (the best version from any of them), so both tools install the same versions.

Usage (the Makefile's): ``uv pip install $(python tools/uv_args.py) PACKAGES``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's option -> uv's option; the values of each are whitespace-separated lists.
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_settings() -> dict[str, str]:
    """pip's configuration as ``pip config list`` shows it: ``PIP_*`` variables win over files."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        target = env if scope == ":env:" else files
        if scope in (":env:", "global", "install"):
            target[name] = value.strip().strip("'\"")
    return {**files, **env}


def uv_args(settings: dict[str, str]) -> list[str]:
    args = ["--index-strategy", "unsafe-best-match"]
    for name, option in OPTIONS.items():
        for value in settings.get(name, "").split():
            args += [option, value]
    return args


if __name__ == "__main__":
    print(shlex.join(uv_args(pip_settings())))
