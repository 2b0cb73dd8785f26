"""HF-format Qwen3-VL / Qwen3-VL-MoE checkpoints <-> osvl state dicts.

Layout differences handled here: HF names, the Conv3d patch embedding (stored 5-D, used as
a Linear), and MoE experts stored fused as ``gate_up_proj`` / ``down_proj``. Released
Qwen checkpoints keep experts as ``[E, D, 2F]`` / ``[E, F, D]``; transformers >= 5 saves
``[E, 2F, D]`` / ``[E, D, F]``. Both load; saves use the released layout.

Saving a sharded model is a streaming collective: :func:`iter_hf_tensors` gathers one decoder
layer (or vision block) at a time and converts it with :func:`to_hf_state_dict`; each tensor has
one writing rank (:func:`shard_plan`), so no rank ever holds the whole model. The same stream
feeds a weight broadcast to inference engines.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from osvl.model.attention import AttentionBackend
from osvl.model.config import Qwen3VLConfig, config_from_hf, config_to_hf
from osvl.model.init import init_rules, local_box
from osvl.model.model import Qwen3VLModel, build_model, materialize
from osvl.model.text_export import text_config_to_hf, to_text_hf

_TEXT = "model.language_model."
_VISUAL = "model.visual."
_LAYER_RENAMES = {
    "self_attn.q_proj.weight": "attention.qkv_linear.wq.weight",
    "self_attn.k_proj.weight": "attention.qkv_linear.wk.weight",
    "self_attn.v_proj.weight": "attention.qkv_linear.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
}
_LAYER_RENAMES_BACK = {v: k for k, v in _LAYER_RENAMES.items()}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERTS = "moe.routed_experts.inner_experts."
_AC_WRAPPER = "._checkpoint_wrapped_module"
_UNIT_KEY = re.compile(r"^(layers\.\d+|visual\.blocks\.\d+)\.")
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class HFSource:
    """Where an osvl parameter lives in an HF checkpoint: the tensor's name and how its layout differs
    (``same``; ``patch_embed``: stored 5-D; ``gate``/``up``: one half of the fused ``gate_up_proj``;
    ``down``: ``down_proj``; both expert tensors in either layout)."""

    name: str
    kind: str = "same"


def hf_source(key: str, config: Qwen3VLConfig) -> HFSource:
    """The HF tensor an osvl parameter (canonical name) is stored in."""
    if key == "visual.patch_embed.proj.weight":
        return HFSource(_VISUAL + key[len("visual.") :], "patch_embed")
    if key.startswith("visual."):
        return HFSource(_VISUAL + key[len("visual.") :])
    if key == "tok_embeddings.weight" or (key == "lm_head.weight" and config.tie_word_embeddings):
        return HFSource(_TEXT + "embed_tokens.weight")
    if key == "norm.weight":
        return HFSource(_TEXT + "norm.weight")
    if key == "lm_head.weight":
        return HFSource("lm_head.weight")
    if m := _LAYER_KEY.match(key):
        layer, rest = m.groups()
        prefix = f"{_TEXT}layers.{layer}."
        experts = {
            "w1_EFD": ("gate_up_proj", "gate"),
            "w3_EFD": ("gate_up_proj", "up"),
            "w2_EDF": ("down_proj", "down"),
        }
        if rest.startswith(_EXPERTS) and rest[len(_EXPERTS) :] in experts:
            name, kind = experts[rest[len(_EXPERTS) :]]
            return HFSource(prefix + "mlp.experts." + name, kind)
        if rest in _LAYER_RENAMES_BACK:
            return HFSource(prefix + _LAYER_RENAMES_BACK[rest])
    raise ValueError(f"no HF name for parameter {key!r}")


def to_hf_state_dict(state: dict[str, torch.Tensor], config: Qwen3VLConfig) -> dict[str, torch.Tensor]:
    """osvl names/layouts -> HF on-disk names/layouts (released expert layout)."""
    v = config.vision
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        source = hf_source(key, config)
        if source.kind == "patch_embed":
            t = t.reshape(v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        elif source.kind == "gate":
            up = state[key.replace("w1_EFD", "w3_EFD")]
            t = torch.cat([t, up], dim=1).transpose(1, 2).contiguous()
        elif source.kind == "down":
            t = t.transpose(1, 2).contiguous()
        elif source.kind == "up":
            continue
        out[source.name] = t
    return out


def released_expert_layout(name: str, shape: tuple[int, ...], E: int, D: int, F: int) -> bool:
    """Whether a stored ``gate_up_proj`` / ``down_proj`` is in the released layout ([E, D, 2F] / [E, F, D]),
    else transformers >= 5's ([E, 2F, D] / [E, D, F]). A shape both could have (D = 2F, or D = F) is read
    as released: what Qwen ships and osvl writes."""
    released, v5 = ((E, D, 2 * F), (E, 2 * F, D)) if name.endswith("gate_up_proj") else ((E, F, D), (E, D, F))
    if shape not in (released, v5):
        raise ValueError(f"{name} has shape {shape}; expected {released} or {v5}")
    return shape == released


def _experts_from_hf(gate_up: torch.Tensor, down: torch.Tensor, config: Qwen3VLConfig, key: str):
    t = config.text
    E, D, F = t.num_experts, t.hidden_size, t.moe_intermediate_size
    released = released_expert_layout(key + "gate_up_proj", tuple(gate_up.shape), E, D, F)
    gate_up_EFD = gate_up.transpose(1, 2) if released else gate_up
    released = released_expert_layout(key + "down_proj", tuple(down.shape), E, D, F)
    down_EDF = down.transpose(1, 2) if released else down
    w1, w3 = gate_up_EFD.split(F, dim=1)
    return w1.contiguous(), down_EDF.contiguous(), w3.contiguous()


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: Qwen3VLConfig) -> dict[str, torch.Tensor]:
    """HF names/layouts (either expert layout) -> osvl names/layouts."""
    v = config.vision
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in hf.items():
        if key.startswith(_VISUAL):
            name = "visual." + key[len(_VISUAL) :]
            if name == "visual.patch_embed.proj.weight":
                t = t.reshape(v.hidden_size, v.patch_dim)
            out[name] = t
        elif key == _TEXT + "embed_tokens.weight":
            out["tok_embeddings.weight"] = t
        elif key == _TEXT + "norm.weight":
            out["norm.weight"] = t
        elif key == "lm_head.weight":
            out["lm_head.weight"] = t
        elif key.startswith(_TEXT + "layers."):
            layer, rest = key[len(_TEXT + "layers.") :].split(".", 1)
            if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                pending.setdefault(layer, {})[rest.rsplit(".", 1)[1]] = t
            elif rest in _LAYER_RENAMES:
                out[f"layers.{layer}.{_LAYER_RENAMES[rest]}"] = t
            else:
                raise ValueError(f"unknown checkpoint tensor {key!r}")
        else:
            raise ValueError(f"unknown checkpoint tensor {key!r}")
    for layer, parts in pending.items():
        key = f"{_TEXT}layers.{layer}.mlp.experts."
        if set(parts) != {"gate_up_proj", "down_proj"}:
            raise ValueError(f"{key}: need both gate_up_proj and down_proj, found {sorted(parts)}")
        w1, w2, w3 = _experts_from_hf(parts["gate_up_proj"], parts["down_proj"], config, key)
        out[f"layers.{layer}.{_EXPERTS}w1_EFD"] = w1
        out[f"layers.{layer}.{_EXPERTS}w2_EDF"] = w2
        out[f"layers.{layer}.{_EXPERTS}w3_EFD"] = w3
    if config.tie_word_embeddings and "lm_head.weight" not in out and "tok_embeddings.weight" in out:
        out["lm_head.weight"] = out["tok_embeddings.weight"]
    return out


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory by its HF name (all shards, through the index when
    there is one)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[key] = f.get_tensor(key)
    return tensors


class CheckpointError(ValueError):
    """A checkpoint directory that cannot give the model its weights; names the file and the tensor."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors checkpoint, as its file's header describes it (nothing read)."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: str  # the safetensors dtype name, e.g. "BF16"


