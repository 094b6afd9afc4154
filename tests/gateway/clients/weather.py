"""The question and the tool every client-library test gives its model (the node script
``node/vercel_ai_sdk.mjs`` writes the same report), and how a test reads the gateway's
request record of a reply."""

from __future__ import annotations

import httpx

from tests.support.polling import wait_until

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the weather in Paris?"
DESCRIPTION = "Get the current weather in a city."


def weather_report(city: str) -> str:
    """What ``get_weather(city)`` returns: a text the model cannot have seen before the call."""
    return f"The weather in {city} is sunny and 18 degrees."


def record(live, response_id: str) -> dict:
    """The gateway's request record of the reply ``response_id`` (polled until written)."""

    def fetch():
        r = httpx.get(f"{live.base_url}/v1/requests/{response_id}", headers=live.headers(), timeout=10)
        return r.json() if r.status_code == 200 and r.json()["status"] != "running" else None

    return wait_until(fetch, f"the request record of {response_id}")
