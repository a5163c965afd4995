"""``IdempotencyStore`` quotas: per key, by count and by bytes, evicting within the key."""

from __future__ import annotations

import asyncio

from phloem.api.server.idempotency import IdempotencyStore, Running, StoredResponse


async def _store(store: IdempotencyStore, owner: str, key: str, body: bytes = b"{}") -> None:
    entry = await store.claim(owner, key, f"POST /x {key}")
    assert isinstance(entry, Running)
    store.succeed(owner, key, entry, StoredResponse(200, body, "application/json"))


def test_the_entry_quota_is_per_key_and_evicts_that_keys_oldest() -> None:
    async def main() -> None:
        store = IdempotencyStore(max_entries=3)
        await _store(store, "alice", "a1")
        for i in range(10):
            await _store(store, "bob", f"b{i}")
        assert store.num_entries("bob") == 3 and store.num_entries("alice") == 1
        assert isinstance(await store.claim("alice", "a1", "POST /x a1"), StoredResponse)
        assert isinstance(await store.claim("bob", "b9", "POST /x b9"), StoredResponse)
        assert isinstance(await store.claim("bob", "b0", "POST /x b0"), Running), "bob's oldest went"
    asyncio.run(main())


def test_the_byte_quota_is_per_key_and_never_drops_a_running_entry() -> None:
    async def main() -> None:
        store = IdempotencyStore(max_entries=100, max_bytes=10_000)
        await _store(store, "alice", "a1", b"x" * 2000)
        running = await store.claim("bob", "slow", "POST /x slow")
        assert isinstance(running, Running)
        for i in range(10):
            await _store(store, "bob", f"b{i}", b"y" * 3000)
        assert store.num_entries("bob") == 1 + 2, "the running entry and the two newest fit"
        assert isinstance(await store.claim("alice", "a1", "POST /x a1"), StoredResponse)
        store.succeed("bob", "slow", running, StoredResponse(200, b"z", "application/json"))
    asyncio.run(main())
