"""What the autouse leak checks (tests/conftest.py) count as a test's leak.

A descriptor or a thread that a test leaves behind is a leak, except what a device driver keeps
for the life of the process once it is initialized. The first CUDA call of a process (of each
xdist worker) opens the driver's device nodes (``/dev/nvidiactl``, ``/dev/nvidia0``,
``/dev/nvidia-uvm``), a few eventfds and pipes beside them, and threads of its own; none of them
is ever closed, and none is the test's doing. So descriptors are classified by what they point to
(their ``/proc/self/fd`` link):

- a device node of an accelerator driver (:data:`DRIVER_NODES`) is never a leak;
- in a test during which such a node appeared (the driver was initialized then), the anonymous
  inodes and pipes that appeared with it (:data:`DRIVER_COMPANIONS`) are the driver's too, and
  so are the threads that Python's ``threading`` did not start (native threads that entered the
  interpreter, ``threading._DummyThread``); in any other test they count, since a ZeroMQ
  socket, for one, holds an eventfd.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

# Device nodes of accelerator drivers: NVIDIA's (nvidiactl, nvidia0.., nvidia-uvm, nvidia-caps/),
# DRM render nodes, AMD's KFD (ROCm), and the kernel's accel class.
DRIVER_NODES = ("/dev/nvidia", "/dev/dri/", "/dev/kfd", "/dev/accel/")
# What a driver opens beside its nodes when it initializes (eventfds and other anonymous inodes,
# pipes): the driver's only in the test that initialized it.
DRIVER_COMPANIONS = ("anon_inode:", "pipe:")


def is_driver_node(target: str) -> bool:
    """Whether a descriptor pointing to ``target`` is an accelerator driver's device node."""
    return target.startswith(DRIVER_NODES)


def new_descriptors(before: Mapping[int, str], after: Mapping[int, str]) -> dict[int, str]:
    """The descriptors of ``after`` that ``before`` did not have (a number reused for another
    target counts as new)."""
    return {fd: target for fd, target in after.items() if before.get(fd) != target}


def driver_initialized(before: Mapping[int, str], after: Mapping[int, str]) -> bool:
    """Whether a driver's device node appeared between the two listings."""
    return any(is_driver_node(t) for t in new_descriptors(before, after).values())


def leaked_descriptors(before: Mapping[int, str], after: Mapping[int, str]) -> dict[int, str]:
    """The descriptors opened between ``before`` and ``after`` that count as the test's leak."""
    new = new_descriptors(before, after)
    initialized = any(is_driver_node(t) for t in new.values())
    return {
        fd: target
        for fd, target in new.items()
        if not is_driver_node(target) and not (initialized and target.startswith(DRIVER_COMPANIONS))
    }


def leaked_threads(
    before: Iterable[threading.Thread], after: Iterable[threading.Thread], *, driver: bool
) -> list[threading.Thread]:
    """The threads of ``after`` not in ``before`` that count as the test's; ``driver``: a device
    driver was initialized during the test (:func:`driver_initialized`)."""
    known = set(before)
    return [
        t
        for t in after
        if t not in known and not (driver and isinstance(t, threading._DummyThread))
    ]
