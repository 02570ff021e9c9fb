"""Stable reason codes carried by every verdict and every denial event.

These strings are an interface: SOC dashboards, sandboxed clients (the X-Stockade-Deny
header) and policy tests match on them. Add codes; never rename or reuse one.
"""

from enum import StrEnum


class Reason(StrEnum):
    # allow
    ALLOWED_BY_RULE = "allowed_by_rule"
    # policy decisions
    NO_MATCHING_RULE = "no_matching_rule"
    DENIED_BY_RULE = "denied_by_rule"
    PORT_NOT_ALLOWED = "port_not_allowed"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    PATH_NOT_ALLOWED = "path_not_allowed"
    INSPECTION_UNAVAILABLE = "inspection_unavailable"
    UNKNOWN_TASK = "unknown_task"
    # a warm-pool sandbox no task has claimed yet: everything from it is denied
    UNCLAIMED = "unclaimed"
    UNKNOWN_PROFILE = "unknown_profile"
    INVALID_HOST = "invalid_host"
    # the gateway's own checks
    ADDRESS_FORBIDDEN = "address_forbidden"
    DESTINATION_MISMATCH = "destination_mismatch"
    SNI_MISSING = "sni_missing"
    ECH_PRESENT = "ech_present"
    PROTOCOL_UNRECOGNISED = "protocol_unrecognised"
    SNIFF_TIMEOUT = "sniff_timeout"
    HEAD_TOO_LARGE = "head_too_large"
    RESOLVE_FAILED = "resolve_failed"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    CONNECTION_LIMIT = "connection_limit"
    UPLOAD_LIMIT = "upload_limit"
    # the flow went to the L7 inspector; each request has its own request_decision event
    INSPECTED = "inspected"
    TASK_ENDED = "task_ended"
    # DNS firewall
    QTYPE_REFUSED = "qtype_refused"
    NAME_TOO_LONG = "name_too_long"
    LABEL_TOO_LONG = "label_too_long"
    HIGH_ENTROPY_LABEL = "high_entropy_label"
    QUERY_RATE_EXCEEDED = "query_rate_exceeded"
    UNRESOLVABLE_NAME_BUDGET = "unresolvable_name_budget"
    # distinct names / name bytes / encoded-looking names under wildcard entries (DNS, TCP)
    NAME_BUDGET_EXCEEDED = "name_budget_exceeded"
    MALFORMED_QUERY = "malformed_query"
    # broker
    API_NOT_ALLOWED = "api_not_allowed"
    OPERATION_NOT_ALLOWED = "operation_not_allowed"
    RATE_LIMITED = "rate_limited"
    BUDGET_EXHAUSTED = "budget_exhausted"
    BODY_TOO_LARGE = "body_too_large"
    BAD_REQUEST = "bad_request"
    VAULT_UNAVAILABLE = "vault_unavailable"
    UPSTREAM_ERROR = "upstream_error"
    INTERNAL_ERROR = "internal_error"
    SECRET_ECHO = "secret_echo"  # noqa: S105 - a reason code, not a secret
    REQUEST_TIMEOUT = "request_timeout"
    CONCURRENCY_LIMIT = "concurrency_limit"
    BODY_MEMORY_LIMIT = "body_memory_limit"
    # launcher
    BYPASS_ATTEMPT = "bypass_attempt"
    EXPORT_REFUSED = "export_refused"
    TTL_EXPIRED = "ttl_expired"
    RESOURCE_LIMIT = "resource_limit"
    # the fence self-test before a sandbox's command: a probe was not refused and logged
    FENCE_UNVERIFIED = "fence_unverified"
