"""Engine configuration: one frozen dataclass per component.

``ModelConfig`` is parsed from a Hugging Face ``config.json`` (plain text config, or a multimodal
config whose ``text_config`` holds the language model). The three supported architectures share
one hybrid layout, so one config type describes them all:

    Qwen3_5MoeForCausalLM   every layer MoE (router always renormalises top-k)
    Qwen3_5ForCausalLM      every layer a dense SwiGLU MLP
    Qwen3NextForCausalLM    MoE unless ``mlp_only_layers`` / ``decoder_sparse_step`` say otherwise

``EngineConfig`` gathers the engine's sections (load, cache, scheduler, runner, parallel,
kernels, grammar, speculative); each option is declared once, in its section. Runtime-measured values (page counts,
slot counts) live on their owners, never here. Nothing here imports torch: the CLI builds an
``EngineConfig`` before torch loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from phloem.kernels.config import KernelConfig

__all__ = [
    "DTYPES", "KV_CACHE_DTYPES", "LOAD_FORMATS", "QUANTIZATIONS", "SPECULATIVE_METHODS", "CacheConfig", "EngineConfig",
    "GrammarConfig", "KernelConfig",
    "LoadConfig", "ModelConfig", "ParallelConfig", "RunnerConfig", "SchedulerConfig", "SpeculativeConfig",
    "default_max_num_batched_tokens",
]

DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("safetensors", "dummy")
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")

SUPPORTED_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")

# Multimodal wrappers whose text part we serve.
_ARCH_ALIASES = {
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
}

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and hyper-parameters of a hybrid GDN + gated-attention model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: expected one of {SUPPORTED_ARCHITECTURES}, got {self.architecture!r}"
            )
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        bad = [t for t in self.layer_types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)]
        if bad:
            raise ValueError(f"layer_types: unknown layer type(s) {sorted(set(bad))}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: must divide num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_key_heads: must divide linear_num_value_heads={self.linear_num_value_heads}, "
                f"got {self.linear_num_key_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Model layer indices of the full-attention layers (their KV lives in the page pool)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Model layer indices of the GDN layers (their state lives in the slot pool)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv1d: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.num_experts <= 0 or layer_idx in self.mlp_only_layers:
            return False
        return (layer_idx + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config dict (text config, or one with ``text_config``)."""
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError("architectures: config.json names no architecture")
        arch = _ARCH_ALIASES.get(archs[0], archs[0])
        text = dict(raw.get("text_config") or raw)
        rope = dict(text.get("rope_parameters") or {})
        num_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
            ]
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_heads = int(text["num_attention_heads"])
        return cls(
            architecture=arch,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            layer_types=tuple(layer_types[:num_layers]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(text.get("num_key_value_heads", num_heads)),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // num_heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
            ),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_experts=int(text.get("num_experts") or 0),
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            # Qwen3.5-MoE's router always renormalises; Qwen3-Next reads the flag.
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            eos_token_ids=eos_ids,
            hidden_act=str(text.get("hidden_act", "silu")),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"path: expected a model folder with config.json, got {str(path)!r}")
        return cls.from_dict(json.loads(config_path.read_text()))


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Memory pools. Sizes come from free memory unless given explicitly (tests, benchmarks).

    Args:
        page_size: tokens per KV page of the full-attention layers.
        memory_fraction: share of the device memory left after weights that the pools may take
            (CPU: of ``cpu_pool_bytes``).
        state_fraction: share of the pool budget given to GDN state slots; the rest is KV pages.
        num_pages / num_state_slots: explicit sizes that bypass the memory-based sizing.
        cpu_pool_bytes: the pool budget on CPU, where "free memory" is not a useful signal.
        enable_prefix_caching: keep finished prefixes (KV pages + GDN checkpoints) in the radix cache.
        checkpoint_interval: also checkpoint every this many tokens of a long prefill (a multiple
            of ``page_size``; 0 disables), except inside the last chunk of a turn resumed from
            the cache, which ends at a prompt-end checkpoint (``engine.scheduler``). A checkpoint
            of Qwen3.5-35B-A3B weighs ~61 MiB, about 3,000 tokens of KV, so the default keeps
            them sparse.
        checkpoint_prompt_end: also checkpoint where a generating request's prompt ends (a copy
            of its partial last page goes with it), one token before the end: the prefill chunk
            is cut there, and the last prompt token runs in the next step (with the decode
            batch). A client that resends that prompt, alone (a retried or regenerated turn,
            ``n`` across requests) or with a different continuation (a stateless chat client
            whose chat template re-renders the previous answer differently, Qwen3's drops the
            reasoning; output text that does not re-tokenize to the same ids), then reuses all
            of it but that last token, which it must compute anyway for its logits
            (docs/decisions.md, "A resent prompt is a full hit"). Costs one state slot per
            generation until the radix cache evicts it (by kind, then recompute cost per byte,
            least recently used on a tie: ``engine.cache.radix``), and the request one more step to its
            first token (a one-token row beside the decode batch); see
            ``prompt_end_split_min_tokens`` for the turns spared that step.
        prompt_end_split_min_tokens: a request that resumed from the cache and computes fewer
            prompt tokens than this (an agent's next turn: a tool result) takes its prompt-end
            checkpoint at the prompt's very end instead: its prompt runs in one step and its
            next decode step stays queued (``engine.step_pipeline``), but a resend of it
            recomputes those tokens from the checkpoint before them (about one step's cost on a
            GPU below a few hundred tokens, where reading the weights dominates). 0: every
            resend is a full hit. A fresh prompt always takes it one token early.
        kv_cache_dtype: ``"auto"`` stores the KV pages in the model's dtype; ``"fp8_e4m3"``
            stores them as ``float8_e4m3fn`` with a unit scale (a saturating cast on write, an
            upcast to the model's dtype on read; docs/decisions.md, "FP8 KV cache"), half the
            bytes of bf16 per token. The conv state stays in the model's dtype and the
            recurrent state in fp32.
        handoff_hold_s: the longest a checkpoint handed to a known next user stays locked for
            it (``engine.cache.holds``): a session turn's end (a request added with
            ``hold_turn_end``) until its session's pin, an imported prefix until the request
            resuming on it is admitted. The user normally comes within milliseconds; a
            prefetch's append may come later, and finds the prefix evictable again after this.
    """

    page_size: int = 16
    memory_fraction: float = 0.85
    state_fraction: float = 0.25
    num_pages: int | None = None
    num_state_slots: int | None = None
    cpu_pool_bytes: int = 256 * 1024 * 1024
    enable_prefix_caching: bool = True
    checkpoint_interval: int = 4096
    checkpoint_prompt_end: bool = True
    prompt_end_split_min_tokens: int = 256
    kv_cache_dtype: str = "auto"
    handoff_hold_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.handoff_hold_s >= 0:
            raise ValueError(f"handoff_hold_s: expected >= 0, got {self.handoff_hold_s}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check_ints(
            self,
            ("page_size", "num_pages", "num_state_slots", "cpu_pool_bytes", "checkpoint_interval",
             "prompt_end_split_min_tokens"),
        )
        if self.prompt_end_split_min_tokens < 0:
            raise ValueError(f"prompt_end_split_min_tokens: expected >= 0, got {self.prompt_end_split_min_tokens}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size: expected a positive power of two, got {self.page_size}")
        if self.checkpoint_interval < 0 or self.checkpoint_interval % self.page_size:
            raise ValueError(
                f"checkpoint_interval: expected 0 or a multiple of page_size={self.page_size}, "
                f"got {self.checkpoint_interval}"
            )
        if self.cpu_pool_bytes <= 0:
            raise ValueError(f"cpu_pool_bytes: expected > 0, got {self.cpu_pool_bytes}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction: expected (0, 1], got {self.memory_fraction}")
        if not 0.0 < self.state_fraction < 1.0:
            raise ValueError(f"state_fraction: expected (0, 1), got {self.state_fraction}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages: expected >= 2, got {self.num_pages}")
        if self.num_state_slots is not None and self.num_state_slots < 2:
            raise ValueError(f"num_state_slots: expected >= 2, got {self.num_state_slots}")


# The step's token budget (the prefill chunk) when none is given, by device type; chosen by
# measurement, docs/configuration.md ("The prefill chunk") has the figures. A GPU prefills a long
# prompt about twice as fast in 8,192-token chunks as in 2,048; on a CPU longer chunks gain
# nothing (no launches to amortise) and hold concurrent decodes for seconds.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 512}


def default_max_num_batched_tokens(device: str) -> int:
    """The step budget on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``) when none is given."""
    return DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device.split(":")[0], DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"])


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits.

    Args:
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks);
            ``None``: ``DEFAULT_MAX_NUM_BATCHED_TOKENS`` of the engine's device type
            (``for_device``).
        max_num_seqs: running requests at most (also the largest decode batch).
        max_model_len: longest token history a request may reach; ``None`` = the model's limit.
        async_scheduling: queue the next decode step on the device before reading the current
            one's sampled ids, so host work overlaps device work (``engine.step_pipeline``; the
            tokens are the same). Not for the steps of a disaggregated prefill.
        seat_yield_min_tokens: with every seat taken, a waiting turn takes the seat of a running
            request only if that one brought at least this many prompt tokens more than the turn
            needs (``engine.scheduler``): a fresh document beside a tool result, not requests of
            about one size trading seats. ``None``: seats are never yielded.
    """

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    async_scheduling: bool = True
    seat_yield_min_tokens: int | None = 256

    def __post_init__(self) -> None:
        _check_ints(self, ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "seat_yield_min_tokens"))
        if self.seat_yield_min_tokens is not None and self.seat_yield_min_tokens <= 0:
            raise ValueError(f"seat_yield_min_tokens: expected > 0, got {self.seat_yield_min_tokens}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens: expected > 0, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs: expected > 0, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len: expected > 0, got {self.max_model_len}")

    def for_device(self, device: str) -> SchedulerConfig:
        """This config with its token budget decided: the one given, else ``device``'s default."""
        if self.max_num_batched_tokens is not None:
            return self
        return replace(self, max_num_batched_tokens=default_max_num_batched_tokens(device))


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """How steps run on the device.

    Args:
        attention_backend: ``"auto"`` (FlashInfer on CUDA when importable and the model runs in
            fp16 / bf16, the only dtypes FlashInfer builds; else torch), ``"flashinfer"`` or
            ``"torch"``.
        enable_cuda_graph: capture decode steps as CUDA graphs, and other steps piecewise
            (``prefill_graph_tokens``); CUDA + FlashInfer + the Triton kernels only.
        max_graph_batch_size: the largest captured decode batch; bigger ones run eagerly.
        prefill_graph_tokens: with ``enable_cuda_graph``, prefill and mixed steps of up to this many
            tokens replay piecewise CUDA graphs (all but the full-attention layers' attention,
            ``engine.prefill_graph``; tensor parallelism runs them eagerly); 0: always eagerly.
    """

    attention_backend: str = "auto"
    enable_cuda_graph: bool = True
    max_graph_batch_size: int = 64
    prefill_graph_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "flashinfer", "torch"):
            raise ValueError(
                f"attention_backend: expected 'auto', 'flashinfer' or 'torch', got {self.attention_backend!r}"
            )
        if self.max_graph_batch_size <= 0:
            raise ValueError(f"max_graph_batch_size: expected > 0, got {self.max_graph_batch_size}")
        if not 0 <= self.prefill_graph_tokens <= 8192:
            raise ValueError(f"prefill_graph_tokens: expected 0 to 8192, got {self.prefill_graph_tokens}")


