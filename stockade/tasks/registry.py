"""The task registry: which sandbox address belongs to which task and profile.

Gateway, DNS firewall and broker identify a caller by its source address through this
registry (the launcher registers each sandbox with them before the command starts).
It is persisted to a state file so a restart keeps the registrations.

Every change is saved first (tmp file + rename) and made in memory only once the save
worked, so memory and disk never disagree: on a full state disk a registration fails with
`StateWriteError` and leaves no trace. An expired task whose removal cannot be saved stays
in both, inert (lookups treat it as gone, its flows are closed) until a save works.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .labels import LabelError, check_labels


class RegistryError(ValueError):
    pass


class StateWriteError(OSError):
    """The state file could not be written (full disk, read-only, gone): nothing changed."""

    code = "state_write_failed"

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(cause.errno, f"{self.code}: {cause.strerror or cause}")
        self.path = path
        self.detail = cause.strerror or str(cause)


@dataclass(frozen=True, slots=True)
class Task:
    task_id: str
    address: str  # the sandbox's source IP, canonical text form
    profile: str
    expires_at: float | None = None  # unix time; None = until deregistered
    registered_at: float = 0.0
    # the caller's labels (labels.py): every event of the task carries them
    labels: dict[str, str] = field(default_factory=dict)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @staticmethod
    def from_dict(d: dict[str, object]) -> Task:
        try:
            task_id = str(d["task_id"])
            address = str(ipaddress.ip_address(str(d["address"])))
            profile = str(d["profile"])
        except (KeyError, ValueError) as e:
            raise RegistryError(f"invalid task: {e}") from None
        if not task_id or len(task_id) > 128 or not task_id.isprintable():
            raise RegistryError("invalid task_id")
        exp = d.get("expires_at")
        if exp is not None and not isinstance(exp, int | float):
            raise RegistryError("expires_at must be a number (unix time)")
        reg = d.get("registered_at") or time.time()
        assert isinstance(reg, int | float)
        try:
            labels = check_labels(d.get("labels"))
        except LabelError as e:
            raise RegistryError(f"invalid labels: {e}") from None
        return Task(task_id, address, profile, float(exp) if exp is not None else None,
                    float(reg), labels)


Listener = Callable[[Task], None]


class TaskRegistry:
    def __init__(self, state_file: str | os.PathLike[str] | None = None) -> None:
        self.state_file = Path(state_file) if state_file else None
        self._by_id: dict[str, Task] = {}
        self._by_addr: dict[str, Task] = {}
        self._on_removed: list[Listener] = []
        self._on_removed_last: list[Listener] = []
        # expired tasks whose removal could not be saved yet, but whose listeners ran
        self._ended_unsaved: set[str] = set()
        if self.state_file is not None and self.state_file.exists():
            self._load()

    # -- queries -------------------------------------------------------------------
    def by_address(self, address: str, now: float | None = None) -> Task | None:
        task = self._by_addr.get(address)
        if task is None:
            # tolerate non-canonical forms (e.g. IPv4-mapped IPv6 from a dual-stack socket)
            try:
                ip = ipaddress.ip_address(address)
            except ValueError:
                return None
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                ip = ip.ipv4_mapped
            task = self._by_addr.get(str(ip))
            if task is None:
                return None
        if task.expired(time.time() if now is None else now):
            self._end(task)
            return None
        return task

    def get(self, task_id: str) -> Task | None:
        return self._by_id.get(task_id)

    def labels_of(self, task_id: str) -> dict[str, str] | None:
        """The task's labels, for the event writer (`EventWriter.label_with`)."""
        task = self._by_id.get(task_id)
        return task.labels if task is not None else None

    def tasks(self) -> list[Task]:
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    # -- changes -------------------------------------------------------------------
    def on_removed(self, fn: Listener, *, last: bool = False) -> None:
        """`fn(task)` runs when a task is deregistered or expires (close its flows).
        `last`: after every other listener, whenever those were added (the event
        writer's end of the task must follow the summaries the others still emit)."""
        (self._on_removed_last if last else self._on_removed).append(fn)

    def register(self, task: Task) -> None:
        other = self._by_addr.get(task.address)
        if other is not None and other.task_id != task.task_id:
            raise RegistryError(f"address {task.address} belongs to task {other.task_id}")
        old = self._by_id.get(task.task_id)
        self._save({**self._by_id, task.task_id: task}.values())  # StateWriteError: no change
        if old is not None and old.address != task.address:
            self._by_addr.pop(old.address, None)
        self._by_id[task.task_id] = task
        self._by_addr[task.address] = task
        self._ended_unsaved.discard(task.task_id)

    def deregister(self, task_id: str) -> Task | None:
        task = self._by_id.get(task_id)
        if task is not None:
            self._remove(task)
        return task

    def expire(self, now: float | None = None) -> list[Task]:
        """Remove expired tasks; call periodically (the gateway does every 0.25 s).
        Raises StateWriteError (after ending every expired task) when a removal could
        not be saved: those stay, inert, and the next call tries again."""
        t = time.time() if now is None else now
        gone = [task for task in self._by_id.values() if task.expired(t)]
        failed: StateWriteError | None = None
        for task in gone:
            try:
                self._remove(task)
            except StateWriteError as e:
                failed = e
                self._ended(task)
        if failed is not None:
            raise failed
        return gone

    def _end(self, task: Task) -> None:
        """An expired task: removed if the save works; else its listeners still run
        (once: its flows close) and the record stays until a later save works."""
        try:
            self._remove(task)
        except StateWriteError:
            self._ended(task)

    def _ended(self, task: Task) -> None:
        if task.task_id not in self._ended_unsaved:
            self._ended_unsaved.add(task.task_id)
            self._notify(task)

    def _remove(self, task: Task) -> None:
        rest = [t for t in self._by_id.values() if t.task_id != task.task_id]
        self._save(rest)  # StateWriteError: nothing changed
        self._by_id.pop(task.task_id, None)
        if self._by_addr.get(task.address) is task:
            del self._by_addr[task.address]
        if task.task_id in self._ended_unsaved:
            self._ended_unsaved.discard(task.task_id)  # its listeners ran already
        else:
            self._notify(task)

    def _notify(self, task: Task) -> None:
        for fn in (*self._on_removed, *self._on_removed_last):
            fn(task)

    # -- persistence -----------------------------------------------------------------
    def _load(self) -> None:
        assert self.state_file is not None
        try:
            data = json.loads(self.state_file.read_text())
            tasks = [Task.from_dict(d) for d in data["tasks"]]
        except (OSError, ValueError, KeyError, TypeError, RegistryError) as e:
            raise RegistryError(f"unreadable registry state {self.state_file}: {e}") from None
        now = time.time()
        for task in tasks:
            if not task.expired(now):
                self._by_id[task.task_id] = task
                self._by_addr[task.address] = task

    def _save(self, tasks: Iterable[Task]) -> None:
        """Write `tasks` as the whole state, or raise StateWriteError (old file intact)."""
        if self.state_file is None:
            return
        body = json.dumps({"tasks": [asdict(t) for t in tasks]})
        try:
            write_atomically(self.state_file, body, ".registry.")
        except OSError as e:
            raise StateWriteError(self.state_file, e) from None


def write_atomically(path: Path, body: str, prefix: str) -> None:
    """Write-then-rename so a crash or a full disk never leaves a torn file; 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix)
    try:
        with os.fdopen(fd, "w") as fh:  # ENOSPC shows at the write or the close
            fh.write(body)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
