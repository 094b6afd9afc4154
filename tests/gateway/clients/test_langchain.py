"""LangChain (``langchain-openai``'s ``ChatOpenAI`` over ``langchain-core``, pinned in the
``test`` extra) against the live server on the real model, T = 0: ``bind_tools`` with a
``ToolMessage`` round trip, and ``with_structured_output(method="json_schema")``."""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.gateway.clients.weather import DESCRIPTION, MODEL, QUESTION, weather_report
from tests.support.wire import Wire

pytestmark = pytest.mark.model


def chat_model(live, wire: Wire, max_tokens: int = 64) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=live.base_url + "/v1", api_key=live.key, temperature=0,
                      max_tokens=max_tokens, max_retries=0, http_client=wire.client())


@tool(description=DESCRIPTION)
def get_weather(city: str) -> str:
    return weather_report(city)


def test_bind_tools_round_trip_with_a_tool_message(live_server):
    """A named ``tool_choice`` gets a call whose args validate against the schema LangChain
    derived and sent; the tool's ``ToolMessage`` goes back with the call's id; the second
    turn (``auto``) is a text answer, finish_reason stop."""
    wire = Wire()
    llm = chat_model(live_server, wire)
    messages = [HumanMessage(QUESTION)]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    (call,) = ai.tool_calls
    sent_tool = wire.requests[0]["tools"][0]["function"]
    assert call["name"] == sent_tool["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], sent_tool["parameters"])
    assert call["args"]["city"].strip() and ai.response_metadata["finish_reason"] == "tool_calls"

    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    assert result.content == weather_report(call["args"]["city"])
    answer = llm.bind_tools([get_weather]).invoke([*messages, ai, result])
    print(ai, answer, sep="\n")

    assert isinstance(answer, AIMessage) and answer.tool_calls == [] and answer.content.strip()
    assert answer.response_metadata["finish_reason"] == "stop" and "<tool_call" not in answer.content
    first, second = wire.requests
    assert first["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "tool_choice" not in second
    assert second["messages"][-2]["tool_calls"][0]["id"] == call["id"]
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": call["id"], "content": result.content}
    assert wire.finish_reasons() == ["tool_calls", "stop"]


class CityFacts(BaseModel):
    city: Annotated[str, Field(max_length=30)]
    country: Annotated[str, Field(max_length=30)]


def test_with_structured_output_json_schema(live_server):
    """``method="json_schema"`` sends the model's schema as a strict ``json_schema``
    response format; the reply parses into the pydantic model."""
    wire = Wire()
    structured = chat_model(live_server, wire).with_structured_output(CityFacts, method="json_schema", include_raw=True)
    out = structured.invoke("Tell me about Paris as JSON.")
    print(out)
    assert out["parsing_error"] is None and isinstance(out["parsed"], CityFacts)
    assert out["parsed"] == CityFacts.model_validate_json(out["raw"].content) and out["parsed"].city.strip()
    (sent,) = wire.requests
    fmt = sent["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["required"] == ["city", "country"]
    assert wire.finish_reasons() == ["stop"]
    assert json.loads(wire.responses[0]["choices"][0]["message"]["content"]) == out["parsed"].model_dump()
