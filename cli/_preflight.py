"""Checks made before a daemon loads anything: can it bind what it must, and read its model?

A runtime spends seconds to minutes loading a model; a socket it cannot bind, a port another
server holds or a model path that does not exist must stop it before that, with one line that
names the configuration file, the key, the endpoint or path, and what to do. Nothing here
imports torch; nothing is bound (a port is bound and released at once to see that it is free).
"""

from __future__ import annotations

import errno
import os
import pwd
import socket
import stat
import tempfile
from pathlib import Path

from ggufswap.config import Config, Transport, transport_of

IPC_PREFIX = "ipc://"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def socket_dir_problem(endpoint: str, *, create: bool = True) -> str | None:
    """Why the directory of an ``ipc://`` endpoint cannot hold this process's socket, or None.

    A missing directory is created as the bind would (``create``), else its nearest existing
    ancestor must be writable (``check-config`` creates nothing).
    """
    if transport_of(endpoint) is not Transport.IPC:
        return None
    path = endpoint.removeprefix(IPC_PREFIX)
    if path.startswith("@"):  # abstract socket: no file system
        return None
    parent = Path(path).parent
    me = _user(os.geteuid())
    if not parent.exists() and not create:
        ancestor = parent
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        try:  # a real attempt: root passes every access() check, not every file system
            os.rmdir(tempfile.mkdtemp(prefix=".ggufswap-check-", dir=ancestor))
        except OSError as exc:
            return (
                f"{parent} does not exist and user {me} cannot create it in {ancestor} "
                f"({exc.strerror or exc}); create it, or point the endpoint (or "
                "$RUNTIME_DIRECTORY) elsewhere"
            )
        return None
    if not parent.exists():
        # The bind creates a missing directory (mode 0700): do it now, where failing is cheap.
        try:
            os.makedirs(parent, mode=0o700, exist_ok=True)
        except OSError as exc:
            return (
                f"cannot create the socket directory {parent} as user {me}: "
                f"{exc.strerror or exc}; point the endpoint (or $RUNTIME_DIRECTORY) at a "
                "writable directory"
            )
    existing = parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    st = existing.stat()
    if not os.access(existing, os.W_OK | os.X_OK):
        return (
            f"cannot create the socket: {parent} is not writable by user {me} (owner "
            f"{_user(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}); run as its owner, or "
            f"point the endpoint (or $RUNTIME_DIRECTORY) at a directory {me} owns"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{parent} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}), "
            f"so another user could replace the socket; chmod 0750 {parent}"
        )
    return None


def _socket_in_use(endpoint: str) -> str | None:
    """Why a bound endpoint is taken by another process right now, or None."""
    if transport_of(endpoint) is Transport.IPC:
        path = endpoint.removeprefix(IPC_PREFIX)
        if path.startswith("@") or not os.path.lexists(path):
            return None
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return f"{path} exists and is not a socket; remove it"
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return None  # a stale socket file; the bind replaces it
        finally:
            probe.close()
        return (
            f"{path} is in use by a live process (another runtime with the same name?); stop "
            "it, or give this one another name or endpoint"
        )
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return port_problem("" if host == "*" else host.strip("[]"), int(port))


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (bound and released at once), or None."""
    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"cannot listen on {host or '*'}:{port}: the port is in use by another process"
        return f"cannot listen on {host or '*'}:{port}: {exc.strerror or exc}"
    finally:
        probe.close()
    return None


def _where(config: Config) -> str:
    return str(config.source) if config.source is not None else "<config>"


def runtime_problems(config: Config, *, http_port: tuple[str, int] | None) -> list[str]:
    """One line per reason ``ggufswap runtime`` would fail after loading: model unreadable,
    endpoint directory unwritable, endpoint or HTTP port (``http_port``, given only when the
    runtime will bind it) taken."""
    rc = config.require_runtime()
    where = _where(config)
    problems = []
    if not rc.model.is_file():
        problems.append(
            f"{where}: runtime.model: {rc.model} does not exist or is not a file; fix the path "
            "(ggufswap check-config checks it)"
        )
    elif not os.access(rc.model, os.R_OK):
        problems.append(
            f"{where}: runtime.model: {rc.model} is not readable by user "
            f"{_user(os.geteuid())}; grant read access (or the unit's ReadOnlyPaths=)"
        )
    endpoints = [
        ("runtime.control_endpoint", rc.control_endpoint),
        ("runtime.status_endpoint", rc.status_endpoint),
        ("runtime.events_endpoint", rc.events_endpoint),
    ]
    seen: set[str] = set()  # a directory's problem once, not once per socket in it
    for key, endpoint in endpoints:
        why = socket_dir_problem(endpoint) or _socket_in_use(endpoint)
        if why is not None and why not in seen:
            seen.add(why)
            problems.append(f"{where}: {key}: {endpoint}: {why}")
    if http_port is not None:  # the caller's: the mode may be the command line's
        host, port = http_port
        why = port_problem(host, port)
        if why is not None:
            problems.append(
                f"{where}: runtime.serve.port: {why}; stop the other server or choose another "
                "port (runtime.serve.port, or --http-port)"
            )
    return problems


def bind_dir_problems(config: Config) -> list[str]:
    """``check-config``: each bound ``ipc://`` endpoint whose directory this user cannot use."""
    where = _where(config)
    endpoints = []
    if config.models:
        endpoints.append(("agent.status_endpoint", config.agent.status_endpoint))
    if config.runtime is not None:
        rc = config.runtime
        endpoints += [
            ("runtime.control_endpoint", rc.control_endpoint),
            ("runtime.status_endpoint", rc.status_endpoint),
            ("runtime.events_endpoint", rc.events_endpoint),
        ]
    problems = []
    seen: set[str] = set()
    for key, endpoint in endpoints:
        why = socket_dir_problem(endpoint, create=False)
        if why is not None and why not in seen:
            seen.add(why)
            problems.append(f"{where}: {key}: {endpoint}: {why}")
    return problems
