"""Incremental chat rendering (``sessions.text.chat``): only the new messages are rendered, history is
never re-tokenized, and the result equals the full render wherever the template is append-only."""

from __future__ import annotations

from typing import Any

import pytest

from phloem.sessions import ChatContext, InvalidInput, Tokenizer, render_append

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "List the files."}
TOOLS = ({"type": "function", "function": {"name": "run", "description": "Run a command",
                                           "parameters": {"type": "object"}}},)


def append(tokenizer: Tokenizer, ctx: ChatContext, tokens: list[int], new: list[dict[str, Any]],
           generate: bool) -> ChatContext:
    text = render_append(tokenizer, ctx, new, add_generation_prompt=generate,
                         last_token_id=tokens[-1] if tokens else None)
    tokens += tokenizer.encode(text)
    return ctx.with_messages(new)


def test_appends_without_generation_equal_the_full_render(tokenizer: Tokenizer) -> None:
    conversation = [SYSTEM, USER, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "Now fix the test."}]
    ctx, tokens = ChatContext(tools=TOOLS), []
    for message in conversation:
        ctx = append(tokenizer, ctx, tokens, [message], generate=False)
    assert tokens == tokenizer.render_messages(conversation, tools=TOOLS)
    ctx = append(tokenizer, ctx, tokens, [{"role": "user", "content": "Go."}], generate=True)
    full = tokenizer.render_messages(conversation + [{"role": "user", "content": "Go."}], tools=TOOLS,
                                     add_generation_prompt=True)
    assert tokens == full


def test_history_is_never_re_rendered(tokenizer: Tokenizer) -> None:
    """Whatever the session holds (here tokens no template would produce) stays as it is."""
    tokens = tokenizer.encode("raw prefix without any template")
    before = list(tokens)
    append(tokenizer, ChatContext().detached(), tokens, [USER], generate=True)
    assert tokens[: len(before)] == before
    assert tokenizer.decode(tokens[len(before):], skip_special_tokens=False) == \
        "<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("output", "closing"), [
    ("Done.<|im_end|>", "\n"),               # the model closed its reply: only the newline is added
    ("Done, and then", "<|im_end|>\n"),     # cut by max_tokens: the template closes the reply
], ids=["eos", "length"])
def test_messages_after_a_generated_reply(tokenizer: Tokenizer, output: str, closing: str) -> None:
    ctx, tokens = ChatContext(), []
    ctx = append(tokenizer, ctx, tokens, [USER], generate=True)
    tokens += tokenizer.encode(output)
    ctx = ctx.with_output(after_generation_prompt=True)
    assert ctx.open_output
    result = {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"}
    text = render_append(tokenizer, ctx, [result], add_generation_prompt=True,
                         last_token_id=tokens[-1])
    assert text == (closing + "<|im_start|>user\n<tool_response>\na.py b.py\n</tool_response>"
                              "<|im_end|>\n<|im_start|>assistant\n")
    if output.endswith("<|im_end|>"):
        # A reply the model closed itself renders exactly like the full conversation.
        reply = {"role": "assistant", "content": "Done."}
        full = tokenizer.render_messages([USER, reply, result], add_generation_prompt=True)
        assert tokens + tokenizer.encode(text) == full


def test_template_that_rewrites_history_is_refused(tokenizer: Tokenizer) -> None:
    """ChatML groups consecutive tool results in one user block: a second one cannot be appended
    on its own once the first block is closed in the token history, but both together can."""
    ctx, tokens = ChatContext(), []
    ctx = append(tokenizer, ctx, tokens, [USER], generate=False)
    results = [{"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}"} for i in range(2)]
    ctx_one = append(tokenizer, ctx, list(tokens), results[:1], generate=False)
    with pytest.raises(InvalidInput, match="together"):
        render_append(tokenizer, ctx_one, results[1:], add_generation_prompt=False, last_token_id=None)
    text = render_append(tokenizer, ctx, results, add_generation_prompt=False, last_token_id=None)
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 1


def test_opaque_content_detaches_the_context(tokenizer: Tokenizer) -> None:
    """After a tool result, a generation without prompt, then another tool result: the second
    result starts its own block (the tokens in between are not a tool result)."""
    ctx, tokens = ChatContext().with_messages([USER]), tokenizer.encode("x")
    ctx = append(tokenizer, ctx, tokens, [{"role": "tool", "content": "r1"}], generate=False)
    opaque = ctx.with_output(after_generation_prompt=False)
    assert not opaque.open_output and opaque.messages[-1]["role"] == "assistant"
    assert opaque.detached() is opaque, "detaching twice adds nothing"
    text = render_append(tokenizer, opaque, [{"role": "tool", "content": "r2"}],
                         add_generation_prompt=False, last_token_id=None)
    assert text == "<|im_start|>user\n<tool_response>\nr2\n</tool_response><|im_end|>\n"
    opened = ctx.with_output(after_generation_prompt=True)
    assert opened.open_output and opened.messages[-1]["role"] == "assistant"
    assert opened.with_output(after_generation_prompt=False) is opened, "a continuation stays open"
    assert not opened.detached().open_output
