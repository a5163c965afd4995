"""``phloem serve``'s authentication and limit flags: API keys from flags, a file and
``$PHLOEM_API_KEY``; loopback-only without keys; limits reach their sections; a key never
shows in a repr, an error message or the help text."""

from __future__ import annotations

from pathlib import Path

import pytest

from phloem.cli.config import ServerConfig
from phloem.cli.main import main
from phloem.api.server.config import ApiKey, is_loopback, parse_api_key, read_api_keys_file

SECRET = "s3cr3t-key-0123456789abcdef"


def serve(tmp_path: Path, *argv: str) -> list[str]:
    # A folder phloem's model check accepts (nothing loads it), and any free port to bind.
    (tmp_path / "config.json").write_text("{}")
    return ["serve", "--model", str(tmp_path), "--data-dir", str(tmp_path), "--port", "0", *argv]


def test_keys_from_flags_and_a_file(served: list[ServerConfig], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# comment\n\n  {SECRET}:admin  \nanother-key-0123456789\n")
    assert main(serve(tmp_path, "--api-key", "flag-key-0123456789ab", "--api-keys-file", str(keys),
                      "--host", "0.0.0.0")) == 0
    (config,) = served
    assert config.http.api_keys == (ApiKey("flag-key-0123456789ab"), ApiKey(SECRET, admin=True),
                                    ApiKey("another-key-0123456789"))
    assert config.http.host == "0.0.0.0" and config.http.auth_enabled
    assert SECRET not in repr(config)


def test_the_environment_key_is_the_default(served: list[ServerConfig], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHLOEM_API_KEY", f"{SECRET}:admin")
    assert main(serve(tmp_path)) == 0
    assert served[-1].http.api_keys == (ApiKey(SECRET, admin=True),)
    assert main(serve(tmp_path, "--api-key", "flag-key-0123456789ab")) == 0
    assert served[-1].http.api_keys == (ApiKey("flag-key-0123456789ab"),), "a flag wins over the variable"


def test_without_keys_only_loopback(served: list[ServerConfig], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(serve(tmp_path, "--host", "0.0.0.0"))
    assert info.value.code == 2 and "--allow-remote-without-auth" in capsys.readouterr().err
    assert served == []
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        assert main(serve(tmp_path, "--host", host)) == 0
    assert main(serve(tmp_path, "--host", "0.0.0.0", "--allow-remote-without-auth")) == 0
    assert served[-1].http.allow_remote_without_auth and not served[-1].http.auth_enabled
    assert [is_loopback(h) for h in ("10.0.0.1", "example.com", "[::1]")] == [False, False, True]


def test_limit_flags_reach_the_config(served: list[ServerConfig], tmp_path: Path) -> None:
    argv = serve(tmp_path, "--max-body-bytes", "1000", "--max-context-len", "2048",
                 "--max-sessions-per-key", "7", "--max-generations-per-key", "3",
                 "--max-generations", "9", "--stream-idle-timeout", "30")
    assert main(argv) == 0
    (config,) = served
    http = config.http
    assert (http.max_body_bytes, config.engine.scheduler.max_model_len, http.max_sessions_per_key,
            http.max_generations_per_key, config.sessions.max_num_generations,
            http.stream_idle_timeout_s) == (1000, 2048, 7, 3, 9, 30.0)


@pytest.mark.parametrize(("argv", "message"), [
    (["--api-key", "short"], "got a key of 5 characters"),
    (["--api-key", "bad key with spaces 0123456789"], "other characters"),
    (["--api-key", SECRET + ":root"], "expected `KEY` or `KEY:admin`"),
    (["--max-generations-per-key", "0"], "max_generations_per_key: expected"),
    (["--stream-idle-timeout", "0"], "stream_idle_timeout_s: expected"),
])
def test_bad_values_are_usage_errors_that_never_echo_a_key(
        served: list[ServerConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(serve(tmp_path, *argv))
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and message in error
    assert SECRET not in error and "short" not in error and "spaces" not in error


def test_a_keys_file_error_names_the_line_not_the_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{SECRET}\n{SECRET}x:owner\n")
    with pytest.raises(ValueError, match=r"keys:2: expected") as info:
        read_api_keys_file(keys)
    assert SECRET not in str(info.value)
    keys.write_text(f"{SECRET}\n{SECRET}\n")
    with pytest.raises(ValueError, match="listed twice"):
        read_api_keys_file(keys)
    assert parse_api_key(f" {SECRET} ") == ApiKey(SECRET)


def test_the_help_never_shows_the_environment_key(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PHLOEM_API_KEY", SECRET)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--api-keys-file" in out and "--stream-idle-timeout" in out and SECRET not in out
