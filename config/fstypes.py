"""Which file system a directory lives on: whether inotify can be trusted there (the agent's
choice of backend), and whether it is one of the kernel's pseudo file systems (never a watch
root: the configuration refuses it).

inotify reports changes made through the local kernel's VFS. On network and user-space file
systems (NFS, SMB/CIFS, FUSE, 9p, Ceph, Lustre...) writes made by another host, or by the FUSE
daemon itself, never reach it; on overlayfs a change to a lower layer is invisible too. The agent
polls such directories. The file system is identified by ``statfs(2)``'s ``f_type`` (through
ctypes), with ``/proc/self/mountinfo`` as the fallback when ``statfs`` cannot be called.

Pseudo file systems (``proc``, ``sysfs``, ``devtmpfs``, cgroups...) hold no model files (``/proc``
a file per process, ``/dev/zero`` never ends) and are refused as watch roots by their type, not by
a path prefix: ``/dev/shm`` is an ordinary tmpfs under ``/dev``. ``devtmpfs`` reports tmpfs's
``statfs`` magic, so the type comes from ``/proc/self/mountinfo`` first.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Final

# statfs f_type magics (linux/magic.h and the file systems' own headers) of file systems on
# which inotify misses changes.
NO_INOTIFY_MAGICS: Final[dict[int, str]] = {
    0x6969: "nfs",
    0x517B: "smb",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x65735546: "fuse",
    0x794C7630: "overlay",
    0x01021997: "9p",
    0x00C36400: "ceph",
    0x5346414F: "afs",
    0x6B414653: "afs",
    0x73757245: "coda",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
}
# The same file systems as /proc/self/mountinfo names them (``fuse.*`` covers every FUSE mount).
NO_INOTIFY_NAMES: Final = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "afs", "coda", "overlay", "lustre"}
    | {"gpfs", "fuse", "fuseblk"}
)
FUSE_PREFIX: Final = "fuse."
# The kernel's pseudo file systems, as /proc/self/mountinfo names them, and the statfs magics of
# those that have one of their own (linux/magic.h), for when mountinfo cannot be read.
PSEUDO_FS_NAMES: Final = frozenset(
    {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs"}
    | {"securityfs", "pstore", "bpf", "configfs", "mqueue", "binfmt_misc", "efivarfs"}
    | {"selinuxfs", "nsfs", "fusectl", "rpc_pipefs", "autofs"}
)
PSEUDO_FS_MAGICS: Final[dict[int, str]] = {
    0x9FA0: "proc",
    0x62656572: "sysfs",
    0x1CD1: "devpts",
    0x27E0EB: "cgroup",
    0x63677270: "cgroup2",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0x6165676C: "pstore",
    0xCAFE4A11: "bpf",
    0x62656570: "configfs",
    0x19800202: "mqueue",
    0x42494E4D: "binfmt_misc",
    0xDE5E81E4: "efivarfs",
    0xF97CFF8C: "selinuxfs",
    0x6E736673: "nsfs",
}
_STATFS_BUFFER_BYTES: Final = 512  # larger than struct statfs on every Linux ABI


@dataclass(frozen=True, slots=True)
class FsInfo:
    """What the agent knows about the file system holding a directory."""

    name: str  # "nfs", "ext4", ... or "0x1234abcd" for an unnamed statfs magic
    inotify_reliable: bool
    source: str  # "statfs" or "mountinfo" or "unknown"


def statfs_magic(path: str) -> int | None:
    """``f_type`` from ``statfs(2)``, or None when libc's ``statfs`` cannot be called."""
    try:
        # The C library this process already has (dlopen(NULL)): find_library would run
        # `ldconfig -p` in a subprocess on every call.
        libc = ctypes.CDLL(None, use_errno=True)
        statfs = libc.statfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(_STATFS_BUFFER_BYTES)
    if statfs(os.fsencode(path), buf) != 0:
        return None
    # f_type is the first member of struct statfs, a __fsword_t (a C long) on every Linux ABI.
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def _unescape_mount_path(text: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 4 <= len(text) and text[i + 1 : i + 4].isdigit():
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def mountinfo_fstype(path: str, *, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The file system type of the mount holding ``path`` (longest mount point prefix)."""
    real = os.path.realpath(path)
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best, best_len = None, -1
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right:
            continue
        mount_point = _unescape_mount_path(fields[4])
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) > best_len:
            best, best_len = right.split()[0], len(mount_point)
    return best


def fs_info(path: str) -> FsInfo:
    """Identify the file system of ``path`` and whether inotify sees every change on it."""
    magic = statfs_magic(path)
    if magic is not None:
        name = NO_INOTIFY_MAGICS.get(magic)
        if name is not None:
            return FsInfo(name, inotify_reliable=False, source="statfs")
        mount_name = mountinfo_fstype(path)
        return FsInfo(mount_name or f"{magic:#x}", inotify_reliable=True, source="statfs")
    name = mountinfo_fstype(path)
    if name is None:
        return FsInfo("unknown", inotify_reliable=True, source="unknown")
    reliable = name not in NO_INOTIFY_NAMES and not name.startswith(FUSE_PREFIX)
    return FsInfo(name, inotify_reliable=reliable, source="mountinfo")


def pseudo_fs(path: str) -> str | None:
    """The name of the kernel pseudo file system holding ``path`` (``proc``, ``devtmpfs``...),
    or None for a file system that can hold files (ext4, xfs, tmpfs such as ``/dev/shm``...)."""
    name = mountinfo_fstype(path)
    if name is not None:
        return name if name in PSEUDO_FS_NAMES else None
    magic = statfs_magic(path)
    return PSEUDO_FS_MAGICS.get(magic) if magic is not None else None
