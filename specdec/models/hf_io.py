"""Loading and saving DeepSeek-V3 checkpoints in the HF layout (config.json + safetensors).

Weight names are those of the public DeepSeek-V3 release as transformers saves them; the MTP
layer lives at ``model.layers.{num_hidden_layers}`` with its enorm/hnorm/eh_proj/shared_head.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.models.deepseek_v3 import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM

_MTP_LAYER_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


def _read_tensors(path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    out[key] = f.get_tensor(key)
    return out


def _load_into(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str, allow_missing: tuple[str, ...] = ()) -> None:
    """Copy tensors into module's parameters/buffers by name; every name must match exactly."""
    own = dict(module.state_dict())
    missing = sorted(k for k in own if k not in tensors and not k.startswith(allow_missing))
    unexpected = sorted(k for k in tensors if k not in own)
    if missing or unexpected:
        raise ValueError(f"checkpoint {where} does not match the model: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for name, t in tensors.items():
        if own[name].shape != t.shape:
            raise ValueError(f"checkpoint {where}: {name} has shape {tuple(t.shape)}, the config implies {tuple(own[name].shape)}")
    module.load_state_dict(tensors, strict=False)


def load_deepseek(path: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> DeepseekV3ForCausalLM:
    """The target model of an HF DeepSeek-V3 directory (the MTP layer, if any, is skipped)."""
    cfg = DeepseekV3Config.from_json(os.path.join(path, "config.json"))
    model = DeepseekV3ForCausalLM(cfg)
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    tensors = {k: v for k, v in _read_tensors(path).items() if not k.startswith(mtp_prefix)}
    if cfg.tie_word_embeddings:
        tensors.setdefault("lm_head.weight", tensors.get("model.embed_tokens.weight"))
    _load_into(model, tensors, path)
    return model.to(device=device, dtype=dtype).eval()


def load_mtp(path: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
             target: Optional[DeepseekV3ForCausalLM] = None) -> DeepseekMTP:
    """The MTP draft layer at ``model.layers.{num_hidden_layers}``; embedding and head come from
    the checkpoint when present, else are shared with ``target``."""
    cfg = DeepseekV3Config.from_json(os.path.join(path, "config.json"))
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    raw = _read_tensors(path, prefix)
    if not raw:
        raise ValueError(f"{path} has no MTP layer ({prefix}*); num_nextn_predict_layers is {cfg.num_nextn_predict_layers}")
    tensors = {}
    for key, t in raw.items():
        name = key[len(prefix):]
        tensors[f"layer.{name}" if name.startswith(_MTP_LAYER_PARTS) else name] = t
    has_own = "embed_tokens.weight" in tensors and "shared_head.head.weight" in tensors
    if not has_own and target is None:
        raise ValueError(f"{path}'s MTP layer has no embed_tokens/shared_head.head of its own: pass target= to share the target's")
    mtp = DeepseekMTP(cfg, target=None if has_own else target)
    shared = () if has_own else ("embed_tokens.", "shared_head.head.")
    _load_into(mtp, tensors, f"{path} (MTP layer)", allow_missing=shared)
    return mtp.to(device=device, dtype=dtype).eval()


def save_deepseek(model: DeepseekV3ForCausalLM, path: str, mtp: Optional[DeepseekMTP] = None) -> None:
    """Write config.json + model.safetensors in the HF layout (the MTP layer included if given)."""
    os.makedirs(path, exist_ok=True)
    cfg = model.config.to_dict()
    cfg["num_nextn_predict_layers"] = 1 if mtp is not None else 0
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    if mtp is not None:
        prefix = f"model.layers.{model.config.num_hidden_layers}."
        for name, v in mtp.state_dict().items():
            key = name[len("layer."):] if name.startswith("layer.") else name
            tensors[prefix + key] = v.detach().contiguous().cpu().clone()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
