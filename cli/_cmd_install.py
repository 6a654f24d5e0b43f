"""``ggufswap install-systemd``: the systemd units, users, socket directory, config skeletons and
documentation of this installation, written under a root directory (``/`` on the host).

The units' ``ExecStart=`` names the ``ggufswap`` script of the environment that runs this
command (a venv's ``bin/ggufswap``), so nothing has to be linked into ``/usr/local/bin``. The
templates and documents come from the environment's ``share/`` (a wheel or ``pip install .``
puts them there), else from the source checkout of an editable install.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Final

EXIT_OK = 0
EXIT_FAILURE = 1

SHIPPED_BINARY: Final = "/usr/local/bin/ggufswap"
SHIPPED_DOCS: Final = "file:///usr/share/doc/ggufswap/"
UNITS: Final = ("ggufswap-agent.service", "ggufswap-runtime@.service")
SYSUSERS: Final = "ggufswap.sysusers.conf"
TMPFILES: Final = "ggufswap.tmpfiles.conf"

# What the units' sandboxing hides from the service (an ExecStart= there fails with 203/EXEC).
HIDDEN: Final = (
    ("/home", "ProtectHome=yes"),
    ("/root", "ProtectHome=yes"),
    ("/run/user", "ProtectHome=yes"),
    ("/tmp", "PrivateTmp=yes"),  # noqa: S108 (a path the unit hides, not one written to)
    ("/var/tmp", "PrivateTmp=yes"),  # noqa: S108
)
INSTALL_HINT: Final = (
    "install into /opt/ggufswap (python3 -m venv /opt/ggufswap && /opt/ggufswap/bin/pip install "
    "'CHECKOUT[runtime]'; then /opt/ggufswap/bin/ggufswap install-systemd --prefix /), or pass "
    "--executable PATH outside them"
)

# Where each file goes, relative to --prefix: admin-installed files live under /etc.
UNIT_DIR: Final = "etc/systemd/system"
SYSUSERS_TARGET: Final = "etc/sysusers.d/ggufswap.conf"
TMPFILES_TARGET: Final = "etc/tmpfiles.d/ggufswap.conf"
CONFIG_DIR: Final = "etc/ggufswap"
DOC_DIR: Final = "usr/share/doc/ggufswap"

AGENT_SKELETON: Final = """\
# ggufswap agent (ggufswap-agent.service): the models whose shard directories it watches.
# Each model NAME is served by ggufswap-runtime@NAME.service, which reads NAME.yaml beside this
# file; with no endpoint named, the agent dials /run/ggufswap/NAME.sock, which that runtime
# binds. Every key: docs/configuration.md. Check: ggufswap check-config config.yaml
version: 1
models:
  - name: example
    watch:
      - path: /srv/models/example
"""

RUNTIME_SKELETON: Final = """\
# ggufswap runtime instance `example` (ggufswap-runtime@example.service): named after this file,
# it binds /run/ggufswap/example.sock and serves OpenAI-style HTTP. Every key:
# docs/configuration.md. Check: sudo -u ggufswap ggufswap check-config example.yaml
version: 1
runtime:
  model: /srv/models/example/model.gguf
  serve: {mode: http, host: 127.0.0.1, port: 8000}
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "install-systemd",
        help="write the systemd units, sysusers/tmpfiles entries and config skeletons",
        description=(
            "Write ggufswap-agent.service and ggufswap-runtime@.service (ExecStart= naming this "
            "installation's ggufswap), the sysusers.d and tmpfiles.d entries, config skeletons "
            "in etc/ggufswap (existing files are kept) and the documentation, all under "
            "--prefix. Then: systemd-sysusers; systemd-tmpfiles --create; systemctl "
            "daemon-reload (docs/operations.md, Install)."
        ),
    )
    parser.add_argument(
        "--prefix",
        required=True,
        metavar="DIR",
        help="root the files are written under: / on the host, or a scratch directory to review",
    )
    parser.add_argument(
        "--executable",
        metavar="PATH",
        help=f"the ggufswap the units run (default: this one, {default_executable()})",
    )
    parser.set_defaults(func=run)


def default_executable() -> Path:
    """The ``ggufswap`` script beside the running interpreter (a venv's bin/)."""
    return Path(sys.executable).parent / "ggufswap"


