"""The ``phloem`` CLI: help texts, ``serve`` wiring (with a stand-in server) and the demo story."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from phloem.kernels.config import KernelConfig
from phloem.api.server.config import HttpConfig
from phloem.cli.config import ServerConfig
from phloem.engine.config import EngineConfig, LoadConfig, ParallelConfig
from phloem.sessions.config import SessionConfig
from phloem.runtime.builtin_model import DEFAULT_MODEL_NAME, trained_model_path
from phloem.cli.demo import BRANCHES, TURNS, DemoOptions, DemoRow, format_report, run_demo, run_story
from phloem.cli.demo_workspace import TOOLS
from phloem.cli.main import build_parser, main


HELP_ARGVS = [[], ["serve"], ["demo"], ["bench"], ["bench", "decode"], ["bench", "long-context"], ["bench", "prefix-cache"], ["bench", "agentic"]]


@pytest.mark.parametrize("argv", HELP_ARGVS, ids=lambda a: " ".join(a) or "phloem")
def test_help_exits_zero_and_shows_examples(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"phloem {argv[0] if argv else 'serve'}" in out


def test_console_script_help_runs_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "phloem.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "serve" in result.stdout
    check = "import sys, phloem.cli.main, phloem.runtime; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0


@pytest.mark.slow  # times decode steps of a model
def test_bench_decode_runs_on_cpu_with_the_tiny_shape(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "decode", "--shape", "tiny", "--device", "cpu", "--batches", "1,2", "--contexts", "64",
            "--prefill-tokens", "128", "--steps", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fraction of roofline" in out and "| 2 | 64 |" in out and "prefill 128 tokens" in out
    assert "sync ms/step" in out  # async scheduling on (the default), timed against it off
    assert "(device-timed; host-timed" in out and "after the grid" in out  # the roofline's denominator, and its spread
    # The choices the numbers depend on head the report (torch kernels on CPU, no opt-in switch).
    assert "kernels torch, async_scheduling True, triton_gemv False, fused_decode True, pdl False" in out


@pytest.mark.slow  # times decode steps of a model
def test_bench_decode_times_the_json_schema_and_tool_call_grammars(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "decode", "--shape", "tiny", "--device", "cpu", "--batches", "1,3", "--contexts", "64",
            "--prefill-tokens", "0", "--steps", "3", "--grammar", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 | 64 |", "| 3 | 64 |"))]
    # Each point also has its ms/step under the JSON schema and under the default tool-call
    # grammar, each with its cost against the plain step.
    cells = [[cell.strip() for cell in row.split("|")[-5:-1]] for row in rows]
    assert len(rows) == 2 and all("-" not in (c[0], c[2]) and c[1].endswith("%") and c[3].endswith("%") for c in cells)


def test_bench_without_a_kind_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench"])
    assert info.value.code == 2


def test_serve_without_model_serves_the_trained_built_in_model(
    served: list[ServerConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--data-dir", str(tmp_path), "--port", "0"]) == 0
    (config,) = served
    # Served in place from the package: nothing is built or copied into the data dir.
    assert config.model == str(trained_model_path())
    assert (Path(config.model) / "model.safetensors").is_file()
    assert not (tmp_path / "models").exists()
    assert (config.http.port, config.http.host, config.data_dir) == (0, "127.0.0.1", tmp_path)
    err = capsys.readouterr().err
    assert f"built-in model {DEFAULT_MODEL_NAME}" in err and "RANDOM" not in err


def configured(argv: list[str]) -> Any:
    """What ``phloem ARGV`` would run with: the parsed flags' config, before any check of this
    machine (a CUDA device, a free port), so it works on any machine."""
    args = build_parser().parse_args(argv)
    return args.configure(args)


def test_serve_flags_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path) -> None:
    monkeypatch.setenv("PHLOEM_PORT", "9123")
    monkeypatch.setenv("PHLOEM_DATA_DIR", str(tmp_path))
    argv = ["serve", "--model", str(model_dir), "--device", "cuda:1", "--dtype", "bfloat16"]
    config = configured([*argv, "--redis-url", "redis://r:6379/0", "--default-ttl", "60", "--tp", "2"])
    assert config == ServerConfig(
        model=str(model_dir),
        engine=EngineConfig(load=LoadConfig(device="cuda:1", dtype="bfloat16"),
                            parallel=ParallelConfig(tensor_parallel_size=2)),
        sessions=SessionConfig(data_dir=tmp_path, redis_url="redis://r:6379/0", default_ttl_s=60.0),
        http=HttpConfig(port=9123),
    )


def test_serve_ep_flag_reaches_the_engine(model_dir: Path) -> None:
    config = configured(["serve", "--model", str(model_dir), "--device", "cuda", "--tp", "2", "--ep"])
    assert config.engine.parallel.expert_parallel is True
    assert config.engine.parallel.tensor_parallel_size == 2


def test_serve_quantization_flag_reaches_the_loader(model_dir: Path) -> None:
    assert configured(["serve", "--model", str(model_dir)]).engine.load.quantization is None
    config = configured(["serve", "--model", str(model_dir), "--quantization", "fp8"])
    assert config.engine.load.quantization == "fp8"
    shape = configured(["serve", "--shape", "qwen3.5-35b-a3b", "--quantization", "fp8"])
    assert shape.engine.load.quantization == "fp8" and shape.engine.load.load_format == "dummy"


def test_serve_ep_without_tp_is_a_usage_error(served: list[ServerConfig], capsys: pytest.CaptureFixture[str],
                                              model_dir: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(model_dir), "--ep"])
    assert info.value.code == 2 and "expert_parallel: needs tensor_parallel_size > 1" in capsys.readouterr().err
    assert served == []


def test_serve_rejects_a_bad_value_naming_it(served: list[ServerConfig], capsys: pytest.CaptureFixture[str],
                                             model_dir: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(model_dir), "--port", "70000"])
    assert info.value.code == 2 and "port: expected" in capsys.readouterr().err
    assert served == []


def test_demo_rejects_a_bad_value_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--max-tokens", "0"])
    assert info.value.code == 2 and "max_tokens: expected" in capsys.readouterr().err


def fake_call(name: str, arguments: str = "{}") -> Any:
    """A parsed tool call as the SDK returns it (``ToolCall``: id, function name and arguments)."""
    function = types.SimpleNamespace(name=name, arguments=arguments)
    return types.SimpleNamespace(id=f"call_{name}", function=function, type="function")


class FakeSession:
    def __init__(self, client: FakeClient, sid: str, num_tokens: int) -> None:
        self.client, self.id, self.num_tokens = client, sid, num_tokens

    def append(self, *, messages: list[dict[str, str]], generate: dict[str, Any]) -> Any:
        self.client.appended.append((self.id, messages))
        prompt = self.num_tokens + 10 * len(messages)
        cached = self.num_tokens  # everything the session held is in the cache
        self.num_tokens = prompt + generate["max_tokens"]
        usage = types.SimpleNamespace(
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=generate["max_tokens"]
        )
        calls = self.client.calls.pop(0) if self.client.calls else None
        return types.SimpleNamespace(usage=usage, finish_reason="length", text="gibberish " * 5, tool_calls=calls)

    def fork(self, n: int) -> list[FakeSession]:
        return [self.client.new_session(self.num_tokens) for _ in range(n)]

    def delete(self) -> None:
        self.client.deleted.append(self.id)


class FakeClient:
    """Stands in for the SDK ``Client``; ``calls`` are the tool calls of the next replies, in
    order (None: a reply without one)."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url, self.api_key = base_url, api_key
        self.sessions = self
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.appended: list[tuple[str, list[dict[str, str]]]] = []
        self.calls: list[list[Any] | None] = []
        self.tools: list[Any] | None = None

    def new_session(self, num_tokens: int) -> FakeSession:
        self.created.append(f"s{len(self.created):07d}")
        return FakeSession(self, self.created[-1], num_tokens)

    def create(self, *, messages: list[dict[str, str]], tools: list[Any] | None = None) -> FakeSession:
        self.tools = tools
        return self.new_session(10 * len(messages))

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_demo_story_runs_turns_then_branches_and_cleans_up() -> None:
    client = FakeClient("http://x")
    rows = run_story(client, max_tokens=4)
    assert [r.step for r in rows] == ["turn 1", "turn 2", "turn 3", "branch A", "branch B"]
    assert len(TURNS) == 3 and len(BRANCHES) == 2
    assert rows[0].cached_tokens == 10 and rows[3].cached_tokens == rows[4].cached_tokens
    assert sorted(client.deleted) == client.created and len(client.created) == 3
    assert client.tools == TOOLS
    # No reply held a call: every step appended its scripted user message.
    assert [m for _, m in client.appended] == [[{"role": "user", "content": t}] for t in TURNS + BRANCHES]
    report = format_report(rows)
    assert "branch B" in report and f"of which {sum(r.cached_tokens for r in rows)} came" in report
    assert "tool calls" not in report


