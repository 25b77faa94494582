"""HF-format DeepSeek-V3 checkpoints: config.json + safetensors (one file, or shards with
``model.safetensors.index.json``), in the public release's weight names.

Target weights are ``model.embed_tokens``, ``model.layers.{i}.*``, ``model.norm``, ``lm_head``;
routed experts are stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), which is
also what transformers 5 writes (it fuses them only in memory). The MTP layer is
``model.layers.{num_hidden_layers}.*``: its decoder-layer weights (self_attn, mlp, norms) plus
enorm, hnorm, eh_proj, shared_head.norm and, in the public release, its own copies of
embed_tokens and shared_head.head.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.models.config import DeepseekV3Config
from specdec.models.deepseek import DeepseekV3ForCausalLM
from specdec.models.mtp import DeepseekMTP

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the release stores copies; else shared


class CheckpointError(ValueError):
    """The checkpoint's weights do not match what the config describes."""


def load_deepseek(path: str, dtype: torch.dtype = torch.bfloat16, device: Any = "cpu") -> DeepseekV3ForCausalLM:
    """The target model of an HF DeepSeek-V3 directory, built directly in ``dtype`` on ``device``
    (an MTP layer in the checkpoint is skipped; see :func:`load_mtp`)."""
    config = DeepseekV3Config.from_json(os.path.join(path, "config.json"))
    index = _weight_index(path)
    model = DeepseekV3ForCausalLM(config, dtype, device)
    names = [n for n in index if not _is_mtp_weight(n, config)]
    if config.tie_word_embeddings:  # a copy of the tied head is redundant (transformers ties it too)
        names = [n for n in names if n != "lm_head.weight"]
    _copy_weights(_own_tensors(model), names, index, path)
    return model.eval()


def load_mtp(path: str, dtype: torch.dtype = torch.bfloat16, device: Any = "cpu",
             target: Optional[DeepseekV3ForCausalLM] = None) -> DeepseekMTP:
    """The MTP draft layer of an HF DeepSeek-V3 directory. Its embed_tokens / shared_head.head are
    loaded when the checkpoint has them, else shared with ``target`` (required then)."""
    config = DeepseekV3Config.from_json(os.path.join(path, "config.json"))
    if config.num_nextn_predict_layers < 1:
        raise ValueError(f"{path} has no MTP layer: its config.json sets num_nextn_predict_layers={config.num_nextn_predict_layers}")
    index = _weight_index(path)
    prefix = f"model.layers.{config.num_hidden_layers}."
    available = [n for n in index if n.startswith(prefix)]
    if not available:
        raise ValueError(f"{path} has no MTP layer: no {prefix}* weights although num_nextn_predict_layers=1")
    absent = [n for n in _MTP_SHARED if prefix + n not in index]
    if absent and target is None:
        raise CheckpointError(f"{path}: the MTP layer has no {[prefix + n for n in absent]}; pass target= to share the target's")
    if absent:
        weight, want = target.embed_tokens.weight, torch.device(device)
        if weight.dtype != dtype or weight.device.type != want.type or want.index not in (None, weight.device.index):
            raise CheckpointError(f"{path}: the MTP layer shares the target's {absent}, which is {weight.dtype} on "
                                  f"{weight.device}; asked for {dtype} on {device}: load both alike")
    mtp = DeepseekMTP(config, None, dtype, device,
                      embed_tokens=target.embed_tokens if "embed_tokens.weight" in absent else None,
                      head=target.lm_head if "shared_head.head.weight" in absent else None)
    own = {prefix + _mtp_checkpoint_name(n): t for n, t in _own_tensors(mtp).items() if n not in absent}
    _copy_weights(own, available, index, path)
    return mtp.eval()


def save_deepseek(model: DeepseekV3ForCausalLM, path: str, mtp: Optional[DeepseekMTP] = None) -> None:
    """Write config.json + model.safetensors in the public layout; with ``mtp``, its layer goes to
    ``model.layers.{num_hidden_layers}`` (embedding and head copies included, as in the release)
    and config.json sets num_nextn_predict_layers=1."""
    os.makedirs(path, exist_ok=True)
    config = model.config.to_dict()
    config["num_nextn_predict_layers"] = int(mtp is not None)
    tensors = {n: t.detach() for n, t in _own_tensors(model).items()}
    if mtp is not None:
        prefix = f"model.layers.{model.config.num_hidden_layers}."
        # Every name, shared ones too: a tied embedding and head are two tensors in the release.
        for name, t in mtp.state_dict(keep_vars=True).items():
            tensors[prefix + _mtp_checkpoint_name(name)] = t.detach()
    written: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in written:  # safetensors refuses shared storage: copy
            t = t.clone()
        written.add(t.untyped_storage().data_ptr())
        out[name] = t
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


# ----------------------------------------------------------------------------------- helpers
def _weight_index(path: str) -> dict[str, str]:
    """Checkpoint weight name -> safetensors file holding it."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_file):
        with open(index_file) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    index = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if name in index:  # without an index json, no file says which copy is meant
                    raise CheckpointError(f"{path}: {name} is in both {index[name]} and {file}")
                index[name] = file
    return index


def _is_mtp_weight(name: str, config: DeepseekV3Config) -> bool:
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= config.num_hidden_layers


def _mtp_checkpoint_name(module_name: str) -> str:
    return module_name[len("layer."):] if module_name.startswith("layer.") else module_name


def _own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent parameters and buffers by state-dict name; a tensor reachable under two names
    (tied lm_head) is listed once, under its first."""
    seen: set[int] = set()
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _copy_weights(own: dict[str, torch.Tensor], available: list[str], index: dict[str, str], where: str) -> None:
    """Copy checkpoint tensors into ``own`` (checkpoint name -> module tensor), one at a time.

    available: the checkpoint weights meant for this module; they must be exactly own's names,
    with own's shapes.
    """
    missing = sorted(own.keys() - set(available))
    unexpected = sorted(set(available) - own.keys())
    if missing or unexpected:
        raise CheckpointError(f"{where} does not match its config.json: missing {_short(missing)}, unexpected {_short(unexpected)}")
    by_file: dict[str, list[str]] = {}
    for name in own:
        by_file.setdefault(index[name], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, "pt") as f:
                for name in names:
                    t = f.get_tensor(name)
                    if not t.is_floating_point() or t.element_size() < 2:
                        # copy_ would read e4m3 codes as values (a weight left quantised, its scale lost)
                        raise CheckpointError(f"{where}: {name} is {t.dtype}; the loader takes 16/32-bit float "
                                              "weights: dequantise FP8 checkpoints to bf16 first")
                    if t.shape != own[name].shape:
                        raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, config.json implies {tuple(own[name].shape)}")
                    own[name].copy_(t)


def _short(names: list[str], limit: int = 8) -> str:
    return repr(names) if len(names) <= limit else f"{names[:limit]!r} and {len(names) - limit} more"
