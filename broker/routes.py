"""Who may call what: the caller's task and profile (`identify`), the grant for the call
(`authorize`, with `OperationCache`), and what a call needs of an API definition that
does not change between calls (`RouteTable`). No I/O."""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from stockade.policy.model import ApiDefinition, BrokerGrant, Profile
from stockade.policy.reasons import Reason

from stockade.tasks import Task, TaskRegistry

from .body import Reservation
from .denials import Denied
from .limits import InFlight
from .metrics import ApiMetrics, BrokerMetrics
from .request import CallRequest, RequestError, Upstream, parse_base_url

if TYPE_CHECKING:
    from .audit import CallLog

MAX_OPERATIONS = 1024


class AddressCheck(Protocol):
    """`stockade.net.addresses.AddressPolicy`: None = may dial, else the category."""

    def check(self, ip: Any) -> str | None: ...


@dataclass(frozen=True, slots=True)
class ApiRoute:
    """What a call needs of one API definition that does not change between calls:
    worked out once per definition (a reload brings new definition objects)."""

    api: ApiDefinition
    upstream: Upstream | None  # None: the base URL is unusable
    address_category: str | None  # an IP-literal host the address check refuses
    metrics: ApiMetrics


class RouteTable:
    def __init__(self, metrics: BrokerMetrics, address_policy: AddressCheck | None,
                 hosts: Mapping[str, Any]) -> None:
        self.metrics = metrics
        # IP-literal base URLs skip any resolver: check them here (same rules as names)
        self._address_policy = address_policy
        self._hosts = hosts  # `broker.hosts`: pinned names are the operator's choice
        self._routes: dict[str, ApiRoute] = {}

    def route(self, api: ApiDefinition) -> ApiRoute:
        r = self._routes.get(api.name)
        if r is None or r.api is not api:
            try:
                up: Upstream | None = parse_base_url(api)
            except RequestError:
                up = None
            category = self._literal_forbidden(up.host) if up is not None else None
            r = ApiRoute(api, up, category, self.metrics.api(api.name))
            self._routes[api.name] = r
        return r

    def clear(self) -> None:
        self._routes.clear()

    def _literal_forbidden(self, host: str) -> str | None:
        if self._address_policy is None or host in self._hosts:
            return None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return None  # a name: the checked resolver decides
        return self._address_policy.check(ip)


class OperationCache:
    """match_operation answers per (grant, method, path): pure, and a task repeats its
    calls; keyed by the grant object's id (a reload brings new ones), bounded."""

    def __init__(self) -> None:
        self._cache: OrderedDict[tuple[int, str, str], tuple[BrokerGrant, bool]] = (
            OrderedDict())

    def allowed(self, grant: BrokerGrant, method: str, path: str) -> bool:
        from stockade.policy import match_operation

        key = (id(grant), method, path)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is grant:  # same object, not a recycled id
            self._cache.move_to_end(key)
            return hit[1]
        ok = match_operation(grant, method, path)
        self._cache[key] = (grant, ok)
        if len(self._cache) > MAX_OPERATIONS:
            self._cache.popitem(last=False)
        return ok

    def clear(self) -> None:
        self._cache.clear()


def identify(cl: CallLog, registry: TaskRegistry,
             profiles: Mapping[str, Profile]) -> tuple[Task, Profile]:
    task = registry.by_address(cl.source_ip)
    if task is None:
        raise Denied(403, Reason.UNKNOWN_TASK, "caller address is not a registered task")
    cl.task = task
    if task.pooled:
        raise Denied(403, Reason.UNCLAIMED, "the caller is a warm-pool sandbox no task "
                     "has claimed")
    profile = profiles.get(task.profile)
    if profile is None:
        raise Denied(403, Reason.UNKNOWN_PROFILE, "the task's profile is not loaded")
    return task, profile


def authorize(
    apis: Mapping[str, ApiDefinition], profile: Profile, call: CallRequest,
    ops: OperationCache,
) -> tuple[ApiDefinition, BrokerGrant]:
    grant = profile.broker.get(call.api)
    api = apis.get(call.api)
    if grant is None or api is None:
        raise Denied(403, Reason.API_NOT_ALLOWED, "the task's profile does not grant this API")
    if not ops.allowed(grant, call.method, call.path):
        raise Denied(403, Reason.OPERATION_NOT_ALLOWED,
                     "the task's profile does not grant this method and path")
    if len(call.body) > grant.max_body_bytes:
        raise Denied(413, Reason.BODY_TOO_LARGE, "request body too large")
    return api, grant


@dataclass(slots=True)
class Admission:
    """A caller identified as a task, holding one of the task's in-flight slots (and,
    once its body is read, a share of the task's body budget) until its handler ends."""

    task: Task
    profile: Profile
    inflight: InFlight
    res: Reservation | None = None

    def release(self) -> None:
        self.inflight.release(self.task.task_id)
        if self.res is not None:
            self.res.release()


def admit_caller(cl: CallLog, registry: TaskRegistry, profiles: Mapping[str, Profile],
                 inflight: InFlight) -> Admission:
    """The caller's task and profile, and one of the task's
    `max_concurrent_calls_per_task` slots, held until the call's handler returns (body
    read, Vault, upstream, streamed answer)."""
    task, profile = identify(cl, registry, profiles)
    if not inflight.acquire(task.task_id):
        raise Denied(429, Reason.CONCURRENCY_LIMIT,
                     "too many calls of this task in flight", retry_after=1)
    return Admission(task, profile, inflight)
