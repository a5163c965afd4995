"""A turn's protocol ``view`` and cached-token count: stored with the turn, durable across a
restart (journal) and in the index record, replaced by ``set_turn_view``, copied by forks."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from phloem.sessions import GenerateOptions, SessionInput, SessionManager, SessionNotFound

OWNER = "key-views"
ManagerFactory = Callable[..., AbstractAsyncContextManager[SessionManager]]
GREEDY = GenerateOptions(max_tokens=3, temperature=0.0, ignore_eos=True)


def unique_ids(n: int) -> tuple[int, ...]:
    rng = random.Random(uuid.uuid4().int)
    return tuple(rng.randrange(3, 1900) for _ in range(n))


def test_a_view_is_stored_with_its_turn_and_survives_a_restart(make_manager: ManagerFactory,
                                                             tmp_path: Path) -> None:
    async def first_life(m: SessionManager) -> str:
        s = await m.create(OWNER)
        view = json.dumps({"kind": "response", "n": 1})
        first = await (await m.append(OWNER, s.session_id, SessionInput(input_ids=unique_ids(20)),
                                      GREEDY, view=view)).result()
        second = await (await m.append(OWNER, s.session_id, SessionInput(input_ids=unique_ids(5)),
                                       GREEDY)).result()
        turns = m.turns(OWNER, s.session_id)
        assert [t.view for t in turns] == [view, None]
        # The second turn saw the whole first turn in the cache (the session is pinned).
        assert turns[1].num_cached_tokens == second.usage.cached_tokens == first.num_tokens
        assert m.turn(OWNER, s.session_id, 0) == turns[0]
        await m.set_turn_view(OWNER, s.session_id, 0, '{"deleted":true}')
        [child] = await m.fork(OWNER, s.session_id, 1, at_turn=0)
        assert m.turn(OWNER, child.session_id, 0).view == '{"deleted":true}'
        record = m._store._index.get_session(s.session_id)  # noqa: SLF001 (what the index holds)
        assert record is not None and '{\\"deleted\\":true}' in record.data
        return s.session_id

    async def second_life(m: SessionManager) -> None:
        turns = m.turns(OWNER, session_id)
        assert [t.view for t in turns] == ['{"deleted":true}', None]
        assert turns[1].num_cached_tokens > 0
        with pytest.raises(SessionNotFound):
            m.turn(OWNER, session_id, 2)
        with pytest.raises(SessionNotFound):
            m.turn("someone-else", session_id, 0)
        with pytest.raises(SessionNotFound):
            await m.set_turn_view(OWNER, session_id, 5, None)

    async def run(body: Callable[[SessionManager], object]) -> object:
        async with make_manager(data_dir=tmp_path) as manager:
            return await body(manager)  # type: ignore[misc]

    session_id = str(asyncio.run(run(first_life)))
    asyncio.run(run(second_life))