def data_dir(kind: str) -> Path | None:
    """``systemd`` templates or ``doc`` files: the environment's share/, else the checkout's."""
    installed = {
        "systemd": Path(sys.prefix) / "share" / "ggufswap" / "systemd",
        "doc": Path(sys.prefix) / "share" / "doc" / "ggufswap",
    }[kind]
    if installed.is_dir():
        return installed
    import ggufswap

    checkout = Path(ggufswap.__file__).resolve().parent.parent  # cli/__init__.py -> repository
    source = checkout / ("systemd" if kind == "systemd" else "docs")
    return source if source.is_dir() else None


def render_unit(text: str, *, executable: Path) -> str:
    """A shipped unit with this installation's executable in ``ExecStart=``."""
    return text.replace(f"ExecStart={SHIPPED_BINARY} ", f"ExecStart={executable} ")


def hidden_by_units(executable: Path) -> str | None:
    """Why the units could not run ``executable``: it (or the interpreter its ``#!`` line
    names, a venv's python) resolves under a directory their sandboxing hides; None if not."""
    paths = [executable.resolve()]
    try:
        with open(executable, "rb") as script:
            first = script.readline(4096)
    except OSError:
        first = b""
    if first.startswith(b"#!"):
        interpreter = first[2:].strip().split(b" ")[0].decode(errors="replace")
        if interpreter:
            paths.append(Path(interpreter).resolve())
    for path in paths:
        for hidden, directive in HIDDEN:
            if path == Path(hidden) or Path(hidden) in path.parents:
                return f"{path} is under {hidden}, which the units hide ({directive})"
    return None


def _runnable_by_units(executable: Path, *, host: bool) -> bool:
    """Say, in one line with the fix, when the units could not run ``executable``; False (refuse)
    on the host, a warning for a scratch root (files written for review)."""
    hidden = hidden_by_units(executable)
    if hidden is None:
        return True
    line = f"ggufswap install-systemd: {hidden}: the service would fail (203/EXEC); "
    if host:  # refused before anything is written
        print(line + INSTALL_HINT, file=sys.stderr)
        return False
    print(line + "on the host this is refused; " + INSTALL_HINT, file=sys.stderr)
    return True


def run(args: argparse.Namespace) -> int:
    prefix = Path(args.prefix)
    executable = Path(args.executable) if args.executable else default_executable()
    if not (executable.is_file() and os.access(executable, os.X_OK)):
        print(
            f"ggufswap install-systemd: {executable} is not an executable file; pass "
            "--executable PATH (the ggufswap script of the venv the units should run)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    if not _runnable_by_units(executable, host=prefix.resolve() == Path("/")):
        return EXIT_FAILURE
    templates = data_dir("systemd")
    if templates is None:
        print(
            f"ggufswap install-systemd: no unit templates in {sys.prefix}/share/ggufswap/systemd; "
            "reinstall with pip install (not a bare copy of the package)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    written: list[str] = []
    kept: list[str] = []

    def write(relative: str, text: str, *, mode: int = 0o644, keep: bool = False) -> None:
        target = prefix / relative
        if keep and target.exists():
            kept.append(str(target))
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode)
        written.append(str(target))

    for unit in UNITS:
        write(
            f"{UNIT_DIR}/{unit}", render_unit((templates / unit).read_text(), executable=executable)
        )
    write(SYSUSERS_TARGET, (templates / SYSUSERS).read_text())
    write(TMPFILES_TARGET, (templates / TMPFILES).read_text())
    # Readable by the service's group, writable by root only (docs/operations.md, Install).
    write(f"{CONFIG_DIR}/config.yaml", AGENT_SKELETON, mode=0o640, keep=True)
    write(f"{CONFIG_DIR}/example.yaml", RUNTIME_SKELETON, mode=0o640, keep=True)
    docs = data_dir("doc")
    if docs is not None:
        for doc in sorted(docs.glob("*.md")):
            target = prefix / DOC_DIR / doc.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(doc, target)
            written.append(str(target))
    for path in written:
        print(f"wrote {path}")
    for path in kept:
        print(f"kept  {path} (exists)")
    print(
        "next, as root: systemd-sysusers; systemd-tmpfiles --create ggufswap.conf; "
        "chgrp ggufswap /etc/ggufswap/*.yaml; systemctl daemon-reload; "
        "systemctl enable --now ggufswap-runtime@NAME ggufswap-agent"
    )
    return EXIT_OK
