"""One run per workdir: a lock file naming its holder (pid, host, since when), taken over once the holder is gone.

The file is created with `O_EXCL`, so of two processes starting on one workdir exactly one gets it;
the other is refused in one line naming the holder. A lock whose process no longer runs on this
host (killed with SIGKILL, the machine rebooted) is stale: the next run renames it aside (an
atomic step only one process can win), says so in a warning, and takes the workdir over. A lock
held by another host cannot be checked from here and is refused with its path, to be removed by
hand once that run is known to be gone. The same process may take its own lock again (the CLI
holds the run's lock while its stages' callbacks ask for it). Imports no TensorFlow.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket

from tfmp.config import UsageError

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class WorkdirInUse(UsageError):
    """Another process holds the workdir's lock; the message names it."""


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, from /proc), to tell a reused pid apart; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as file:
            return file.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(holder: dict) -> bool:
    """Whether the lock's holder may still run (a holder on another host always may, as far as this host knows)."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    started = holder.get("process_start")
    return started is None or _process_start(pid) in (None, started)


class WorkdirLock:
    """The lock of the run directory `directory` (`acquire` / `release`, or a `with` block).

    Args:
        directory: the run directory (created by `acquire` if needed).
    """

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILE)
        self.owned = False

    def _write_new(self) -> bool:
        """Creates the lock file naming this process; False when one exists."""
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        record = {"pid": os.getpid(), "host": socket.gethostname(), "process_start": _process_start(os.getpid()),
                  "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(record, file)
        return True

    def holder(self) -> dict | None:
        """Who holds the lock now (its record), or None when nobody does; {} when its file does not read."""
        try:
            with open(self.path, encoding="utf-8") as file:
                return json.load(file)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "WorkdirLock":
        """Takes the lock (or finds this process already holds it).

        Raises:
            WorkdirInUse: another running process holds it.
        """
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        for _ in range(3):  # a holder that leaves, or a stale lock taken over, between two looks
            if self._write_new():
                self.owned = True
                atexit.register(self.release)
                return self
            holder = self.holder()
            if holder is None:
                continue
            if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                return self  # this process's own lock: kept by whoever took it first
            if not holder:
                # Unreadable: being written this very moment, or damaged; either way not ours to take.
                raise WorkdirInUse(f"workdir {os.path.dirname(self.path)} has a lock file that does not read ({self.path}); "
                                   "if no run uses this workdir, remove that file and rerun")
            if _running(holder):
                where = "" if holder.get("host") == socket.gethostname() else f" on {holder.get('host')}"
                raise WorkdirInUse(f"workdir {os.path.dirname(self.path)} is in use by pid {holder.get('pid')}{where} "
                                   f"(since {holder.get('since')}); wait for that run to end, or choose another --workdir"
                                   + (f" (a run on another host: remove {self.path} once it is gone)" if where else ""))
            aside = f"{self.path}.stale-{os.getpid()}"
            try:
                os.rename(self.path, aside)  # only one process wins the stale file
            except FileNotFoundError:
                continue
            os.remove(aside)
            logger.warning("workdir %s: the run holding it (pid %s, since %s) is gone; taking it over",
                           os.path.dirname(self.path), holder.get("pid"), holder.get("since"))
        raise WorkdirInUse(f"workdir {os.path.dirname(self.path)}: its lock changed hands while starting; rerun")

    def release(self) -> None:
        """Removes the lock if this object took it."""
        if not self.owned:
            return
        self.owned = False
        atexit.unregister(self.release)
        holder = self.holder()
        if holder and holder.get("pid") == os.getpid():
            os.remove(self.path)

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()
