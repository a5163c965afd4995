"""tools/train/prepare.py writes the built-in model's corpus deterministically, in the chat template."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _prepare():
    spec = importlib.util.spec_from_file_location("train_prepare", ROOT / "tools" / "train" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # writes the corpus twice
def test_same_arguments_write_the_same_bytes(tmp_path: Path) -> None:
    prepare = _prepare()
    a = prepare.prepare(tmp_path / "a", stdlib_bytes=30_000, transcripts=40, tokenizer=False)
    b = prepare.prepare(tmp_path / "b", stdlib_bytes=30_000, transcripts=40, tokenizer=False)
    for name in ("train.txt", "heldout.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert a[name]["sha256"] == b[name]["sha256"]
    assert a["documents"]["heldout"] >= 1
    # The standard-library cap holds (module docstrings plus sources, each source cut at a line end).
    docs = prepare.stdlib_documents(30_000)
    headers = sum(len(d.split("\n", 1)[0]) + 1 for d in docs[1:])  # "# file: Lib/NAME" lines
    assert sum(len(d) for d in docs) - headers <= 30_000 and len(docs[0]) <= 30_000 // 4
    assert any(d.startswith("# file: Lib/") for d in docs)


def test_transcripts_hold_tool_calls_and_results_in_chatml() -> None:
    prepare = _prepare()
    docs = prepare.transcript_documents(60)
    assert docs == prepare.transcript_documents(60)
    # The assistant turns' calls (the system turn's format line has a placeholder, not JSON).
    calls = [json.loads(m) for d in docs for m in re.findall(r"<tool_call>\n(\{\"name\": \".*?)\n</tool_call>", d)]
    assert {c["name"] for c in calls} >= {"calculator", "get_weather", "kv_get", "list_files", "read_file", "run_tests"}
    assert all(isinstance(c["arguments"], dict) for c in calls)
    for doc in docs:
        assert doc.startswith("<|im_start|>") and doc.endswith("<|im_end|>\n")
        if "<tool_call>" in doc:
            assert "<|im_start|>user\n<tool_response>\n" in doc
            assert "# Tools" in doc  # the tools are declared in the system turn
