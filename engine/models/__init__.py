"""Model definitions, keyed by the Hugging Face ``architectures`` name.

All three supported architectures share one hybrid implementation; the loader absorbs their
checkpoint differences.

May import: ``engine.parallel``, ``engine.forward_batch``, ``engine.config``, ``phloem.kernels``
(and torch); not the loader, the runner, the cache or the sampling (import-linter's engine layers
contract checks it).
"""

from __future__ import annotations

from phloem.engine.models.qwen3_hybrid import Qwen3HybridForCausalLM

__all__ = ["ARCHITECTURES", "Qwen3HybridForCausalLM", "get_model_class"]

ARCHITECTURES: dict[str, type[Qwen3HybridForCausalLM]] = {
    "Qwen3_5MoeForCausalLM": Qwen3HybridForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3HybridForCausalLM,
    "Qwen3NextForCausalLM": Qwen3HybridForCausalLM,
}


def get_model_class(architecture: str) -> type[Qwen3HybridForCausalLM]:
    cls = ARCHITECTURES.get(architecture)
    if cls is None:
        raise ValueError(f"architecture: expected one of {sorted(ARCHITECTURES)}, got {architecture!r}")
    return cls