def test_demo_story_answers_the_model_s_tool_calls() -> None:
    """A reply's calls are answered by the workspace in the next step (a bad call gets an error
    string); a reply without a call gets the next scripted user message."""
    client = FakeClient("http://x")
    client.calls = [[fake_call("list_files")], None,
                    [fake_call("run_tests", '{"fix": "    return sum(xs) / len(xs)"}'), fake_call("rm", "[1]")]]
    rows = run_story(client, max_tokens=4)
    sent = [m for _, m in client.appended]
    assert sent[1] == [{"role": "tool", "tool_call_id": "call_list_files", "content": "stats.py\ntest_stats.py"}]
    assert sent[2] == [{"role": "user", "content": TURNS[2]}]
    answers = [{"role": "tool", "tool_call_id": "call_run_tests", "content": "1 passed"},
               {"role": "tool", "tool_call_id": "call_rm", "content": "error: unknown tool 'rm'"}]
    assert sent[3][:2] == sent[4][:2] == answers
    assert [sent[3][2:], sent[4][2:]] == [[{"role": "user", "content": text}] for text in BRANCHES]
    assert rows[0].calls == ("list_files({})",) and rows[1].calls == ()
    assert rows[2].calls == ('run_tests({"fix": "    return sum(xs) / len(xs)"})', "rm({})")
    report = format_report(rows)
    assert "→ list_files({})" in report and "tool calls written by the model: 3" in report


