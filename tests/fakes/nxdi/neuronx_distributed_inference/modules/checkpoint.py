"""Checkpoint files of the fake: the formats NxD Inference reads a state dict directory in.

aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
modules/checkpoint.py (the line numbers below).
"""

from __future__ import annotations

import os

import torch

_SAFETENSORS_MODEL_INDEX_FILENAME_JSON = "model.safetensors.index.json"  # L10-L13
_SAFETENSORS_MODEL_FILENAME = "model.safetensors"
_PYTORCH_MODEL_BIN_FILENAME = "pytorch_model.bin"


def load_state_dict(state_dict_dir: str) -> dict[str, torch.Tensor]:
    """model.safetensors, its sharded index, or pytorch_model.bin, in that order (L24-L70)."""
    import json

    from safetensors.torch import load_file

    single = os.path.join(state_dict_dir, _SAFETENSORS_MODEL_FILENAME)
    index = os.path.join(state_dict_dir, _SAFETENSORS_MODEL_INDEX_FILENAME_JSON)
    bin_path = os.path.join(state_dict_dir, _PYTORCH_MODEL_BIN_FILENAME)
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for name in files:
            out.update(load_file(os.path.join(state_dict_dir, name)))
        return out
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"Can not find model.safetensors or pytorch_model.bin in {state_dict_dir}")


def save_state_dict_safetensors(state_dict: dict, state_dict_dir: str,
                                max_shard_size: str = "10GB") -> None:
    """HF-style safetensors in state_dict_dir (L171-L183; the real one shards at 10 GB through
    huggingface_hub.save_torch_state_dict, the fake writes one file)."""
    from safetensors.torch import save_file

    # fake only: separate storage per tensor (the hub helper drops shared duplicates)
    tensors = {k: v.detach().clone().contiguous() for k, v in state_dict.items()}
    save_file(tensors, os.path.join(state_dict_dir, _SAFETENSORS_MODEL_FILENAME),
              metadata={"format": "pt"})


def prune_state_dict(state_dict):
    """Drop None values; torch.save cannot write them (L186-L199)."""
    return {k: v for k, v in state_dict.items() if v is not None}
