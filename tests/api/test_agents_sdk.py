"""The OpenAI Agents SDK (``openai-agents``) runs a two-tool task against a real ``phloem serve``
(the session-wide ``server``) through the Responses API.

The built-in model has random weights, so the task is laid out for the grammar: each tool is
enabled only at its step (``is_enabled``), ``tool_choice="required"`` forces a call of the one
that is, and the run stops at the second tool (``StopAtTools``). The SDK's two modes run: the
whole history in each request, and ``auto_previous_response_id`` (the server holds the
conversation; the tools change between the steps, so it is rendered again as a new session).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, Literal

import pytest
from openai import AsyncOpenAI

if TYPE_CHECKING:  # the SDK is imported in the tests: 1.5 s that every collection would pay
    from agents import Agent, RunContextWrapper

pytestmark = pytest.mark.slow  # the session's phloem serve process

MODEL = "phloem-tiny-qwen3.5"


def weather_agent(client: AsyncOpenAI, calls: list[str]) -> Agent[Any]:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, StopAtTools, function_tool

    def step(name: str, after: str | None) -> Any:
        def enabled(ctx: RunContextWrapper[Any], agent: Agent[Any]) -> bool:
            return name not in calls and (after is None or after in calls)
        return enabled

    @function_tool(is_enabled=step("find_capital", None))
    def find_capital(country: Literal["France", "Norway"]) -> str:
        """The capital of a country."""
        calls.append("find_capital")
        return {"France": "Paris", "Norway": "Oslo"}[country]

    @function_tool(is_enabled=step("get_weather", "find_capital"))
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Today's weather in a city."""
        calls.append("get_weather")
        return f"sunny in {city}"

    return Agent(name="weather", instructions="Answer with the tools.", tools=[find_capital, get_weather],
                 model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                 model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                              temperature=0, max_tokens=200),
                 reset_tool_choice=False, tool_use_behavior=StopAtTools(stop_at_tool_names=["get_weather"]))


@pytest.mark.parametrize("server_side_history", [False, True], ids=["full-history", "previous-response-id"])
def test_an_agent_runs_a_two_tool_task(server: Any, server_side_history: bool) -> None:
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    async def run() -> tuple[Any, list[Any]]:
        async with AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
            result = await Runner.run(weather_agent(client, calls), "What is the weather in the capital of France?",
                                      auto_previous_response_id=server_side_history)
            second = result.raw_responses[-1].response_id
            return result, [item async for item in client.responses.input_items.list(second)]

    result, items = asyncio.run(run())
    assert calls == ["find_capital", "get_weather"]
    assert result.final_output in ("sunny in Paris", "sunny in Oslo")
    first, second = result.raw_responses
    [call] = first.output
    assert call.type == "function_call" and call.name == "find_capital"
    assert second.response_id != first.response_id and second.output[0].name == "get_weather"
    # The second request carried the first call's result (with its whole history or without).
    outputs = [(i.call_id, i.output) for i in items if i.type == "function_call_output"]
    capital = {"France": "Paris", "Norway": "Oslo"}[json.loads(call.arguments)["country"]]
    assert outputs == [(call.call_id, capital)]
