"""``phloem demo``: an agent conversation against a server, with a token report.

The story: create a session with a system prompt and three tools, run 3 turns of append +
generate, fork it into 2 branches, generate once in each, then delete the sessions. The report
shows, per generation, the prompt, cached and completion tokens, so the prefix cache is
visible: every turn after the first, and both branches, find their history cached.

The agent fixes a failing test in a make-believe workspace (``cli.demo_workspace``), the task
the trained built-in model was trained on: the first turn gives it the task; each later turn
gives it the workspace's answers to the tool calls it wrote, or, when it wrote none (a model
that writes noise, or too few ``--max-tokens`` for a whole call), the next user message of
``TURNS``; each branch asks it to try one candidate fix. So the calls in the report are the
model's own, and the story runs to its end whatever the model writes.

The SDK client class is passed in by ``cli.main``; anything with the SDK's ``Client`` shape
works, which is how the tests drive it.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from phloem.cli.demo_workspace import FIXES, SYSTEM_PROMPT, TASK, TOOLS, call_text, tool_result

__all__ = ["BRANCHES", "DEFAULT_MAX_TOKENS", "SYSTEM_PROMPT", "TURNS", "DemoOptions", "DemoRow",
           "format_report", "run_demo", "run_story"]

# A tool call takes 26-44 of the built-in model's tokens: room for one whole call.
DEFAULT_MAX_TOKENS = 64
# The user's messages: the task, then what turns 2 and 3 say when the last reply held no call.
TURNS = (
    TASK,
    "Start by listing the files in the workspace.",
    "Read test_stats.py, then propose a fix for stats.py.",
)
# What each branch asks: run the tests with one candidate fix.
BRANCHES = tuple(f"Run the tests with this fix:\n{fix}" for fix in FIXES)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``phloem demo`` was asked to do (see ``phloem demo --help``)."""

    base_url: str | None = None
    api_key: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    model: str | None = None
    data_dir: Path | None = None
    startup_timeout_s: float = 120.0
    port: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1, got {self.max_tokens}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s: expected > 0, got {self.startup_timeout_s}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"port: expected 1-65535, got {self.port}")


@dataclass(frozen=True, slots=True)
class DemoRow:
    """One generation of the story and its usage.

    ``prompt_input`` is what was appended before it, in short; ``calls`` the tool calls the
    model wrote (``name({...})``), answered by the workspace in the next turn.
    """

    step: str
    session_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None
    text: str
    prompt_input: str = ""
    calls: tuple[str, ...] = ()


def run_demo(options: DemoOptions, client_class: Callable[..., Any], out: TextIO) -> int:
    """Run the story against ``options.base_url``, or against a server started for the occasion.

    Args:
        options: The demo's options.
        client_class: The SDK ``Client`` class (called as ``client_class(base_url, api_key=...)``).
        out: Where the report goes.

    Returns:
        The exit status: 0 on success, 1 if the server could not be started or the story failed.
    """
    try:
        with contextlib.ExitStack() as stack:
            base_url = options.base_url or stack.enter_context(_local_server(options, out))
            client = stack.enter_context(client_class(base_url, api_key=options.api_key))
            rows = run_story(client, options.max_tokens)
    except Exception as exc:  # report any failure as the command's outcome, not a traceback
        out.write(f"phloem demo: failed: {type(exc).__name__}: {exc}\n")
        return 1
    out.write(format_report(rows))
    if options.base_url is None and options.model is None:
        out.write("NOTE: the built-in model is a 4M-parameter test model: its tool calls are its own, "
                  "their arguments often wrong.\n")
    return 0


def run_story(client: Any, max_tokens: int) -> list[DemoRow]:
    """Create a session, 3 turns, fork into 2 branches, one turn each; then delete them.

    A turn appends the workspace's answers to the previous reply's tool calls, or its own user
    message of ``TURNS`` when there were none; each branch appends the answers to turn 3's
    calls (a call is never left unanswered) and then its message of ``BRANCHES``.

    Args:
        client: An SDK ``Client`` (``client.sessions.create``, ``Session.append/fork/delete``).
        max_tokens: Tokens per generation (greedy).

    Returns:
        One row per generation, in order.
    """
    generate = {"max_tokens": max_tokens, "temperature": 0.0}
    root = client.sessions.create(messages=[{"role": "system", "content": SYSTEM_PROMPT}], tools=TOOLS)
    created = [root]
    rows: list[DemoRow] = []
    try:
        pending: list[dict[str, str]] = []  # the workspace's answers to the last reply's calls
        for i, text in enumerate(TURNS):
            messages = pending or [_user(text)]
            result = root.append(messages=messages, generate=generate)
            rows.append(_row(f"turn {i + 1}", root.id, result, messages))
            pending = _answers(result)
        branches = root.fork(len(BRANCHES))
        created += branches
        for name, branch, text in zip("AB", branches, BRANCHES):
            messages = [*pending, _user(text)]
            result = branch.append(messages=messages, generate=generate)
            rows.append(_row(f"branch {name}", branch.id, result, messages))
    finally:
        for session in reversed(created):
            session.delete()
    return rows


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _answers(result: Any) -> list[dict[str, str]]:
    """The workspace's answer to each tool call of ``result``, as tool messages."""
    return [{"role": "tool", "tool_call_id": call.id, "content": tool_result(call)}
            for call in result.tool_calls or ()]


