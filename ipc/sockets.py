"""Socket construction with the production options, and secure bind/connect of endpoints.

One :class:`SocketOptions` record carries everything a socket owner needs. Every socket gets
an explicit ``LINGER``, high-water marks and a transport size cap (``MAXMSGSIZE``); a ROUTER
also gets ``ROUTER_MANDATORY`` so that a reply to a vanished peer is an error rather than a
silent drop. Endpoints:

- ``ipc://PATH``: the parent directory is created with mode 0700, an existing one must not be
  writable by group or others, the socket file is created under umask 0o077 (mode 0600), and a
  stale socket file left by a dead process is removed (a live one raises ``EndpointInUse``).
- ``tcp://HOST:PORT``: requires CURVE (server: its secret key plus a ZAP authenticator that only
  admits the public keys found in an authorized-keys directory) unless the operator explicitly
  sets ``allow_insecure_tcp``; otherwise ``InsecureEndpoint``.
- ``inproc://NAME``: in-process only, no checks.

Only one ZAP authenticator can serve a context, so a socket bound with CURVE should have a
context of its own (``RequestServer`` and ``Publisher`` do).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ggufswap.config.endpoints import default_runtime_dir, socket_dir_problem
from ggufswap.ipc.codec import DEFAULT_MAX_MSG_SIZE
from ggufswap.ipc.errors import EndpointInUse, InsecureEndpoint, IpcError
from ggufswap.logs import get_logger

log = get_logger(__name__)

DEFAULT_LINGER_MS = 200
DEFAULT_HWM = 1000
# libzmq drops the connection of a peer that sends a frame over MAXMSGSIZE, so nobody could be
# told why. The transport limit is therefore a little above the protocol cap: frames between the
# two get a polite ``error TOO_LARGE`` reply; grossly oversized ones are cut off by libzmq
# before they are buffered whole.
TRANSPORT_SLACK_BYTES = 1024 * 1024
IPC_SCHEME = "ipc://"
TCP_SCHEME = "tcp://"
INPROC_SCHEME = "inproc://"
PRIVATE_UMASK = 0o077
PRIVATE_DIR_MODE = 0o700
SOCKET_FILE_MODE = 0o600
GROUP_SOCKET_FILE_MODE = 0o660  # status sockets in a group-enterable directory

_umask_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Paths of CURVE key files (``zmq.auth.create_certificates`` format).

    Mirrors the config's ``security.curve`` section. A server needs ``server_secret_key`` and
    ``authorized_keys_dir`` (the client public keys it admits); a client needs
    ``client_secret_key`` and ``server_public_key``.
    """

    server_secret_key: Path | None = None
    server_public_key: Path | None = None
    client_secret_key: Path | None = None
    authorized_keys_dir: Path | None = None

    @classmethod
    def of(cls, section: CurveSection | None) -> CurveKeys | None:
        """The keys of a config's ``security.curve`` section (None when it is not configured)."""
        if section is None:
            return None
        return cls(
            server_secret_key=section.server_secret_key,
            server_public_key=section.server_public_key,
            client_secret_key=section.client_secret_key,
            authorized_keys_dir=section.authorized_keys_dir,
        )


class CurveSection(Protocol):
    """What :meth:`CurveKeys.of` reads: the shape of ``ggufswap.config.CurveConfig``."""

    @property
    def server_secret_key(self) -> Path | None: ...
    @property
    def server_public_key(self) -> Path | None: ...
    @property
    def client_secret_key(self) -> Path | None: ...
    @property
    def authorized_keys_dir(self) -> Path | None: ...


