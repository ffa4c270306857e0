"""Property-based fuzzing of every documented endpoint from /openapi.json: no 5xx, responses conform.

Drives schemathesis through hypothesis directly (its pytest plugin does not
support this pytest version).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from kvtier.config import ServerConfig
from kvtier.server.app import create_app
from tests.server.fakes import FakeEngine, HFTokenizer

MODEL = "smollm2-135m"
# Examples per operation: enough to hit type and range edges, short enough for CPU CI.
EXAMPLES_PER_OPERATION = 30
HOST = {"host": "127.0.0.1"}


@pytest.fixture(scope="module")
def api_schema(tokenizer_dir):
    engine = FakeEngine(HFTokenizer.load(tokenizer_dir), max_model_len=512)
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(engine, ServerConfig()), headers=HOST)


def _fix_model(case) -> None:
    """Mostly the served model, so generation gets past the 404 and into the engine path."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and len(str(case.body)) % 5:
        case.body["model"] = MODEL


@pytest.mark.timeout(600)
def test_no_server_errors_or_schema_violations(api_schema):
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/responses",
                                              "/v1/messages", "/v1/messages/count_tokens", "/v1/models"}
    statuses: dict[str, set[int]] = {}
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            _fix_model(case)
            # schema-valid bodies may still be semantic 4xx (unknown tool name, context overflow),
            # so "valid data must be accepted" does not apply; every other check does.
            response = case.call_and_validate(headers=HOST, excluded_checks=[positive_data_acceptance])
            assert response.status_code < 500, response.text
            statuses.setdefault(op.path, set()).add(response.status_code)
        run()
    assert 200 in statuses["/v1/chat/completions"] | statuses["/v1/messages"]


# The same fuzzing over HTTP against `kvtier serve` on the embedded model: fewer examples, and
# generation budgets clamped so every accepted request finishes in a few real tokens.
REAL_EXAMPLES_PER_OPERATION = 6
REAL_MAX_TOKENS = 4
# The budget field of each generating endpoint (absent = the rest of the context: minutes on CPU).
TOKEN_FIELD = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
               "/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}


def _clamp_tokens(case) -> None:
    field = TOKEN_FIELD.get(case.path)
    if field is None or not isinstance(case.body, dict):
        return
    case.body.pop("max_completion_tokens", None)
    value = case.body.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value > REAL_MAX_TOKENS:
        case.body[field] = REAL_MAX_TOKENS


@pytest.mark.timeout(300)
def test_real_server_no_server_errors(real_server):
    from tests.server.conftest import API_KEY
    auth = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(real_server.url + "/openapi.json")
    statuses: dict[str, set[int]] = {}
    for op in [r.ok() for r in schema.get_all_operations()]:
        @given(case=op.as_strategy())
        @settings(max_examples=REAL_EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        def run(case) -> None:
            _fix_model(case)
            _clamp_tokens(case)
            response = case.call_and_validate(base_url=real_server.url, headers=auth, timeout=60,
                                              excluded_checks=[positive_data_acceptance])
            assert response.status_code < 500, response.text
            statuses.setdefault(op.path, set()).add(response.status_code)
        run()
    assert 200 in statuses["/v1/chat/completions"] | statuses["/v1/messages"]
