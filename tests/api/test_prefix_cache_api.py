"""Issue 48, as a stateless client meets it: a real ``phloem serve`` (the built-in model, CPU) and
the openai client, with two API keys (``tenants``).

- the same prompt sent twice: the second reports all of it but the last token as cached (its
  logits must be computed), on /v1/chat/completions and /v1/completions;
- three requests sharing a ~1,000-token system prompt: the third resumes at the branch-point
  checkpoint the second published, at least the shared token prefix floored to the page;
- greedy tokens are the same on the fresh, branch-checkpoint and full-hit paths;
- a key's repeat hits; another key's copy of the same text does not.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from live_servers import ServerProcess
from tenants import ALICE, BOB, key_args

from phloem.runtime.builtin_model import DEFAULT_MODEL_NAME, trained_model_path
from phloem.sessions import Tokenizer

pytestmark = pytest.mark.slow  # a phloem serve process of its own

PAGE = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("prefix-cache-api"), key_args()).start()
    try:
        yield proc
    finally:
        proc.stop()


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(Path(trained_model_path()))


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "ledger", "tool", "call", "return", "value", "schema", "field", "agent", "reply",
             "budget", "token", "cache", "shared", "prefix", "system", "check", "order", "route", "state"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def chat(c: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    r = c.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def complete(c: openai.OpenAI, prompt: str) -> tuple[str, int, int]:
    r = c.completions.create(model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def test_a_resent_chat_prompt_is_a_full_hit(server: ServerProcess) -> None:
    c = client(server, ALICE)
    messages = [{"role": "user", "content": "resend-chat " + words(180, 1)}]
    text, prompt_tokens, cached = chat(c, messages)
    assert cached == 0 and prompt_tokens > 200
    again, prompt_again, cached_again = chat(c, messages)
    assert (again, prompt_again) == (text, prompt_tokens)
    assert cached_again == prompt_tokens - 1  # all but the last token, whose logits it needs


def test_a_resent_completion_prompt_is_a_full_hit(server: ServerProcess) -> None:
    c = client(server, ALICE)
    prompt = "resend-completion " + words(200, 2)
    text, prompt_tokens, cached = complete(c, prompt)
    assert cached == 0
    again, _, cached_again = complete(c, prompt)
    assert again == text and cached_again == prompt_tokens - 1


def test_the_third_request_sharing_a_system_prompt_resumes_at_the_branch_point(
    server: ServerProcess, tokenizer: Tokenizer
) -> None:
    c = client(server, ALICE)
    system = "system-prompt-chat " + words(700, 3)
    assert len(tokenizer.encode(system)) > 900
    users = ["What is the route state?", "Summarise the ledger schema.", "Which tool call failed?"]
    results = [chat(c, [{"role": "system", "content": system}, {"role": "user", "content": u}]) for u in users]
    floor = len(tokenizer.encode(system)) // PAGE * PAGE  # the shared token prefix is longer
    assert results[0][2] == 0 and results[1][2] == 0
    assert results[2][2] >= floor
    # Greedy tokens on every path: the branch-checkpoint resume (third) and its full-hit resend,
    # against the fresh computation under another key (its own namespace: nothing cached).
    third = [{"role": "system", "content": system}, {"role": "user", "content": users[2]}]
    resend = chat(c, third)
    fresh = chat(client(server, BOB), third)
    # The third resumed at the branch point and added fewer than 256 tokens: its prompt-end
    # checkpoint sits at its very end (``CacheConfig.prompt_end_split_min_tokens``), so its
    # resend resumes at the branch point again.
    assert fresh[2] == 0 and resend[2] == results[2][2]
    assert results[2][0] == resend[0] == fresh[0]


def test_completions_sharing_a_prefix_resume_at_the_floored_shared_prefix(
    server: ServerProcess, tokenizer: Tokenizer
) -> None:
    c = client(server, ALICE)
    system = "system-prompt-completion " + words(700, 4)
    prompts = [system + "\nQ: " + q for q in ("first question", "another thing", "third ask")]
    ids = [tokenizer.encode(p) for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(ids[1], ids[2])) if a != b)
    outs = [complete(c, p) for p in prompts]
    assert outs[2][2] >= shared // PAGE * PAGE > 900
    assert outs[2][0] == complete(client(server, BOB), prompts[2])[0]


def test_a_keys_repeat_hits_and_another_keys_copy_does_not(server: ServerProcess) -> None:
    alice, bob = client(server, ALICE), client(server, BOB)
    messages = [{"role": "user", "content": "tenancy " + words(120, 5)}]
    text, prompt_tokens, cached = chat(alice, messages)
    assert cached == 0
    assert chat(alice, messages) == (text, prompt_tokens, prompt_tokens - 1)
    assert chat(bob, messages) == (text, prompt_tokens, 0)  # Alice's copy is not Bob's
    assert chat(bob, messages) == (text, prompt_tokens, prompt_tokens - 1)  # his own is
