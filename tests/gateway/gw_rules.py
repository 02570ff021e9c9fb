"""Rule sets the gateway tests load (written into a temp dir, loaded by the real loader)."""

from __future__ import annotations

from pathlib import Path

WEB = """\
profile: web
description: gateway tests
limits: {egress_bytes: 1MiB}
egress:
  mode: enforce
  allow:
    - host: allowed.test
      ports: [443, 80, 8080]
      reason: the test upstream
    - host: pypi.test
      ports: [443]
      reason: package index
    - host: echo.test
      ports: [443, 80]
      reason: echo server
    - host: "*.wild.test"
      reason: wildcard
    - host: inspect.test
      reason: needs request inspection
      http: {methods: [GET]}
    - host: front.test
      ports: [443, 80]
      reason: a shared front-end (inspected only to hold Host to the SNI)
      host_must_match_sni: true
    - host: private.test
      ports: [443, 80]
      reason: resolves to a private address (trap)
    - host: metadata.test
      ports: [443, 80]
      reason: resolves to a metadata address (trap)
    - host: loopback.test
      ports: [443, 80]
      reason: resolves to loopback (trap)
    - host: mapped.test
      ports: [443, 80]
      reason: resolves to an IPv4-mapped address (trap)
    - host: nat64.test
      ports: [443, 80]
      reason: resolves to a NAT64 address embedding an allowed IPv4 (trap)
    - host: cgnat.test
      ports: [443, 80]
      reason: resolves to a CGNAT address (trap)
    - host: rebind.test
      ports: [443, 80]
      reason: rebinding trap
    - host: xn--bcher-kva.test
      ports: [443]
      reason: IDN name
    - cidr: {cidr}
      ports: [5432, 7000]
      reason: raw TCP to the fake internet database port
  deny:
    - host: bad.wild.test
      reason: denied subdomain
"""

REPORT = """\
profile: watch
description: report mode
egress:
  mode: report
  allow:
    - host: allowed.test
      ports: [443, 80]
      reason: the test upstream
"""

TINY = """\
profile: tiny
description: small upload budget
limits: {egress_bytes: 64KiB}
egress:
  allow:
    - host: allowed.test
      ports: [443, 80, 8080]
      reason: the test upstream
"""


def write_rules(root: Path, cidr: str = "10.250.0.0/24") -> Path:
    (root / "profiles").mkdir(parents=True, exist_ok=True)
    (root / "profiles" / "web.yaml").write_text(WEB.replace("{cidr}", cidr))
    (root / "profiles" / "watch.yaml").write_text(REPORT)
    (root / "profiles" / "tiny.yaml").write_text(TINY)
    return root
