"""Records the logits the engine sampled from, per request, and compares two runs' records."""

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


def assert_logits_follow(
    got_tokens: list[list[int]], want_tokens: list[list[int]], got_rows: list[list[torch.Tensor]],
    want_rows: list[list[torch.Tensor]], rel_tol: float, what: str,
) -> int:
    """Per request, each sampled row's logits within ``rel_tol`` (``||a - b|| / ||b||``) of the
    wanted run's, up to and including the step where the two greedy paths part (later rows read
    different histories). Returns the number of rows compared."""
    compared = 0
    for r, (got, want, a_rows, b_rows) in enumerate(zip(got_tokens, want_tokens, got_rows, want_rows, strict=True)):
        for i, (a, b) in enumerate(zip(a_rows, b_rows)):
            rel = float((a - b).norm() / b.norm())
            assert rel <= rel_tol, f"request {r} step {i}: logits {rel:.3f} away from {what}"
            compared += 1
            if got[i] != want[i]:
                break
    return compared
