"""Per-task event throttle: a flood from one sandbox becomes counts, not gigabytes.

Pure (no I/O, `now` is an argument); `EventWriter` runs every event through it.

- Per task and per key (component, action, decision, reason, destination domain or IP;
  ports are not part of the key, so a port scan of one host is one key) the first
  `verbatim_per_key` denied events pass verbatim; later ones are counted and come back as
  `event_summary` events, one per key and window of `window_s` (count, first and last
  time), from `due()` once the window has ended and from `end_task()`.
- A per-task budget (`task_events` events and `task_bytes` bytes written verbatim): once
  it is spent, every further event of the task (allowed ones too) is only counted.
  Allowed events are not throttled before that: they are the task's audit trail and a
  sandbox cannot produce them faster than the gateway admits flows.
- Memory is bounded: at most `keys_per_task` keys per task; later destinations share an
  overflow key per (component, action, decision, reason), at most OVERFLOW_KEYS of them,
  then one per component; at most `tasks` tasks (the oldest is ended, its summaries and
  totals emitted, to make room).
- `end_task()` also returns one `event_totals` event per component (events written and
  summarised, by decision and reason): every event offered is either written or counted
  in exactly one summary, so written + summarised equals what the component decided.

Events without a task id, and lifecycle, summary, totals and loss events, always pass;
so do the fence self-test's (their destination or question is a marker name,
probemark.py): up to PROBE_EVENTS of a task pass verbatim and spend none of its budget
or keys (they are in its totals), so a task's budget is the same with a self-test as
without one; past that they are ordinary events (a sandbox naming markers itself). The
probes whose events cannot name a marker (TLS without SNI and UDP to the raw address,
the query for an allowed name: probemark.py UNMARKED_PROBES) pass the same way once per
task and kind, within the self-test's window of the task's first event (`probes`): one
self-test sends each once, before the task runs any process, so a sandbox that mimics
them later finds the window closed or the allowance spent;
so do (charged to the task) events that carry a component's own count of refusals it did
not log one by one (`suppressed_events`, the name budgets' summaries).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stockade.net.addresses import is_ip_literal

from .build import make_event, timestamp
from .probemark import (
    NO_WINDOW,
    PROBES_PER_TASK,
    Kind,
    ProbeWindow,
    destination_address,
    is_marker,
    probe_kind,
    unmarked_probe_kind,
)

Event = dict[str, Any]
# (component, action, decision, reason, destination)
Key = tuple[str, str, str, str, str]

SUMMARY_ACTION = "event_summary"
TOTALS_ACTION = "event_totals"
LOST_ACTION = "events_lost"
# never throttled: the record of a task's life and of the throttle itself
EXEMPT_ACTIONS = frozenset(("sandbox_lifecycle", SUMMARY_ACTION, TOTALS_ACTION, LOST_ACTION))
OVERFLOW = "*"
OVERFLOW_KEYS = 16  # keys per task beyond keys_per_task, for (component, action, reason)
TOTALS_ROWS = 256  # (component, decision, reason) rows per task in the totals
PROBE_EVENTS = PROBES_PER_TASK  # a task's self-test events kept off its budget


@dataclass(frozen=True, slots=True)
class ThrottleSettings:
    verbatim_per_key: int = 20
    window_s: float = 60.0
    task_events: int = 2000
    task_bytes: int = 2 * 2**20
    keys_per_task: int = 64
    tasks: int = 4096
    probes: ProbeWindow = NO_WINDOW  # the unmarked probe events' targets and window


@dataclass(slots=True)
class _Window:
    count: int = 0
    first: float = 0.0
    last: float = 0.0
    budget: bool = False  # some of the count is there because the task budget was spent


@dataclass(slots=True)
class _KeyState:
    verbatim: int = 0
    window: _Window | None = None


@dataclass(slots=True)
class _TaskState:
    profile: str | None = None
    events: int = 0
    bytes: int = 0
    probes: int = 0  # self-test events passed off the budget
    first: float = 0.0  # when the task's first event came
    unmarked: set[Kind] = field(default_factory=set)  # UNMARKED_PROBES kinds passed
    keys: dict[Key, _KeyState] = field(default_factory=dict)
    # (component, decision, reason) -> [written, summarised]
    totals: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    next_due: float = float("inf")


def _get(ev: Event, a: str, b: str) -> Any:
    part = ev.get(a)
    return part.get(b) if isinstance(part, dict) else None


def task_of(ev: Event) -> str | None:
    t = _get(ev, "labels", "task_id")
    return t if isinstance(t, str) and t else None


def key_of(ev: Event) -> Key:
    # each part looked up once (not through _get): this runs for every event offered
    e, st, d = ev.get("event"), ev.get("stockade"), ev.get("destination")
    e = e if isinstance(e, dict) else _NONE
    st = st if isinstance(st, dict) else _NONE
    d = d if isinstance(d, dict) else _NONE
    return (
        str(st.get("component") or ""),
        str(e.get("action") or ""),
        str(st.get("decision") or "none"),
        str(e.get("reason") or ""),
        str(d.get("domain") or d.get("ip") or ""),
    )


_NONE: dict[str, Any] = {}  # a missing part (never written to)


class EventHead(NamedTuple):
    """What the throttle reads of an event (`head_of`), which a component knows before
    it builds the event: `EventThrottle.counts` decides on it alone."""

    task_id: str | None
    profile: str | None
    key: Key
    domain: str  # destination.domain ("" if none)
    address: str  # probemark.destination_address ("" if none)
    question: str = ""  # dns.question.name


def head_of(ev: Event) -> EventHead:
    question = _get(ev, "dns", "question")
    name = question.get("name") if isinstance(question, dict) else None
    profile = _get(ev, "labels", "profile")
    return EventHead(
        task_of(ev), profile if isinstance(profile, str) else None, key_of(ev),
        str(_get(ev, "destination", "domain") or ""), str(destination_address(ev) or ""),
        name if isinstance(name, str) else "")


def is_probe(ev: Event) -> bool:
    """An event of a fence self-test's probe: it names a marker."""
    question = _get(ev, "dns", "question")
    return is_marker(_get(ev, "destination", "domain")) or (
        isinstance(question, dict) and is_marker(question.get("name")))


