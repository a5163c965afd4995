"""The random-weight tiny model: a ``Qwen3_5MoeForCausalLM`` with RANDOM weights, built on first use.

Tests and benchmarks that need a model whose output is noise (generations that run to
``max_tokens`` instead of stopping at the end of a turn, any vocabulary id as likely as another)
ask for it by calling ``ensure_default_model``; the benchmark shapes use its tokenizer
(``runtime.model_shapes``). ``phloem serve`` without ``--model`` serves the trained built-in
model instead (``runtime.builtin_model``). Its output is gibberish by construction.

    data_dir/models/phloem-tiny-qwen3.5-random/
        config.json            real architecture, tiny shapes (``runtime._default_model_weights``)
        model.safetensors      fp32, Hugging Face names, per-expert layout, seeded (same module)
        tokenizer.json         byte-level BPE trained on ``runtime/_corpus.txt``
                               (``runtime._default_model_tokenizer``)
        tokenizer_config.json  ChatML chat template, eos ``<|im_end|>``
        README.md              says the weights are random

Both ``Engine.from_pretrained`` and transformers' ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained`` read the folder. The build is deterministic (same files every
time), takes well under a second after torch is imported, and is atomic: it happens in a
temporary sibling folder that is renamed into place, so a folder with the final name is always
complete, and two processes racing to build it both end up using one complete copy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

# CHAT_TEMPLATE is unused here: code that imports the demo model's template from this module keeps working.
from phloem.runtime._default_model_tokenizer import (
    CHAT_TEMPLATE, SPECIAL_TOKENS, TARGET_VOCAB, tokenizer_config, train_tokenizer,
)
from phloem.runtime._default_model_weights import model_config, random_weights, weight_shapes
from phloem.runtime.builtin_model import DEFAULT_MODEL_NAME, trained_model_path
from phloem.runtime.progress import progress_bar

# DEFAULT_MODEL_NAME and trained_model_path (the trained model's) are re-exported for old imports.
__all__ = ["DEFAULT_MODEL_NAME", "RANDOM_MODEL_NAME", "SPECIAL_TOKENS", "ensure_default_model",
           "trained_model_path"]

RANDOM_MODEL_NAME = "phloem-tiny-qwen3.5-random"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md")

_README = """# phloem-tiny-qwen3.5-random

**The weights of this model are random.** It generates gibberish. It exists for the tests and
benchmarks that need a model whose output is noise, with nothing to download: the architecture (`Qwen3_5MoeForCausalLM`:
3 Gated-DeltaNet layers + 1 gated full-attention layer, 8 experts top-2 + a shared expert) is real,
only tiny, so sessions, the prefix cache, forks and the API behave exactly as with a real model.

The tokenizer is a byte-level BPE trained on a few KB of English (any text round-trips), with the
ChatML special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (end of turn, the EOS).

Built by `phloem.runtime.default_model.ensure_default_model`; delete this folder to rebuild it.
`phloem serve` without `--model` serves the trained built-in model instead.
"""


def ensure_default_model(data_dir: Path, show_progress: bool | None = None) -> Path:
    """Return the random-weight model folder under ``data_dir``, building it on first use.

    Args:
        data_dir: The Phloem data directory; the model goes to
            ``data_dir/models/phloem-tiny-qwen3.5-random``.
        show_progress: A progress bar while building: False never, None when stderr is a
            terminal (``runtime.progress``).

    Returns:
        The model folder (complete: the build is atomic).

    Raises:
        OSError: ``data_dir`` is not writable, or a non-model folder occupies the name.
    """
    final = Path(data_dir).expanduser() / "models" / RANDOM_MODEL_NAME
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{RANDOM_MODEL_NAME}.", dir=final.parent))
    try:
        _build(build, show_progress)
        try:
            os.rename(build, final)
        except OSError as exc:
            # Lost a race with another process: its copy is as good as ours.
            if not _is_complete(final):
                raise OSError(f"{final} exists but is not a complete demo model; delete it to rebuild") from exc
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return final


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _FILES)


def _build(folder: Path, show_progress: bool | None) -> None:
    # The bar's units: training the tokenizer, each weight tensor, writing the checkpoint.
    num_tensors = len(weight_shapes(model_config(TARGET_VOCAB, 0, 0)))
    with progress_bar(num_tensors + 2, "building the demo model", "step", show_progress) as advance:
        tokenizer = train_tokenizer()
        advance(1)
        tokenizer.save(str(folder / "tokenizer.json"))
        special: dict[str, int] = {}
        for token in SPECIAL_TOKENS:
            token_id = tokenizer.token_to_id(token)
            assert token_id is not None, f"tokenizer: special token {token!r} missing after training"
            special[token] = token_id
        vocab_size = 64 * math.ceil(tokenizer.get_vocab_size() / 64)
        config = model_config(vocab_size, eos_id=special["<|im_end|>"], pad_id=special["<|endoftext|>"])
        _write_json(folder / "config.json", config)
        weights = random_weights(config, advance)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        advance(1)
    _write_json(folder / "tokenizer_config.json", tokenizer_config(special))
    (folder / "README.md").write_text(_README)
    for name in _FILES:
        with open(folder / name, "rb") as f:
            os.fsync(f.fileno())


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