def checkpoint_files(path: str | Path) -> dict[str, list[str]]:
    """File name -> the tensors the index says it holds (``[]`` when there is no index)."""
    path = Path(path)
    index = path / INDEX_FILE
    if not index.exists():
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors files in {path}")
        return {name: [] for name in files}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index}: not a safetensors index ({error})") from None
    files: dict[str, list[str]] = {}
    for tensor, name in weight_map.items():
        files.setdefault(name, []).append(tensor)
    return dict(sorted(files.items()))


def stored_tensors(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of an HF checkpoint directory from the file headers alone: a missing shard file, a
    truncated one, or a tensor the index places in a file that lacks it is a :class:`CheckpointError`
    naming the file (and the tensor)."""
    path = Path(path)
    out: dict[str, StoredTensor] = {}
    for name, indexed in checkpoint_files(path).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing; the index places {len(indexed)} tensors in it, e.g. {indexed[0]!r}"
            )
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    view = f.get_slice(key)
                    out[key] = StoredTensor(file, key, tuple(view.get_shape()), view.get_dtype())
        except Exception as error:  # safetensors raises its own error type for a truncated or garbled file
            raise CheckpointError(f"{file} cannot be read ({error}); is it truncated?") from None
        absent = [t for t in indexed if out.get(t) is None or out[t].file != file]
        if absent:
            raise CheckpointError(f"{file} lacks {absent[0]!r}, which the index places in it")
    return out


def _expected_shapes(source: HFSource, shape: tuple[int, ...], config: Qwen3VLConfig) -> list[tuple[int, ...]]:
    """The stored shapes an osvl parameter of ``shape`` may come from (both expert layouts)."""
    v = config.vision
    if source.kind == "patch_embed":
        return [(v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)]
    if source.kind in ("gate", "up"):
        E, F, D = shape
        return [(E, D, 2 * F), (E, 2 * F, D)]
    if source.kind == "down":
        E, D, F = shape
        return [(E, F, D), (E, D, F)]
    return [shape]


def checkpoint_sources(
    model: torch.nn.Module, stored: dict[str, StoredTensor]
) -> dict[str, tuple[HFSource, StoredTensor]]:
    """Canonical parameter name -> (where it is stored, the stored tensor), after checking that
    the checkpoint holds every parameter in a shape it can come from and nothing else (a tied model's
    separate ``lm_head.weight`` is allowed and ignored). Reads headers only: call it on the meta model,
    before anything is allocated."""
    config: Qwen3VLConfig = model.arch
    out = {}
    problems = []
    used = set()
    for name, (_, param) in init_rules(model).items():
        source = hf_source(name, config)
        used.add(source.name)
        found = stored.get(source.name)
        if found is None:
            problems.append(f"missing {source.name!r} (for {name}, shape {tuple(param.shape)})")
            continue
        accepted = _expected_shapes(source, tuple(param.shape), config)
        if found.shape not in accepted:
            problems.append(
                f"{found.file.name}: {source.name!r} has shape {found.shape}, the architecture needs "
                + " or ".join(map(str, accepted))
            )
            continue
        out[name] = (source, found)
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(set(stored) - used - ignored)
    problems += [f"{stored[k].file.name}: unexpected tensor {k!r}" for k in unexpected]
    problems = list(dict.fromkeys(problems))  # a fused expert tensor serves two parameters
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        directory = next(iter(stored.values())).file.parent if stored else "?"
        raise CheckpointError(f"checkpoint {directory} does not match the architecture: {shown}")
    return out


def read_box(
    view, source: HFSource, full_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]
) -> torch.Tensor:
    """The ``[offset, offset + shape)`` box of an osvl parameter of ``full_shape`` from a safetensors slice
    ``view`` of the tensor it is stored in. Only the box is read: the fused expert halves and the
    transposed expert layouts become index ranges of the stored tensor."""
    box = [slice(o, o + n) for o, n in zip(offset, shape, strict=True)]
    if source.kind == "same":
        return view[tuple(box)]
    if source.kind == "patch_embed":  # stored 5-D; the tower is small and sharded by rows only
        return view[box[0]].reshape(shape[0], -1)[:, box[1]]
    e, a, b = box
    if source.kind in ("gate", "up"):  # osvl [E, F, D] from gate_up_proj [E, D, 2F] or [E, 2F, D]
        E, F, D = full_shape
        if source.kind == "up":
            a = slice(a.start + F, a.stop + F)
    else:  # osvl [E, D, F] from down_proj [E, F, D] or [E, D, F]
        E, D, F = full_shape
    released = released_expert_layout(source.name, tuple(view.get_shape()), E, D, F)
    return view[e, b, a].permute(0, 2, 1) if released else view[e, a, b]


@torch.no_grad()
def load_checkpoint_shards(model: torch.nn.Module, sources: dict[str, tuple[HFSource, StoredTensor]]) -> None:
    """Fills this rank's part of every parameter from the checkpoint (:func:`checkpoint_sources` of the
    same model, taken before it was materialised). Each tensor's file is opened on its own and closed
    before the next, so the pages read (memory-mapped) never add up beyond one box."""
    for name, (_, param) in init_rules(model).items():
        source, found = sources[name]
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.numel() == 0:
            continue
        offset, shape = local_box(param)
        try:
            with safe_open(str(found.file), framework="pt") as f:
                local.copy_(read_box(f.get_slice(found.name), source, tuple(param.shape), offset, shape))
        except Exception as error:
            raise CheckpointError(f"{found.file}: reading {found.name!r} for {name} failed: {error}") from error


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend = "sdpa",
) -> Qwen3VLModel:
    """Load an HF Qwen3-VL / Qwen3-VL-MoE checkpoint directory: built on the meta device, checked against
    the files' headers, then allocated once on ``device`` and filled tensor by tensor."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json")
    config = config_from_hf(json.loads((path / "config.json").read_text()))
    model = build_model(config, attn_backend=attn_backend, device="meta", dtype=dtype)
    sources = checkpoint_sources(model, stored_tensors(path))
    load_checkpoint_shards(materialize(model, device), sources)
    return model


