"""Errors raised by the agent: watcher backends, the shard index and the link to a runtime.

Messages name the directory, file, model or endpoint involved and say what to do about it.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class of every error the ``ggufswap.agent`` package raises."""


class BackendUnavailable(AgentError, ImportError):
    """A watcher backend cannot be used in this interpreter (its module does not import)."""


class WatchError(AgentError, OSError):
    """A directory could not be watched (missing, not a directory, or a kernel limit)."""


class WatchLimitError(WatchError):
    """``inotify_add_watch`` failed with ENOSPC: ``fs.inotify.max_user_watches`` is too low."""


class LinkStateError(AgentError, RuntimeError):
    """An illegal transition of a runtime link's state machine: a bug, never an input problem."""


class DaemonStateError(AgentError, RuntimeError):
    """An illegal transition of the daemon's lifecycle (``start()`` twice, for one)."""
