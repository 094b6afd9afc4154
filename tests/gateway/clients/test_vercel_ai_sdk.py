"""The Vercel AI SDK (``ai`` with ``@ai-sdk/openai``, pinned in ``node/package-lock.json``)
against the live server on the real model, T = 0: ``generateObject`` with a zod schema and
``streamText`` with a tool, run by ``node/vercel_ai_sdk.mjs`` (which prints its results and the
request bodies it sent as JSON).

Needs Node.js ≥ 20 and the packages installed (``npm ci`` in ``tests/gateway/clients/node``;
``.ci/run`` does it): skipped locally without them, a failure under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import jsonschema
import pytest

from tests.conftest import require_or_skip
from tests.gateway.clients.weather import MODEL, weather_report
from tests.support.polling import DEADLINE_S

pytestmark = pytest.mark.model

NODE_DIR = os.path.join(os.path.dirname(__file__), "node")


@pytest.fixture(scope="module")
def sdk_run(request) -> dict:
    """The script's JSON output against the live server (started only once Node is found)."""
    node = shutil.which("node")
    require_or_skip(node is not None and shutil.which("npm") is not None, "Node.js and npm (Debian packages nodejs, npm)")
    require_or_skip(os.path.isdir(os.path.join(NODE_DIR, "node_modules", "ai")),
                    "the Vercel AI SDK (`make install`, or `npm ci` in tests/gateway/clients/node)")
    live_server = request.getfixturevalue("live_server")
    env = {**os.environ, "OPENAI_BASE_URL": live_server.base_url + "/v1", "OPENAI_API_KEY": live_server.key,
           "MODEL": MODEL}
    r = subprocess.run([node, "vercel_ai_sdk.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True,
                       timeout=4 * DEADLINE_S)
    assert r.returncode == 0, f"node exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout)
    print(json.dumps(out, indent=1))
    return out


def test_generate_object_with_a_zod_schema(sdk_run):
    """The zod schema goes out as a strict ``json_schema`` response format in draft-07 (its
    ``z.tuple`` an array-valued ``items``, which the gateway reads as ``prefixItems``); the
    object the SDK parsed and validated is the model's reply, finish reason stop."""
    result, sent = sdk_run["object"], sdk_run["requests"][0]["body"]
    fmt = sent["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    schema = fmt["json_schema"]["schema"]
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["required"] == ["city", "country", "coordinates"] and schema["properties"]["city"]["maxLength"] == 30
    assert [t["type"] for t in schema["properties"]["coordinates"]["items"]] == ["integer", "integer"]
    jsonschema.validate(result["object"], schema)  # by draft-07's rules (its $schema)
    assert result["finishReason"] == "stop" and result["object"]["city"].strip()
    assert len(result["object"]["coordinates"]) == 2


def test_stream_text_with_a_tool_round_trip(sdk_run):
    """Step 1 (streamed, ``toolChoice: "required"``) calls the tool with input valid against
    the schema the SDK sent; the SDK runs it and step 2 (streamed, ``auto``) sends its result
    back as a ``tool`` message and streams a text answer, finish reason stop."""
    run = sdk_run["streamText"]
    assert run["errors"] == []
    _, first, second = (r["body"] for r in sdk_run["requests"])
    call_step, answer_step = run["steps"]
    (call,) = call_step["toolCalls"]
    (tool,) = first["tools"]
    assert call["toolName"] == tool["function"]["name"] == "get_weather" and call_step["finishReason"] == "tool-calls"
    jsonschema.validate(call["input"], tool["function"]["parameters"])
    assert run["toolInputs"] == [call["input"]] and call["input"]["city"].strip()  # the SDK ran the tool, once
    report = weather_report(call["input"]["city"])
    assert call_step["toolResults"] == [{"toolCallId": call["toolCallId"], "output": report}]

    assert first["stream"] is True and first["tool_choice"] == "required" and second["tool_choice"] == "auto"
    assert second["messages"][-2]["tool_calls"][0]["id"] == call["toolCallId"]
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": call["toolCallId"], "content": report}
    assert report not in json.dumps(first)

    assert answer_step["toolCalls"] == [] and answer_step["finishReason"] == "stop"
    assert run["text"] == answer_step["text"] and run["text"].strip() and "<tool_call" not in run["text"]
    assert run["finishReason"] == "stop" and run["textDeltas"] >= 2  # streamed, not one block
