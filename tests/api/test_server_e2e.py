"""End to end against a real ``phloem serve`` process: an agent loop with a tool call, then a fork
into three branches whose outputs match fresh sessions and whose cache reuse is exact."""

from __future__ import annotations

import uuid

import pytest

from phloem.api import Client, Session, SessionNotFound

pytestmark = pytest.mark.slow  # the session's phloem serve process

TOOLS = [{"type": "function", "function": {"name": "run", "description": "Run a shell command",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]


def greedy(max_tokens: int = 8) -> dict[str, object]:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def history(session: Session) -> list[int]:
    return [t for turn in session.turns(include_tokens=True) for t in (turn.token_ids or [])]


def test_agent_loop_then_fork(client: Client) -> None:
    system = {"role": "system", "content": f"You are agent {uuid.uuid4().hex}."}
    root = client.sessions.create(messages=[system], tools=TOOLS, metadata={"task": "e2e"}, ttl=30)
    assert (root.info.num_turns, root.info.status, root.info.ttl) == (1, "active", 30.0)

    first = root.append(messages=[{"role": "user", "content": "List the files."}], generate=greedy())
    assert (first.turn, len(first.output_ids), first.finish_reason) == (1, 8, "length")
    assert first.usage.prompt_tokens == first.num_tokens - 8 and first.usage.completion_tokens == 8

    tool = root.append(messages=[{"role": "tool", "tool_call_id": "c1", "content": "a.py tests.py"}])
    assert (tool.turn, tool.output_ids, tool.finish_reason) == (2, [], None)
    assert tool.usage.completion_tokens == 0 and tool.usage.prompt_tokens == tool.num_tokens

    second = root.append(generate=greedy())
    assert second.turn == 3 and second.usage.prompt_tokens == tool.num_tokens
    assert second.usage.cached_tokens == first.num_tokens, "turn 1 ended with a checkpoint"

    parent = root.refresh()
    assert parent.num_tokens == second.num_tokens and parent.num_turns == 4
    branches = root.fork(3)
    assert [b.info.num_tokens for b in branches] == [parent.num_tokens] * 3
    assert all(b.info.parent_id == root.id and b.info.fork_turn == 3 for b in branches)
    assert all(b.info.metadata == {"task": "e2e"} for b in branches)
    assert [t.created_at for t in branches[0].turns()] == [t.created_at for t in root.turns()]

    earlier: list[list[int]] = []
    for i, branch in enumerate(branches):
        result = branch.append(messages=[{"role": "tool", "tool_call_id": f"b{i}",
                                          "content": f"branch {i}: exit code {i}"}],
                               generate=greedy())
        tokens = history(branch)
        # The branch reused the parent's whole history from the cache, not one token less; past
        # it, at most the tool message's tokens that an earlier branch (and its fresh replay)
        # computed too, floored to the page: the branch-point checkpoint they publish (issue 48).
        shared = max((next((k for k, (a, b) in enumerate(zip(e, tokens)) if a != b), 0) for e in earlier),
                     default=0)
        if i == 0:
            assert result.usage.cached_tokens == parent.num_tokens
        else:
            assert parent.num_tokens <= result.usage.cached_tokens <= max(parent.num_tokens, shared // 16 * 16)
        earlier.append(tokens)
        assert tokens[: parent.num_tokens] == history(root)
        prompt = tokens[: len(tokens) - len(result.output_ids)]
        fresh = client.sessions.create(input_ids=prompt)
        expect = fresh.append(generate=greedy())
        assert (result.output_ids, result.text) == (expect.output_ids, expect.text)
        fresh.delete()

    assert {s.id for s in client.sessions.list(parent_id=root.id)} == {b.id for b in branches}
    root.delete()
    assert all(b.refresh().num_turns == 5 for b in branches), "forks outlive their parent"
    try:
        root.refresh()
    except SessionNotFound:
        pass
    else:
        raise AssertionError("a deleted session must be gone")
    for branch in branches:
        branch.delete()