def test_demo_table_tells_sessions_apart() -> None:
    """Real ids share their time prefix (``sess_01M...``): the table shows their random ends."""
    ids = ["sess_01M8VQX69B3K5Q0D6YPZK9GF6FJ48ZP661FB", "sess_01M8VQX6CQ2KB349DA1F9V511T2J20PDEY9A",
           "sess_01M8VQX6CQ2KB349DAH1T4QW7R8Y0N3KEJ2M"]
    rows = [DemoRow(step, sid, 10, 5, 2, "length", "x") for step, sid in zip(("turn 1", "branch A", "branch B"), ids)]
    shown = [line.split()[2] for line in format_report(rows).splitlines()[2:5]]
    assert shown == ["…8ZP661FB", "…20PDEY9A", "…0N3KEJ2M"], shown


def test_demo_against_a_running_server_prints_the_report() -> None:
    out = io.StringIO()
    clients: list[FakeClient] = []

    def client_class(base_url: str, api_key: str | None = None) -> FakeClient:
        clients.append(FakeClient(base_url, api_key))
        return clients[-1]

    options = DemoOptions(base_url="http://127.0.0.1:9", api_key="k", max_tokens=3)
    assert run_demo(options, client_class, out) == 0
    assert clients[0].base_url == "http://127.0.0.1:9" and clients[0].api_key == "k"
    assert out.getvalue().count("\n") == 2 + 5 + 1 and "random" not in out.getvalue()

    def unreachable(base_url: str, api_key: str | None = None) -> FakeClient:
        raise ConnectionError("refused")

    out = io.StringIO()
    assert run_demo(options, unreachable, out) == 1
    assert "failed: ConnectionError: refused" in out.getvalue()


_FAKE_APP = """
import sys, types
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

def serve(config, sock=None, startup=None):
    if sock is not None:
        sock.close()  # the port `phloem serve` bound for the real server; this one binds it again
    HTTPServer((config.http.host, config.http.port), Health).serve_forever()

compose = types.ModuleType("phloem.cli.compose")
compose.serve = serve
sys.modules["phloem.cli.compose"] = compose
"""


def test_demo_starts_and_stops_its_own_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The child `phloem serve` gets a stand-in composition root (phloem.cli.compose) through
    # sitecustomize; the rest of PYTHONPATH stays, so the child imports the same phloem.
    (tmp_path / "sitecustomize.py").write_text(_FAKE_APP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    clients: list[FakeClient] = []

    def client_class(base_url: str, api_key: str | None = None) -> FakeClient:
        clients.append(FakeClient(base_url, api_key))
        return clients[-1]

    out = io.StringIO()
    model = tmp_path / "model"  # checked before serving (a config.json), never loaded by the stand-in
    model.mkdir()
    (model / "config.json").write_text("{}")
    options = DemoOptions(model=str(model), data_dir=tmp_path, startup_timeout_s=60)
    assert run_demo(options, client_class, out) == 0, out.getvalue()
    (client,) = clients
    assert client.base_url.startswith("http://127.0.0.1:") and "branch B" in out.getvalue()
    log = out.getvalue().split("(log: ")[1].split(")")[0]
    assert not Path(log).exists()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{client.base_url}/health", timeout=2.0)


def _server_available() -> bool:
    try:
        return importlib.util.find_spec("phloem.api.server.app") is not None
    except ImportError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _server_available(), reason="phloem.api.server.app (the server) is not there yet")
