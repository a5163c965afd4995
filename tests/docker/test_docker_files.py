"""The Docker files stay in step with the README and the CLI (docker itself does not run here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from phloem.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


def readme_setup_commands() -> list[str]:
    """The pip commands of the README's first code block (set-up + main job)."""
    block = re.search(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None, "README has no bash block"
    return [c.strip() for c in block.group(1).split("&&") if c.strip().startswith("pip install")]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_installs_exactly_like_the_readme(dockerfile: str) -> None:
    text = (ROOT / "docker" / dockerfile).read_text()
    run_lines = [line.removeprefix("RUN ").strip() for line in text.splitlines() if line.startswith("RUN pip")]
    installs = [c.strip() for line in run_lines for c in line.split("&&")]
    commands = readme_setup_commands()
    assert commands, "the README's set-up line lost its pip commands"
    for command in commands:
        assert command in installs, f"{dockerfile} does not run the README's `{command}`"


def test_compose_wires_redis_into_the_server() -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"redis", "phloem"} <= set(services)
    phloem = services["phloem"]
    command = phloem["command"]
    url = command[command.index("--redis-url") + 1]
    assert url.startswith("redis://redis:")
    assert "redis" in phloem["depends_on"]
    dockerfile = ROOT / "docker" / Path(phloem["build"]["dockerfile"]).name
    assert dockerfile.is_file()
    # Every flag the compose file passes is one `phloem serve` accepts.
    assert command[:2] == ["phloem", "serve"]
    args = build_parser().parse_args(command[1:])
    assert args.redis_url == url and args.host == "0.0.0.0"


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_default_command_parses(dockerfile: str) -> None:
    text = (ROOT / "docker" / dockerfile).read_text()
    cmd = re.search(r'^CMD (\[.*\])$', text, re.M)
    assert cmd is not None
    argv = yaml.safe_load(cmd.group(1))
    assert argv[:2] == ["phloem", "serve"]
    build_parser().parse_args(argv[1:])
