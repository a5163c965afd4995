"""Agent protocols through the stock ``openai`` client against a real ``phloem serve``.

The built-in model has random weights: every call or document that parses and validates here
does so because the grammar (``tool_choice`` / ``response_format``) forced it. The server is the
session-wide one (``conftest.server``).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from probe import next_token_logits
from pydantic import BaseModel, Field

from phloem.engine import CacheConfig, Engine
from phloem.runtime.builtin_model import trained_model_path
from phloem.runtime.default_model import RANDOM_MODEL_NAME
from phloem.sessions import Tokenizer

pytestmark = pytest.mark.slow  # the session's phloem serve process

MODEL = "phloem-tiny-qwen3.5"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"]}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"]}}},
]


@pytest.fixture
def oai(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def ask(text: str = "What is the weather?") -> Any:
    return [{"role": "system", "content": f"test {uuid.uuid4().hex}"}, {"role": "user", "content": text}]


def check_call(name: str, arguments: str) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


def test_required_tool_call_parses_validates_and_streams_the_same(oai: openai.OpenAI) -> None:
    messages = ask()
    kwargs: Any = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                       parallel_tool_calls=False, temperature=0, max_tokens=400)
    out = oai.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)

    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += d.id or ""
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [r for r in reasons if r] == ["tool_calls"]
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    streamed = (calls[0]["name"], json.loads(calls[0]["arguments"]))
    assert streamed == (call.function.name, json.loads(call.function.arguments))


def test_a_named_function_is_the_one_called(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model=MODEL, messages=ask("Add two numbers"), tools=TOOLS, temperature=0.8, seed=3, max_tokens=400,
        tool_choice={"type": "function", "function": {"name": "add"}})
    [call] = out.choices[0].message.tool_calls or []
    assert call.function.name == "add"
    check_call("add", call.function.arguments)


def test_a_forced_call_without_tools_or_of_an_unknown_tool_is_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tools"):
        oai.chat.completions.create(model=MODEL, messages=ask(), tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="no tool is named"):
        oai.chat.completions.create(model=MODEL, messages=ask(), tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        oai.chat.completions.create(model=MODEL, messages=ask(), response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=9)
    sunny: bool


def test_parse_returns_a_pydantic_object(oai: openai.OpenAI, server: Any) -> None:
    out = oai.chat.completions.parse(model=MODEL, messages=ask("JSON please"), response_format=Forecast,
                                     temperature=0, max_tokens=300)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and out.choices[0].finish_reason == "stop"

    # Any object: random weights would write one endless key, so a bias favours closing quotes
    # and braces (the grammar still decides which tokens may come).
    tokenizer = Tokenizer.from_pretrained(trained_model_path())
    bias = {str(t): 30 for t in tokenizer.encode('"') + tokenizer.encode("}")}
    json_object = oai.chat.completions.create(model=MODEL, messages=ask(), temperature=0, max_tokens=300,
                                              response_format={"type": "json_object"}, logit_bias=bias)
    assert isinstance(json.loads(json_object.choices[0].message.content or ""), dict)


def scrape(base_url: str, name: str) -> float:
    lines = httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith(name + " ")))


@pytest.fixture
def random_oai(random_server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{random_server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_n_choices_share_the_prompt_pages(random_oai: openai.OpenAI, random_server: Any) -> None:
    """Served by the random-weight model: the trained one is so sure of its next tokens that
    independent draws of a few tokens often coincide."""
    cached_before = scrape(random_server.base_url, "phloem_cached_tokens_total")
    out = random_oai.chat.completions.create(model=RANDOM_MODEL_NAME, messages=ask(), n=3, temperature=1.0,
                                             max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) > 1  # independent draws
    usage = out.usage
    assert usage is not None and usage.completion_tokens == 18
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 0
    # Each choice took all but the last prompt token from the one shared prefill.
    assert details.model_extra == {"shared_tokens": usage.prompt_tokens - 1}
    assert scrape(random_server.base_url, "phloem_cached_tokens_total") - cached_before == 3 * (usage.prompt_tokens - 1)

    messages = ask()

    def seeded() -> list[str | None]:
        out = random_oai.chat.completions.create(model=RANDOM_MODEL_NAME, messages=messages, n=2, temperature=1.0,
                                                 seed=11, max_tokens=6, extra_body={"ignore_eos": True})
        return [c.message.content for c in out.choices]

    choices = seeded()
    assert choices == seeded() and choices[0] != choices[1]  # choice i draws from seed + i

    streamed = list(random_oai.chat.completions.create(model=RANDOM_MODEL_NAME, messages=ask(), n=2, temperature=0,
                                                       max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
    text = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
    assert text[0] == text[1] and text[0]  # greedy: the same tokens from the shared prefix


@pytest.fixture(scope="module")
def engine(server: Any) -> Engine:
    """The served model, loaded again in this process: the reference for log-probabilities."""
    return Engine.from_pretrained(trained_model_path(), cache=CacheConfig(num_pages=64, num_state_slots=4))


def log_softmax_after(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """The engine's next-token log-probabilities after ``tokens`` (one fresh forward)."""
    return next_token_logits(engine, tokens).float().log_softmax(-1)


