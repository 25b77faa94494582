"""HF-format DeepSeek-V3 checkpoints: config.json + safetensors (one file, or shards with
``model.safetensors.index.json``), in the public release's weight names.

Target weights are ``model.embed_tokens``, ``model.layers.{i}.*``, ``model.norm``, ``lm_head``;
routed experts are stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), which is
also what transformers 5 writes (it fuses them only in memory). The MTP layer is
``model.layers.{num_hidden_layers}.*``: its decoder-layer weights (self_attn, mlp, norms) plus
enorm, hnorm, eh_proj, shared_head.norm and, in the public release, its own copies of
embed_tokens and shared_head.head. DeepSeek-V3.2 (model_type deepseek_v32) adds every layer's
indexer, ``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``, the MTP layer's too.
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

from specdec.models.config import DeepseekV32Config, DeepseekV3Config
from specdec.models.deepseek import DeepseekV3ForCausalLM
from specdec.models.deepseek_v32 import DeepseekV32ForCausalLM, DeepseekV32MTP
from specdec.models.mtp import DeepseekMTP
from specdec.parallel import SINGLE, Parallel

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's; the release stores copies
_WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")  # safetensors' names of the float types copy_ converts exactly
# Tensors cut across tensor-parallel ranks, by module name: the dim cut. A rank's slice is one
# contiguous block (heads, intermediate units and vocabulary ids are consecutive); others are whole.
_TP_DIMS = {"q_proj": 0, "q_b_proj": 0, "kv_b_proj": 0, "o_proj": 1, "gate_proj": 0, "up_proj": 0, "down_proj": 1,
            "embed_tokens": 0, "lm_head": 0, "head": 0}


class CheckpointError(ValueError):
    """The checkpoint's weights do not match what the config describes."""


def load_deepseek(path: str, dtype: torch.dtype = torch.bfloat16, device: Any = "cpu",
                  parallel: Parallel = SINGLE) -> DeepseekV3ForCausalLM:
    """The target model of an HF DeepSeek-V3 directory, built directly in ``dtype`` on ``device``
    (an MTP layer in the checkpoint is skipped; see :func:`load_mtp`). The weights' names, dtypes
    and shapes are checked against the config before the model is built (CheckpointError).
    parallel: this rank's slice; it reads only its slice of each cut tensor (_TP_DIMS) from the
    files, so no rank ever holds the whole model. A config.json of model_type deepseek_v32 loads a
    DeepseekV32ForCausalLM (sparse attention)."""
    config, model_class, _ = _architecture(path)
    index = _weight_index(path)
    names = [n for n in index if not _is_mtp_weight(n, config)]
    if config.tie_word_embeddings:  # a copy of the tied head is redundant (transformers ties it too)
        names = [n for n in names if n != "lm_head.weight"]
    _check_weights(_own_tensors(model_class(config, dtype, "meta", parallel)), names, index, path, parallel)
    if config.tie_word_embeddings and "lm_head.weight" in index:
        # A head that is not the embedding would be dropped silently (as transformers does). Checked
        # before the build, against the embedding as stored (tied models are small ones).
        embed = "model.embed_tokens.weight"
        with safe_open(index[embed], "pt") as f:
            stored = f.get_tensor(embed)
        if not _holds(index["lm_head.weight"], "lm_head.weight", stored, SINGLE):
            raise CheckpointError(f"{path}: config.json ties the head to the embedding (tie_word_embeddings=true), "
                                  f"but the checkpoint's lm_head.weight is not {embed}: set tie_word_embeddings to "
                                  "false to load that head, or remove it from the checkpoint")
    model = model_class(config, dtype, device, parallel)
    _copy_weights(_own_tensors(model), index, parallel)
    return model.eval()


def _architecture(path: str) -> tuple[DeepseekV3Config, type, type]:
    """The config of ``path``'s config.json and the target and MTP classes its model_type names:
    DeepSeek-V3.2's (deepseek_v32: sparse attention, in the MTP layer too), else V3's."""
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    if isinstance(d, dict) and d.get("model_type") in DeepseekV32Config._model_types:
        return DeepseekV32Config.from_dict(d), DeepseekV32ForCausalLM, DeepseekV32MTP
    return DeepseekV3Config.from_dict(d), DeepseekV3ForCausalLM, DeepseekMTP


