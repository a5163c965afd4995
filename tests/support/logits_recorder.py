"""Records the logits the engine sampled from, per request, for tests that compare two runs."""

from __future__ import annotations

import pytest
import torch


class LogitsRecorder:
    """Records the logits each sampled row of each request had, keyed by its params object."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import phloem.engine.model_runner as model_runner

        self.rows: dict[int, list[torch.Tensor]] = {}
        sample = model_runner.sample

        def recording(logits, params, *args):  # type: ignore[no-untyped-def]
            for row, p in zip(logits, params):
                self.rows.setdefault(id(p), []).append(row.float().cpu())
            return sample(logits, params, *args)

        monkeypatch.setattr(model_runner, "sample", recording)