@dataclass(frozen=True)
class HFTensorSpec:
    """One tensor of the HF checkpoint, known before anything is gathered."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ShardFile:
    """One safetensors file of a save: the rank that writes it and its tensors, in write order."""

    name: str
    owner: int
    tensors: tuple[str, ...]
    nbytes: int


def _conversion_units(model: Qwen3VLModel, text_only: bool = False) -> list[dict[str, torch.Tensor]]:
    """The model's state in state-dict order, cut into the units the HF conversion needs whole: one
    decoder layer (its experts are fused into ``gate_up_proj``), one vision block, or one other tensor.
    ``text_only`` leaves the vision tower out (never gathered)."""
    units: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in model.state_dict().items():
        key = key.replace(_AC_WRAPPER, "")
        if key == "lm_head.weight" and model.arch.tie_word_embeddings:
            continue  # the same tensor as the embedding; HF stores it once
        if text_only and key.startswith("visual."):
            continue
        unit = _UNIT_KEY.match(key)
        units.setdefault(unit.group(1) if unit else key, {})[key] = t
    return list(units.values())


def largest_conversion_unit(model: Qwen3VLModel, dtype_bytes: int) -> int:
    """Bytes of the largest unit :func:`iter_hf_tensors` gathers at once (whole, in a ``dtype_bytes`` dtype)."""
    return max(sum(t.numel() for t in unit.values()) for unit in _conversion_units(model)) * dtype_bytes


def _hf_unit(unit: dict[str, torch.Tensor], config: Qwen3VLConfig, text_only: bool) -> list[tuple[str, torch.Tensor]]:
    hf = to_hf_state_dict(unit, config)
    if not text_only:
        return list(hf.items())
    return [pair for name, t in hf.items() for pair in to_text_hf(name, t)]


def hf_tensor_specs(
    model: Qwen3VLModel, dtype: torch.dtype | None = None, *, text_only: bool = False
) -> list[HFTensorSpec]:
    """What :func:`iter_hf_tensors` yields (HF names, shapes, dtypes), in its order. Local: no
    communication, so every rank knows the whole layout before the first gather."""
    specs: list[HFTensorSpec] = []
    for unit in _conversion_units(model, text_only):
        meta = {k: torch.empty(t.shape, dtype=dtype or t.dtype, device="meta") for k, t in unit.items()}
        specs += [HFTensorSpec(name, tuple(t.shape), t.dtype) for name, t in _hf_unit(meta, model.arch, text_only)]
    return specs


def _gathered(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)  # on the local shard: half the bytes on the wire for bf16, same bits as after
    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_hf_tensors(
    model: Qwen3VLModel, dtype: torch.dtype | None = None, *, text_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for the whole model in HF names and the released layout.

    Collective for a sharded (FSDP2 / TP / EP) model: every rank must iterate it to the end, in
    step (each unit's shards are all-gathered on every rank). At most one conversion unit (a decoder
    layer or a vision block) is gathered at a time; a yielded tensor is freed once the caller drops
    it. Tensors are on the model's device, cast to ``dtype`` when given; for an unsharded model they
    may alias its parameters (read, never write them). Order and names: :func:`hf_tensor_specs`.
    ``text_only``: the language model as a Qwen3 text checkpoint (:mod:`osvl.model.text_export`).
    """
    for unit in _conversion_units(model, text_only):
        hf = _hf_unit({k: _gathered(t, dtype) for k, t in unit.items()}, model.arch, text_only)
        while hf:
            yield hf.pop(0)


