"""Per-profile lookup tables, built once at load time so a decision costs O(labels).

Exact names are a dict; `*.suffix` patterns are a dict keyed by the suffix, probed once
per label of the request name; CIDRs are grouped by prefix length and probed once per
distinct length. None of this grows with the number of entries.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from dataclasses import dataclass, field

from .model import EgressEntry, Profile, Verdict
from .reasons import Reason

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(slots=True)
class EntryIndex:
    exact: dict[str, list[EgressEntry]] = field(default_factory=dict)
    suffix: dict[str, list[EgressEntry]] = field(default_factory=dict)
    # version -> [(prefix length, {network int >> host bits: entries})], longest first
    nets: dict[int, list[tuple[int, dict[int, list[EgressEntry]]]]] = field(default_factory=dict)

    @classmethod
    def build(cls, entries: tuple[EgressEntry, ...]) -> EntryIndex:
        idx = cls()
        tables: dict[int, dict[int, dict[int, list[EgressEntry]]]] = defaultdict(dict)
        for e in entries:
            if e.host is not None:
                if e.host.startswith("*."):
                    idx.suffix.setdefault(e.host[2:], []).append(e)
                else:
                    idx.exact.setdefault(e.host, []).append(e)
            elif e.cidr is not None:
                net = e.cidr
                bits = net.max_prefixlen - net.prefixlen
                table = tables[net.version].setdefault(net.prefixlen, {})
                table.setdefault(int(net.network_address) >> bits, []).append(e)
        for version, by_len in tables.items():
            idx.nets[version] = sorted(by_len.items(), reverse=True)
        return idx

    def by_name(self, name: str) -> list[EgressEntry]:
        """Entries whose pattern matches `name`, most specific first."""
        out = list(self.exact.get(name, ()))
        if self.suffix:
            dot = name.find(".")
            while dot != -1:
                hit = self.suffix.get(name[dot + 1 :])
                if hit:
                    out.extend(hit)
                dot = name.find(".", dot + 1)
        return out

    def by_ip(self, ip: IPAddress) -> list[EgressEntry]:
        """Entries whose CIDR holds `ip`, longest prefix first."""
        out: list[EgressEntry] = []
        groups = self.nets.get(ip.version)
        if not groups:
            return out
        value = int(ip)
        maxlen = ip.max_prefixlen
        for plen, table in groups:
            hit = table.get(value >> (maxlen - plen))
            if hit:
                out.extend(hit)
        return out


# denials report mode may let through; malformed input stays denied in any mode
REPORTABLE = frozenset(
    {
        Reason.NO_MATCHING_RULE,
        Reason.DENIED_BY_RULE,
        Reason.PORT_NOT_ALLOWED,
        Reason.METHOD_NOT_ALLOWED,
        Reason.PATH_NOT_ALLOWED,
        Reason.INSPECTION_UNAVAILABLE,
    }
)


@dataclass(slots=True)
class CompiledProfile:
    profile: Profile
    allow: EntryIndex
    deny: EntryIndex
    version: str = ""
    # Verdicts are immutable and few per profile (reason x entry); building a frozen
    # dataclass costs more than the whole lookup, so each is built once and reused.
    _verdicts: dict[tuple[bool, Reason, str | None, bool], Verdict] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def build(cls, profile: Profile, version: str = "") -> CompiledProfile:
        return cls(
            profile, EntryIndex.build(profile.allow), EntryIndex.build(profile.deny), version
        )

    def verdict(
        self,
        allowed: bool,
        reason: Reason,
        entry: EgressEntry | None = None,
        needs_inspection: bool = False,
    ) -> Verdict:
        key = (allowed, reason, entry.id if entry is not None else None, needs_inspection)
        v = self._verdicts.get(key)
        if v is None:
            report = not allowed and self.profile.mode == "report" and reason in REPORTABLE
            v = Verdict(
                allowed=allowed or report,
                reason=reason,
                policy_version=self.version,
                rule_id=entry.id if entry else None,
                entry_reason=entry.reason if entry else None,
                report_only=report,
                needs_inspection=needs_inspection,
            )
            if len(self._verdicts) < 100_000:  # bounded: keys come from the rule set
                self._verdicts[key] = v
        return v