def test_logprobs_are_the_engines_log_softmax(oai: openai.OpenAI, engine: Engine, server: Any) -> None:
    messages = ask()
    out = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5,
                                      logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    tokenizer = Tokenizer.from_pretrained(trained_model_path())
    tokens = tokenizer.render_messages(messages, add_generation_prompt=True)
    for entry in content:
        expected = log_softmax_after(engine, tokens)
        top = expected.topk(5)
        chosen = int(top.indices[0])  # greedy
        assert entry.token == tokenizer.decode([chosen], skip_special_tokens=False)
        assert math.isclose(entry.logprob, float(expected[chosen]), abs_tol=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        tokens.append(chosen)

    prompt = tokenizer.encode(f"Once upon {uuid.uuid4().hex}")
    text = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0.7, seed=5, logprobs=2,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = text.choices[0]
    ids = choice.model_extra["token_ids"]  # type: ignore[index]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    for i, value in enumerate(choice.logprobs.token_logprobs):
        assert math.isclose(value, float(log_softmax_after(engine, prompt + ids[:i])[ids[i]]), abs_tol=1e-4)


def test_sampling_fields_are_accepted_and_unknown_ones_refused(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model=MODEL, messages=ask(), max_tokens=4, temperature=0.5, seed=1, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"5": -100}, metadata={"run": "x"}, store=False, user="u",
        service_tier="auto", stop=["zzz"], extra_body={"min_tokens": 4, "repetition_penalty": 1.2})
    assert out.usage is not None and out.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="no_such_field"):
        oai.chat.completions.create(model=MODEL, messages=ask(), extra_body={"no_such_field": 1})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model=MODEL, messages=ask(), top_logprobs=2)


def test_models_retrieve(oai: openai.OpenAI) -> None:
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_langchain_tool_round_trip(server: Any) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class AddArgs(BaseModel):
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    @tool(args_schema=AddArgs)
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused",  # type: ignore[arg-type]
                     temperature=0, max_tokens=200, max_retries=0)
    messages: list[Any] = [SystemMessage(f"test {uuid.uuid4().hex}"), HumanMessage("What is 2 + 3?")]
    reply = llm.bind_tools([add], tool_choice="add", parallel_tool_calls=False).invoke(messages)
    [call] = reply.tool_calls
    assert call["name"] == "add" and 0 <= call["args"]["a"] <= 99 and 0 <= call["args"]["b"] <= 99
    messages += [reply, add.invoke(call)]
    answer = llm.bind_tools([add], tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("stop", "length")
    # The same tools render the same system turn: the first request's prompt came from the cache.
    assert answer.usage_metadata is not None
    cached = answer.usage_metadata.get("input_token_details", {}).get("cache_read", 0)
    # All of the first prompt but its last token: the prompt-end checkpoint sits one token early.
    assert cached >= reply.usage_metadata["input_tokens"] - 1  # type: ignore[index]
