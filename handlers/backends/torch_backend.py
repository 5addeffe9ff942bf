"""Hugging Face transformers on CPU (or CUDA when present), with slot-level batching.

The running sequences share one left-padded KV cache (a DynamicCache with rows in
order of arrival): newcomers are prefilled together in one left-padded forward (a
single newcomer needs no padding, so its logits match a plain `generate`), then
padded and concatenated into the batch; a finished row is cut out and all-padding
columns on the left are trimmed. Decoding runs the whole
batch with a 2-D attention mask and explicit per-row position ids, which is how
`generate` handles left padding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from handlers.backends.base import Backend, SamplingParams
from handlers.config import HandlerConfig
from handlers.errors import ConfigError
from handlers.sampling import RowSampler

logger = logging.getLogger(__name__)


class _AppendLayer(DynamicLayer):
    """A DynamicLayer that appends into spare capacity instead of re-concatenating.

    `DynamicLayer.update` copies the whole layer cache every step (torch.cat); on the
    bench model that was ~8% of a decode step. Here `keys`/`values` are prefix views of
    buffers with room to grow; when the backend replaces them (rows cut out, rows
    joined) the next update copies them once into fresh buffers.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self._is_view_with_room(key_states):
            self._regrow(key_states)
        length, added = self.get_seq_length(), key_states.shape[-2]
        self._kbuf[:, :, length:length + added] = key_states
        self._vbuf[:, :, length:length + added] = value_states
        self.keys = self._kbuf[:, :, :length + added]
        self.values = self._vbuf[:, :, :length + added]
        return self.keys, self.values

    def _is_view_with_room(self, new: torch.Tensor) -> bool:
        buf = getattr(self, "_kbuf", None)
        return (buf is not None and self.keys.data_ptr() == buf.data_ptr()
                and self.keys.shape[:2] == buf.shape[:2] == new.shape[:2]
                and self.keys.shape[2] + new.shape[2] <= buf.shape[2])

    def _regrow(self, new: torch.Tensor) -> None:
        length = self.get_seq_length()
        capacity = length + new.shape[-2] + max(64, length)  # amortized doubling
        shape = (*new.shape[:2], capacity, new.shape[-1])
        self._kbuf = new.new_empty(shape)
        self._vbuf = new.new_empty(shape)
        if length:
            self._kbuf[:, :, :length] = self.keys
            self._vbuf[:, :, :length] = self.values
        self.keys, self.values = self._kbuf[:, :, :length], self._vbuf[:, :, :length]


@dataclass
class _Row:
    slot: int
    length: int  # real tokens in the cache (prompt + generated so far)
    last_token: int
    sampler: RowSampler


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("handler.device: 'cuda' but no CUDA device is visible; use 'auto'")
        return torch.device("cuda")
    return torch.device("cpu")


class TorchBackend(Backend):
    def __init__(self, checkpoint: Path, config: HandlerConfig) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = pick_device(config.device)
        dtype = getattr(torch, config.dtype)
        start = time.monotonic()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(self.device)
        self.model.eval()
        logger.info("loaded %s on %s (%s) in %.1fs", checkpoint, self.device, config.dtype,
                    time.monotonic() - start)
        self.batch_size = config.batch_size
        positions = getattr(self.model.config, "max_position_embeddings", config.max_length)
        if config.max_length > positions:
            raise ConfigError(f"handler.max_length: {config.max_length} exceeds the model's "
                              f"max_position_embeddings {positions}; lower it")
        self.max_length = config.max_length
        self.max_prompt_length = config.max_length - 1
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, T] 1 = real token, 0 = padding

    # -- Backend interface ------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                params: Sequence[SamplingParams]) -> list[int]:
        """All newcomers in one left-padded forward (one row alone needs no padding)."""
        busy = {r.slot for r in self._rows} & set(slots)
        if busy:
            raise ValueError(f"prefill into busy slots {sorted(busy)}")
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts],
                           device=self.device)  # [n, L]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)  # [n, L]
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)  # [n, L] positions count real tokens only
        samplers = [RowSampler(p, self.eos_token_ids, self.device) for p in params]
        cache = self._new_cache()
        # logits of the last position only (as `generate` asks): the lm_head over every
        # prompt position was ~8% of a 30-token prefill
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        tokens = [sampler(out.logits[i, -1]) for i, sampler in enumerate(samplers)]
        # nothing above touched the running batch, so a failure leaves it as it was
        self._rows += [_Row(slot, len(prompt), token, sampler) for slot, prompt, token, sampler
                       in zip(slots, prompts, tokens, samplers, strict=True)]
        self._append_rows(cache, mask)
        return tokens

    @torch.inference_mode()
    def decode(self, slots: Sequence[int]) -> list[int]:
        order = {r.slot: i for i, r in enumerate(self._rows)}
        if set(slots) != set(order):
            raise ValueError(f"decode of slots {sorted(slots)} but running {sorted(order)}")
        rows = self._rows
        ids = torch.tensor([[r.last_token] for r in rows], device=self.device)  # [B, 1]
        pos = torch.tensor([[r.length] for r in rows], device=self.device)  # [B, 1]
        self._mask = F.pad(self._mask, (0, 1), value=1)  # [B, T+1]
        out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=pos,
                         past_key_values=self._cache, use_cache=True)
        logits = out.logits[:, -1]  # [B, vocab]
        for i, r in enumerate(rows):
            r.length += 1
            r.last_token = r.sampler(logits[i])
        return [rows[order[s]].last_token for s in slots]

    def release(self, slots: Sequence[int]) -> None:
        gone = set(slots)
        keep = [i for i, r in enumerate(self._rows) if r.slot not in gone]
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        index = torch.tensor(keep, device=self.device)
        self._mask = self._mask[index]
        trim = int((self._mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # leading pad cols
        self._mask = self._mask[:, trim:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, trim:]
            layer.values = layer.values[index, :, trim:]

    def warmup(self) -> None:
        """One short prefill + decode so the first request does not pay for lazy init."""
        slot = next(s for s in range(self.batch_size) if s not in {r.slot for r in self._rows})
        self.prefill([slot], [[0, 1, 2, 3]], [SamplingParams()])
        self.decode([r.slot for r in self._rows])
        self.release([slot])

    # -- batch cache ------------------------------------------------------------------
    def _new_cache(self) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        if all(type(layer) is DynamicLayer for layer in cache.layers):  # not sliding-window
            cache.layers = [_AppendLayer() for _ in cache.layers]
        return cache

    def _append_rows(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Left-pad the new rows or the batch to a common length and concatenate."""
        if self._cache is None:
            self._cache, self._mask = cache, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])
        grow_batch, grow_new = width - self._mask.shape[1], width - mask.shape[1]
        self._mask = torch.cat([F.pad(self._mask, (grow_batch, 0)), F.pad(mask, (grow_new, 0))])
        for mine, new in zip(self._cache.layers, cache.layers, strict=True):
            # keys/values: [B, kv_heads, T, head_dim]; pad dim 2 on the left
            mine.keys = torch.cat([F.pad(mine.keys, (0, 0, grow_batch, 0)),
                                   F.pad(new.keys, (0, 0, grow_new, 0))])
            mine.values = torch.cat([F.pad(mine.values, (0, 0, grow_batch, 0)),
                                     F.pad(new.values, (0, 0, grow_new, 0))])
