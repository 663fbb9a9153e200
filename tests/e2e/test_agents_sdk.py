"""The OpenAI Agents SDK (``openai-agents``) against a real ``structllm run`` (default
model) through ``OpenAIResponsesModel``: a one-tool agent runs to its final output, the
tool is called, and its output goes back to the model (tracing off: nothing leaves the
machine)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import agents  # openai-agents, from the `test` extra
import anyio
import openai
import pytest

from tests.support.server import Server

pytestmark = pytest.mark.slow

# the answering turn: one short sentence (see AnswerAfterTheTool)
ANSWER = r"[A-Za-z0-9 ,]{1,40}\."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    with Server("--max-model-len", "2048", "--responses-store", str(store)) as s:
        yield s
        assert s.stop() == 0


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_one_tool_agent_runs_to_completion(server: Server, stream: bool) -> None:
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 18 degrees and sunny in {city}."

    async def main() -> tuple[object, list[object]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model_name = (await client.models.list()).data[0].id

        class AnswerAfterTheTool(agents.RunHooks):  # type: ignore[misc]
            async def on_tool_end(
                self, context: object, agent: object, tool: object, out: object
            ) -> None:
                # once the tool has answered, the next turn writes text (a 135M model asked
                # with "auto" tends to call the tool again), one short sentence: greedy
                # text from a 135M model need not reach its end token within
                # max_tokens, and the streamed runner fails an incomplete response
                agent.model_settings = dataclasses.replace(  # type: ignore[attr-defined]
                    agent.model_settings,
                    tool_choice="none",  # type: ignore[attr-defined]
                    extra_body={"structured_outputs": {"regex": ANSWER}},
                )

        agent = agents.Agent(
            name="weather",
            instructions="You answer questions about the weather using your tool.",
            model=agents.OpenAIResponsesModel(model=model_name, openai_client=client),
            # the first turn must call the tool (a 135M model may not choose to)
            model_settings=agents.ModelSettings(
                tool_choice="required", temperature=0, max_tokens=80
            ),
            tools=[get_weather],
            reset_tool_choice=False,
        )
        ask = "What is the weather in Paris?"
        if stream:  # the SDK's streamed path reads our events
            result = agents.Runner.run_streamed(agent, ask, max_turns=4, hooks=AnswerAfterTheTool())
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, ask, max_turns=4, hooks=AnswerAfterTheTool())
        last = result.raw_responses[-1].response_id
        assert last is not None
        items = [i async for i in client.responses.input_items.list(last, order="asc")]
        await client.close()
        return result, items

    result, items = anyio.run(main)
    assert calls, "the tool was not called"
    outputs = [i for i in result.new_items if isinstance(i, agents.ToolCallOutputItem)]  # type: ignore[attr-defined]
    assert outputs and "18 degrees" in str(outputs[0].output)
    assert isinstance(result.final_output, str)  # type: ignore[attr-defined]
    assert re.fullmatch(ANSWER, result.final_output)  # type: ignore[attr-defined]
    # the answering turn was generated from the tool's output
    sent = [i for i in items if i.type == "function_call_output"]  # type: ignore[attr-defined]
    assert sent and "18 degrees" in sent[0].output  # type: ignore[attr-defined]
