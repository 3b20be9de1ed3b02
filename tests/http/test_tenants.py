"""Keys, tenants and quotas over HTTP: the same keys as gRPC (Bearer or Anthropic's x-api-key), a tenant at its
cap refused with 429 naming the cap and when it lifts, an admin key refused 403, a bad key 401; a client's request
id scoped to its tenant."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from billing import commands
from services.inference.device.spec import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.http.conftest import STEP_S, post
from tests.inference.harness import ServerThread
from tests.inference.test_quotas import set_policy


@pytest.fixture(scope="module")
def server(llama_dir):
    executor = ExecutorConfig(max_batch=4, max_seq_len=256)
    config = ServeConfig(str(llama_dir), port=0, http_port=0, executor=executor, policy_refresh_s=0.2)
    # a step floor keeps the long call of the request-id test in flight while its twin arrives: the tiny model
    # ends it at its end-of-sequence after about 20 tokens, which without a floor take under 30 ms
    s = ServerThread(config, step_floor_s=STEP_S)
    s.other_key = commands.create_tenant(s.config.ledger_url, "other")
    s.admin_key = commands.create_admin_key(s.config.ledger_url)
    s.start()
    yield s
    s.stop()


BODY = {"prompt": "def f(x):", "max_tokens": 2}


def test_past_its_calls_per_second_a_tenant_gets_429_naming_its_cap_and_when_it_lifts(server):
    set_policy(server, "acme", calls_per_s=1)
    try:
        replies = [post(server, "/v1/completions", BODY) for _ in range(4)]
        refused = [r for r in replies if r.status_code == 429]
        assert refused, "four calls in a row within one call per second"
        r = refused[0]
        assert r.json()["error"]["code"] == "QUOTA_EXCEEDED" and r.headers["x-quota-cap"] == "calls_per_s"
        assert r.headers["x-quota-limit"] == "1" and 0 < int(r.headers["retry-after-ms"]) <= 1000
        assert r.headers["retry-after"] == "1" and r.headers["x-should-retry"] == "true"
        assert post(server, "/v1/completions", BODY, key=server.other_key).status_code == 200  # no cap there
    finally:
        set_policy(server, "acme", calls_per_s=None)


def test_keys_are_the_same_as_grpcs_in_either_header(server):
    url = f"http://127.0.0.1:{server.replica.http_port}/v1/completions"
    assert httpx.post(url, json=BODY, headers={"x-api-key": server.key}).status_code == 200
    bad = httpx.post(url, json=BODY, headers={"authorization": "Bearer zq_not_a_key"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    missing = httpx.post(url, json=BODY)
    assert missing.status_code == 401 and missing.json()["error"]["param"] == "authorization"
    admin = post(server, "/v1/completions", BODY, key=server.admin_key)
    assert admin.status_code == 403 and admin.json()["error"]["type"] == "permission_error"


def test_a_request_id_is_the_tenants_own(server):
    """The same X-Request-Id in flight twice for one tenant is 409; another tenant's call with it runs."""
    long = {"prompt": "x", "max_tokens": 120}
    first = threading.Thread(target=post, args=(server, "/v1/completions", long), kwargs={"x_request_id": "same-1"})
    first.start()
    try:
        deadline = time.monotonic() + 10
        while not server.replica.service.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)
        again = post(server, "/v1/completions", BODY, x_request_id="same-1")
        assert again.status_code == 409 and again.json()["error"]["code"] == "REQUEST_ID_IN_USE"
        assert again.headers["x-should-retry"] == "false"
        other = post(server, "/v1/completions", BODY, key=server.other_key, x_request_id="same-1")
        assert other.status_code == 200 and other.headers["x-request-id"] == "same-1"
    finally:
        first.join()