def load_mtp(path: str, dtype: torch.dtype = torch.bfloat16, device: Any = "cpu",
             target: Optional[DeepseekV3ForCausalLM] = None, parallel: Optional[Parallel] = None) -> DeepseekMTP:
    """The MTP draft layer of an HF DeepSeek-V3 directory (a V3.2 one's, model_type deepseek_v32:
    a DeepseekV32MTP, its indexer included). Its embed_tokens and shared_head.head
    are the target's (``target``, in ``dtype``; device "cuda" then means the target's GPU) where the
    checkpoint has no copy of them, or a copy equal to the target's (the public release stores
    copies of the shared tensors: ~3.7 GB of bf16 saved, and a frozen target freezes them too);
    else the checkpoint's own (a draft trained with its own embedding or head). parallel: as
    load_deepseek's (default: the target's, else one process)."""
    if parallel is None:
        parallel = target.parallel if target is not None else SINGLE
    config, _, mtp_class = _architecture(path)
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
    shared: tuple[str, ...] = ()
    if target is not None:
        weight, want = target.embed_tokens.weight, torch.device(device)
        if want.type == weight.device.type and want.index is None:
            want = weight.device
        if weight.dtype == dtype and weight.device == want:
            device = want
            modules = dict(zip(_MTP_SHARED, (target.embed_tokens, target.lm_head)))
            _check_shared_shapes(modules, config, path, parallel)
            shared = tuple(n for n in _MTP_SHARED
                           if n in absent or _holds(index[prefix + n], prefix + n, modules[n].weight, parallel))
        elif absent:
            raise CheckpointError(f"{path}: the MTP layer shares the target's {absent}, which is {weight.dtype} on "
                                  f"{weight.device}; asked for {dtype} on {device}: load both alike")
    available = [n for n in available if n[len(prefix):] not in shared]

    def build(on: Any) -> DeepseekMTP:
        return mtp_class(config, None, dtype, on,
                         embed_tokens=target.embed_tokens if "embed_tokens.weight" in shared else None,
                         head=target.lm_head if "shared_head.head.weight" in shared else None, parallel=parallel)

    def own(mtp: DeepseekMTP) -> dict[str, torch.Tensor]:
        return {prefix + _mtp_checkpoint_name(n): t for n, t in _own_tensors(mtp).items() if n not in shared}

    _check_weights(own(build("meta")), available, index, path, parallel)
    mtp = build(device)
    _copy_weights(own(mtp), index, parallel)
    return mtp.eval()


