"""The OpenAI Agents SDK (``openai-agents``, pinned in the ``test`` extra) against the live
server on the real model: an agent with one function tool completes a tool round trip to a
final answer at T = 0.

The 135M model is weak, so the first turn forces a call (``ModelSettings(tool_choice="required")``);
the SDK's default ``reset_tool_choice=True`` drops it once the tool has been used, so the
second turn (``tool_use_behavior="run_llm_again"``, the default) answers in free text.
Each model class of the SDK is one entry of :data:`MODEL_CLASSES`; assertions are on the
SDK's run items, on the traffic (``tests/support/wire.py``) and on the gateway's request
records, none of which depends on the endpoint the class talks to.
"""

from __future__ import annotations

import json

import agents
import jsonschema
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from tests.gateway.clients.weather import DESCRIPTION, MODEL, QUESTION, record, weather_report
from tests.support.wire import Wire

pytestmark = pytest.mark.model

#: The SDK's model classes under test: /v1/chat/completions and /v1/responses (the SDK's default).
MODEL_CLASSES = [pytest.param(agents.OpenAIChatCompletionsModel, id="chat_completions"),
                 pytest.param(agents.OpenAIResponsesModel, id="responses")]


@pytest.mark.parametrize("model_class", MODEL_CLASSES)
async def test_agent_completes_a_tool_round_trip(live_server, model_class):
    cities: list[str] = []

    @agents.function_tool(description_override=DESCRIPTION)
    def get_weather(city: str) -> str:
        cities.append(city)
        return weather_report(city)

    wire = Wire()
    async with AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key=live_server.key,
                           http_client=wire.async_client(), max_retries=0) as client:
        agent = agents.Agent(
            name="weather", instructions="You are a helpful assistant.", tools=[get_weather],
            model=model_class(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64))
        result = await agents.Runner.run(agent, QUESTION, max_turns=3,
                                         run_config=agents.RunConfig(tracing_disabled=True))
    print(result.new_items, wire.requests, sep="\n")

    call, output, answer = result.new_items
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert call.raw_item.name == "get_weather"
    arguments = json.loads(call.raw_item.arguments)
    jsonschema.validate(arguments, get_weather.params_json_schema)
    assert cities == [arguments["city"]] and arguments["city"].strip()  # the SDK ran the tool, once
    report = weather_report(arguments["city"])
    assert output.output == report

    # Two model calls: the first forced a call; the second carried the tool's result and no
    # longer forced one (reset_tool_choice).
    first, second = wire.requests
    assert first["tool_choice"] == "required" and second.get("tool_choice") in (None, "auto")
    assert report not in json.dumps(first) and report in json.dumps(second)

    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert agents.ItemHelpers.text_message_output(answer) == result.final_output
    assert "<tool_call" not in result.final_output
    # Both replies ended at EOS, not at max_tokens (the gateway's records, whatever the endpoint).
    assert len(wire.responses) == 2
    records = [record(live_server, r["id"]) for r in wire.responses]
    assert [(r["status"], r["finish_reason"]) for r in records] == [("finished", "stop")] * 2



class Forecast(BaseModel):
    city: str = Field(max_length=30)
    sunny: bool


@pytest.mark.parametrize("model_class", MODEL_CLASSES)
async def test_agent_with_tools_and_an_output_type_gets_the_format(live_server, model_class):
    """An agent with a tool and an ``output_type`` sends the tools and a strict ``json_schema``
    response format together. With ``tool_choice="none"`` the reply is an instance of the
    format, which the SDK parses into the pydantic model. (Under ``auto`` the reply is calls or
    the format — tests/runtime/engine/test_tool_grammar.py; this 135M model, given the tool's
    result, calls the tool again every turn, so a full loop would only test the model.)"""
    wire = Wire()
    async with AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key=live_server.key,
                           http_client=wire.async_client(), max_retries=0) as client:
        agent = agents.Agent(
            name="weather", instructions="You are a helpful assistant.", output_type=Forecast,
            tools=[agents.function_tool(weather_report, name_override="get_weather", description_override=DESCRIPTION)],
            model=model_class(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="none", temperature=0, max_tokens=64))
        result = await agents.Runner.run(agent, QUESTION, max_turns=1,
                                         run_config=agents.RunConfig(tracing_disabled=True))
    print(result.new_items, wire.requests, sep="\n")
    (sent,), (got,) = wire.requests, wire.responses
    assert sent["tools"] and sent["tool_choice"] == "none"
    assert isinstance(result.final_output, Forecast) and result.final_output.city.strip()
    if model_class is agents.OpenAIResponsesModel:
        assert sent["text"]["format"]["type"] == "json_schema"
        (item,) = got["output"]
        assert item["type"] == "message"
        content = item["content"][0]["text"]
    else:
        assert sent["response_format"]["type"] == "json_schema"
        content = got["choices"][0]["message"]["content"]
    assert Forecast.model_validate_json(content) == result.final_output  # what the model wrote, parsed
