"""HF-format Qwen3-VL / Qwen3-VL-MoE checkpoints <-> osvl state dicts.

Layout differences handled here: HF names, the Conv3d patch embedding (stored 5-D, used as
a Linear), and MoE experts stored fused as ``gate_up_proj`` / ``down_proj``. Released
Qwen checkpoints keep experts as ``[E, D, 2F]`` / ``[E, F, D]``; transformers >= 5 saves
``[E, 2F, D]`` / ``[E, D, F]``. Both load; saves use the released layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from osvl.model.attention import AttentionBackend
from osvl.model.config import Qwen3VLConfig, config_from_hf, config_to_hf
from osvl.model.model import Qwen3VLModel, build_model

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


def to_hf_state_dict(state: dict[str, torch.Tensor], config: Qwen3VLConfig) -> dict[str, torch.Tensor]:
    """osvl names/layouts -> HF on-disk names/layouts (released expert layout)."""
    v = config.vision
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key.startswith("visual."):
            name = _VISUAL + key[len("visual.") :]
            if key == "visual.patch_embed.proj.weight":
                t = t.reshape(v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
            out[name] = t
        elif key == "tok_embeddings.weight":
            out[_TEXT + "embed_tokens.weight"] = t
        elif key == "norm.weight":
            out[_TEXT + "norm.weight"] = t
        elif key == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["lm_head.weight"] = t
        elif m := _LAYER_KEY.match(key):
            layer, rest = m.groups()
            prefix = f"{_TEXT}layers.{layer}."
            if rest == _EXPERTS + "w1_EFD":
                w3 = state[f"layers.{layer}.{_EXPERTS}w3_EFD"]
                out[prefix + "mlp.experts.gate_up_proj"] = torch.cat([t, w3], dim=1).transpose(1, 2).contiguous()
            elif rest == _EXPERTS + "w2_EDF":
                out[prefix + "mlp.experts.down_proj"] = t.transpose(1, 2).contiguous()
            elif rest == _EXPERTS + "w3_EFD":
                continue
            elif rest in _LAYER_RENAMES_BACK:
                out[prefix + _LAYER_RENAMES_BACK[rest]] = t
            else:
                raise ValueError(f"no HF name for parameter {key!r}")
        else:
            raise ValueError(f"no HF name for parameter {key!r}")
    return out


def _experts_from_hf(gate_up: torch.Tensor, down: torch.Tensor, config: Qwen3VLConfig, key: str):
    t = config.text
    E, D, F = t.num_experts, t.hidden_size, t.moe_intermediate_size
    if gate_up.shape == (E, 2 * F, D):
        gate_up_EFD = gate_up
    elif gate_up.shape == (E, D, 2 * F):
        gate_up_EFD = gate_up.transpose(1, 2)
    else:
        raise ValueError(f"{key}gate_up_proj has shape {tuple(gate_up.shape)}; expected ({E}, {D}, {2 * F}) or ({E}, {2 * F}, {D})")
    if down.shape == (E, D, F):
        down_EDF = down
    elif down.shape == (E, F, D):
        down_EDF = down.transpose(1, 2)
    else:
        raise ValueError(f"{key}down_proj has shape {tuple(down.shape)}; expected ({E}, {F}, {D}) or ({E}, {D}, {F})")
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


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
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


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend = "sdpa",
) -> Qwen3VLModel:
    """Load an HF Qwen3-VL / Qwen3-VL-MoE checkpoint directory."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json")
    config = config_from_hf(json.loads((path / "config.json").read_text()))
    model = build_model(config, attn_backend=attn_backend, device=device, dtype=dtype, init=False)
    state = from_hf_state_dict(_read_safetensors(path), config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model.load_state_dict({k: t.to(dtype) for k, t in state.items()}, strict=True)
    return model


def save_pretrained(
    model: Qwen3VLModel, path: str | Path, *, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write ``config.json`` + safetensors shards (+ index when sharded) in HF layout.

    For a sharded (FSDP / TP / EP) model every rank must call this (tensors are all-gathered);
    only rank 0 writes.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    config = model.arch
    state = {
        k.replace("._checkpoint_wrapped_module", ""): (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        for k, t in model.state_dict().items()
    }
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = to_hf_state_dict(state, config)
    if dtype is not None:
        hf = {k: t.to(dtype) for k, t in hf.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(hf):
        nbytes = hf[key].numel() * hf[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = hf[key].contiguous().cpu()
        size += nbytes
    dtype_name = str(next(iter(hf.values())).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config_to_hf(config, dtype=dtype_name), indent=2))
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in hf.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def iter_hf_tensors(model: Qwen3VLModel, dtype: torch.dtype | None = None):
    """(HF name, full tensor) pairs, one layer's parameters gathered at a time (collective: every rank
    iterates in the same order). INTERIM: replaced by the sharded-export implementation."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in model.state_dict().items():
        key = key.replace("._checkpoint_wrapped_module", "")
        m = _LAYER_KEY.match(key)
        groups.setdefault(f"layers.{m.group(1)}" if m else key, {})[key] = t
    for part in groups.values():
        full = {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for k, t in part.items()}
        for name, tensor in to_hf_state_dict(full, model.arch).items():
            yield name, tensor if dtype is None else tensor.to(dtype)
