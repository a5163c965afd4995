"""Shared fixtures: tiny random Hugging Face checkpoints of the three supported architectures.

``tiny_checkpoint(arch, layout, experts, dtype, num_layers, tie, shared_expert_size, mtp, wide)`` writes (once per
argument set, per session) a folder that ``engine.loader`` and transformers both read; ``hf_model(...)`` loads
the equivalent plain checkpoint with transformers. All variants of one ``(arch, num_layers, tie)``
share the same weights: the other layouts are rewrites of the plain, per-expert, fp32 one.
``mtp=True`` adds an MTP layer (``mtp.*``, shaped as in published checkpoints; transformers
skips it) to those weights. ``wide=True`` builds other weights, with ``WIDE_HEADS``: every size
tensor parallelism shards divides by 8 (TP=4 and TP=8 tests).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from phloem.runtime.env import use_nccl_defaults

# Hermetic runs: every test, and every server or CLI process a test spawns (they inherit the
# environment), sees a temporary home and a temporary default data directory, so a run never
# reads or writes the user's `~/.phloem` (a `phloem serve` may be running on it) or home.
# Set when this file is imported, before any test module (or anything it imports) reads them;
# `pytest_unconfigure` removes the folder. `_real_data_dir_untouched` fails a test after which
# anything under the real `~/.phloem` changed. Kernel compile caches stay where they were
# (Triton's and FlashInfer's defaults under the real home, unless set): they are caches, not the
# user's data, and rebuilding them would cost the GPU runs minutes.
_REAL_HOME = Path("~").expanduser()
_REAL_DATA_DIR = _REAL_HOME / ".phloem"
_TEMP_ROOT = Path(tempfile.mkdtemp(prefix="phloem-tests-"))
os.environ.setdefault("TRITON_CACHE_DIR", str(_REAL_HOME / ".triton" / "cache"))
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(_REAL_HOME / ".cache" / "flashinfer"))
os.environ["HOME"] = str(_TEMP_ROOT / "home")
os.environ["PHLOEM_DATA_DIR"] = str(_TEMP_ROOT / "home" / ".phloem")
(_TEMP_ROOT / "home").mkdir()


def _tree_state(root: Path) -> dict[str, tuple[int, int]] | None:
    """Every path under ``root`` with its mtime and size (None: ``root`` does not exist)."""
    if not root.exists():
        return None
    state: dict[str, tuple[int, int]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                state[os.path.relpath(path, root)] = (st.st_mtime_ns, st.st_size)
    return state


_real_data_dir_state = {"last": _tree_state(_REAL_DATA_DIR)}


def _changes(before: dict[str, tuple[int, int]] | None, after: dict[str, tuple[int, int]] | None) -> list[str]:
    if before == after:
        return []
    if before is None or after is None:
        return ["(the folder itself was " + ("created" if before is None else "deleted") + ")"]
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_TEMP_ROOT, ignore_errors=True)


@pytest.fixture(autouse=True)
def _real_data_dir_untouched() -> Iterator[None]:
    """Fail the test if anything under the real ``~/.phloem`` changed while it ran."""
    yield
    now = _tree_state(_REAL_DATA_DIR)
    changed = _changes(_real_data_dir_state["last"], now)
    _real_data_dir_state["last"] = now  # only the test that wrote fails
    if changed:
        pytest.fail(f"the test wrote under the real data directory {_REAL_DATA_DIR}: {changed[:10]}",
                    pytrace=False)

# `python3 -m pytest` puts the checkout first on sys.path, where its top-level folders would shadow
# PyPI packages of the same names (transformers imports Hugging Face's `kernels` when it is
# installed). It goes last instead: the project is imported as the installed `phloem` package, and
# the processes the tests spawn still import `tests` from the checkout.
_CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT] + [str(_CHECKOUT)]

# transformers must take its torch fallbacks, never flash-linear-attention kernels (GPU-only
# Triton code). On a GPU machine fla stays importable for the engine's own GPU tests; the tests
# that run transformers on the CPU are not marked `gpu` and are not run there.
if not torch.cuda.is_available():
    sys.modules["fla"] = None  # type: ignore[assignment]
    # Triton kernels run on CPU only under the interpreter, and the choice is fixed when triton is
    # first imported — which transformers does indirectly (torch.distributed.fsdp -> torch._dynamo)
    # long before the kernel test modules load. Switch it on before any test module imports.
    os.environ["TRITON_INTERPRET"] = "1"

# The engine sets no NCCL variable; the tests that build tensor-parallel engines on GPUs directly
# get what the runtime sets before it builds one (NVLink multicast off).
use_nccl_defaults()

# The tiny models are far too small for intra-op threads to pay off: on the 2-core CI machine,
# thread contention made the model tests ~8x slower than single-threaded.
torch.set_num_threads(1)

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

TINY_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "eos_token_id": None,
    "pad_token_id": None,
    "bos_token_id": None,
}
# Head counts every rank count up to 8 divides: 4 KV heads split at TP=4 and are replicated (one
# per two ranks) at TP=8; two GDN value heads per key head, as in TINY_TEXT_CONFIG.
WIDE_HEADS: dict[str, Any] = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
}
TINY_MOE_CONFIG: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
_MULTIMODAL = {
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
    "Qwen3_5ForCausalLM": ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
}


def _hf_config(
    arch: str, num_layers: int, tie: bool, shared_expert_size: int | None = None, wide: bool = False
) -> Any:
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    common = dict(
        TINY_TEXT_CONFIG, num_hidden_layers=num_layers, layer_types=layer_types, tie_word_embeddings=tie
    )
    if wide:
        common.update(WIDE_HEADS)
    moe = dict(TINY_MOE_CONFIG)
    if shared_expert_size is not None:
        moe["shared_expert_intermediate_size"] = shared_expert_size
    if arch == "Qwen3NextForCausalLM":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
        return Qwen3NextConfig(**common, **moe, intermediate_size=96, rope_parameters=rope)
    # Qwen3.5 carries an interleaved M-RoPE section; for text it reduces to plain RoPE.
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    if arch == "Qwen3_5MoeForCausalLM":
        return Qwen3_5MoeTextConfig(**common, **moe, rope_parameters=rope)
    if arch == "Qwen3_5ForCausalLM":
        return Qwen3_5TextConfig(**common, intermediate_size=96, rope_parameters=rope)
    raise ValueError(f"arch: unknown {arch!r}")


def _reinit_(model: torch.nn.Module, seed: int) -> None:
    """Weights of a scale that keeps activations O(1) and logits far from uniform.

    HF's init (std 0.02, zero norms) gives near-uniform logits, where greedy argmax is decided
    by rounding noise; these weights make the top-2 margin large compared with fp32 error.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                value = torch.empty(p.shape).uniform_(0.05, 8.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                value = normal(p.shape, 0.2, 1.0)
            elif name.endswith("linear_attn.norm.weight"):
                value = normal(p.shape, 0.1, 1.0)
            elif name.endswith("norm.weight"):
                value = normal(p.shape, 0.1)
            elif name.endswith("conv1d.weight"):
                value = normal(p.shape, 0.5)
            elif name.endswith("embed_tokens.weight"):
                value = normal(p.shape, 1.0)
            elif name == "lm_head.weight":
                value = normal(p.shape, 3.0 / math.sqrt(p.shape[-1]))
            else:
                # Linear [out, in] and fused experts [E, out, in]: unit gain on fan-in.
                value = normal(p.shape, 1.0 / math.sqrt(p.shape[-1]))
            p.copy_(value)


def _build_plain(
    arch: str, num_layers: int, tie: bool, folder: Path, shared_expert_size: int | None, wide: bool = False
) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _hf_config(arch, num_layers, tie, shared_expert_size, wide)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_(model, seed=1234 + num_layers)
    if tie:
        model.tie_weights()
    model.save_pretrained(folder)


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        expert, proj, _ = tail.split(".")
        experts.setdefault(head, {}).setdefault(int(expert), {})[proj] = t
    for head, by_expert in experts.items():
        ids = sorted(by_expert)
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((by_expert[e]["gate_proj"], by_expert[e]["up_proj"])) for e in ids]
        )
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def _to_language_model_layout(
    arch: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Published layout: ``model.language_model.*`` plus vision and MTP tensors to be ignored."""
    out = {re.sub(r"^model\.", "model.language_model.", n): t for n, t in tensors.items()}
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    if not any(n.startswith("mtp.") for n in out):
        out["mtp.fc.weight"] = torch.zeros(4, 8)  # a stand-in, ignored without speculation
    if arch not in _MULTIMODAL:
        return out, config
    wrapper, model_type = _MULTIMODAL[arch]
    text = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    text["model_type"] = model_type + "_text"
    wrapped = {
        "architectures": [wrapper],
        "model_type": model_type,
        "text_config": text,
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }
    return out, wrapped


def _mtp_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """An MTP layer as Qwen3.5 / Qwen3-Next checkpoints store it: ``mtp.fc`` ``[H, 2H]``, the two
    pre-fc norms and the final norm, and ``mtp.layers.0.*`` shaped as the trunk's full-attention
    layer (per-expert experts, as the plain checkpoint's), with weights of its own."""
    gen = torch.Generator().manual_seed(seed)
    hidden = int(config["hidden_size"])
    layer = next(i for i, t in enumerate(config["layer_types"]) if t == "full_attention")
    prefix = f"model.layers.{layer}."
    out = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden)}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.randn(hidden, generator=gen) * 0.1
    for name, t in sorted(tensors.items()):
        if name.startswith(prefix):
            std = 0.1 if name.endswith("norm.weight") else 1.0 / math.sqrt(t.shape[-1])
            out["mtp.layers.0." + name[len(prefix) :]] = torch.randn(t.shape, generator=gen) * std
    return out


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path, num_shards: int = 2) -> None:
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: tensors[n].contiguous() for n in names[i::num_shards]}
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``(arch, layout="plain"|"language_model", experts="per_expert"|"fused",
    dtype=torch.float32, num_layers=4, tie=False, shared_expert_size=None, mtp=False, wide=False)
    -> folder``; cached per arguments. ``shared_expert_size`` None: the shared expert has the routed
    experts' FFN size. ``mtp``: with an MTP layer (``_mtp_tensors``). ``wide``: ``WIDE_HEADS``."""
    cache: dict[tuple[Any, ...], Path] = {}

    def build(
        arch: str,
        layout: str = "plain",
        experts: str = "per_expert",
        dtype: torch.dtype = torch.float32,
        num_layers: int = 4,
        tie: bool = False,
        shared_expert_size: int | None = None,
        mtp: bool = False,
        wide: bool = False,
    ) -> Path:
        key = (arch, layout, experts, dtype, num_layers, tie, shared_expert_size) + ((True,) if mtp else ())
        key += ("wide",) if wide else ()
        if key in cache:
            return cache[key]
        shape = dict(num_layers=num_layers, tie=tie, shared_expert_size=shared_expert_size, wide=wide)
        base_key = (arch, "plain", "per_expert", torch.float32, num_layers, tie, shared_expert_size)
        wide_tag = ("wide",) if wide else ()
        if mtp and key == base_key + (True,) + wide_tag:
            base = build(arch, **shape)  # type: ignore[arg-type]
            tensors = _read_all(base)
            config = json.loads((base / "config.json").read_text())
            tensors.update(_mtp_tensors(tensors, config, seed=4321 + num_layers))
            config["mtp_num_hidden_layers"] = 1
            folder = tmp_path_factory.mktemp(f"{arch}_{num_layers}l_mtp{'_wide' if wide else ''}")
            (folder / "config.json").write_text(json.dumps(config, indent=2))
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"})
            cache[key] = folder
            return folder
        if key == base_key + wide_tag:
            shared = "" if shared_expert_size is None else f"_shared{shared_expert_size}"
            name = f"{arch}_{num_layers}l{'_tied' if tie else ''}{shared}{'_wide' if wide else ''}"
            folder = tmp_path_factory.mktemp(name)
            _build_plain(arch, num_layers, tie, folder, shared_expert_size, wide)
            cache[key] = folder
            return folder
        base = build(arch, mtp=mtp, **shape)  # type: ignore[arg-type]
        tensors = {n: t.to(dtype) for n, t in _read_all(base).items()}
        config = json.loads((base / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        if experts == "fused":
            tensors = _fuse_experts(tensors)
        if layout == "language_model":
            tensors, config = _to_language_model_layout(arch, tensors, config)
        suffix = ("_mtp" if mtp else "") + ("_wide" if wide else "")
        folder = tmp_path_factory.mktemp(f"{arch}_{layout}_{experts}_{config.get('dtype', 'x')}{suffix}")
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        if layout == "language_model":
            _save_sharded(tensors, folder)
        else:
            contiguous = {n: t.contiguous() for n, t in tensors.items()}
            save_file(contiguous, str(folder / "model.safetensors"), {"format": "pt"})
        cache[key] = folder
        return folder

    return build


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint: Callable[..., Path]) -> Callable[..., torch.nn.Module]:
    """Factory: ``(arch, dtype=torch.float32, num_layers=4, tie=False, shared_expert_size=None)`` ->
    transformers model (eval)."""
    cache: dict[tuple[Any, ...], torch.nn.Module] = {}

    def load(
        arch: str, dtype: torch.dtype = torch.float32, num_layers: int = 4, tie: bool = False,
        shared_expert_size: int | None = None,
    ) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        key = (arch, dtype, num_layers, tie, shared_expert_size)
        if key not in cache:
            path = tiny_checkpoint(arch, dtype=dtype, num_layers=num_layers, tie=tie,
                                   shared_expert_size=shared_expert_size)
            cache[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return cache[key]

    return load
