"""A session's tool calls: forced by the grammar, parsed into its turn, kept across a restart,
and answered by a ``role: tool`` message that continues from the cache."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from phloem.runtime import EngineClient
from phloem.sessions import (
    GenerateOptions, InvalidInput, ResponseFormat, SessionConfig, SessionInput, SessionManager,
    ToolChoice, Tokenizer, model_fingerprint,
)

OWNER = "key-tools"
ManagerFactory = Callable[..., AbstractAsyncContextManager[SessionManager]]
LOOKUP = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["id"]}
TOOLS = ({"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},)


@pytest.mark.slow  # a grammar-constrained tool call
def test_a_forced_call_is_a_turn_that_a_tool_result_continues(make_manager: ManagerFactory, tmp_path: Path) -> None:
    async def first_life(m: SessionManager) -> str:
        system = ({"role": "system", "content": f"run {uuid.uuid4().hex}"}, {"role": "user", "content": "find 7"})
        s = await m.create(OWNER, content=SessionInput(messages=system), tools=TOOLS)
        forced = GenerateOptions(max_tokens=200, temperature=0.0, tool_choice=ToolChoice("required"),
                                 parallel_tool_calls=False)
        result = await (await m.append(OWNER, s.session_id, None, forced)).result()
        assert result.finish_reason == "stop" and result.parsed is not None
        [call] = result.parsed.tool_calls
        assert call.name == "lookup" and result.parsed.content is None
        jsonschema.validate(json.loads(call.arguments), LOOKUP)
        assert m.turns(OWNER, s.session_id)[-1].tool_calls == (call,)
        return s.session_id

    async def second_life(m: SessionManager) -> None:
        [*_, turn] = m.turns(OWNER, session_id)
        assert [c.name for c in turn.tool_calls] == ["lookup"]  # read back from the journal
        answer = ({"role": "tool", "tool_call_id": turn.tool_calls[0].id, "content": "found"},)
        out = await (await m.append(OWNER, session_id, SessionInput(messages=answer),
                                    GenerateOptions(max_tokens=4, temperature=0.0, ignore_eos=True))).result()
        assert out.usage.cached_tokens == turn.end  # the whole history, call included, from the cache
        assert out.parsed is not None and not out.parsed.tool_calls

    async def run(body: Callable[[SessionManager], object], data_dir: Path) -> object:
        async with make_manager(data_dir=data_dir) as manager:
            return await body(manager)  # type: ignore[misc]

    session_id = str(asyncio.run(run(first_life, tmp_path)))
    asyncio.run(run(second_life, tmp_path))


def test_response_format_constrains_an_append_and_bad_schemas_fail_before_it_starts(
        make_manager: ManagerFactory) -> None:
    async def body(m: SessionManager) -> None:
        s = await m.create(OWNER, content=SessionInput(text=f"run {uuid.uuid4().hex}"))
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        json_format = ResponseFormat("json_schema", schema)
        options = GenerateOptions(max_tokens=200, temperature=0.0, response_format=json_format)
        out = await (await m.append(OWNER, s.session_id, SessionInput(text=" JSON:"), options)).result()
        jsonschema.validate(json.loads(out.text), schema)
        bad = GenerateOptions(response_format=ResponseFormat("json_schema", {"type": "nonsense"}))
        try:
            await m.append(OWNER, s.session_id, None, bad)
        except InvalidInput as exc:
            assert "cannot be compiled" in str(exc)
        else:
            raise AssertionError("a schema the grammar engine rejects must be InvalidInput")
        assert m.get(OWNER, s.session_id).num_turns == 2  # nothing was committed by the refusal

    async def main() -> None:
        async with make_manager() as manager:
            await body(manager)

    asyncio.run(main())


# A Qwen3.5-style template: XML tool calls, and a thinking block the prompt opens unless
# `enable_thinking` is false (then it renders an empty, closed one).
QWEN35_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>\\nCall a function as <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n"
    "</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


@pytest.mark.slow  # a grammar-constrained tool call
def test_a_thinking_xml_template(engine: EngineClient, model_dir: Path, tmp_path: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    hf.chat_template = QWEN35_TEMPLATE
    tokenizer = Tokenizer(hf)
    config = SessionConfig(data_dir=tmp_path)
    messages = ({"role": "user", "content": f"find 7 {uuid.uuid4().hex}"},)

    async def main() -> None:
        manager = SessionManager(engine, tokenizer, config, model_fingerprint=model_fingerprint(model_dir))
        await manager.start()
        try:
            system = SessionInput(messages=({"role": "system", "content": "tools"},))
            s = await manager.create(OWNER, tools=TOOLS, content=system)
            forced = GenerateOptions(max_tokens=200, temperature=0.0, tool_choice=ToolChoice("function", "lookup"))
            user = SessionInput(messages=messages, template_kwargs={"enable_thinking": False})
            out = await (await manager.append(OWNER, s.session_id, user, forced)).result()
            assert out.parsed is not None and out.parsed.reasoning is None
            [call] = out.parsed.tool_calls
            text = tokenizer.decode(await_tokens(manager, s.session_id))
            assert "<think>\n\n</think>\n\n<tool_call>\n<function=lookup>\n" in text
            jsonschema.validate(json.loads(call.arguments), LOOKUP)
            # Thinking on: the output starts inside the reasoning block (random weights never close it).
            [thinking] = await manager.complete(tokenizer.render_messages(messages, add_generation_prompt=True),
                                                GenerateOptions(max_tokens=6, temperature=0.0, ignore_eos=True))
            result = await thinking.result()
            assert result.parsed is not None and result.parsed.reasoning == result.text
            assert result.parsed.content is None
        finally:
            await manager.close()

    asyncio.run(main())


def await_tokens(manager: SessionManager, session_id: str) -> list[int]:
    return [t for turn in manager.turns(OWNER, session_id, include_tokens=True) for t in turn.token_ids or ()]