class SecuritySection(Protocol):
    """What :meth:`SocketOptions.of` reads: the shape of ``ggufswap.config.SecurityConfig``."""

    @property
    def curve(self) -> CurveSection | None: ...
    @property
    def allow_insecure_tcp(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class SocketOptions:
    """How a socket owner opens its sockets: transport security and the ZeroMQ settings.

    Every owner (``RequestServer``, ``Publisher``, ``request``, ``DealerClient``,
    ``Subscriber``, and through them the control server and the agent's links) takes one of
    these; a process builds it once from its config with :meth:`of`. ``max_msg_size`` is the
    protocol cap (``MAXMSGSIZE`` is set a little above it, see :func:`transport_limit`).
    """

    curve: CurveKeys | None = None
    allow_insecure_tcp: bool = False
    max_msg_size: int = DEFAULT_MAX_MSG_SIZE
    linger_ms: int = DEFAULT_LINGER_MS
    hwm: int = DEFAULT_HWM
    # Status sockets: members of the socket directory's group may connect (0660) when the
    # directory lets the group in (g+x, as /run/ggufswap 0750); every other socket stays 0600.
    group_access: bool = False

    @classmethod
    def of(cls, security: SecuritySection) -> SocketOptions:
        """The options of a config's ``security`` section (the other settings at defaults)."""
        return cls(
            curve=CurveKeys.of(security.curve), allow_insecure_tcp=security.allow_insecure_tcp
        )


DEFAULT_OPTIONS: Final = SocketOptions()


def transport_limit(max_msg_size: int) -> int:
    """The ``MAXMSGSIZE`` set on sockets whose protocol cap is ``max_msg_size``."""
    return max_msg_size + TRANSPORT_SLACK_BYTES


def make_socket(
    context: zmq.Context[zmq.Socket[bytes]],
    socket_type: int,
    options: SocketOptions = DEFAULT_OPTIONS,
) -> zmq.Socket[bytes]:
    """A socket of ``socket_type`` with LINGER, MAXMSGSIZE, SNDHWM/RCVHWM (and ROUTER_MANDATORY)."""
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, options.linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, transport_limit(options.max_msg_size))
    sock.setsockopt(zmq.SNDHWM, options.hwm)
    sock.setsockopt(zmq.RCVHWM, options.hwm)
    if socket_type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def _load_key(path: Path | None, *, role: str, secret: bool) -> tuple[bytes, bytes | None]:
    if path is None:
        raise IpcError(f"CURVE: the {role} key file is not configured (security.curve)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise IpcError(f"CURVE: cannot load the {role} key file {path}: {exc}") from exc
    if secret and secret_key is None:
        raise IpcError(
            f"CURVE: {path} holds no secret key; the {role} key must be a '.key_secret' file"
        )
    return public, secret_key


def _unix_socket_is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        probe.close()
    return True


def _prepare_ipc_path(path: str, endpoint: str) -> None:
    """Private parent directory, no stale socket file; raises when that cannot be ensured."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=PRIVATE_DIR_MODE, exist_ok=True)
        os.chmod(parent, PRIVATE_DIR_MODE)
    st = os.stat(parent)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InsecureEndpoint(
            f"{endpoint}: directory {parent} is writable by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); use a private directory "
            f"(chmod 0700 {parent}) such as a systemd RuntimeDirectory"
        )
    problem = socket_dir_problem(Path(parent))
    if problem is not None:
        raise InsecureEndpoint(f"{endpoint}: {problem}")
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(lst.st_mode):
        raise IpcError(f"{endpoint}: {path} exists and is not a socket; refusing to replace it")
    if _unix_socket_is_live(path):
        raise EndpointInUse(f"{endpoint}: {path} is in use by a live process")
    log.info("ipc.stale_socket_removed", path=path)
    os.unlink(path)


def _socket_mode(path: str, *, group_access: bool) -> int:
    """0600, or 0660 for a ``group_access`` socket in a directory its group may enter."""
    parent = os.stat(os.path.dirname(os.path.abspath(path)))
    if group_access and parent.st_mode & stat.S_IXGRP:
        return GROUP_SOCKET_FILE_MODE
    return SOCKET_FILE_MODE


class Binding:
    """What ``bind_endpoint`` set up; ``close()`` after closing the socket."""

    def __init__(
        self, endpoint: str, *, authenticator: ThreadAuthenticator | None, ipc_path: str | None
    ):
        self.endpoint = endpoint  # as resolved by libzmq (a tcp wildcard port is filled in)
        self.authenticator = authenticator
        self.ipc_path = ipc_path

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
        if self.ipc_path is not None:
            try:
                if stat.S_ISSOCK(os.lstat(self.ipc_path).st_mode):
                    os.unlink(self.ipc_path)
            except FileNotFoundError:
                pass
            self.ipc_path = None


def _last_endpoint(sock: zmq.Socket[bytes], fallback: str) -> str:
    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text or fallback


def bind_endpoint(
    sock: zmq.Socket[bytes], endpoint: str, options: SocketOptions = DEFAULT_OPTIONS
) -> Binding:
    """Bind ``sock`` to ``endpoint`` with the protections described in the module docstring."""
    curve = options.curve
    if endpoint.startswith(IPC_SCHEME):
        path = endpoint[len(IPC_SCHEME) :]
        if path.startswith("@"):  # Linux abstract namespace: no file, no directory
            sock.bind(endpoint)
            return Binding(_last_endpoint(sock, endpoint), authenticator=None, ipc_path=None)
        with _umask_lock:
            # The umask is process-wide: hold it restrictive only around mkdir and bind.
            previous = os.umask(PRIVATE_UMASK)
            try:
                _prepare_ipc_path(path, endpoint)
                sock.bind(endpoint)
            finally:
                os.umask(previous)
        os.chmod(path, _socket_mode(path, group_access=options.group_access))
        return Binding(_last_endpoint(sock, endpoint), authenticator=None, ipc_path=path)
    if endpoint.startswith(TCP_SCHEME):
        authenticator = None
        if curve is not None:
            authenticator = _start_curve_server(sock, curve)
        elif not options.allow_insecure_tcp:
            raise InsecureEndpoint(
                f"{endpoint}: tcp endpoints require CURVE keys (security.curve); set "
                f"allow_insecure_tcp only on a trusted network"
            )
        else:
            log.warning("ipc.insecure_tcp", endpoint=endpoint)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            if authenticator is not None:
                authenticator.stop()
            raise
        return Binding(_last_endpoint(sock, endpoint), authenticator=authenticator, ipc_path=None)
    if endpoint.startswith(INPROC_SCHEME):
        sock.bind(endpoint)
        return Binding(endpoint, authenticator=None, ipc_path=None)
    raise IpcError(f"{endpoint}: unsupported transport; use ipc://, tcp:// or inproc://")


def _start_curve_server(sock: zmq.Socket[bytes], curve: CurveKeys) -> ThreadAuthenticator:
    public, secret = _load_key(curve.server_secret_key, role="server secret", secret=True)
    keys_dir = curve.authorized_keys_dir
    if keys_dir is None or not Path(keys_dir).is_dir():
        raise IpcError(
            f"CURVE: authorized_keys_dir {keys_dir} is not a directory of client public keys"
        )
    authenticator = ThreadAuthenticator(sock.context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=os.fspath(keys_dir))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return authenticator


def connect_endpoint(
    sock: zmq.Socket[bytes], endpoint: str, options: SocketOptions = DEFAULT_OPTIONS
) -> None:
    """Connect ``sock`` to ``endpoint``; tcp needs CURVE client keys unless explicitly insecure."""
    curve = options.curve
    if endpoint.startswith(TCP_SCHEME):
        if curve is not None:
            public, secret = _load_key(curve.client_secret_key, role="client secret", secret=True)
            server_public, _ = _load_key(
                curve.server_public_key, role="server public", secret=False
            )
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_serverkey = server_public
        elif not options.allow_insecure_tcp:
            raise InsecureEndpoint(
                f"{endpoint}: tcp endpoints require CURVE keys (security.curve); set "
                f"allow_insecure_tcp only on a trusted network"
            )
    elif endpoint.startswith(IPC_SCHEME):
        _check_ipc_client_dir(endpoint)
    elif not endpoint.startswith(INPROC_SCHEME):
        raise IpcError(f"{endpoint}: unsupported transport; use ipc://, tcp:// or inproc://")
    sock.connect(endpoint)


def _check_ipc_client_dir(endpoint: str) -> None:
    """Refuse to connect through a socket directory others could write (anyone could have put
    the socket there); in this user's default runtime directory its owner must also be this
    user or root (another user may have created it first, to receive this process's requests).
    """
    path = endpoint.removeprefix(IPC_SCHEME)
    if path.startswith("@"):
        return  # an abstract socket has no directory
    parent = Path(os.path.dirname(os.path.abspath(path)))
    owner_checked = os.path.realpath(parent) == os.path.realpath(default_runtime_dir())
    problem = socket_dir_problem(parent, owner_checked=owner_checked)
    if problem is not None:
        raise InsecureEndpoint(f"{endpoint}: {problem}")
