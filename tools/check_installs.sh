#!/usr/bin/env bash
# Installs by role, as a user gets them (CI: .ci/run). From this checkout:
#   1. the serve install: the project's wheel (`pip wheel --no-deps .`) in a fresh venv, without
#      extras, after the README's torch/triton/numpy pins; no test, fuzzing, agent-framework or
#      plotting package comes along; `phloem serve` (the trained built-in model, from the
#      installed package data) on a free port and a temporary data dir answers /health and a chat
#      request, and `phloem demo` (the README's first command) runs against it;
#   2. the SDK-only install: the phloem-sdk wheel (tools/build_sdk.py) alone in a second fresh
#      venv; torch and the server do not import there, and the SDK holds a session with that server.
# Everything lives in one temporary folder, removed on exit with the server stopped. pip skips
# compiling .pyc files (--no-compile) for the thousands of modules never run: the serve venv
# installed in 86 s instead of 151 s on the two-core CI-like machine.
#   bash tools/check_installs.sh            # KEEP=1 keeps the folder (its path is printed)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
start=$SECONDS
work=$(mktemp -d -t phloem-installs-XXXXXX)
server_pid=""
step="setting up"

cleanup() {
    local status=$?
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill "$server_pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$server_pid" 2>/dev/null || true
    fi
    if [[ $status -ne 0 ]]; then
        echo "check_installs: FAILED while $step (exit $status)" >&2
        [[ -f "$work/serve.log" ]] && { echo "--- phloem serve log (last 40 lines)" >&2; tail -n 40 "$work/serve.log" >&2; }
    fi
    if [[ "${KEEP:-0}" == 1 ]]; then echo "check_installs: kept $work" >&2; else rm -rf "$work"; fi
    exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { echo "check_installs: [$((SECONDS - start)) s] $*"; }
fail() { echo "check_installs: $*" >&2; exit 1; }
quiet() { "$@" > "$work/step.log" 2>&1 || { cat "$work/step.log" >&2; fail "command failed: $*"; }; }

step="building the wheels"
quiet python3 -m pip wheel -q --no-deps -w "$work/dist" "$repo"
wheel=$(ls "$work"/dist/phloem-*.whl)
sdk_wheel=$(python3 tools/build_sdk.py --out "$work/dist") || fail "tools/build_sdk.py failed"
say "built $(basename "$wheel") and $(basename "$sdk_wheel")"

# Every package of the tree is in the wheel (pyproject's packages list), and the built-in model.
python3 - "$wheel" <<'EOF' || fail "the wheel misses files of the tree (see above)"
import sys, zipfile
from pathlib import Path
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
skip = {"tests", "tools", "docs", "docker", "build", "dist"}
packages = {p.parent for p in Path(".").rglob("__init__.py")
            if not (set(p.parts) & skip or any(part.startswith(".") for part in p.parts))}
missing = [f"phloem/{p}/__init__.py".replace("/./", "/") for p in packages
           if f"phloem/{p}/__init__.py".replace("/./", "/") not in names]
model = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
missing += [f"phloem/runtime/_trained_model/{f}" for f in model
            if f"phloem/runtime/_trained_model/{f}" not in names]
for name in missing:
    print(f"  missing from the wheel: {name} (pyproject.toml: [tool.setuptools] packages / package-data)")
sys.exit(1 if missing else 0)
EOF

step="installing the serve venv"
python3 -m venv "$work/serve"
serve_py="$work/serve/bin/python"
quiet "$serve_py" -m pip install -q --no-compile "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
quiet "$serve_py" -m pip install -q --no-compile "$wheel"
say "serve venv: $("$serve_py" -m pip list 2>/dev/null | tail -n +3 | wc -l) packages, $(du -sm "$work/serve" | cut -f1) MiB"
# The serve install brings no development, fuzzing, agent-framework or plotting package.
"$serve_py" - <<'EOF' || fail "the serve install (no extras) brought packages it should not"
import importlib.util, sys
extra = [m for m in ("pytest", "schemathesis", "langchain_openai", "agents", "anthropic", "openai",
                     "importlinter", "matplotlib", "trie")
         if importlib.util.find_spec(m) is not None]
print("  installed without being asked for:", ", ".join(extra)) if extra else None
sys.exit(1 if extra else 0)
EOF

step="starting phloem serve from the wheel"
port=$("$serve_py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$work/home"
# From the temporary folder, with its own HOME: nothing of the checkout or ~/.phloem is reachable.
(cd "$work" && exec env HOME="$work/home" OMP_NUM_THREADS=1 PHLOEM_DATA_DIR="$work/data" \
    "$work/serve/bin/phloem" serve --port "$port" --data-dir "$work/data" > "$work/serve.log" 2>&1) &
server_pid=$!
base="http://127.0.0.1:$port"
"$serve_py" - "$base" "$server_pid" <<'EOF' || fail "phloem serve did not answer /health within 300 s"
import os, sys, time, httpx
base, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("  the server exited before it answered")
    try:
        if httpx.get(f"{base}/health", timeout=5).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
EOF
grep -q "serving the built-in model phloem-tiny-qwen3.5 from $work/serve/lib/" "$work/serve.log" \
    || fail "phloem serve did not load the built-in model from the installed wheel"
say "phloem serve (wheel, no extras) answers on $base"

step="sending a chat request to the serve install"
(cd "$work" && "$serve_py" - "$base") <<'EOF' || fail "the chat request failed"
import sys, httpx
base = sys.argv[1]
health = httpx.get(f"{base}/health", timeout=10).json()
assert health["model"] == "phloem-tiny-qwen3.5", health
r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
    "model": health["model"], "max_tokens": 8, "temperature": 0,
    "messages": [{"role": "user", "content": "Say hello."}]})
