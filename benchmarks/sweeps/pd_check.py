"""Greedy tokens of a disaggregated pair (its decode instance's API) against a colocated server.

    python3 benchmarks/sweeps/pd_check.py DECODE_PORT COLOCATED_PORT

Both servers must serve the same model (the built-in tiny model by default); prints each prompt's
text from both and "ALL SAME" or "DIFFER". Used by ``tools/gpu/gpu_checks.sh``.
"""

from __future__ import annotations

import sys

import httpx

PROMPTS = [[5, 17, 42, 99, 3, 250, 7] * 40, list(range(30, 330)), [9] * 700, [1, 2, 3] * 900]


def complete(port: str, prompt: list[int]) -> dict:  # type: ignore[type-arg]
    base = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()  # type: ignore[no-any-return]


def main(pd: str, colocated: str) -> int:
    same = True
    for prompt in PROMPTS:
        a, b = complete(pd, prompt), complete(colocated, prompt)
        ta, tb = a["choices"][0]["text"], b["choices"][0]["text"]
        same &= ta == tb
        print(f"{len(prompt)} tokens: same={ta == tb}\n  pd:        {ta!r}\n  colocated: {tb!r}")
        print(f"  usage pd {a.get('usage')}\n  usage colocated {b.get('usage')}")
    print("ALL SAME" if same else "DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
