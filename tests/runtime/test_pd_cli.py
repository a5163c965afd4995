"""``phloem serve --role prefill|decode|both`` and the ``--pd-*`` flags; a real prefill instance
started by the CLI serves a decode client in this process."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from phloem.engine import Engine, SamplingParams
from phloem.cli.main import build_parser, main
from phloem.cli.config import ServerConfig
from phloem.engine.config import EngineConfig
from phloem.runtime.engine_client import EngineClient
from phloem.runtime.pd.decode import PDEngineClient
from phloem.runtime.pd.roles import PDConfig, parse_peer


def configure(*argv: str) -> ServerConfig:
    args = build_parser().parse_args(["serve", *argv])
    return args.configure(args)  # type: ignore[no-any-return]


def test_role_flags_build_the_config() -> None:
    assert configure().pd == PDConfig()
    config = configure("--role", "decode", "--pd-peer", "10.0.0.2:9555", "--pd-timeout", "5",
                       "--pd-local-prefill-tokens", "0", "--pd-no-local-retry")
    assert config.pd == PDConfig(role="decode", peer="10.0.0.2:9555", timeout_s=5.0, local_prefill_tokens=0,
                                 retry_local=False)
    assert configure("--role", "prefill", "--pd-peer", "[::1]:0").pd.address == ("::1", 0)
    assert configure("--role", "decode", "--pd-peer", "h:1", "--tp", "2").engine.parallel.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "decode"], "--role decode needs the peer address"),
        (["--pd-peer", "127.0.0.1:9555"], "only a prefill or decode instance has a peer"),
        (["--role", "prefill", "--pd-peer", "127.0.0.1"], "expected HOST:PORT"),
        (["--role", "prefill", "--pd-peer", "h:70000"], "expected HOST:PORT"),
        (["--role", "decode", "--pd-peer", "h:1", "--pd-timeout", "0"], "pd_timeout_s"),
        (["--role", "decode", "--pd-peer", "h:1", "--pd-local-prefill-tokens", "-1"], "pd_local_prefill_tokens"),
        (["--role", "decode", "--pd-peer", "h:1", "--no-prefix-cache"], "needs the prefix cache"),
    ],
)
def test_bad_role_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_peer() -> None:
    assert parse_peer("prefill.internal:9555") == ("prefill.internal", 9555)
    with pytest.raises(ValueError, match="pd_peer"):
        parse_peer(":9555")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # a prefill process
def test_serve_role_prefill_serves_a_decode_instance(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    peer = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "phloem.cli", "serve", "--role", "prefill", "--pd-peer", peer,
         "--model", str(model), "--data-dir", str(tmp_path), "--no-progress"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "listening for a decode instance" in line:
                break
        else:
            pytest.fail(f"the prefill instance exited with {proc.wait()} before listening")
        # Keep draining its stderr: a child blocked on a full pipe while it logs from a worker
        # thread cannot shut down cleanly, and its last lines explain a bad exit.
        rest: list[str] = []
        drain = threading.Thread(target=lambda: rest.extend(proc.stderr or ()), daemon=True)
        drain.start()
        prompt = [(7 * i + 1) % 256 for i in range(40)]
        params = SamplingParams(max_tokens=8)
        expected = Engine.from_pretrained(model).generate([prompt], params)[0].token_ids

        async def run() -> list[int]:
            config = PDConfig(role="decode", peer=peer, retry_local=False)
            async with PDEngineClient(Engine.from_pretrained(model), config) as client:
                outs = [out async for out in client.generate(prompt, params)]
                assert client.num_remote == 1
            return outs[-1].token_ids

        assert asyncio.run(run()) == expected
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        drain.join(5)
        assert code == 0, "".join(rest)[-3000:]
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_role_both_serves_a_plain_engine_client(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    from phloem.runtime.pd.decode import engine_client_for

    model = str(tiny_checkpoint("Qwen3_5MoeForCausalLM"))
    plain = engine_client_for(model, EngineConfig(), PDConfig())
    assert type(plain) is EngineClient
    with pytest.raises(ValueError, match="serves no HTTP"):
        engine_client_for(model, EngineConfig(), PDConfig(role="prefill", peer="h:1"))