assert r.status_code == 200, (r.status_code, r.text)
chat = r.json()
assert chat["choices"][0]["message"]["role"] == "assistant", chat
assert chat["usage"]["completion_tokens"] > 0, chat
print(f"  chat: {chat['usage']['prompt_tokens']} prompt + {chat['usage']['completion_tokens']} completion tokens")
EOF

step="installing the SDK-only venv"
python3 -m venv "$work/sdk"
sdk_py="$work/sdk/bin/python"
quiet "$sdk_py" -m pip install -q --no-compile "$sdk_wheel"
say "SDK venv: $("$sdk_py" -m pip list 2>/dev/null | tail -n +3 | wc -l) packages, $(du -sm "$work/sdk" | cut -f1) MiB"

step="talking to the server from the SDK-only install"
(cd "$work" && "$sdk_py" - "$base") <<'EOF' || fail "the SDK-only install failed (see above)"
import importlib.util, sys
for name in ("torch", "triton", "litestar", "phloem.api.server", "phloem.engine", "phloem.sessions"):
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    assert not found, f"{name} is importable in the SDK-only venv"
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("import torch succeeded in the SDK-only venv")

from phloem.api import Client

with Client(sys.argv[1], timeout=120) as client:
    session = client.sessions.create(messages=[{"role": "system", "content": "Be terse."}])
    greedy = {"max_tokens": 8, "temperature": 0}
    first = session.append(messages=[{"role": "user", "content": "hi"}], generate=greedy)
    second = session.append(messages=[{"role": "user", "content": "and now?"}], generate=greedy)
    assert second.usage.cached_tokens == first.num_tokens > 0, (first, second.usage)
    session.delete()
assert "torch" not in sys.modules
print(f"  SDK session: 2 turns, {second.usage.cached_tokens} tokens cached on the second")
EOF

step="running phloem demo (the README's first command) from the serve install"
# Against the running server: its own would load the same model from the same wheel again.
(cd "$work" && HOME="$work/home" timeout 300 "$work/serve/bin/phloem" demo --base-url "$base" \
    > "$work/demo.log" 2>&1) \
    || { tail -n 30 "$work/demo.log" >&2; fail "phloem demo failed from the serve install"; }
say "phloem demo: $(grep -c . "$work/demo.log") lines of report"
say "OK: serve install (serve, chat, demo) and SDK-only install"
