"""``ServerConfig``: everything ``phloem serve`` runs with, one section per layer.

    ServerConfig
      model      the model folder (None: the trained built-in model)
      chat_template  a Jinja chat template file overriding the model's
      engine     engine.config.EngineConfig     device, dtype, parallelism, pools, scheduler, kernels
      sessions   sessions.config.SessionConfig  data directory, index, TTLs, admission, spilling
      http       api.server.config.HttpConfig   socket, API keys, per-key limits, timeouts, logs
      pd         runtime.pd.roles.PDConfig       prefill/decode disaggregation

Each option is declared once, in the section of the layer that uses it, and validated there
(``tests/runtime/test_config.py`` walks the sections and fails on a name declared twice). What
spans sections is checked here: a prefill or decode instance needs the prefix cache.

Decision: it lives in ``phloem.cli`` because it is made of every layer's section, and only the
top layer may import them all (the import-linter layers ``cli -> benchmarks -> api -> sessions ->
runtime -> engine``); it is consumed only by the composition root (``cli.compose``), which hands
each layer its own section. Runtime-measured values (the model's fingerprint, page counts) are no
part of it. Nothing here imports torch, so ``phloem --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from phloem.api.server.config import HttpConfig
from phloem.engine.config import EngineConfig
from phloem.runtime.pd.roles import PDConfig
from phloem.sessions.config import SessionConfig

__all__ = ["SECTIONS", "ServerConfig"]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything ``phloem serve`` needs, as the sections of the layers that use it::

        ServerConfig(model="~/models/Qwen3.5-35B-A3B",
                     engine=EngineConfig(load=LoadConfig(device="cuda", dtype="bfloat16")),
                     http=HttpConfig(port=9000))

    Args:
        model: Hugging Face model folder; ``None`` means the trained built-in model, served
            from the package (``runtime.builtin_model.trained_model_path()``).
        chat_template: a Jinja chat template file used instead of the model folder's (its
            ``tokenizer_config.json`` / ``chat_template.jinja``): it renders chat requests, and
            the tool-call format and reasoning tags are read from it. None: the model's own.
        engine: the engine's options (``engine.config``): its device and dtype (``load``), the
            longest context (``scheduler.max_model_len``), tensor parallelism (``parallel``)...
        sessions: the sessions layer's options (``sessions.config``), among them the data
            directory (``data_dir``) and the server-wide limit on generations.
        http: the HTTP server's options (``api.server.config``): socket, API keys, per-key
            limits, timeouts, logs.
        pd: prefill/decode disaggregation (``--role``, ``--pd-peer``; ``runtime.pd.roles``); a
            prefill or decode instance needs the prefix cache (any ``tensor_parallel_size``).

    Raises:
        ValueError: a section is not of its type, or the sections disagree (the message names
            the field).
    """

    model: str | None = None
    chat_template: Path | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    pd: PDConfig = field(default_factory=PDConfig)

    def __post_init__(self) -> None:
        if self.model is not None and not self.model:
            raise ValueError("model: expected a model folder or None, got ''")
        if self.chat_template is not None and not isinstance(self.chat_template, Path):
            raise ValueError(f"chat_template: expected a Path or None, got {self.chat_template!r}")
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                article = "an" if kind.__name__[0] in "AEIOU" else "a"
                raise ValueError(f"{name}: expected {article} {kind.__name__}, got {type(getattr(self, name)).__name__}")
        if self.pd.is_disaggregated and not self.engine.cache.enable_prefix_caching:
            raise ValueError(f"pd: --role {self.pd.role} needs the prefix cache (drop --no-prefix-cache)")

    @property
    def data_dir(self) -> Path:
        """``sessions.data_dir``: models, spilled sessions, the index, kernel caches, the secret."""
        return self.sessions.data_dir

    def read_chat_template(self) -> str | None:
        """The text of ``chat_template``; None without one.

        Raises:
            OSError: The file cannot be read.
        """
        return None if self.chat_template is None else self.chat_template.read_text(encoding="utf-8")

    @property
    def models_dir(self) -> Path:
        """Where downloaded models and the random-weight test model live: ``data_dir / "models"``."""
        return self.data_dir / "models"


SECTIONS: dict[str, type] = {"engine": EngineConfig, "sessions": SessionConfig, "http": HttpConfig, "pd": PDConfig}
"""``ServerConfig``'s section fields and their types."""
