"""The built-in default model: which folder it is and the name the API serves it under."""

from __future__ import annotations

from pathlib import Path

import pytest

from phloem.runtime.builtin_model import DEFAULT_MODEL_NAME, served_model_name, trained_model_path
from phloem.runtime.default_model import RANDOM_MODEL_NAME


def test_the_default_is_the_packaged_trained_model() -> None:
    folder = trained_model_path()
    assert folder.parent.name == "runtime" and (folder / "model.safetensors").is_file()


def test_the_trained_model_is_served_as_the_default_name_by_any_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served_model_name(trained_model_path()) == DEFAULT_MODEL_NAME
    monkeypatch.chdir(trained_model_path().parent)
    assert served_model_name("_trained_model") == DEFAULT_MODEL_NAME
    (tmp_path / "link").symlink_to(trained_model_path())
    assert served_model_name(tmp_path / "link") == DEFAULT_MODEL_NAME


def test_any_other_folder_is_served_by_its_name(tmp_path: Path) -> None:
    assert served_model_name(tmp_path / "models" / RANDOM_MODEL_NAME) == RANDOM_MODEL_NAME
    assert served_model_name(tmp_path / "_trained_model") == "_trained_model"
    assert RANDOM_MODEL_NAME != DEFAULT_MODEL_NAME
