"""OpenAI's Agents SDK (PyPI ``openai-agents``), unmodified, against a live server on
a tiny model with a tool-calling template: an agent with a function tool and an
``output_type`` calls the tool, then answers with the type, on chat completions and
on the Responses API.

An agent with both sends its tools beside a strict JSON schema response format on
every request, so the server must decode to a call or that format (``_with_calls``):
the scripted answers go through that grammar, which writes calls as the template
does and the final answer compactly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.result import RunResultBase
from mlx_lm.utils import load_tokenizer
from openai import AsyncOpenAI
from pydantic import BaseModel

from engine.server.bridge import ServerBridge
from tests.engine.server.conftest import Served, start_server
from tests.engine.server.tool_models import Turns, make_tool_model_dir

# The SDK would export its traces to OpenAI: nothing here may leave the machine.
set_tracing_disabled(True)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# As the format's grammar writes it: compact, the schema's field order.
ANSWER = '{"city":"Paris","sunny":true}'


class Forecast(BaseModel):
    city: str
    sunny: bool


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("agents-sdk")
    running, stop = start_server(make_tool_model_dir(root), root / "kv")
    yield running
    stop()


async def run_agent(served: Served, api: str,
                    stream: bool) -> tuple[RunResultBase, list[str], list[dict]]:
    """One run of the agent on ``api`` (its answers streamed or whole); its result,
    the cities its tool was asked about and the bodies of the requests the SDK sent."""
    asked: list[str] = []
    sent: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "Sunny, 24 degrees."

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
    client = AsyncOpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0,
                         http_client=http)
    model = (OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(
        model="tiny", openai_client=client)
    agent = Agent(name="Forecaster", instructions="Answer with the city's forecast.",
                  tools=[get_weather], output_type=Forecast, model=model,
                  model_settings=ModelSettings(max_tokens=120))
    config = RunConfig(tracing_disabled=True)
    try:
        if stream:
            result = Runner.run_streamed(agent, "Is it sunny in Paris?", run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, "Is it sunny in Paris?", run_config=config)
    finally:
        await client.close()
        await http.aclose()
    return result, asked, sent


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_an_agent_calls_its_tool_then_answers_with_its_output_type(
        agent_server: Served, api: str, stream: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    turns = Turns(load_tokenizer(Path(agent_server.bridge.info.path)), CALL, ANSWER)
    turns.install(monkeypatch, ServerBridge)
    result, asked, sent = asyncio.run(run_agent(agent_server, api, stream))
    assert asked == ["Paris"]
    assert result.final_output == Forecast(city="Paris", sunny=True)
    assert len(result.raw_responses) == 2 and len(sent) == 2
    # Both requests held the tool beside the output type's strict schema.
    for body in sent:
        assert [tool.get("name") or tool["function"]["name"]
                for tool in body["tools"]] == ["get_weather"]
        format_ = body["response_format"]["json_schema"] if api == "chat" \
            else body["text"]["format"]
        assert format_["strict"] is True
        assert format_["schema"]["required"] == ["city", "sunny"]
        assert body.get("stream", False) is stream
    # The tool's result reached the model's second turn.
    tool_turns = [m for m in turns.requests[-1] if m["role"] == "tool"]
    assert tool_turns and "Sunny, 24 degrees." in tool_turns[-1]["content"]
