"""`python -m stockade.testing.testnet`: start a fake internet by hand and keep it up until
Ctrl-C / SIGTERM (for exploring, benches and manual demos)."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading

from stockade.testing.testnet.host import TestnetError
from stockade.testing.testnet.internet import DEFAULT_API_KEY, FakeInternet
from stockade.testing.testnet.layout import DEFAULT_SUBNET


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stockade.testing.testnet", description=__doc__)
    parser.add_argument("--subnet", default=DEFAULT_SUBNET,
                        help="IPv4 subnet to use (a free one is picked if taken)")
    parser.add_argument("--api-key", default=DEFAULT_API_KEY, help="key api.test accepts")
    parser.add_argument("--print-only", action="store_true",
                        help="start, print the attributes as JSON, stop")
    args = parser.parse_args(argv)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        with FakeInternet(args.subnet, api_key=args.api_key) as fi:
            print(json.dumps({
                "namespace": fi.namespace, "subnet": fi.subnet, "host_ip": fi.host_ip,
                "dns_server": fi.dns_server, "addresses": fi.addresses,
                "ipv6.test": fi.ipv6_address, "tcp_echo": fi.tcp_echo,
                "udp_echo": fi.udp_echo, "ca_pem": fi.ca_pem,
            }, indent=2), flush=True)
            if not args.print_only:
                with contextlib.suppress(KeyboardInterrupt):
                    done.wait()
    except TestnetError as e:
        print(f"stockade.testing.testnet: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