def shard_plan(specs: Sequence[HFTensorSpec], world_size: int, max_shard_bytes: int) -> list[ShardFile]:
    """Which rank writes which tensors to which file: ranks own consecutive runs of ``specs`` balanced
    by bytes, each run cut into files of at most ``max_shard_bytes`` (a larger tensor gets its own
    file). Files follow ``specs`` order, so a file is complete as soon as its last tensor streams by."""
    if not specs:
        raise ValueError("a checkpoint needs at least one tensor")
    if world_size < 1 or max_shard_bytes <= 0:
        raise ValueError(f"world_size must be >= 1 and max_shard_bytes > 0, got {world_size}, {max_shard_bytes}")
    total = sum(s.nbytes for s in specs)
    runs: list[tuple[int, list[HFTensorSpec]]] = []
    before = size = 0
    for spec in specs:  # the owner holds the tensor's byte midpoint
        owner = min(world_size - 1, world_size * (2 * before + spec.nbytes) // max(2 * total, 1))
        before += spec.nbytes
        if not runs or runs[-1][0] != owner or size + spec.nbytes > max_shard_bytes:
            runs.append((owner, []))
            size = 0
        runs[-1][1].append(spec)
        size += spec.nbytes
    n = len(runs)
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    return [
        ShardFile(name, owner, tuple(s.name for s in run), sum(s.nbytes for s in run))
        for name, (owner, run) in zip(names, runs, strict=True)
    ]


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_pretrained(
    model: Qwen3VLModel,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    text_only: bool = False,
) -> list[ShardFile]:
    """Write ``config.json`` + safetensors shards (+ index when more than one) in HF layout.

    Collective when ``torch.distributed`` is initialized: every rank calls it, and each writes the
    files :func:`shard_plan` gives it while the model streams through :func:`iter_hf_tensors`, so a
    rank holds at most one gathered layer plus the one file it is filling, never the whole model.
    The tensors are the same whatever the world size and sharding. Rank 0 writes ``config.json`` and
    the index (and first removes the safetensors of an earlier save at ``path``). ``path`` must be
    storage every rank sees (one shared directory). Returns the plan once every file is on disk.
    ``text_only`` writes the language model alone as a Qwen3 text checkpoint (:mod:`osvl.model.text_export`).
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    path = Path(path)
    rank, world = _rank_and_world()
    specs = hf_tensor_specs(model, dtype, text_only=text_only)
    plan = shard_plan(specs, world, max_shard_bytes)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        for old in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
            old.unlink(missing_ok=True)
    _barrier()
    file_of = {name: file for file in plan for name in file.tensors}
    filling: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in iter_hf_tensors(model, dtype, text_only=text_only):
        file = file_of[name]
        if file.owner == rank:
            shard = filling.setdefault(file.name, {})
            shard[name] = t.to("cpu").contiguous()
            if len(shard) == len(file.tensors):
                save_file(filling.pop(file.name), str(path / file.name), metadata={"format": "pt"})
        del t
    if rank == 0:
        dtype_name = str(dtype or specs[0].dtype).removeprefix("torch.")
        to_config = text_config_to_hf if text_only else config_to_hf
        (path / "config.json").write_text(json.dumps(to_config(model.arch, dtype=dtype_name), indent=2))
        if len(plan) > 1:
            index = {
                "metadata": {"total_size": sum(f.nbytes for f in plan)},
                "weight_map": {name: f.name for f in plan for name in f.tensors},
            }
            (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    _barrier()
    return plan
