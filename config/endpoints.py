"""ZeroMQ endpoints in a configuration: where the sockets live by default, and their syntax.

Only two transports are accepted: ``ipc://PATH`` (a Unix socket, the default) and
``tcp://HOST:PORT`` (which needs CURVE keys unless the operator opts out explicitly).
"""

from __future__ import annotations

import enum
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

# Linux ``sockaddr_un.sun_path`` holds 108 bytes including the terminating NUL.
MAX_IPC_PATH_BYTES = 107
DEFAULT_RUNTIME_DIR = Path("/run/ggufswap")

_TCP = re.compile(r"tcp://(?P<host>\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>\d{1,5})")


class Transport(str, enum.Enum):
    """The transport of an endpoint, from its scheme."""

    IPC = "ipc"
    TCP = "tcp"


class Env:
    """Environment variables that choose the default runtime directory, in order of preference."""

    RUNTIME_DIRECTORY = "RUNTIME_DIRECTORY"  # set by systemd's RuntimeDirectory=
    XDG_RUNTIME_DIR = "XDG_RUNTIME_DIR"  # per-user, set by the login manager


def default_runtime_dir(*, environ: Mapping[str, str] | None = None) -> Path:
    """Directory for the default ``ipc://`` sockets; nothing is created.

    In order: ``$RUNTIME_DIRECTORY`` (its first entry; systemd sets it from
    ``RuntimeDirectory=``), ``/run/ggufswap`` when it exists and is writable,
    ``$XDG_RUNTIME_DIR/ggufswap``, and last ``<tmpdir>/ggufswap-<uid>``.
    """
    env = os.environ if environ is None else environ
    systemd_dir = env.get(Env.RUNTIME_DIRECTORY, "").split(":")[0]
    if systemd_dir:
        return Path(systemd_dir)
    # Searchable is enough: a member of group ggufswap (r-x) connects to the daemons' sockets
    # there (`ggufswap status`); a process that must bind and cannot write is told so at start.
    if DEFAULT_RUNTIME_DIR.is_dir() and os.access(DEFAULT_RUNTIME_DIR, os.X_OK):
        return DEFAULT_RUNTIME_DIR
    xdg = env.get(Env.XDG_RUNTIME_DIR, "")
    if xdg:
        return Path(xdg) / "ggufswap"
    return Path(tempfile.gettempdir()) / f"ggufswap-{os.getuid()}"


def ipc_endpoint(path: Path) -> str:
    """``ipc://`` endpoint of a socket file."""
    return f"ipc://{path}"


def transport_of(endpoint: str) -> Transport:
    """Transport of a validated endpoint."""
    return Transport(endpoint.split("://", 1)[0])


def check_endpoint(text: str, *, base_dir: Path) -> tuple[str | None, str]:
    """``(normalized endpoint, "")`` for a valid endpoint, else ``(None, why)``.

    A relative ``ipc://`` path is made absolute against ``base_dir``; an abstract Unix socket
    (``ipc://@name``) is kept as written.
    """
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in {t.value for t in Transport}:
        return None, f"expected an ipc://PATH or tcp://HOST:PORT endpoint, found {text!r}"
    if scheme == Transport.IPC.value:
        if not rest:
            return None, f"an ipc:// endpoint needs a socket path, found {text!r}"
        if "\x00" in rest:
            return None, "an ipc:// socket path cannot contain a NUL byte"
        if rest.startswith("@"):
            return text, ""
        path = Path(os.path.normpath(base_dir / os.path.expanduser(rest)))
        if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            return None, (
                f"ipc:// socket path {str(path)!r} is {len(os.fsencode(path))} bytes long; "
                f"Unix sockets allow at most {MAX_IPC_PATH_BYTES} (choose a shorter directory)"
            )
        return ipc_endpoint(path), ""
    match = _TCP.fullmatch(text)
    if match is None:
        return None, f"expected tcp://HOST:PORT (HOST may be '*' to bind), found {text!r}"
    port = int(match.group("port"))
    if not 1 <= port <= 65535:
        return None, f"tcp:// port must be in 1..65535, found {port}"
    return text, ""


def sibling_endpoint(control: str, *, role: str, port_offset: int) -> str:
    """Default endpoint next to a validated control endpoint.

    ``ipc:///run/ggufswap/m.sock`` gives ``ipc:///run/ggufswap/m.<role>.sock``;
    ``tcp://host:5555`` gives ``tcp://host:<5555 + port_offset>``.
    """
    scheme, _, rest = control.partition("://")
    if scheme == Transport.TCP.value:
        host, _, port = rest.rpartition(":")
        return f"tcp://{host}:{int(port) + port_offset}"
    stem, dot, suffix = rest.rpartition(".")
    if dot and "/" not in suffix:
        return f"ipc://{stem}.{role}.{suffix}"
    return f"ipc://{rest}.{role}"


def socket_dir_problem(directory: Path, *, owner_checked: bool = True) -> str | None:
    """Why a Unix socket's ``directory`` cannot be trusted, or None when it can.

    As OpenSSH's StrictModes: the directory and every ancestor up to ``/`` (their real paths)
    must be owned by this process's user or root, and writable by no one else; an ancestor that
    others may write is accepted only with the sticky bit and a trusted owner (``/tmp``: no one
    else can rename or remove what is in it). Someone else able to write to the socket's
    directory could replace the socket, and clients would send their plans to an impostor. With
    ``owner_checked`` false only writability is checked (a client connecting to a socket another
    user's service owns). A directory that does not exist yet is judged by its first existing
    ancestor, which would hold it.
    """
    uid = os.getuid()
    real = Path(os.path.realpath(directory))
    own_dir = True
    for current in (real, *real.parents):
        try:
            st = os.stat(current)
        except FileNotFoundError:
            own_dir = False  # it will be created, private, inside its first existing ancestor
            continue
        except OSError as exc:
            return f"{current} cannot be checked ({exc.strerror})"
        trusted_owner = st.st_uid in (uid, 0)
        writable = stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH)
        what = "the socket directory" if current == real else "its ancestor"
        if owner_checked and not trusted_owner:
            return (
                f"{what} {current} is owned by uid {st.st_uid}, not by this process's user "
                f"(uid {uid}) or root: its owner could replace the socket; remove it or use a "
                "directory of your own (such as a systemd RuntimeDirectory)"
            )
        sticky_ok = bool(st.st_mode & stat.S_ISVTX) and trusted_owner and not own_dir
        if writable and not sticky_ok:
            return (
                f"{what} {current} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): they could replace the socket; "
                f"chmod go-w {current}"
            )
        own_dir = False
    return None
