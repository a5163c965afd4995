"""The model ``phloem serve`` and ``phloem demo`` serve when no ``--model`` is given.

It is the trained built-in model shipped in the package, ``runtime/_trained_model``: a 4.23M
parameter ``Qwen3_5MoeForCausalLM`` with an MTP layer, trained by ``tools/train`` on a corpus of
agent transcripts and Python text (``docs/default-model.md``). It writes ChatML turns and
well-formed ``<tool_call>`` JSON for the tools it was trained with, so the stack can be shown
doing real work with nothing to download; it is a test fixture and a demo, not an assistant.

It is served in place, NOT copied into the data directory: the engine and the tokenizer only
read the folder, so a copy would buy nothing but 17 MB per data directory and a copy that could
go stale when the package is upgraded. Sessions saved under one version of the folder are told
apart from another's by ``sessions.tiers.store.model_fingerprint`` (its config and tokenizer).

The API names it ``DEFAULT_MODEL_NAME`` (the folder's own name, ``_trained_model``, says nothing
to a client), whatever path reaches it. The random-weight model of ``runtime.default_model`` is
still built on demand for the tests and benchmarks that need one; it has a name of its own.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "served_model_name", "trained_model_path"]

DEFAULT_MODEL_NAME = "phloem-tiny-qwen3.5"


def trained_model_path() -> Path:
    """The trained built-in model's folder inside the installed package (read-only use)."""
    return Path(__file__).resolve().parent / "_trained_model"


def served_model_name(model: str | Path) -> str:
    """The name the API serves the model folder ``model`` under: ``DEFAULT_MODEL_NAME`` for the
    trained built-in model, the folder's name for any other."""
    folder = Path(model).expanduser()
    try:
        if folder.resolve() == trained_model_path():
            return DEFAULT_MODEL_NAME
    except OSError:
        pass  # an unreadable path is not the packaged folder
    return folder.name