def _carries_a_count(ev: Event) -> bool:
    """A component's own summary (the name budgets' `suppressed_events`): counted into
    ours it would become one tick and its count would be lost. Those components send at
    most one per entry, budget and interval, so passing them keeps the bound."""
    n = _get(ev, "stockade", "suppressed_events")
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


class EventThrottle:
    def __init__(self, settings: ThrottleSettings | None = None) -> None:
        self.s = settings or ThrottleSettings()
        self._tasks: OrderedDict[str, _TaskState] = OrderedDict()
        self._next_due = float("inf")
        self._evicted: list[Event] = []  # summaries/totals of tasks ended to make room

    @property
    def tracked_tasks(self) -> int:
        return len(self._tasks)

    def keys(self, task_id: str) -> int:
        t = self._tasks.get(task_id)
        return len(t.keys) if t else 0

    def _task(self, task_id: str, profile: str | None, now: float) -> _TaskState:
        t = self._tasks.get(task_id)
        if t is None:
            while len(self._tasks) >= self.s.tasks:
                oldest = next(iter(self._tasks))
                self._evicted += self.end_task(oldest, now)
            t = self._tasks[task_id] = _TaskState(profile=profile, first=now)
        return t

    def _slot(self, t: _TaskState, k: Key) -> Key:
        """The key `k` is counted under (looked up, not created)."""
        if k in t.keys or len(t.keys) < self.s.keys_per_task:
            return k
        # past the cap, destinations share a key (reason codes are a small set); past
        # OVERFLOW_KEYS more, everything of the component does
        if len(t.keys) < self.s.keys_per_task + OVERFLOW_KEYS:
            return (*k[:4], OVERFLOW)
        return (k[0], OVERFLOW, OVERFLOW, OVERFLOW, OVERFLOW)

    def _key(self, t: _TaskState, k: Key) -> _KeyState:
        slot = self._slot(t, k)
        ks = t.keys.get(slot)
        if ks is None:
            ks = t.keys[slot] = _KeyState()
        return ks

    def offer(self, ev: Event, size: int, now: float) -> bool:
        """True: write `ev` verbatim (and its `size` bytes are charged to its task);
        False: it was counted into a summary."""
        task_id = task_of(ev)
        if task_id is None:
            return True
        k = key_of(ev)  # once: every check and count below reads it
        if k[1] in EXEMPT_ACTIONS:
            return True
        t = self._task(task_id, _get(ev, "labels", "profile"), now)
        if t.probes < PROBE_EVENTS and self._probe(t, ev, now):
            t.probes += 1
            self._charge(t, k, size, written=True, spend=False)
            return True
        over = t.events >= self.s.task_events or t.bytes + size > self.s.task_bytes
        if (not over and k[2] != "denied") or _carries_a_count(ev):
            self._charge(t, k, size, written=True)
            return True
        ks = self._key(t, k)
        if not over and ks.verbatim < self.s.verbatim_per_key:
            ks.verbatim += 1
            self._charge(t, k, size, written=True)
            return True
        self._count(t, ks, k, now, budget=over)
        return False

    def counts(self, head: EventHead, now: float) -> bool:
        """True: `offer` would only count an event with this head, whatever its size
        (its task's budget is spent, or its key is past `verbatim_per_key` with a window
        the budget already marked), and it has been counted as `offer` would count it:
        the caller need not build the event. False: nothing changed; build it and
        `offer` it. Only for events that carry no count of their own (`suppressed_events`)."""
        k = head.key
        t = self._tasks.get(head.task_id) if head.task_id is not None else None
        if t is None or k[1] in EXEMPT_ACTIONS:
            return False  # passes, or the task's first event: offer decides
        # a line is at least its newline: with the bytes spent, any size is over
        over = t.events >= self.s.task_events or t.bytes >= self.s.task_bytes
        if not over and k[2] != "denied":
            return False  # written, or over by its size: offer decides (first: cheapest)
        if t.probes < PROBE_EVENTS and self._may_be_probe(t, head, now):
            return False
        if over:
            self._count(t, self._key(t, k), k, now, budget=True)
            return True
        ks = t.keys.get(self._slot(t, k))
        # past verbatim, offer counts it with budget=over, which needs the size unless
        # the window is marked already
        if ks is None or ks.verbatim < self.s.verbatim_per_key or ks.window is None \
                or not ks.window.budget:
            return False
        self._count(t, ks, k, now, budget=True)
        return True

    def tally(self, ev: Event, now: float) -> None:
        """Count an event its component decided not to write (e.g. rate-limited DNS
        queries): it shows up in the task's summaries and totals only."""
        task_id = task_of(ev)
        if task_id is None:
            return
        t = self._task(task_id, _get(ev, "labels", "profile"), now)
        k = key_of(ev)
        self._count(t, self._key(t, k), k, now, budget=False)

    def _probe(self, t: _TaskState, ev: Event, now: float) -> bool:
        """`ev` is one of the task's self-test events: it names a marker, or it is the
        first of an unmarked probe's kind within the window."""
        if is_probe(ev):
            return True
        w = self.s.probes
        if now - t.first > w.window_s:
            return False
        kind = unmarked_probe_kind(ev, w.targets)
        if kind is None or kind in t.unmarked:
            return False
        t.unmarked.add(kind)
        return True

    def _may_be_probe(self, t: _TaskState, h: EventHead, now: float) -> bool:
        """`_probe` of the event `h` heads would be true (nothing is marked here)."""
        if is_marker(h.domain) or is_marker(h.question):
            return True
        w = self.s.probes
        if now - t.first > w.window_s:
            return False
        k = h.key
        kind = probe_kind((k[0], k[1], k[2]), h.domain, h.address, w.targets)
        return kind is not None and kind not in t.unmarked

    def _charge(self, t: _TaskState, k: Key, size: int, *, written: bool,
                spend: bool = True) -> None:
        if written and spend:
            t.events += 1
            t.bytes += size
        tk = (k[0], k[2], k[3])
        if tk not in t.totals and len(t.totals) >= TOTALS_ROWS:
            tk = (k[0], k[2], OVERFLOW)  # bounded even if reasons were not a small set
        row = t.totals.setdefault(tk, [0, 0])
        row[0 if written else 1] += 1

    def _count(self, t: _TaskState, ks: _KeyState, k: Key, now: float, *, budget: bool) -> None:
        w = ks.window
        if w is None:
            w = ks.window = _Window(first=now)
            due = now + self.s.window_s
            t.next_due = min(t.next_due, due)
            self._next_due = min(self._next_due, due)
        w.count += 1
        w.last = now
        w.budget = w.budget or budget
        self._charge(t, k, 0, written=False)

    def due(self, now: float) -> list[Event]:
        """Summaries of windows that have ended (cheap when none has)."""
        out, self._evicted = self._evicted, []
        if now < self._next_due:
            return out
        self._next_due = float("inf")
        for task_id, t in self._tasks.items():
            if now >= t.next_due:
                out += self._flush(task_id, t, now, force=False)
            self._next_due = min(self._next_due, t.next_due)
        return out

    def _flush(self, task_id: str, t: _TaskState, now: float, *, force: bool) -> list[Event]:
        out: list[Event] = []
        t.next_due = float("inf")
        for k, ks in t.keys.items():
            w = ks.window
            if w is None:
                continue
            if force or now >= w.first + self.s.window_s:
                out.append(self._summary(task_id, t, k, w))
                ks.window = None
            else:
                t.next_due = min(t.next_due, w.first + self.s.window_s)
        return out

    def _summary(self, task_id: str, t: _TaskState, k: Key, w: _Window) -> Event:
        component, action, decision, reason, dst = k
        if dst == OVERFLOW:  # an overflow key: any destination (and maybe any reason)
            dst = ""
            reason = "" if reason == OVERFLOW else reason
            action = "" if action == OVERFLOW else action
            decision = "" if decision == OVERFLOW else decision
        ip = dst if is_ip_literal(dst) else None
        return make_event(
            component=component,  # type: ignore[arg-type]
            action=SUMMARY_ACTION,
            decision=decision if decision in ("allowed", "denied") else None,  # type: ignore[arg-type]
            reason=reason or None,
            task_id=task_id,
            profile=t.profile,
            destination_ip=ip,
            destination_domain=None if ip else (dst or None),
            message=f"{w.count} more {action or 'events'} ({reason or decision}) not written"
                    " one by one",
            extra={"summary": {
                "action": action, "count": w.count,
                "first": timestamp(w.first), "last": timestamp(w.last),
                "window_s": self.s.window_s, "budget_exhausted": w.budget,
            }},
            now=w.last,
        )

    def end_task(self, task_id: str, now: float) -> list[Event]:
        """Pending summaries and one totals event per component; forgets the task."""
        t = self._tasks.pop(task_id, None)
        if t is None:
            return []
        out = self._flush(task_id, t, now, force=True)
        by_component: dict[str, list[dict[str, Any]]] = {}
        sums: dict[str, Counter[str]] = {}
        for (component, decision, reason), (written, summarised) in sorted(t.totals.items()):
            by_component.setdefault(component, []).append(
                {"decision": decision, "reason": reason, "written": written,
                 "summarised": summarised})
            c = sums.setdefault(component, Counter())
            c["written"] += written
            c["summarised"] += summarised
        for component, rows in by_component.items():
            out.append(make_event(
                component=component,  # type: ignore[arg-type]
                action=TOTALS_ACTION, task_id=task_id, profile=t.profile,
                message=f"event totals for the task ({component})",
                extra={"totals": {"written": sums[component]["written"],
                                  "summarised": sums[component]["summarised"],
                                  "bytes": t.bytes, "by": rows}},
                now=now,
            ))
        return out

    def flush_all(self, now: float) -> list[Event]:
        """Every pending summary (the writer is closing); tasks stay tracked."""
        out, self._evicted = self._evicted, []
        for task_id, t in self._tasks.items():
            out += self._flush(task_id, t, now, force=True)
        self._next_due = float("inf")
        return out
