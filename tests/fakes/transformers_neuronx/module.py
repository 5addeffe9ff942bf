"""Checkpoint discovery and weight reading with the real loader's rules.

from_pretrained() picks the format (and reads eager formats) like the real
`load_state_dict_dir`; to_neuron() materializes every weight the model needs, so a
missing one fails there, as it does in the real `load_weights`. Citations are to
aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/module.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
KEY_TO_FILENAME = "key_to_filename.json"
BASE_PREFIX = "model."  # LlamaForCausalLM.get_base_model() is `.model` (llama/modules.py:L32-L33)
TIES = (("model.embed_tokens.weight", "lm_head.weight"),)  # llama/modules.py:L29-L30


@dataclass
class Weights:
    """Where each weight comes from: lazy (file per key) or eager (tensors read already)."""

    directory: str
    files: dict[str, str] = field(default_factory=dict)  # checkpoint key -> file (lazy formats)
    tensors: dict[str, torch.Tensor] | None = None  # eager formats: every tensor, exact names

    def materialize(self, names: list[str]) -> dict[str, torch.Tensor]:
        """name -> tensor for each name; a weight nobody provided is an uninitialized parameter."""
        if self.tensors is not None:  # exact names only, no ties (module.py:L118-L127)
            found = {n: self.tensors[n] for n in names if n in self.tensors}
        else:
            found = {n: self._read(key, path) for n, (key, path) in self._lazy(names).items()}
        missing = [n for n in names if n not in found]
        if missing:  # .detach() of an uninitialized parameter (llama/model.py:L130-L132)
            raise ValueError(f"Attempted to use an uninitialized parameter in <method 'detach' of "
                             f"'torch._C.TensorBase' objects>: no weight for {missing[:3]} in "
                             f"{self.directory}")
        return found

    def _lazy(self, names: list[str]) -> dict[str, tuple[str, str]]:
        # full names, then names under the base model, then ties (module.py:L161-L176)
        where = {n: (n, self.files[n]) for n in names if n in self.files}
        if len(where) < len(names):
            for n in names:
                short = n[len(BASE_PREFIX):] if n.startswith(BASE_PREFIX) else None
                if n not in where and short in self.files:
                    where[n] = (short, self.files[short])
            for tie in TIES:
                src = next((where[t] for t in tie if t in where), None)
                for t in tie:
                    if src is not None and t in names and t not in where:
                        where[t] = src
        return where

    @staticmethod
    def _read(key: str, path: str) -> torch.Tensor:
        if path.endswith(".safetensors"):  # module.py:L75-L80
            with safe_open(path, framework="pt") as f:
                if key not in f.keys():
                    raise FileNotFoundError(f"Could not find a weight for {key} in {path}")
                return f.get_tensor(key)
        return torch.load(path)  # a split checkpoint's one-tensor file (module.py:L81-L82)


def find_weights(path: str) -> Weights:
    """Real order: safetensors, its index, split dir, .bin, .bin index (module.py:L434-L460)."""
    def join(name: str) -> str:
        return os.path.join(path, name)

    if os.path.isfile(join(SAFETENSORS)):
        with safe_open(join(SAFETENSORS), framework="pt") as f:
            keys = list(f.keys())
        return Weights(path, {k: join(SAFETENSORS) for k in keys})
    if os.path.exists(join(SAFETENSORS_INDEX)):
        with open(join(SAFETENSORS_INDEX)) as f:
            return Weights(path, {k: join(v) for k, v in json.load(f)["weight_map"].items()})
    if os.path.isdir(join(BIN)):  # save_pretrained_split layout (module.py:L218-L225)
        split = os.path.realpath(join(BIN))
        with open(os.path.join(split, KEY_TO_FILENAME)) as f:  # absent: FileNotFoundError
            return Weights(path, {k: os.path.join(split, v) for k, v in json.load(f).items()})
    if os.path.isfile(join(BIN)):  # eager (module.py:L178-L184)
        return Weights(path, tensors=dict(torch.load(join(BIN))))
    if os.path.isfile(join(BIN_INDEX)):  # eager, every shard (module.py:L186-L197)
        with open(join(BIN_INDEX)) as f:
            shards = set(json.load(f)["weight_map"].values())
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(torch.load(join(shard)))
        return Weights(path, tensors=tensors)
    raise FileNotFoundError(f"Can not find model.safetensors or pytorch_model.bin in {path}")
