"""Fuzzing the proxy in front of fast fake nodes, on a short budget: Schemathesis cases from its
/openapi.json (positive and negative) and the hostile bodies of tests/proxy/fuzzing.py; no 5xx,
no hang, every error an OpenAI error object, and a normal request still served correctly.
benchmarks/fuzz.py runs the same for longer."""

from __future__ import annotations

import httpx

from tests.proxy.conftest import MODEL_NAME
from tests.proxy.fuzzing import check_still_serving, fuzz_schema, send_hostile

# Fast fake nodes and a short context, so positive cases finish in milliseconds.
FAST_NODES = {"step_s": 0.001, "prefill_s": 0.001}
# A count of cases per mode, not a time: on a loaded 2-core machine a 16 s budget sent only 35
# positive cases. The budget only bounds a hang (half of it per mode).
CASES_PER_MODE = 70
BUDGET_S = 240.0


def test_openapi_describes_every_request_body(proxy):
    document = httpx.get(proxy.base_url + "/openapi.json", timeout=10).json()
    schemas = document["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/detokenize", "DetokenizeRequest")):
        body = document["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    # Unknown top-level fields: ignored by the completion endpoints (unless --strict-fields).
    assert schemas["DetokenizeRequest"]["additionalProperties"] is False
    assert "additionalProperties" not in schemas["CompletionRequest"]
    assert schemas["ResponseFormat"]["additionalProperties"] is False
    assert {"prompt", "max_tokens", "n", "logit_bias"} <= set(schemas["CompletionRequest"]["properties"])
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    tokenize = document["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(tokenize["anyOf"]) == 2
    assert "429" in document["paths"]["/v1/completions"]["post"]["responses"]


def test_fuzzed_and_hostile_requests_get_no_5xx_and_openai_errors(start_proxy):
    proxy = start_proxy(node=FAST_NODES, max_model_len=64)
    report = send_hostile(proxy.base_url, MODEL_NAME)
    fuzz_schema(proxy.base_url, MODEL_NAME, max_examples=CASES_PER_MODE, budget_s=BUDGET_S, report=report)
    problems = report.problems + check_still_serving(proxy.base_url, MODEL_NAME)
    assert not problems, "\n".join(problems[:20])
    table = report.by_status()
    print("fuzz answers by source and status:", table, "negative cases accepted:", report.accepted_negative)
    assert set(table) == {"hostile", "positive", "negative"}
    assert sum(table["positive"].values()) >= 50 and sum(table["negative"].values()) >= 50, table
    assert table["positive"].get("200", 0) >= 5, table  # some positive cases got all the way through
