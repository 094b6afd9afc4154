"""pydantic-ai (``pydantic-ai-slim[openai]``, pinned in the ``test`` extra; ``OpenAIChatModel``
over ``OpenAIProvider``) against the live server on the real model, T = 0: an agent with an
``output_type`` (pydantic-ai's default tool output, and ``NativeOutput``: a ``json_schema``
response format), and an agent with a tool that completes a round trip to a text answer."""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput, RunContext
from pydantic_ai.messages import ModelResponse, ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.gateway.clients.weather import DESCRIPTION, MODEL, QUESTION, weather_report
from tests.support.wire import Wire

pytestmark = pytest.mark.model

SETTINGS = {"temperature": 0, "max_tokens": 64}


def chat_model(live, wire: Wire) -> OpenAIChatModel:
    client = AsyncOpenAI(base_url=live.base_url + "/v1", api_key=live.key, http_client=wire.async_client(),
                         max_retries=0)
    return OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client))


class CityFacts(BaseModel):
    city: Annotated[str, Field(max_length=30)]
    country: Annotated[str, Field(max_length=30)]


@pytest.mark.parametrize("output", ["tool", "native"])
async def test_output_type_agent_returns_the_model(live_server, output):
    """``output_type=CityFacts``: by default pydantic-ai asks for a call of its
    ``final_result`` tool (``tool_choice: "required"``); ``NativeOutput`` sends a strict
    ``json_schema`` response format. Either way the run's output is the pydantic model, and
    it is what the model wrote."""
    wire = Wire()
    agent = Agent(chat_model(live_server, wire), output_type=CityFacts if output == "tool" else NativeOutput(CityFacts),
                  model_settings=SETTINGS)
    result = await agent.run("Tell me about Paris.")
    print(result.output, wire.requests, sep="\n")
    assert isinstance(result.output, CityFacts) and result.output.city.strip()
    (sent,), (reply,) = wire.requests, wire.responses
    message = reply["choices"][0]["message"]
    if output == "tool":
        (tool,) = sent["tools"]
        assert sent["tool_choice"] == "required" and "response_format" not in sent
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == tool["function"]["name"] and reply["choices"][0]["finish_reason"] == "tool_calls"
        written = call["function"]["arguments"]
    else:
        assert sent["response_format"]["type"] == "json_schema" and sent["response_format"]["json_schema"]["strict"]
        assert "tools" not in sent and reply["choices"][0]["finish_reason"] == "stop"
        written = message["content"]
    assert CityFacts.model_validate_json(written) == result.output


async def test_agent_with_a_tool_completes_a_round_trip(live_server):
    """The first step forces a call of the tool (``tool_choice=["get_weather"]`` from a
    per-step settings callable: pydantic-ai refuses a static ``"required"``), the second is
    free: the tool's result goes back as a ``tool`` message and the answer is text."""
    wire = Wire()
    cities: list[str] = []

    def settings(ctx: RunContext) -> dict:
        return {**SETTINGS, "tool_choice": ["get_weather"] if ctx.run_step <= 1 else "auto"}

    agent = Agent(chat_model(live_server, wire), model_settings=settings)

    @agent.tool_plain(description=DESCRIPTION)
    def get_weather(city: str) -> str:
        cities.append(city)
        return weather_report(city)

    result = await agent.run(QUESTION)
    messages = result.all_messages()
    print(messages, wire.requests, sep="\n")

    calls = [p for m in messages if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart)]
    (call,) = calls
    first, second = wire.requests
    jsonschema.validate(call.args_as_dict(), first["tools"][0]["function"]["parameters"])
    assert call.tool_name == "get_weather" and cities == [call.args_as_dict()["city"]] and cities[0].strip()
    (returned,) = [p for m in messages for p in getattr(m, "parts", ()) if isinstance(p, ToolReturnPart)]
    report = weather_report(cities[0])
    assert returned.content == report and returned.tool_call_id == call.tool_call_id

    assert first["tool_choice"] == "required"  # pydantic-ai sends a list that names every tool as "required"
    assert second["tool_choice"] == "auto"
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": call.tool_call_id, "content": report}
    assert report not in json.dumps(first)
    assert isinstance(result.output, str) and result.output.strip() and "<tool_call" not in result.output
    assert wire.finish_reasons() == ["tool_calls", "stop"]
