"""L7 inspection of TLS flows: a compatibility shim until the redesign's last step.

The hand-off metadata lives in `gateway/inspector/handoff.py`, the per-request decision
in `gateway/inspector/requests.py`, the CA helpers in `stockade.trust` (the launcher needs
them too); their names stay importable from here.
"""

from __future__ import annotations

from stockade.trust import (
    CA_BASENAME,
    SYSTEM_BUNDLES,
    TRUST_ENV_VARS,
    ca_cert_file,
    ca_dir,
    ensure_ca,
    inspection_ca_cert,
    trust_bundle,
    trust_env,
)

from .inspector.handoff import (
    FLOW_HEADER,
    HEALTH_HOST,
    MAX_HEADER_VALUE,
    META_VERSION,
    FlowMeta,
    MetaError,
    connect_request,
    decode_meta,
    encode_meta,
)
from .inspector.requests import (
    InnerRequest,
    RequestDecision,
    decide_request,
    denial_body,
    request_syntax_error,
)

__all__ = [
    "CA_BASENAME",
    "FLOW_HEADER",
    "HEALTH_HOST",
    "MAX_HEADER_VALUE",
    "META_VERSION",
    "SYSTEM_BUNDLES",
    "TRUST_ENV_VARS",
    "FlowMeta",
    "InnerRequest",
    "MetaError",
    "RequestDecision",
    "ca_cert_file",
    "ca_dir",
    "connect_request",
    "decide_request",
    "decode_meta",
    "denial_body",
    "encode_meta",
    "ensure_ca",
    "inspection_ca_cert",
    "request_syntax_error",
    "trust_bundle",
    "trust_env",
]
