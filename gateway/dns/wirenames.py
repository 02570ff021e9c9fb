"""dnslib's message parser with a bound on what one name may cost. Pure, no sockets.

dnslib decodes a compressed name by recursing once per pointer and copying the labels
found so far at every level, so a name behind a chain of ~1,000 pointers costs a million
label copies (and the stack), and every record of a message may name such a chain:
hostile queries that stall the event loop every task's DNS shares. Here a name is read
in a loop, follows at most MAX_POINTERS pointers and holds at most MAX_LABELS labels
(a legal name has at most 127 of either), so each name costs O(MAX_LABELS) whatever the
message holds; pointers must point backwards, as in dnslib.
"""

from __future__ import annotations

from dnslib import RR, DNSHeader, DNSLabel, DNSQuestion, DNSRecord
from dnslib.buffer import BufferError as DnsBufferError
from dnslib.label import DNSBuffer

MAX_POINTERS = 127
MAX_LABELS = 255  # longer-than-legal names still parse, to be refused by name (too long)


class BoundedNameBuffer(DNSBuffer):
    """A DNSBuffer whose `decode_name` is linear and bounded (see the module docstring);
    otherwise dnslib's rules: labels must be UTF-8, a pointer must point backwards."""

    def decode_name(self, last: int = -1) -> DNSLabel:
        data = self.data
        pos = self.offset
        resume: int | None = None  # where the message goes on after the name
        labels: list[bytes] = []
        pointers = 0
        while True:
            if pos >= len(data):
                raise DnsBufferError("name runs past the message")
            length = data[pos]
            if length & 0xC0 == 0xC0:
                if pos + 2 > len(data):
                    raise DnsBufferError("truncated pointer")
                pointer = ((length & 0x3F) << 8) | data[pos + 1]
                pointers += 1
                if pointer >= pos or pointers > MAX_POINTERS:
                    raise DnsBufferError("forward, looping or over-long pointer chain")
                if resume is None:
                    resume = pos + 2
                pos = pointer
                continue
            if length == 0:
                break
            label = bytes(data[pos + 1 : pos + 1 + length])
            if len(label) != length or len(labels) >= MAX_LABELS:
                raise DnsBufferError("truncated label or too many labels")
            try:
                label.decode()
            except UnicodeDecodeError:
                raise DnsBufferError("label is not UTF-8") from None
            labels.append(label)
            pos += 1 + length
        self.offset = resume if resume is not None else pos + 1
        return DNSLabel(labels)


def parse_message(data: bytes, max_records: int) -> tuple[DNSRecord, int]:
    """(message, question count) with bounded names. The whole message when its shape
    is a query's (one question, at most `max_records` other records), else the header
    and first question only, enough for the FORMERR a second question gets. ValueError
    for one question with more records; dnslib's errors for anything unparseable."""
    buf = BoundedNameBuffer(data)
    h = DNSHeader.parse(buf)
    qdcount = int(h.q)  # DNSRecord() below resets the header's counts to what it holds
    if qdcount != 1:
        questions = [DNSQuestion.parse(buf)] if qdcount else []
        return DNSRecord(h, questions), qdcount
    if h.a + h.auth + h.ar > max_records:
        raise ValueError("too many records for a query")
    question = DNSQuestion.parse(buf)
    rr, auth, ar = ([RR.parse(buf) for _ in range(n)] for n in (h.a, h.auth, h.ar))
    return DNSRecord(h, [question], rr, auth=auth, ar=ar), 1
