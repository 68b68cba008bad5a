"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis): whatever a client sends,
the server answers without a 5xx and without hanging. Bounded: a few dozen cases per operation."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from deploy.openai_api import api  # noqa: E402
from tests.deploy.test_openai_app import base_url, tide_home  # noqa: E402,F401 - the served app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

schema = schemathesis.openapi.from_dict(api.openapi())


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx_and_no_hang(case, base_url):  # noqa: F811 - the fixture
    response = case.call(base_url=base_url, headers={"Authorization": "Bearer sk-alpha"}, timeout=60)
    assert response.status_code < 500, f"{case.as_curl_command()}\n-> {response.status_code} {response.text[:500]}"
