"""Weights packed for decode, named as the checkpoint names them.

A packed module stores checkpoint tensors that one kernel reads together as one tensor: q_a_proj
and kv_a_proj_with_mqa as one ``[q_lora + 576, D]`` weight (one GEMM, not two), gate_proj and
up_proj as one ``[2I, D]``, routed experts stacked ``[E, 2I, D]`` / ``[E, D, I]`` (one grouped
GEMM). Each checkpoint tensor is a row-slice *view* of its packed tensor, so ``state_dict()``,
``load_state_dict()`` and the loader see checkpoint names and shapes, loading writes straight into
the packed layout (no second copy of the weights at load), and saving writes the checkpoint back.
"""

from __future__ import annotations

import torch


class CheckpointViews:
    """Mixin (before nn.Module in the bases) for a module with packed parameters.

    ``_packed``: names of its own parameters held in packed form (absent from the state dict);
    ``checkpoint_views()``: checkpoint name (relative to the module) -> a view of a packed
    parameter, of the checkpoint tensor's shape. Its other parameters, buffers and children keep
    their usual state-dict entries.
    """

    _packed: tuple[str, ...] = ()

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._packed:
            destination.pop(prefix + name, None)
        for name, view in self.checkpoint_views().items():
            destination[prefix + name] = view if keep_vars else view.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        views = self.checkpoint_views()
        with torch.no_grad():
            for name, view in views.items():
                key = prefix + name
                if key not in state_dict:
                    if strict:
                        missing_keys.append(key)
                    continue
                value = state_dict[key]
                if tuple(value.shape) != tuple(view.shape):
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, "
                                      f"the shape in current model is {tuple(view.shape)}.")
                    continue
                view.copy_(value)
        seen_missing, seen_unexpected = len(missing_keys), len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        packed, ours = {prefix + n for n in self._packed}, {prefix + n for n in views}
        missing_keys[seen_missing:] = [k for k in missing_keys[seen_missing:] if k not in packed]
        unexpected_keys[seen_unexpected:] = [k for k in unexpected_keys[seen_unexpected:] if k not in ours]


def row_views(packed: torch.Tensor, sections: dict[str, int]) -> dict[str, torch.Tensor]:
    """``{name: rows}`` consecutive row blocks of ``packed`` (dim -2 for a stacked tensor), as views.

    >>> sorted((n, tuple(v.shape)) for n, v in row_views(torch.empty(6, 4), {"a.weight": 2, "b.weight": 4}).items())
    [('a.weight', (2, 4)), ('b.weight', (4, 4))]
    """
    return dict(zip(sections, packed.split(list(sections.values()), dim=-2)))