MAX_TP_SIZE = 8


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many ranks run the model.

    Args:
        tensor_parallel_size: ranks of the tensor-parallel group, 1 to ``MAX_TP_SIZE``: one
            process each and, on CUDA, one GPU each (the engine's device and the ones after it).
            It must divide the attention and GDN heads (``engine.parallel.check_tp_size``).
        expert_parallel: split the routed experts across the ranks whole (rank ``r`` holds experts
            ``[r*E/N, (r+1)*E/N)``) instead of splitting every expert's intermediate; needs
            ``tensor_parallel_size > 1``, a MoE model and ``E`` divisible by it. Everything else
            stays tensor-parallel (``engine.models._moe``).
    """

    tensor_parallel_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_TP_SIZE:
            raise ValueError(f"tensor_parallel_size: expected an integer in [1, {MAX_TP_SIZE}], got {size!r}")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"expert_parallel: expected a bool, got {self.expert_parallel!r}")
        if self.expert_parallel and size == 1:
            raise ValueError("expert_parallel: needs tensor_parallel_size > 1 (one rank holds every expert)")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How weights are obtained.

    Args:
        load_format: ``"safetensors"`` reads the folder; ``"dummy"`` builds random weights of the
            real shapes directly on the target device (benchmarks).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: ``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"auto"`` (checkpoint dtype; bf16 for dummy).
        seed: seed for dummy weights.
        show_progress: draw progress bars while loading weights and capturing CUDA graphs
            (``engine.progress_bars``): False never, None when stderr is a terminal.
            Tensor-parallel workers never draw one.
        quantization: ``None`` serves the weights as stored (an FP8 checkpoint, one whose
            config.json has ``quantization_config.quant_method == "fp8"``, loads as FP8 either
            way); ``"fp8"`` also quantizes a bf16 checkpoint's (or dummy) projection weights at
            load to block FP8 (e4m3, one scale per 128x128 block; ``engine.models._fp8``).
    """

    load_format: str = "safetensors"
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    show_progress: bool | None = None
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: expected 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected auto/bfloat16/float16/float32, got {self.dtype!r}")
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _check_ints(self, ("seed",))
        if self.seed < 0:
            raise ValueError(f"seed: expected >= 0, got {self.seed}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: expected None or 'fp8', got {self.quantization!r}")


SPECULATIVE_METHODS = ("mtp",)
MAX_DRAFT_TOKENS = 4
DEFAULT_MAX_VERIFY_TOKENS = 128
"""Tokens a verify forward may hold before a step runs plain. Speculation pays while the verify of
B × (k + 1) tokens costs about what a plain step of B tokens does: while its GEMMs stay below the
ridge point, where reading the weights stops bounding them. A bf16 GEMM over weights does 2 FLOP
per 2 bytes of weight per token, so its arithmetic intensity is about its token count, and the
H200's ridge is 989 TFLOP/s / 4.8 TB/s ≈ 206 tokens (≈ 180 at the rates the benchmarks measure).
128 stops short of it, since before the ridge the MoE's distinct experts (read once each) grow
with the tokens too: k = 3 speculates up to batch 32, k = 1 up to 64. A device measurement
replaces the figure (docs/decisions.md)."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (off by default).

    Args:
        method: ``None`` (off) or ``"mtp"``: the checkpoint's multi-token-prediction layer
            (``mtp.*``, ``engine.models.mtp``) drafts. With ``"mtp"`` the loader loads that layer
            and fails when the checkpoint has none.
        num_draft_tokens: draft tokens per step, 1 to ``MAX_DRAFT_TOKENS`` (the MTP layer run
            recursively); 0 when off.
        max_verify_tokens: the most tokens a verify forward may hold, batch × (num_draft_tokens
            + 1): a decode step of more requests than ``max_batch_size`` runs plain.
            ``DEFAULT_MAX_VERIFY_TOKENS`` (the arithmetic is there) until a device measures it.

    With ``"mtp"`` the synchronous engine loop drafts ``num_draft_tokens`` tokens a step and
    verifies them in one forward (``engine.speculative``): greedy and seeded requests get their
    plain tokens, token for token, unseeded sampled requests tokens of the plain distribution
    (rejection sampling), with or without a grammar or logprobs. Requests with penalties, a logit
    bias or ``min_tokens`` run plain steps. Under tensor parallelism every rank drafts, verifies
    and rolls back alongside rank 0 (on CPU; on CUDA at TP=1 only). For now speculative steps run
    eagerly (CUDA graphs serve the plain steps) and async scheduling is turned off.
    """

    method: str | None = None
    num_draft_tokens: int = 0
    max_verify_tokens: int = DEFAULT_MAX_VERIFY_TOKENS

    def __post_init__(self) -> None:
        _check_ints(self, ("num_draft_tokens", "max_verify_tokens"))
        if self.method is None:
            if self.num_draft_tokens != 0:
                raise ValueError(f"num_draft_tokens: expected 0 without a method, got {self.num_draft_tokens}")
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method: expected None or one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens: expected 1 to {MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}")
        if self.max_verify_tokens < self.num_draft_tokens + 1:
            raise ValueError(
                f"max_verify_tokens: expected at least num_draft_tokens + 1 = {self.num_draft_tokens + 1} "
                f"(one request's verify), got {self.max_verify_tokens}"
            )

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def uses_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def max_batch_size(self) -> int:
        """The largest decode step that speculates: ``max_verify_tokens // (k + 1)`` (0 when off)."""
        return self.max_verify_tokens // (self.num_draft_tokens + 1) if self.enabled else 0

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig:
        """``"mtp:K"`` (the future ``--speculative`` flag's value) -> ``SpeculativeConfig("mtp", K)``;
        ``None``, ``""`` or ``"off"``: off.

        Raises:
            ValueError: another form, an unknown method or K outside 1..``MAX_DRAFT_TOKENS``.
        """
        if text is None or text.strip().lower() in ("", "off", "none"):
            return cls()
        method, sep, count = text.strip().partition(":")
        if not sep or not count.strip().isdigit():
            raise ValueError(f"speculative: expected METHOD:K (e.g. 'mtp:3') or 'off', got {text!r}")
        return cls(method.strip().lower(), int(count))


@dataclass(frozen=True, slots=True)
class GrammarConfig:
    """Structured output: what a client's grammar may cost (``engine.sampling.grammar_limits``),
    where it compiles and how much compiled grammars may hold.

    The limits are measured on the built-in model's tokenizer (docs/decisions.md): a schema at
    the enum and literal limits compiles in 0.1-0.25 s and holds at most about 9 MB, 128 KiB of
    plain properties in 1-2 s; past them compile time and memory grow much faster (a
    100,000-value ``enum``: 114 s and +1 GB).

    Args:
        max_schema_bytes: the JSON text of one grammar (a ``response_format`` schema, or a
            structural tag with every tool's schema), in bytes.
        max_depth: nesting of that JSON document (objects and arrays; a schema nested ``n``
            properties deep is about ``2n``).
        max_enum_values: values of one ``enum``.
        max_literal_bytes: the JSON text of every ``enum`` value and ``const`` of one grammar,
            together (xgrammar builds a trie over them: its size is what costs).
        max_pattern_bytes: one ``pattern`` (a regular expression).
        max_pattern_repeat: a ``pattern``'s repetition counts expanded (``a{1000}``: 1000,
            ``(a{10}){5}``: 50, summed over the pattern): xgrammar unrolls them.
        compile_workers: threads that compile grammars (their own pool, never the default one).
        compile_per_owner: compiles one owner (API key) runs at once; its others queue.
        compile_timeout_s: how long a request waits for its grammar before it is refused.
        cache_bytes: compiled grammars kept, by their measured size (least recently used out).
        cache_bytes_per_owner: of which one owner's compiles may hold at most this much.
    """

    max_schema_bytes: int = 128 * 1024
    max_depth: int = 64
    max_enum_values: int = 4096
    max_literal_bytes: int = 32 * 1024
    max_pattern_bytes: int = 4096
    max_pattern_repeat: int = 1000
    compile_workers: int = 2
    compile_per_owner: int = 1
    compile_timeout_s: float = 10.0
    cache_bytes: int = 256 * 1024 * 1024
    cache_bytes_per_owner: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        ints = tuple(f.name for f in fields(self) if f.name != "compile_timeout_s")
        _check_ints(self, ints)
        for name in ints:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s: expected > 0, got {self.compile_timeout_s!r}")
        if self.cache_bytes_per_owner > self.cache_bytes:
            raise ValueError(f"cache_bytes_per_owner: expected <= cache_bytes ({self.cache_bytes}), "
                             f"got {self.cache_bytes_per_owner}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine is built from besides the model folder, one frozen section each::

        EngineConfig(load=LoadConfig(device="cuda", dtype="bfloat16"), cache=CacheConfig(num_pages=512))

    Each component gets only its own section (the scheduler ``scheduler``, the runner ``runner``
    and ``cache``, the loader ``load``); ``kernels`` chooses the ops (``kernels.dispatch``).

    Args:
        load: how weights are obtained, and on which device in which dtype.
        cache: the KV page and GDN state pools, and the prefix cache.
        scheduler: continuous-batching limits.
        runner: attention backend and CUDA graphs.
        parallel: tensor and expert parallelism.
        kernels: the kernel choices that are product options.
        grammar: structured output's limits, compile workers and compiled-grammar cache.
        speculative: speculative decoding (off by default; the loader reads it).
    """

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            # The annotations are strings (``from __future__ import annotations``): the section class's name.
            if not isinstance(value, globals()[str(f.type)]):
                raise ValueError(f"{f.name}: expected a {f.type}, got {type(value).__name__}")

    def with_sections(self, **sections: Any) -> EngineConfig:
        """This configuration with whole sections replaced: ``with_sections(cache=CacheConfig(num_pages=64))``.

        Raises:
            TypeError: a name that is not a section; for a section's option (``num_pages=64``) the
                message names the section to pass instead.
            ValueError: a section of the wrong type.
        """
        names = [f.name for f in fields(self)]
        for name in sections:
            if name in names:
                continue
            owner = next((s for s in names if name in {f.name for f in fields(getattr(self, s))}), None)
            if owner is not None:
                kind = type(getattr(self, owner)).__name__
                raise TypeError(f"{name}= is an option of the {owner} section: pass {owner}={kind}({name}=...)")
            raise TypeError(f"unknown option {name!r}: expected a section ({', '.join(names)})")
        return replace(self, **sections)


def _check_ints(config: object, names: tuple[str, ...]) -> None:
    """Each named field is an int or None (a bool is not: ``num_pages=True`` is a mistake)."""
    for name in names:
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
