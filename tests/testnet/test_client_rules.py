"""The client namespace's nft table, as text and as checked by the real `nft -c`."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from stockade.testing.testnet import ClientNamespace, nft_ruleset


def test_ruleset_redirects_and_rejects() -> None:
    text = nft_ruleset("stockade_t_x", "skcl-abc", "10.251.0.1", 15001, 15053, (8200,))
    assert "table inet stockade_t_x {" in text
    assert "type nat hook prerouting priority dstnat" in text
    assert 'iifname "skcl-abc" ip daddr 10.251.0.1 tcp dport { 8200 } return' in text
    assert "th dport 53 redirect to :15053" in text
    assert "meta l4proto tcp redirect to :15001" in text
    assert 'iifname "skcl-abc" reject' in text
    # the exemption comes before the catch-all redirect
    assert text.index("return") < text.index("redirect to :15001")


def test_ruleset_without_exemptions_has_no_return() -> None:
    text = nft_ruleset("stockade_t_y", "skcl-abc", "10.251.0.1", 15001, 15053)
    assert " return" not in text.split("chain input")[0]


@pytest.mark.netns
@pytest.mark.usefixtures("netns_available")
def test_ruleset_parses_with_real_nft() -> None:
    if shutil.which("nft") is None:
        pytest.skip("nft not installed")
    text = nft_ruleset("stockade_t_check", "skcl-abc", "10.251.0.1", 15001, 15053, (1, 2))
    proc = subprocess.run(["nft", "-c", "-f", "-"], input=text, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("suffix", ["", "UPPER", "a-b", "x" * 25, "semi;colon"])
def test_bad_suffix_rejected(suffix: str) -> None:
    with pytest.raises(ValueError):
        ClientNamespace(suffix, None, 1, 2)


def test_bad_port_rejected() -> None:
    with pytest.raises(ValueError):
        ClientNamespace("ok", None, 0, 53)