def test_demo_end_to_end(tmp_path: Path) -> None:
    """The default demo: the trained built-in model writes its own tool calls (greedy, so the
    first one is the same every time: ``list_files``, as the corpus taught it)."""
    result = subprocess.run(
        [sys.executable, "-m", "phloem.cli", "demo", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "branch B" in result.stdout and "built-in model is a 4M-parameter test model" in result.stdout
    turn_1 = next(line for line in result.stdout.splitlines() if line.startswith("turn 1"))
    assert turn_1.endswith("→ list_files({})"), result.stdout
    assert "tool calls written by the model: " in result.stdout


def test_serve_shape_serves_dummy_weights_with_the_demo_tokenizer(served: list[ServerConfig], tmp_path: Path) -> None:
    assert main(["serve", "--data-dir", str(tmp_path), "--shape", "tiny", "--no-prefix-cache", "--port", "0"]) == 0
    (config,) = served
    folder = Path(str(config.model))
    assert folder == tmp_path / "shapes" / "tiny"
    assert {p.name for p in folder.iterdir()} == {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert (config.engine.load.load_format, config.engine.cache.enable_prefix_caching) == ("dummy", False)


def test_serve_shape_and_model_together_is_a_usage_error(served: list[ServerConfig], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--shape", "tiny", "--model", "/m"])
    assert info.value.code == 2 and "either --model or --shape" in capsys.readouterr().err
    assert served == []


def test_serve_step_budget_flags_reach_the_engine(served: list[ServerConfig], model_dir: Path) -> None:
    argv = ["serve", "--model", str(model_dir), "--max-num-batched-tokens", "8192", "--max-num-seqs", "16"]
    assert main([*argv, "--port", "0"]) == 0
    (config,) = served
    assert (config.engine.scheduler.max_num_batched_tokens, config.engine.scheduler.max_num_seqs) == (8192, 16)


def test_serve_kernel_variables_reach_the_engine(served: list[ServerConfig], model_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``PHLOEM_PDL`` / ``PHLOEM_TRITON_GEMV`` (read in ``runtime.env`` only) become the served
    engine's ``KernelConfig``; unset, the engine keeps the defaults."""
    assert main(["serve", "--model", str(model_dir), "--port", "0"]) == 0
    monkeypatch.setenv("PHLOEM_PDL", "0")
    monkeypatch.setenv("PHLOEM_TRITON_GEMV", "0")
    assert main(["serve", "--model", str(model_dir), "--port", "0"]) == 0
    default, chosen = served
    assert default.engine.kernels == KernelConfig()
    assert chosen.engine.kernels == KernelConfig(pdl=False, triton_gemv=False)


def test_serve_rejects_a_zero_step_budget(served: list[ServerConfig], capsys: pytest.CaptureFixture[str],
                                          model_dir: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(model_dir), "--max-num-batched-tokens", "0"])
    assert info.value.code == 2 and "max_num_batched_tokens" in capsys.readouterr().err
    assert served == []


@pytest.mark.slow
@pytest.mark.skipif(not _server_available(), reason="phloem.api.server.app (the server) is not there yet")
def test_demo_runs_beside_a_server_on_the_default_data_dir(tmp_path: Path) -> None:
    """A ``phloem serve`` holds the default data directory (this run's temporary one,
    ``$PHLOEM_DATA_DIR``): the demo starts its own server on a temporary data directory and a free
    port; pointed at the held one, it fails, keeps its log and suggests ``--base-url``."""
    from tests.support.live_servers import ServerProcess

    default = Path(os.environ["PHLOEM_DATA_DIR"])
    server = ServerProcess(default, log=tmp_path / "server.log").start()
    try:
        result = subprocess.run([sys.executable, "-m", "phloem.cli", "demo", "--max-tokens", "8"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "branch B" in result.stdout and "with a temporary data directory" in result.stdout
        log = result.stdout.split("(log: ")[1].split(")")[0]
        assert f"deleted its log {log}" in result.stdout and not Path(log).exists()

        held = subprocess.run([sys.executable, "-m", "phloem.cli", "demo", "--data-dir", str(default)],
                              capture_output=True, text=True, timeout=300)
        assert held.returncode == 1, held.stdout + held.stderr
        assert "--base-url" in held.stdout and "another phloem server" in held.stdout
        kept = held.stdout.split("(log: ")[1].split(")")[0]
        assert f"log is kept at {kept}" in held.stdout and Path(kept).exists()
        Path(kept).unlink()
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    finally:
        server.stop()


def test_serve_memory_and_cache_flags_reach_the_engine(served: list[ServerConfig], model_dir: Path) -> None:
    argv = ["serve", "--model", str(model_dir), "--gpu-memory-utilization", "0.6", "--num-pages", "512",
            "--num-state-slots", "32", "--checkpoint-interval", "2048", "--port", "0"]
    assert main(argv) == 0
    (config,) = served
    cache = config.engine.cache
    assert (cache.memory_fraction, cache.num_pages, cache.num_state_slots, cache.checkpoint_interval) == (0.6, 512, 32, 2048)


def test_serve_grammar_and_prompt_end_flags_reach_the_engine(served: list[ServerConfig], model_dir: Path) -> None:
    argv = ["serve", "--model", str(model_dir), "--prompt-end-split-min-tokens", "0",
            "--grammar-compile-timeout", "2.5", "--grammar-cache-bytes", "1048576",
            "--grammar-cache-bytes-per-key", "65536", "--grammar-compile-workers", "3",
            "--grammar-compiles-per-key", "2", "--grammar-max-schema-bytes", "4096",
            "--grammar-max-enum-values", "64", "--port", "0"]
    assert main(argv) == 0
    (config,) = served
    grammar = config.engine.grammar
    assert config.engine.cache.prompt_end_split_min_tokens == 0
    assert (grammar.compile_timeout_s, grammar.cache_bytes, grammar.cache_bytes_per_owner, grammar.compile_workers,
            grammar.compile_per_owner, grammar.max_schema_bytes, grammar.max_enum_values) == (
        2.5, 1 << 20, 1 << 16, 3, 2, 4096, 64)


@pytest.mark.parametrize(("flag", "value", "field"), [("--gpu-memory-utilization", "1.5", "memory_fraction"),
                                                      ("--checkpoint-interval", "100", "checkpoint_interval"),
                                                      ("--num-pages", "1", "num_pages")])
def test_serve_rejects_a_bad_memory_flag_naming_its_field(served: list[ServerConfig], capsys: pytest.CaptureFixture[str],
                                                          model_dir: Path, flag: str, value: str, field: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(model_dir), flag, value])
    assert info.value.code == 2 and f"{field}: expected" in capsys.readouterr().err
    assert served == []


def test_serve_names_and_chat_template_reach_their_fields(served: list[ServerConfig], model_dir: Path,
                                                          tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    argv = ["serve", "--model", str(model_dir), "--served-model-name", "qwen", "q35", "--chat-template", str(template)]
    assert main([*argv, "--port", "0"]) == 0
    assert main(["serve", "--model", str(model_dir), "--port", "0"]) == 0
    chosen, default = served
    assert (chosen.http.served_model_names, chosen.chat_template) == (("qwen", "q35"), template)
    assert chosen.read_chat_template() == template.read_text()
    assert (default.http.served_model_names, default.chat_template) == ((), None)


@pytest.mark.parametrize(("text", "words"), [(None, "cannot read"), ("{% for %}", "is no Jinja template")])
def test_serve_rejects_a_bad_chat_template(served: list[ServerConfig], capsys: pytest.CaptureFixture[str],
                                           model_dir: Path, tmp_path: Path, text: str | None, words: str) -> None:
    template = tmp_path / "chat.jinja"
    if text is not None:
        template.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(model_dir), "--chat-template", str(template)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--chat-template: " in err and words in err
    assert served == []


def test_serve_a_hub_id_says_how_to_download_it(served: list[ServerConfig], capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # empty: nothing downloaded
    monkeypatch.chdir(tmp_path)  # no folder named Qwen/ here
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", "Qwen/Qwen3.5-35B-A3B"])
    lines = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and served == []
    assert lines[-1] == ("phloem serve: error: --model: 'Qwen/Qwen3.5-35B-A3B' is a Hugging Face Hub id and no "
                         "folder; download it first: `hf download Qwen/Qwen3.5-35B-A3B --local-dir "
                         "~/models/Qwen3.5-35B-A3B`, then `--model ~/models/Qwen3.5-35B-A3B` (docs/models.md)")


def test_serve_a_hub_id_in_the_local_cache_serves_its_snapshot(served: list[ServerConfig], monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    repo = cache / "models--Qwen--Qwen3.5-35B-A3B"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--model", "Qwen/Qwen3.5-35B-A3B", "--port", "0"]) == 0
    (config,) = served
    assert Path(str(config.model)).resolve() == snapshot.resolve()
