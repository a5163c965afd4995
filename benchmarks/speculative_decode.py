"""``phloem bench decode --speculative mtp:K``: where a speculative decode step's time goes.

Each point decodes the synthetic requests of ``run_decode`` twice on one engine: plain (the
speculator detached: no drafting, no MTP step on the trunk's rows) and speculating, both
synchronous (a speculating engine turns async scheduling off). The
speculative steps are split by phase (``SpeculativeRanks.seconds``, rank 0's wall time with the
device synchronized around each call): **draft** (the MTP layer's k steps and their LM head),
**verify** (GDN-state snapshot, the trunk over batch × (k + 1) tokens, its LM head),
**rollback** (restore and rerun over the accepted tokens, on the request-steps that rejected a
draft) and **rest** (the step's wall time less those: scheduling, acceptance, outputs). On CUDA
the plain pass replays the decode graphs while the speculative steps run eagerly
(``engine.speculative``), so the comparison includes the launch cost graphs save.

Accepted length is measured: tokens a request got per speculative step (accepted drafts + the
target's). Dummy weights draft noise, so it is ~1.0 there; ``accept_length`` adds a
*projection*: tok/s had each step emitted that many tokens at the measured step time. It is
conservative only while the measured steps rolled back (the report gives their share): at a
higher acceptance fewer steps roll back, though each reruns more tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from phloem.benchmarks.decode import run_decode
from phloem.engine import Engine, SpeculationStats

__all__ = ["SpeculativeSplit", "run_speculative_decode", "speculative_table"]

PHASES = ("draft", "verify", "rollback")


@dataclass(frozen=True, slots=True)
class SpeculativeSplit:
    batch: int
    context: int
    num_drafts: int
    plain_ms_per_step: float
    ms_per_step: float  # a speculating engine's step (a few plain ones included: plain_steps)
    phase_ms: dict[str, float]  # per timed step, by PHASES
    steps: int  # speculative steps timed
    plain_steps: int  # steps of the timed run that ran plain
    accepted_length: float  # tokens per request per speculative step
    rollback_share: float  # request-steps that rejected a draft (emitted fewer than k + 1)

    @property
    def rest_ms(self) -> float:
        return self.ms_per_step - sum(self.phase_ms.values())

    def tok_per_s_per_user(self, accepted_length: float | None = None) -> float:
        """At the measured accepted length, or at ``accepted_length`` (a projection)."""
        return 1000.0 * (accepted_length or self.accepted_length) / self.ms_per_step


def run_speculative_decode(
    engine: Engine, batch: int, context: int, bandwidth: float, steps: int = 20, warmup: int = 3,
) -> SpeculativeSplit:  # fmt: skip
    """Time ``batch`` synthetic requests at ``context`` plain, then speculating (module doc)."""
    spec = engine.speculator
    assert spec is not None, "the engine does not speculate (SpeculativeConfig)"
    runner = engine.runner
    hook = runner.hidden_hook
    engine.speculator, runner.hidden_hook = None, None
    try:
        plain = run_decode(engine, batch, context, bandwidth, steps, warmup, compare_sync=False)
    finally:
        engine.speculator, runner.hidden_hook = spec, hook
    before: list[SpeculationStats] = []

    def start() -> None:
        spec.ranks.seconds = {}
        before.append(spec.stats.snapshot())

    try:
        result = run_decode(engine, batch, context, bandwidth, steps, warmup, compare_sync=False,
                            tokens_per_step=spec.k + 1, before_timing=start)
        seconds = dict(spec.ranks.seconds or {})
    finally:
        spec.ranks.seconds = None
    return _split(batch, context, spec.k, plain.ms_per_step, result.ms_per_step, seconds, steps, before[0], spec.stats)


def _split(
    batch: int, context: int, k: int, plain_ms: float, ms: float, seconds: dict[str, float], steps: int,
    before: SpeculationStats, after: SpeculationStats,
) -> SpeculativeSplit:  # fmt: skip
    request_steps = after.request_steps - before.request_steps
    emitted = after.emitted_tokens - before.emitted_tokens
    full = after.emitted_lengths[k + 1] - before.emitted_lengths[k + 1] if k + 1 < len(after.emitted_lengths) else 0
    return SpeculativeSplit(
        batch, context, k, plain_ms, ms, {p: 1000.0 * seconds.get(p, 0.0) / steps for p in PHASES},
        after.steps - before.steps, after.plain_steps - before.plain_steps,
        emitted / request_steps if request_steps else 0.0, 1.0 - full / request_steps if request_steps else 0.0,
    )


def speculative_table(results: list[SpeculativeSplit], accept_length: float | None = None) -> list[str]:
    """The report's lines: one row per point, the step split in ms per step."""
    if not results:
        return []
    k = results[0].num_drafts
    head = ("| batch | context | plain ms/step | spec ms/step | draft | verify | rollback | rest | spec steps | "
            "plain steps | accepted length | rolled back | tok/s per user (plain) | tok/s per user (spec) |")
    cols = 14
    if accept_length is not None:
        head += f" tok/s per user at accepted length {accept_length:g} (projection) |"
        cols += 1
    lines = [
        f"speculative decoding mtp:{k}: each step's split in ms (draft = the MTP layer's {k} steps; verify = the "
        f"trunk over k + 1 = {k + 1} tokens a request; rollback = restore + rerun; rest = the step less those)",
        "", head, "|" + "---|" * cols,
    ]
    for r in results:
        row = (
            f"| {r.batch} | {r.context} | {r.plain_ms_per_step:.2f} | {r.ms_per_step:.2f} "
            + "".join(f"| {r.phase_ms[p]:.2f} " for p in PHASES)
            + f"| {r.rest_ms:.2f} | {r.steps} | {r.plain_steps} | {r.accepted_length:.2f} | {r.rollback_share:.0%} "
            f"| {1000.0 / r.plain_ms_per_step:.0f} | {r.tok_per_s_per_user():.0f} |"
        )
        if accept_length is not None:
            row += f" {r.tok_per_s_per_user(accept_length):.0f} |"
        lines.append(row)
    if accept_length is not None:
        lines += ["", f"projection: {accept_length:g} tokens a step at the measured spec ms/step; not measured "
                      "(conservative while 'rolled back' is near 100%: fewer rollbacks at a higher acceptance)"]
    return lines