def _check_shared_shapes(modules: dict[str, torch.nn.Module], config: DeepseekV3Config, path: str,
                         parallel: Parallel) -> None:
    """CheckpointError where the target's embedding or head is not the [vocab / tp, hidden] of the
    checkpoint's config (a target of another checkpoint)."""
    expected = (config.vocab_size // parallel.size, config.hidden_size)
    for name, module in modules.items():
        if tuple(module.weight.shape) != expected:
            raise CheckpointError(f"{path}: the target's {name} is {tuple(module.weight.shape)}, its config.json implies "
                                  f"{expected}: pass the target of this checkpoint")


def _holds(file: str, name: str, tensor: torch.Tensor, parallel: Parallel, chunk_bytes: int = 64 << 20) -> bool:
    """Whether the checkpoint's ``name`` (this rank's slice of it, a cut tensor's) equals ``tensor``
    once in its dtype, compared a block of rows at a time (never a whole vocabulary-sized copy)."""
    with safe_open(file, "pt") as f:
        header = f.get_slice(name)
        if (header.get_dtype() not in _WEIGHT_DTYPES
                or tuple(header.get_shape()) != _full_shape(name, tuple(tensor.shape), parallel)):
            return False
        offset = parallel.rank * tensor.shape[0] if _tp_dim(name, parallel) == 0 else 0
        rows = max(1, chunk_bytes // max(1, tensor[0].numel() * tensor.element_size()))
        length = tensor.shape[0]
        return all(torch.equal(header[offset + start:offset + min(start + rows, length)].to(tensor.device, tensor.dtype),
                               tensor[start:start + rows]) for start in range(0, length, rows))


def save_deepseek(model: DeepseekV3ForCausalLM, path: str, mtp: Optional[DeepseekMTP] = None) -> None:
    """Write config.json + model.safetensors in the public layout; with ``mtp``, its layer goes to
    ``model.layers.{num_hidden_layers}`` (embedding and head copies included, as in the release)
    and config.json sets num_nextn_predict_layers=1."""
    os.makedirs(path, exist_ok=True)
    stale = sorted(f for f in os.listdir(path) if f == "model.safetensors.index.json"
                   or (f.endswith(".safetensors") and f != "model.safetensors"))
    if stale:
        raise ValueError(f"{path} holds {_short(stale)}, which the loaders would read with (or instead of) the new "
                         "model.safetensors: save into another directory, or remove them")
    if model.parallel.size > 1:
        raise ValueError(f"save_deepseek writes a whole model: this one holds rank {model.parallel.rank}'s slice of "
                         f"{model.parallel.size}; save from a single-process model")
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
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_file} has no weight_map (weight name -> safetensors file)")
        index = {name: os.path.join(path, file) for name, file in weight_map.items()}
        absent = sorted({os.path.basename(f) for f in index.values() if not os.path.exists(f)})
        if absent:
            raise CheckpointError(f"{index_file} maps weights to files that are not in {path}: {_short(absent)}")
    else:
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
    scales = sorted(n for n in index if n.endswith("_scale_inv"))
    if scales:  # the public release's block-FP8 weights: e4m3 codes whose scales live in these tensors
        raise CheckpointError(f"{path} is FP8 block-quantised ({_short(scales, 2)}): the loader takes float weights "
                              "of 16 bits or more; dequantise it to bf16 first (e.g. DeepSeek's fp8_cast_bf16.py)")
    return index


def _is_mtp_weight(name: str, config: DeepseekV3Config) -> bool:
    """A weight of the MTP layer the config announces; any other layer past the decoder's stays a
    weight of the target, unexpected there."""
    m = _LAYER.match(name)
    return m is not None and config.num_nextn_predict_layers > 0 and int(m.group(1)) == config.num_hidden_layers


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


def _check_weights(own: dict[str, torch.Tensor], available: list[str], index: dict[str, str], where: str,
                   parallel: Parallel) -> None:
    """CheckpointError unless the checkpoint weights meant for a module (``available``) are exactly
    own's names (checkpoint name -> module tensor, on any device: meta too), each in its file, a
    float of 16 bits or more, of own's shape (times tp along a cut dim); reads only the headers."""
    missing = sorted(own.keys() - set(available))
    unexpected = sorted(set(available) - own.keys())
    if missing or unexpected:
        raise CheckpointError(f"{where} does not match its config.json: missing {_short(missing)}, unexpected {_short(unexpected)}")
    for file, names in _by_file(own, index).items():
        with safe_open(file, "pt") as f:
            held = set(f.keys())
            for name in names:
                if name not in held:
                    raise CheckpointError(f"{where}: the index maps {name} to {os.path.basename(file)}, which does not hold it")
                header = f.get_slice(name)
                if header.get_dtype() not in _WEIGHT_DTYPES:
                    # copy_ would read e4m3 codes as values (a weight left quantised, its scale lost)
                    raise CheckpointError(f"{where}: {name} is {header.get_dtype()}; the loader takes float weights of "
                                          "16 bits or more: dequantise FP8 checkpoints to bf16 first")
                expected = _full_shape(name, tuple(own[name].shape), parallel)
                if tuple(header.get_shape()) != expected:
                    raise CheckpointError(f"{where}: {name} has shape {tuple(header.get_shape())}, config.json implies "
                                          f"{expected}")


def _copy_weights(own: dict[str, torch.Tensor], index: dict[str, str], parallel: Parallel) -> None:
    """Copy checkpoint tensors (this rank's slice of a cut one, read alone) into ``own``
    (checkpoint name -> module tensor), one at a time; _check_weights has checked them."""
    with torch.no_grad():
        for file, names in _by_file(own, index).items():
            with safe_open(file, "pt") as f:
                for name in names:
                    dim, target = _tp_dim(name, parallel), own[name]
                    if dim is None:
                        target.copy_(f.get_tensor(name))
                        continue
                    start = parallel.rank * target.shape[dim]
                    cut = slice(start, start + target.shape[dim])
                    target.copy_(f.get_slice(name)[cut] if dim == 0 else f.get_slice(name)[:, cut])


def _tp_dim(name: str, parallel: Parallel) -> Optional[int]:
    """The dim of checkpoint tensor ``name`` cut across ranks (_TP_DIMS), None if it is whole."""
    parts = name.split(".")
    return _TP_DIMS.get(parts[-2]) if parallel.size > 1 and len(parts) >= 2 else None


def _full_shape(name: str, local: tuple[int, ...], parallel: Parallel) -> tuple[int, ...]:
    """The checkpoint shape of tensor ``name`` whose rank slice is ``local``."""
    dim = _tp_dim(name, parallel)
    return local if dim is None else local[:dim] + (local[dim] * parallel.size,) + local[dim + 1:]


def _by_file(own: dict[str, torch.Tensor], index: dict[str, str]) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name in own:
        by_file.setdefault(index[name], []).append(name)
    return by_file


def _short(names: list[str], limit: int = 8) -> str:
    return repr(names) if len(names) <= limit else f"{names[:limit]!r} and {len(names) - limit} more"