def _row(step: str, session_id: str, result: Any, messages: Sequence[dict[str, str]]) -> DemoRow:
    usage = result.usage
    return DemoRow(
        step, session_id, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
        result.finish_reason, result.text, _describe(messages),
        tuple(call_text(call) for call in result.tool_calls or ()),
    )


def _describe(messages: Sequence[dict[str, str]]) -> str:
    """The appended messages in a few words: the last user message, else the tool results."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    if users:
        return "user: " + " ".join(users[-1].split())
    return "tool: " + " | ".join(" ".join(m["content"].split()) for m in messages)


def format_report(rows: list[DemoRow]) -> str:
    """A fixed-width table of the rows and a cache summary line (and a count of the model's
    tool calls, when it wrote any).

    A session is shown by the last 8 characters of its id: ids begin with their creation time
    (``sess_`` + milliseconds), so a branch and its parent share the first ones; the random end
    tells them apart. ``input`` is what the step appended; ``output`` the tool calls the model
    wrote (``→ name({...})``), or its text when it wrote none.
    """
    header = (f"{'step':<10} {'session':<10} {'prompt':>7} {'cached':>7} {'completion':>10}  "
              f"{'finish':<7} {'input':<22} output")
    lines = [header, "-" * (len(header) + 42)]
    for r in rows:
        output = "→ " + "; ".join(r.calls) if r.calls else repr(r.text)
        lines.append(
            f"{r.step:<10} {'…' + r.session_id[-8:]:<10} {r.prompt_tokens:>7} {r.cached_tokens:>7} "
            f"{r.completion_tokens:>10}  {r.finish_reason or '-':<7} {_cut(r.prompt_input, 22):<22} "
            f"{_cut(output, 48)}"
        )
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    share = f"{100 * cached / prompt:.0f}%" if prompt else "-"
    lines.append(f"prompt tokens {prompt}, of which {cached} came from the prefix cache ({share})")
    calls = sum(len(r.calls) for r in rows)
    if calls:
        lines.append(f"tool calls written by the model: {calls} (a make-believe workspace answers them)")
    return "\n".join(lines) + "\n"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


@contextlib.contextmanager
def _local_server(options: DemoOptions, out: TextIO) -> Iterator[str]:
    """Start ``phloem serve`` on ``options.port`` (else a free loopback port) with
    ``options.data_dir`` (else a temporary data directory, deleted afterwards); yield its URL once
    ``/health`` answers. So it runs beside a ``phloem serve`` that holds the default port and
    data directory. The server's log is deleted when all went well and kept (and named) when not."""
    port = options.port or _free_port()
    base_url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        data_dir = options.data_dir
        if data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="phloem-demo-data-")))
        command = [sys.executable, "-m", "phloem.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--data-dir", str(data_dir)]
        if options.model is not None:
            command += ["--model", options.model]
        with tempfile.NamedTemporaryFile(prefix="phloem-demo-", suffix=".log", delete=False) as log:
            pass
        log_path = Path(log.name)
        where = "a temporary data directory" if options.data_dir is None else f"data directory {data_dir}"
        out.write(f"phloem demo: starting a server at {base_url} with {where} (log: {log_path})\n")
        out.flush()
        succeeded = False
        try:
            with log_path.open("wb") as log_file:
                server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
            try:
                _wait_until_healthy(base_url, server, options.startup_timeout_s, log_path)
                yield base_url
                succeeded = True
            finally:
                server.terminate()
                try:
                    server.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
        finally:
            if succeeded:
                log_path.unlink(missing_ok=True)
                out.write(f"phloem demo: stopped the server; deleted its log {log_path}\n")
            else:
                out.write(f"phloem demo: the server's log is kept at {log_path}\n")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_healthy(base_url: str, server: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    import httpx  # here, so `phloem --help` does not pay for it

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            hint = ""
            if "another phloem server" in tail:
                hint = ("\nto drive the server that holds that data directory, pass its URL, e.g. "
                        "`phloem demo --base-url http://127.0.0.1:8000`; or leave --data-dir out (the demo "
                        "then uses a temporary one)")
            raise RuntimeError(f"the server exited with status {server.returncode}; its log ends:\n{tail}{hint}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise TimeoutError(f"the server at {base_url} did not answer /health within {timeout_s} s (log: {log})")
