"""Builds a model on its target device and fills it from a Hugging Face folder, or with random weights.

The model is constructed on the ``meta`` device and materialised with ``to_empty`` on the target
device, so no parameter ever exists twice and nothing of a CUDA model is ever allocated on the
host. Checkpoint tensors are then read one at a time (``safe_open``) and copied into place.

Checkpoint names accepted, beside the model's own (``engine.models.qwen3_hybrid``)::

    model.language_model.X                      -> model.X (published multimodal layout)
    model.visual.*, visual.*                    ignored (vision tower)
    mtp.*                                       the MTP layer (``engine.models.mtp``) when
                                                speculation asks for it, else ignored
    ....experts.{e}.{gate,up}_proj.weight       -> ....experts.gate_up_proj[e, :I] / [e, I:]
    ....experts.{e}.down_proj.weight            -> ....experts.down_proj[e]
    ....{mlp,shared_expert}.{gate,up}_proj.weight -> ....gate_up_proj.weight[:I] / [I:]
    ....linear_attn.in_proj_qkvz.weight         -> in_proj_qkv + in_proj_z (Qwen3-Next; rows
    ....linear_attn.in_proj_ba.weight           -> in_proj_b + in_proj_a    grouped per key head)
    ....linear_attn.conv1d.weight [C, 1, K]     -> ....linear_attn.conv_weight [C, K]
    lm_head.weight                              ignored when the embeddings are tied

Then each module's ``fused_weights()`` redirects tensors into the model's fused parameters:
``q/k/v_proj`` -> rows of ``qkv_proj``; ``in_proj_{qkv,z,b,a}`` -> rows of ``in_proj``;
``mlp.gate`` + ``mlp.shared_expert_gate`` -> rows of ``mlp.router``; ``mlp.shared_expert.*`` ->
expert ``E`` of ``mlp.experts.*`` (when the shared expert's FFN size is the experts'; else it
stays a module of its own, ``engine.models._moe``).

Every parameter must be covered by the checkpoint; an unknown, missing or mis-shaped tensor
raises ``ValueError`` naming it.

Tensor parallelism: a rank reads only its shard of each checkpoint tensor
(``safe_open(...).get_slice(name)[...]``, as each module's ``checkpoint_shards()`` says), before
any of the above; the layout conversions and the fused-row redirects then run on the shard,
against the rank's local parameter shapes. Replicated tensors (norms, the router) are read whole.
With expert parallelism a rank reads whole experts of its own range (their rows remapped to local
ones) and never opens another rank's expert tensors (``Shard.skip``); the rows no tensor fills
(the zero expert, and the shared expert off rank 0) are exempt from the coverage check and
zeroed after loading, for both formats.

With ``SpeculativeConfig(method="mtp")`` the model gets its MTP layer (``model.mtp``, parameters
``mtp.*``: the checkpoint's names, converted by the rules above like any layer's) and a
checkpoint without ``mtp.*`` tensors is refused before anything is read; dummy weights cover it.

FP8 checkpoints (``quantization_config.quant_method == "fp8"``, e4m3, ``weight_block_size``
``[128, 128]``): a tensor ``X.weight`` with an ``X.weight_scale_inv`` beside it is FP8 (what the
checkpoint stores otherwise stays in the model dtype). A parameter all of whose checkpoint
tensors are FP8 is stored as FP8 with its scales (``engine.models._fp8``); an FP8 tensor that
shares a fused parameter with unquantized ones (GDN ``in_proj``: FP8 ``in_proj_qkvz`` beside the
bf16 ``in_proj_b``/``in_proj_a``) is dequantized into it at load. Scales are read whole (they are
small), expanded along the rows, and then follow their weight through the same shard, layout and
fused-row steps. A column shard must start on a 128 multiple (a scale block column is shared by
the ranks only at its right edge). ``LoadConfig.quantization="fp8"`` quantizes a bf16 (or dummy)
model's projection weights after loading (``_QUANTIZED``).

Dummy weights are defined per rank: every rank draws its local tensors from the same seed in the
same order, so replicated weights agree across ranks, but the model at TP=N is not the TP=1
dummy model (drawing the full tensors to slice them would cost the full model's memory).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from phloem.engine.progress_bars import progress, progress_bar, progress_shown
from phloem.engine.config import LoadConfig, ModelConfig, SpeculativeConfig
from phloem.engine.models import Qwen3HybridForCausalLM, get_model_class
from phloem.engine.models._fp8 import (
    FP8_BLOCK, FP8_DTYPE, ROW_BLOCK, dequantize_on_read, make_fp8, scale_name,
)
from phloem.engine.models._gdn import GatedDeltaNet
from phloem.engine.models.mtp import add_mtp
from phloem.engine.parallel.group import TPGroup
from phloem.engine.parallel.layers import Shard
from phloem.kernels.config import KernelConfig
from phloem.kernels.dispatch import get_ops
from phloem.kernels.linear.fp8 import fp8_block_dequant, fp8_block_quantize

__all__ = ["load_model"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_IGNORED = re.compile(r"^(model\.visual\.|visual\.)|\.rotary_emb\.inv_freq$")
_MTP = "mtp."
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_GATE_UP = re.compile(r"^(.*)\.(gate_proj|up_proj)\.weight$")
_EXPERT_IDX = re.compile(r"\.experts\.\d+\.")
_SCALE_SUFFIX = "_scale_inv"
# Quantized at load (``quantization="fp8"``), as in Qwen's FP8 releases: the attention, GDN output
# and MLP/expert projections. Not lm_head, embeddings, norms, routers, the GDN conv/A_log/dt_bias,
# nor GDN ``in_proj`` (its fused rows hold ``in_proj_b``/``in_proj_a``, bf16 in the releases).
_QUANTIZED = re.compile(
    r"(\.(qkv_proj|o_proj|out_proj|gate_up_proj|down_proj)\.weight|\.experts\.(gate_up_proj|down_proj))$"
)


def load_model(
    model_path: str | Path, model_config: ModelConfig, load_config: LoadConfig, tp: TPGroup | None = None,
    kernels: KernelConfig = KernelConfig(), speculative: SpeculativeConfig = SpeculativeConfig(),
) -> Qwen3HybridForCausalLM:
    """Returns the model (this rank's shard under ``tp``) in eval mode on ``load_config.device``,
    weights in the resolved dtype, its ops chosen by ``kernels`` (``kernels.dispatch.get_ops``). A progress bar counts the tensors read (or drawn) when
    ``load_config.show_progress`` allows it (``engine.progress_bars``). ``speculative`` with
    ``method="mtp"``: also its MTP layer, ``model.mtp`` (``engine.models.mtp``).

    Raises:
        ValueError: no safetensors files, or an unknown, missing or mis-shaped tensor; MTP asked
            for and the checkpoint has no ``mtp.*`` tensors.
    """
    device = torch.device(load_config.device)
    dtype = _resolve_dtype(Path(model_path), load_config)
    if speculative.uses_mtp and load_config.load_format != "dummy":
        _check_has_mtp(Path(model_path))
    fp8_checkpoint = load_config.load_format != "dummy" and _is_fp8_checkpoint(Path(model_path))
    with torch.device("meta"):
        model = get_model_class(model_config.architecture)(model_config, tp, ops=get_ops(device, kernels))
        if speculative.uses_mtp:
            add_mtp(model)
    model = model.to(dtype=dtype)
    fp8_params: set[str] = set()
    if fp8_checkpoint:
        fp8_params = _fp8_params(model, _checkpoint_shapes(Path(model_path)))
        for name in sorted(fp8_params):
            module, _, attr = name.rpartition(".")
            make_fp8(model.get_submodule(module), attr)
    model = model.to_empty(device=device)
    model.post_materialize()
    with torch.no_grad():
        for name in fp8_params:
            model.get_parameter(scale_name(name)).fill_(1.0)  # rows never loaded (EP) dequantize to 0
        if load_config.load_format == "dummy":
            _init_dummy(model, load_config.seed, load_config.show_progress)
        else:
            _load_safetensors(model, Path(model_path), load_config.show_progress)
        for module in model.modules():
            zero = getattr(module, "zero_unloaded", None)  # expert parallelism's zero expert rows
            if zero is not None:
                zero()
        if load_config.quantization == "fp8" and not fp8_checkpoint:
            fp8_params = _quantize(model)
    for name in sorted(fp8_params):
        module, _, attr = name.rpartition(".")
        dequantize_on_read(model.get_submodule(module), attr, dtype)
    return model.eval()


def _is_fp8_checkpoint(path: Path) -> bool:
    """Whether config.json declares Qwen's block-FP8 format; raises on another quantization."""
    config = path / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not quant:
        return False
    method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
    block = list(quant.get("weight_block_size") or [])
    if method != "fp8" or fmt != "e4m3" or block != list(FP8_BLOCK):
        raise ValueError(
            f"quantization_config: only quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128] "
            f"is supported, got {quant!r} in {str(config)!r}"
        )
    return True


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's name -> shape (file headers only)."""
    out: dict[str, tuple[int, ...]] = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def _scale_of(name: str) -> str:
    return name + _SCALE_SUFFIX


def _fp8_params(model: Qwen3HybridForCausalLM, shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """The parameters every checkpoint tensor of which is FP8 (has a ``*_scale_inv``)."""
    redirects = _redirects(model)
    shards = _shards(model)
    sources: dict[str, set[bool]] = {}
    for name, shape in shapes.items():
        target = None if name.endswith(_SCALE_SUFFIX) else _canonical_name(
            name, model.config.tie_word_embeddings, model.mtp is not None
        )
        if target is None:
            continue
        shard = shards.get(target) or shards.get(_EXPERT_IDX.sub(".experts.*.", target))
        if shard is not None and shard.skipped:
            continue  # another rank's expert (expert parallelism)
        source = torch.empty(shape, device="meta")
        try:
            writes = _plan(model, target, source if shard is None else shard.read(source))
        except (ValueError, RuntimeError):
            continue  # reported by the load itself
        for write in writes:
            sources.setdefault(_redirect(write, redirects).param, set()).add(_scale_of(name) in shapes)
    params = dict(model.named_parameters())
    return {p for p, fp8 in sources.items() if fp8 == {True} and p in params}


def _read_scale(f: Any, name: str, weight_shape: tuple[int, ...], target: str, shards: dict[str, Shard]) -> torch.Tensor:
    """This rank's part of ``name``'s block scales ``[..., ceil(N/128), ceil(K/128)]``, expanded
    along the rows to ``[..., N_shard, ceil(K_shard/128)]`` (``ROW_BLOCK``), sharded as its weight."""
    scale = f.get_tensor(name).to(torch.float32)
    expected = (*weight_shape[:-2], -(-weight_shape[-2] // FP8_BLOCK[0]), -(-weight_shape[-1] // FP8_BLOCK[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r}: expected block scales of shape {expected}, got {tuple(scale.shape)}")
    scale = scale.repeat_interleave(FP8_BLOCK[0], dim=-2)[..., : weight_shape[-2], :]
    shard = shards.get(target) or shards.get(_EXPERT_IDX.sub(".experts.*.", target))
    if shard is None:
        return scale
    parts = []
    for index in shard.parts:
        if len(index) == scale.ndim and isinstance(index[-1], slice) and index[-1] != slice(None):
            cols = index[-1]
            start, stop = cols.start or 0, weight_shape[-1] if cols.stop is None else cols.stop
            if start % FP8_BLOCK[1]:
                raise ValueError(
                    f"checkpoint tensor {name!r}: a tensor-parallel column shard starting at {start} "
                    f"splits a {FP8_BLOCK[1]}-column FP8 scale block; use a TP size that keeps "
                    f"column shards on {FP8_BLOCK[1]} multiples"
                )
            index = (*index[:-1], slice(start // FP8_BLOCK[1], -(-stop // FP8_BLOCK[1])))
        parts.append(scale[index])
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
    if shard.pad_rows is not None and out.shape[0] < shard.pad_rows:
        out = torch.cat((out, out.new_ones((shard.pad_rows - out.shape[0], *out.shape[1:]))))
    return out


def _quantize(model: Qwen3HybridForCausalLM) -> set[str]:
    """Quantizes the ``_QUANTIZED`` parameters in place to block FP8 (128x128 blocks of each
    parameter, stored row-expanded); returns their names."""
    names = {n for n, _ in model.named_parameters() if _QUANTIZED.search(n)}
    for name in sorted(names):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        weight = getattr(module, attr).data
        w_fp8, scale = fp8_block_quantize(weight, FP8_BLOCK)
        make_fp8(module, attr)
        getattr(module, attr).data.copy_(w_fp8)
        rows = scale.repeat_interleave(FP8_BLOCK[0], dim=-2)[..., : weight.shape[-2], :]
        getattr(module, scale_name(attr)).data.copy_(rows)
        del weight
    return names


def _resolve_dtype(path: Path, load_config: LoadConfig) -> torch.dtype:
    if load_config.dtype != "auto":
        return _DTYPES[load_config.dtype]
    if load_config.load_format == "dummy":
        return torch.bfloat16
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    for section in (raw, raw.get("text_config") or {}):
        name = section.get("dtype") or section.get("torch_dtype")
        if name in _DTYPES:
            return _DTYPES[name]
    # No dtype in the config: take the embedding's dtype from the checkpoint itself.
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight"):
                    return _SAFETENSORS_DTYPES[f.get_slice(name).get_dtype()]
    raise ValueError(f"dtype: 'auto' found no dtype in {path}/config.json nor an embed_tokens tensor")


def _check_has_mtp(path: Path) -> None:
    """Raises ``ValueError`` unless the checkpoint holds ``mtp.*`` tensors (names only are read)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names: list[str] = list(json.loads(index.read_text())["weight_map"])
    else:
        names = []
        for file in _safetensors_files(path):
            with safe_open(file, framework="pt") as f:
                names += list(f.keys())
    if not any(name.startswith(_MTP) for name in names):
        raise ValueError(
            f"speculative: method 'mtp' needs the checkpoint's MTP layer (mtp.* tensors), and "
            f"{str(path)!r} has none; turn speculation off or use a checkpoint that ships it"
        )


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path: expected *.safetensors files in {str(path)!r}, found none")
    return files


@dataclass(frozen=True, slots=True)
class _Write:
    """One checkpoint tensor (or a slice of it) copied into (a part of) one parameter."""

    param: str
    source: torch.Tensor
    expert: int | None = None  # row of dim 0 of a fused expert tensor
    half: str | None = None  # "gate" / "up": first / second half of dim -2
    rows: tuple[int, int] | None = None  # a row range of a fused 2-D weight

    @property
    def piece(self) -> _Piece:
        return (self.expert, self.half, self.rows)

    def destination(self, param: torch.Tensor) -> torch.Tensor:
        view = param if self.expert is None else param[self.expert]
        if self.half is not None:
            half = view.shape[-2] // 2
            view = view[..., :half, :] if self.half == "gate" else view[..., half:, :]
        if self.rows is not None:
            view = view[self.rows[0] : self.rows[1]]
        return view


_Piece = tuple[int | None, str | None, tuple[int, int] | None]
_WHOLE: _Piece = (None, None, None)
_Redirects = dict[str, tuple[str, int | None, tuple[int, int] | None]]


def _redirects(model: Qwen3HybridForCausalLM) -> _Redirects:
    """Full checkpoint-parameter name -> (fused parameter, expert row, rows), from every module."""
    out: _Redirects = {}
    for prefix, module in model.named_modules():
        fused = getattr(module, "fused_weights", None)
        if fused is not None:
            for src, (dst, expert, rows) in fused().items():
                out[f"{prefix}.{src}"] = (f"{prefix}.{dst}", expert, rows)
    return out


def _redirect(write: _Write, redirects: _Redirects) -> _Write:
    if write.param not in redirects:
        return write
    param, expert, rows = redirects[write.param]
    return _Write(param, write.source, expert if expert is not None else write.expert, write.half, rows)


def _shards(model: Qwen3HybridForCausalLM) -> dict[str, Shard]:
    """Checkpoint name (expert index as ``*``) -> this rank's part of it; empty at TP=1."""
    if model.tp.size == 1:
        return {}
    out: dict[str, Shard] = {}
    for prefix, module in model.named_modules():
        shards = getattr(module, "checkpoint_shards", None)
        if shards is not None:
            out.update({f"{prefix}.{src}": shard for src, shard in shards().items()})
    return out


def _read(f: Any, name: str, target: str, shards: dict[str, Shard]) -> torch.Tensor | None:
    """This rank's part of checkpoint tensor ``name``; None when it holds none of it (not read)."""
    shard = shards.get(target) or shards.get(_EXPERT_IDX.sub(".experts.*.", target))
    if shard is not None and shard.skipped:
        return None
    return f.get_tensor(name) if shard is None else shard.read(f.get_slice(name))


def _unloaded(model: Qwen3HybridForCausalLM) -> dict[str, set[_Piece]]:
    """Expert-tensor pieces no checkpoint tensor fills on this rank (expert parallelism)."""
    out: dict[str, set[_Piece]] = {}
    for prefix, module in model.named_modules():
        rows = getattr(module, "unloaded_rows", None)
        if rows is not None and rows():
            out[f"{prefix}.experts.gate_up_proj"] = {(r, half, None) for r in rows() for half in ("gate", "up")}
            out[f"{prefix}.experts.down_proj"] = {(r, None, None) for r in rows()}
    return out


def _checkpoint_tensors(files: list[Path], show_progress: bool | None) -> Iterator[tuple[Any, str]]:
    """Every ``(open file, tensor name)`` of the checkpoint, under one progress bar."""
    total = 0
    if progress_shown(show_progress):
        for file in files:
            with safe_open(file, framework="pt") as f:
                total += len(f.keys())
    with progress_bar(total or None, "loading weights", "tensor", show_progress) as advance:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield f, name
                    advance(1)


def _load_safetensors(model: Qwen3HybridForCausalLM, path: Path, show_progress: bool | None) -> None:
    params = dict(model.named_parameters())
    redirects = _redirects(model)
    shards = _shards(model)
    row_targets: dict[str, set[_Piece]] = {}
    for param, expert, rows in redirects.values():
        if rows is not None:
            row_targets.setdefault(param, set()).add((expert, None, rows))
    loaded: dict[str, set[_Piece]] = {name: set() for name in params}
    _load_tensors(model, path, show_progress, params, redirects, shards, loaded)
    sources = {(param, rows): src for src, (param, _e, rows) in redirects.items() if rows is not None}
    unloaded = _unloaded(model)
    for name, param in params.items():
        base = name.removesuffix(_SCALE_SUFFIX)  # a scale is loaded piece by piece as its weight
        missing = row_targets.get(base) or _required_pieces(base, param)
        missing = missing - loaded[name] - unloaded.get(base, set())
        if missing and base in row_targets:
            absent = sorted(sources[(base, rows)] for _e, _h, rows in missing if rows is not None)
            raise ValueError(f"checkpoint: missing weight {absent[0]!r} (part of {name!r}) in {str(path)!r}")
        if missing and _WHOLE not in loaded[name]:
            parts = "" if missing == {_WHOLE} else f" (expert, half, rows) parts {sorted(missing, key=str)[:4]}"
            raise ValueError(f"checkpoint: missing weight {name!r}{parts} in {str(path)!r}")


def _scale_files(path: Path) -> dict[str, Path]:
    """Every ``*_scale_inv`` tensor's name -> its file."""
    out: dict[str, Path] = {}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            out.update({name: file for name in f.keys() if name.endswith(_SCALE_SUFFIX)})
    return out


def _load_tensors(
    model: Qwen3HybridForCausalLM, path: Path, show_progress: bool | None, params: dict[str, torch.Tensor],
    redirects: _Redirects, shards: dict[str, Shard], loaded: dict[str, set[_Piece]],
) -> None:
    """Copies every checkpoint tensor (with its scales, when FP8) into ``params``; records the
    pieces filled in ``loaded``."""
    scales = _scale_files(path)
    with ExitStack() as handles:
        scale_handles: dict[Path, Any] = {}  # a large shard's header is megabytes of JSON: opened once
        for f, name in _checkpoint_tensors(_safetensors_files(path), show_progress):
            _load_tensor(model, f, name, params, redirects, shards, loaded, scales, handles, scale_handles)


def _load_tensor(
    model: Qwen3HybridForCausalLM, f: Any, name: str, params: dict[str, torch.Tensor], redirects: _Redirects,
    shards: dict[str, Shard], loaded: dict[str, set[_Piece]], scales: dict[str, Path], handles: ExitStack,
    scale_handles: dict[Path, Any],
) -> None:
    """One checkpoint tensor ``name`` of open file ``f`` (and its scales, when FP8) into ``params``."""
    if name in scales:
        return  # read with its weight
    target = _canonical_name(name, model.config.tie_word_embeddings, model.mtp is not None)
    if target is None:
        return
    source = _read(f, name, target, shards)
    if source is None:
        return
    writes = [_redirect(w, redirects) for w in _plan(model, target, source)]
    scale_writes: list[_Write | None] = [None] * len(writes)
    if _scale_of(name) in scales:
        shape = tuple(f.get_slice(name).get_shape())
        file = scales[_scale_of(name)]
        if file not in scale_handles:
            scale_handles[file] = handles.enter_context(safe_open(file, framework="pt"))
        scale = _read_scale(scale_handles[file], _scale_of(name), shape, target, shards)
        scale_writes = [_redirect(w, redirects) for w in _plan(model, target, scale)]
    for write, scale_write in zip(writes, scale_writes, strict=True):
        if write.param not in params:
            raise ValueError(f"checkpoint: unknown weight {name!r} (no parameter {write.param!r})")
        dst = write.destination(params[write.param])
        if dst.shape != write.source.shape:
            raise ValueError(
                f"checkpoint tensor {name!r}: expected shape {tuple(dst.shape)} for "
                f"{write.param!r}, got {tuple(write.source.shape)}"
            )
        if scale_write is not None and dst.dtype == FP8_DTYPE:
            scale_param = scale_name(write.param)
            scale_write = _Write(scale_param, scale_write.source, scale_write.expert, scale_write.half, scale_write.rows)
            scale_write.destination(params[scale_param]).copy_(scale_write.source)
            loaded[scale_param].add(scale_write.piece)
            dst.copy_(write.source)
        elif scale_write is not None:
            dst.copy_(fp8_block_dequant(write.source, scale_write.source, ROW_BLOCK, dst.dtype))
        else:
            if dst.dtype == FP8_DTYPE:
                raise ValueError(f"checkpoint tensor {name!r}: {write.param!r} is FP8 but {name!r} has no scales")
            dst.copy_(write.source)
        loaded[write.param].add(write.piece)


def _canonical_name(name: str, tied: bool, with_mtp: bool = False) -> str | None:
    if _IGNORED.search(name) or (tied and name == "lm_head.weight") or (not with_mtp and name.startswith(_MTP)):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def _required_pieces(name: str, param: torch.Tensor) -> set[_Piece]:
    if name.endswith("experts.gate_up_proj"):
        return {(e, half, None) for e in range(param.shape[0]) for half in ("gate", "up")}
    if name.endswith("experts.down_proj"):
        return {(e, None, None) for e in range(param.shape[0])}
    if name.endswith("gate_up_proj.weight"):
        return {(None, "gate", None), (None, "up", None)}
    return {_WHOLE}


def _plan(model: Qwen3HybridForCausalLM, name: str, tensor: torch.Tensor) -> list[_Write]:
    if m := _EXPERT.match(name):
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        expert = _expert_row(model, prefix, expert)
        if proj == "down_proj":
            return [_Write(f"{prefix}.down_proj", tensor, expert=expert)]
        return [_Write(f"{prefix}.gate_up_proj", tensor, expert=expert, half=proj.removesuffix("_proj"))]
    if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
        # Fused [E, ...] checkpoint tensors fill experts 0..E-1 (row E is the shared expert).
        if name.endswith("down_proj"):
            return [_Write(name, tensor[e], expert=e) for e in range(tensor.shape[0])]
        inter = tensor.shape[1] // 2
        return [
            _Write(name, part, expert=e, half=half)
            for e in range(tensor.shape[0])
            for half, part in (("gate", tensor[e, :inter]), ("up", tensor[e, inter:]))
        ]
    if name.endswith("linear_attn.in_proj_qkvz.weight"):
        return _split_qkvz(model, name.removesuffix(".in_proj_qkvz.weight"), tensor)
    if name.endswith("linear_attn.in_proj_ba.weight"):
        return _split_ba(model, name.removesuffix(".in_proj_ba.weight"), tensor)
    if name.endswith("linear_attn.conv1d.weight"):
        return [_Write(name.replace("conv1d.weight", "conv_weight"), tensor.squeeze(1))]
    if m := _GATE_UP.match(name):
        return [_Write(f"{m.group(1)}.gate_up_proj.weight", tensor, half=m.group(2).removesuffix("_proj"))]
    return [_Write(name, tensor)]


def _expert_row(model: Qwen3HybridForCausalLM, experts: str, expert: int) -> int:
    """The row of global expert ``expert`` in this rank's ``experts`` tensors (its own index unless
    the experts are split across ranks, whose other experts the loader never reads)."""
    try:
        moe = model.get_submodule(experts.removesuffix(".experts"))
    except AttributeError:
        return expert  # an unknown weight: reported when its parameter is not found
    local = getattr(moe, "local_expert", None)
    row = local(expert) if local is not None else expert
    assert row is not None, f"expert {expert} of {experts}: another rank's expert was read"
    return row


def _gdn(model: Qwen3HybridForCausalLM, prefix: str, name: str) -> GatedDeltaNet:
    try:
        module = model.get_submodule(prefix)
    except AttributeError as e:
        raise ValueError(f"checkpoint: unknown weight {name!r}") from e
    if not isinstance(module, GatedDeltaNet):
        raise ValueError(f"checkpoint: unknown weight {name!r} ({prefix!r} is not a GDN layer)")
    return module


def _split_qkvz(model: Qwen3HybridForCausalLM, prefix: str, tensor: torch.Tensor) -> list[_Write]:
    """Qwen3-Next rows are grouped per key head: ``[q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)]``, r = Hv/Hk."""
    gdn = _gdn(model, prefix, prefix + ".in_proj_qkvz.weight")
    hidden = tensor.shape[-1]
    per_head_v = gdn.value_dim // gdn.num_k_heads
    grouped = tensor.view(gdn.num_k_heads, -1, hidden)  # [Hk, 2Dk + 2r*Dv, H]
    parts = torch.split(grouped, [gdn.key_head_dim, gdn.key_head_dim, per_head_v, per_head_v], dim=1)
    q, k, v, z = (x.reshape(-1, hidden) for x in parts)
    return [
        _Write(prefix + ".in_proj_qkv.weight", torch.cat((q, k, v))),
        _Write(prefix + ".in_proj_z.weight", z),
    ]


def _split_ba(model: Qwen3HybridForCausalLM, prefix: str, tensor: torch.Tensor) -> list[_Write]:
    """Qwen3-Next rows are grouped per key head: ``[b (r heads) | a (r heads)]``."""
    gdn = _gdn(model, prefix, prefix + ".in_proj_ba.weight")
    hidden = tensor.shape[-1]
    grouped = tensor.view(gdn.num_k_heads, 2, -1, hidden)  # [Hk, {b, a}, r, H]
    return [
        _Write(prefix + ".in_proj_b.weight", grouped[:, 0].reshape(-1, hidden)),
        _Write(prefix + ".in_proj_a.weight", grouped[:, 1].reshape(-1, hidden)),
    ]


def _init_dummy(model: Qwen3HybridForCausalLM, seed: int, show_progress: bool | None) -> None:
    """Deterministic random weights of a sensible scale, generated in place on the model's device."""
    device = model.model.embed_tokens.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    params = sorted(model.named_parameters())
    for name, param in progress(params, len(params), "random weights", "tensor", show_progress):
        if name.endswith("A_log"):
            # HF init: A ~ U(0.01, 16); drawn in fp32 since bf16 rounds the bounds.
            a = torch.empty(param.shape, dtype=torch.float32, device=device).uniform_(0.01, 16, generator=gen)
            param.copy_(a.log_())
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            param.fill_(1.0)
        elif name.endswith("norm.weight"):
            # Zero-centred norms: scale 1 + w.
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("conv_weight"):
            bound = param.shape[-1] ** -0.5
            param.uniform_(-bound, bound, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)
