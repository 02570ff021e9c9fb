"""Any JSON a caller posts to /v1/call is either a valid call or a 400 `bad_request`:
never an exception (a 500 with a stack trace in the log) and never a call off the API host."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from stockade.broker.metrics import BrokerMetrics
from stockade.broker.request import build_url, parse_base_url
from stockade.broker.server import Broker, Denied
from stockade.broker.settings import BrokerSettings
from stockade.policy.model import ApiDefinition, CredentialSource, Injection, Profile

from stockade.events import EventWriter
from stockade.tasks import TaskRegistry

API = ApiDefinition("gh", "https://api.example.test/v3", CredentialSource("secret", "p", "f"),
                    Injection("header", header="X-Api-Key"))


class _Rules:
    version = "test"
    profiles: dict[str, Profile] = {}
    apis = {"gh": API}


class _NoSecrets:
    async def get(self, cred: Any) -> Any:
        raise AssertionError("not reached")


BROKER = Broker(BrokerSettings(), _Rules(), _NoSecrets(), TaskRegistry(None), EventWriter(None),
                BrokerMetrics())
PROFILE = Profile("p", "d")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "api": st.sampled_from(["gh", "", "x"]) | json_values,
        "method": st.sampled_from(["GET", "post", "TRACE", "CONNECT"]) | json_values,
        "path": st.text(alphabet=st.sampled_from(list("/.%2fFeE5c\\:@?#a \r\n")), max_size=20)
        | json_values,
        "query": json_values,
        "headers": st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3)
        | json_values,
        "body": st.text(max_size=10) | json_values,
        "json": json_values,
        "extra": json_values,
    },
)
# mostly a valid call with a few fields replaced, so every field's check gets reached
docs = st.builds(lambda f: {"api": "gh", "method": "GET", "path": "/x", **f}, fields) | json_values


@settings(max_examples=700, deadline=None)
@given(doc=docs)
def test_call_doc_is_a_call_or_bad_request(doc: Any) -> None:
    try:
        call = BROKER._parse_call_doc(doc, PROFILE)
    except Denied as d:
        assert (d.status, d.reason) == (400, "bad_request")
        return
    url = build_url(parse_base_url(API), call.path, call.query)
    assert url.startswith("https://api.example.test/v3/")
    assert all(k.lower() not in ("host", "x-api-key", "authorization") for k, _ in call.headers)
