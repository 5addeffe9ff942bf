"""Hugging Face transformers on CPU (or CUDA when present), with slot-level batching.

The running sequences share one left-padded KV cache (a DynamicCache whose layers
keep their rows in buffers with room, `_AppendLayer`): newcomers are prefilled
together in one left-padded forward (a single newcomer needs no padding, so its
logits match a plain `generate`), then written below the batch, right-aligned; a
finished row is replaced by the last one and all-padding columns on the left are
trimmed -- in place, so joins and leaves cost a row, not the cache. Decoding runs
the whole batch with a 2-D attention mask and explicit per-row position ids, which
is how `generate` handles left padding.

When newcomers arrive while a batch runs, `step` packs their prompts and the
running rows' next tokens into one forward (see `_PackedStep`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, create_causal_mask, sdpa_mask

from handlers.backends.base import Backend, Rows, SamplingParams, SlotError, TokenLogprob
from handlers.backends.sampling import RowSampler, prompt_logprobs, sample_rows
from handlers.config import HandlerConfig
from handlers.errors import ConfigError
from handlers.structured.masks import SlotGrammars

logger = logging.getLogger(__name__)


class _AppendLayer(DynamicLayer):
    """A DynamicLayer kept in buffers with spare rows and columns, so nothing re-copies it.

    `keys`/`values` are the window `buf[:rows, :, start:end]`. `DynamicLayer.update`
    re-concatenates the whole cache every step (torch.cat; ~8% of a bench decode step);
    here a step writes its column into the spare room. The backend's batch operations
    work in place too: a finished row is overwritten by the last row (`keep`: one row
    copied, not the cache twice -- a cut, then a regrow at the next step), leading
    all-padding columns leave by moving `start`, and newcomers are written into spare
    rows (`add`). Columns of a row left of its first token hold stale but finite values
    from earlier rows (buffers start zeroed); the attention mask hides them, and a
    masked position adds exactly zero to SDPA's output, so results do not change.
    """

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [rows, kv_heads, added, head_dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        added = key_states.shape[2]
        if self._kbuf is None:
            self._rows, self._start, self._end = key_states.shape[0], 0, 0
            self._reserve(key_states, self._rows, added + max(64, added), 0)
        elif key_states.shape[0] != self._rows:
            raise ValueError(f"update of {key_states.shape[0]} rows into a cache of {self._rows}")
        elif self._end + added > self._kbuf.shape[2]:
            width = self._end - self._start
            self._reserve(key_states, self._kbuf.shape[0], width + added + max(64, width), 0)
        self._kbuf[:self._rows, :, self._end:self._end + added] = key_states
        self._vbuf[:self._rows, :, self._end:self._end + added] = value_states
        self._end += added
        return self._view()

    def keep(self, moves: list[tuple[int, int]], rows: int, trim: int) -> None:
        """Rows leave: copy row `src` into row `dst` for each move, keep the first `rows`
        rows and drop `trim` columns on the left."""
        for dst, src in moves:
            self._kbuf[dst, :, self._start:self._end] = self._kbuf[src, :, self._start:self._end]
            self._vbuf[dst, :, self._start:self._end] = self._vbuf[src, :, self._start:self._end]
        self._rows, self._start = rows, self._start + trim
        self._view()

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Newcomers' cache [n, kv_heads, L, head_dim] joins below the rows, right-aligned;
        the window widens on the left when L is wider than it."""
        n, length = keys.shape[0], keys.shape[2]
        rows, grow = self._rows + n, max(0, length - (self._end - self._start))
        if rows > self._kbuf.shape[0] or grow > self._start:
            width = self._end - self._start
            room = max(rows, 2 * self._kbuf.shape[0])  # amortized doubling, as for columns
            self._reserve(keys, room, grow + width + max(64, width), grow)
        self._start -= grow
        self._kbuf[self._rows:rows, :, self._end - length:self._end] = keys
        self._vbuf[self._rows:rows, :, self._end - length:self._end] = values
        self._rows = rows
        self._view()

    def cut(self, width: int) -> None:
        """Back to `width` columns (a failed packed step appended to some layers)."""
        self._end = min(self._end, self._start + width)
        self._view()

    def _reserve(self, like: torch.Tensor, rows: int, columns: int, left: int) -> None:
        """Fresh zeroed buffers; the window moves to column `left`."""
        shape = (rows, like.shape[1], columns, like.shape[3])
        kbuf, vbuf = like.new_zeros(shape), like.new_zeros(shape)
        width = self._end - self._start
        if self._kbuf is not None and width:
            kbuf[:self._rows, :, left:left + width] = self.keys
            vbuf[:self._rows, :, left:left + width] = self.values
        self._kbuf, self._vbuf, self._start, self._end = kbuf, vbuf, left, left + width

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = self._kbuf[:self._rows, :, self._start:self._end]
        self.values = self._vbuf[:self._rows, :, self._start:self._end]
        return self.keys, self.values


PACKED_ATTENTION = "inf2serve_packed_sdpa"


@dataclass
class _PackedStep:
    """One forward for the newcomers' prefill and the running batch's decode.

    A prefill alone reads every weight for a few dozen tokens: a 30-token prefill of the
    bench model took ~65 ms, twice its share of a batched one, and stalled the running
    rows meanwhile. Packed as one sequence -- the B running rows' last tokens, then the
    newcomers' left-padded prompts -- the linear layers read their weights once for
    both. Attention cannot be packed: per layer, `packed_attention` splits the sequence
    and runs HF's own SDPA attention twice, the running rows against the batch cache
    (exactly as `decode` does) and the prompts against themselves (as `prefill` does).
    """

    batch: int  # running rows, first in the packed sequence
    newcomers: int
    width: int  # left-padded prompt length
    batch_layers: list  # the running batch's cache layers
    batch_mask: torch.Tensor | None  # [B, 1, 1, T+1] bool (None: no padding), as in decode
    new_cache: DynamicCache  # receives the newcomers' KV, left-padded like a prefill
    new_mask: torch.Tensor | None  # [n, 1, L, L] bool, or None: one newcomer, is_causal
    layers_done: int = 0  # a model whose attention bypasses ours leaves this at 0

    def attend(self, module, query, key, value, **kwargs) -> torch.Tensor:
        b, n, width, layer = self.batch, self.newcomers, self.width, module.layer_idx
        self.layers_done += 1

        def rows(t: torch.Tensor, count: int, length: int, start: int) -> torch.Tensor:
            # [1, heads, N, d] slice -> [count, heads, length, d]
            part = t[0, :, start:start + count * length]
            return part.reshape(t.shape[1], count, length, t.shape[-1]).transpose(0, 1)

        k_dec, v_dec = self.batch_layers[layer].update(rows(key, b, 1, 0), rows(value, b, 1, 0))
        out_dec, _ = sdpa_attention_forward(module, rows(query, b, 1, 0), k_dec, v_dec,
                                            self.batch_mask, **kwargs)
        k_new, v_new = self.new_cache.layers[layer].update(rows(key, n, width, b),
                                                           rows(value, n, width, b))
        out_new, _ = sdpa_attention_forward(module, rows(query, n, width, b), k_new, v_new,
                                            self.new_mask, **kwargs)
        # each is [rows, length, heads, d]; back to the packed [1, N, heads, d]
        return torch.cat([out_dec.reshape(1, b, *out_dec.shape[2:]),
                          out_new.reshape(1, n * width, *out_new.shape[2:])], dim=1)


def packed_attention(module, query, key, value, attention_mask, packed_step=None, **kwargs):
    """SDPA for ordinary calls; the split of `_PackedStep` when one is passed in."""
    if packed_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return packed_step.attend(module, query, key, value, **kwargs), None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


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
        dtype = getattr(torch, config.torch_dtype)
        start = time.monotonic()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(self.device)
        self.model.eval()
        logger.info("loaded %s on %s (%s) in %.1fs", checkpoint, self.device, config.torch_dtype,
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
        self._prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}  # slot -> (echo)
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [rows, T] 1 = real token, 0 = padding
        self._plain = all(type(layer) is DynamicLayer  # no sliding-window layers
                          for layer in DynamicCache(config=self.model.config).layers)
        # packed steps need HF's SDPA attention (ours wraps it) and plain cache layers
        self.mixes_prefill = self.model.config._attn_implementation == "sdpa" and self._plain
        if self.mixes_prefill:
            self.model.set_attn_implementation(PACKED_ATTENTION)
        # structured outputs: masks over the LM head's width (which may pad the tokenizer's)
        self.grammars = SlotGrammars(self.batch_size, int(self.model.config.vocab_size))

    # -- Backend interface ------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams]) -> list[int]:
        """All newcomers in one left-padded forward (one row alone needs no padding)."""
        self._echo(slots, prompts, params)  # first: a failure must leave the batch as it was
        ids, mask, pos = self._left_pad(prompts)
        samplers = [RowSampler(p, self.eos_token_ids, self.device, prompt)
                    for p, prompt in zip(params, prompts, strict=True)]
        cache = self._new_cache()
        self._start_masks(list(slots))  # filled while the forward runs
        # logits of the last position only (as `generate` asks): the lm_head over every
        # prompt position was ~8% of a 30-token prefill
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        tokens = self._sample(out.logits[:, -1], samplers, list(slots))  # one batched pass
        # nothing above touched the running batch, so a failure leaves it as it was
        self._rows += [_Row(slot, len(prompt), token, sampler) for slot, prompt, token, sampler
                       in zip(slots, prompts, tokens, samplers, strict=True)]
        self._append_rows(cache, mask)
        return tokens

    @torch.inference_mode()
    def _decode(self, slots: Sequence[int]) -> Rows:
        order = {r.slot: i for i, r in enumerate(self._rows)}
        rows = self._rows
        ids = torch.tensor([[r.last_token] for r in rows], device=self.device)  # [B, 1]
        pos = torch.tensor([[r.length] for r in rows], device=self.device)  # [B, 1]
        self._mask = F.pad(self._mask, (0, 1), value=1)  # [B, T+1]
        order_slots = [r.slot for r in rows]
        self._start_masks(order_slots)
        out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=pos,
                         past_key_values=self._cache, use_cache=True)
        tokens = self._sample(out.logits[:, -1], [r.sampler for r in rows], order_slots)
        for r, token in zip(rows, tokens, strict=True):
            r.length += 1
            r.last_token = token
        return [[rows[order[s]].last_token] for s in slots]

    @torch.inference_mode()
    def _step(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
              params: Sequence[SamplingParams], running: Sequence[int]
              ) -> tuple[list[int], Rows]:
        """Prefill newcomers into `slots` and decode the `running` batch in one forward."""
        order = {r.slot: i for i, r in enumerate(self._rows)}
        if not order:
            raise SlotError("a packed step needs a running batch; prefill alone")
        self._echo(slots, prompts, params)  # first: a failure must leave the batch as it was
        rows, b, n = self._rows, len(self._rows), len(prompts)
        new_ids, new_mask, new_pos = self._left_pad(prompts)
        width = new_ids.shape[1]
        last = torch.tensor([r.last_token for r in rows], device=self.device)
        ids = torch.cat([last, new_ids.flatten()])[None]  # [1, B + n*L]
        pos = torch.cat([torch.tensor([r.length for r in rows], device=self.device),
                         new_pos.flatten()])[None]
        batch_mask = F.pad(self._mask, (0, 1), value=1)  # [B, T+1]
        plan = _PackedStep(
            batch=b, newcomers=n, width=width, batch_layers=self._cache.layers,
            batch_mask=self._sdpa_mask(batch_mask, pos[:, :b].T, self._cache),
            new_cache=self._new_cache(), new_mask=self._sdpa_mask(new_mask, new_pos, None))
        keep = torch.tensor(list(range(b)) + [b + (i + 1) * width - 1 for i in range(n)],
                            device=self.device)
        samplers = [RowSampler(p, self.eos_token_ids, self.device, prompt)
                    for p, prompt in zip(params, prompts, strict=True)]
        length = self._mask.shape[1]
        order_slots = [r.slot for r in rows] + list(slots)
        self._start_masks(order_slots)
        try:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                             logits_to_keep=keep, packed_step=plan)
        except BaseException:
            self._truncate(length)  # layers that appended keep the batch as it was
            raise
        if plan.layers_done != len(self._cache.layers):
            self._truncate(length)
            self.mixes_prefill = False
            raise RuntimeError(f"{type(self.model).__name__}'s attention did not run the packed "
                               "step; prefill and decode run apart from now on")
        self._mask = batch_mask
        # [B + n, vocab]: the running rows, then the newcomers, sampled in one pass
        tokens = self._sample(out.logits[0], [r.sampler for r in rows] + samplers, order_slots)
        for r, token in zip(rows, tokens[:b], strict=True):
            r.length += 1
            r.last_token = token
        first = tokens[b:]
        decoded = [[rows[order[s]].last_token] for s in running]
        self._rows += [_Row(slot, len(prompt), token, sampler) for slot, prompt, token, sampler
                       in zip(slots, prompts, first, samplers, strict=True)]
        self._append_rows(plan.new_cache, new_mask)
        return first, decoded

    def _start_masks(self, slots: list[int]) -> None:
        """Constrained rows' masks, filled on the grammar's thread during the forward."""
        if self.grammars.any(slots):
            self.grammars.start(slots)

    def _sample(self, logits: torch.Tensor, samplers: list[RowSampler], slots: list[int]
                ) -> list[int]:
        """Every row's token (logits [rows, vocab], rows in `slots` order), constrained rows
        within their masks; the grammars take the tokens at the next step's start."""
        masks = self.grammars.masks()
        tokens = sample_rows(logits, samplers, masks=masks)
        if masks is not None:
            self.grammars.took(slots, tokens)
        return tokens

    def token_logprobs(self, slot: int) -> TokenLogprob | None:
        return next((r.sampler.last for r in self._rows if r.slot == slot), None)

    def prompt_logprobs(self, slot: int) -> list[TokenLogprob | None] | None:
        return self._prompt_logprobs.pop(slot, None)

    def _echo(self, slots: Sequence[int], prompts: Sequence[Sequence[int]],
              params: Sequence[SamplingParams]) -> None:
        """Prompt logprobs for the rows that ask (OpenAI `echo` with `logprobs`): a forward
        of the prompt alone, every position's logits -- prefill keeps only the last, and
        no other row pays for this one's."""
        for slot, prompt, p in zip(slots, prompts, params, strict=True):
            if p.prompt_logprobs is not None:
                ids = torch.tensor([list(prompt)], device=self.device)  # [1, L]
                logits = self.model(input_ids=ids, use_cache=False).logits[0]  # [L, vocab]
                self._prompt_logprobs[slot] = prompt_logprobs(logits, prompt, p.prompt_logprobs)

    def _left_pad(self, prompts: Sequence[Sequence[int]]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids, mask (1 = real token) and positions, each [n, L], left-padded to the longest;
        positions count real tokens only, as `generate` does."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts],
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)

    def _sdpa_mask(self, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache | None):
        """The mask HF's own forward would give SDPA for these rows (None: run causal)."""
        shape = (*pos.shape, 1)  # only the embeddings' batch, length, dtype and device count
        embeds = torch.empty(shape, dtype=self.model.dtype, device=self.device)
        return create_causal_mask(config=self.model.config, inputs_embeds=embeds,
                                  attention_mask=mask, past_key_values=cache, position_ids=pos)

    def _truncate(self, length: int) -> None:
        for layer in self._cache.layers:
            if isinstance(layer, _AppendLayer) and layer._kbuf is not None:
                layer.cut(length)
            elif layer.is_initialized and layer.keys.shape[2] > length:
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]

    @torch.inference_mode()
    def _release(self, slots: Sequence[int]) -> None:
        """Rows leave; the last rows move into their places (one row copied per leaver, in
        the cache's own buffers) and leading all-padding columns are trimmed."""
        leaving = set(slots)
        for slot in leaving.intersection(self._prompt_logprobs):
            del self._prompt_logprobs[slot]
        gone = {i for i, r in enumerate(self._rows) if r.slot in leaving}
        if not gone:
            return
        rows = len(self._rows) - len(gone)
        if not rows:
            self._rows, self._cache, self._mask = [], None, None
            return
        # holes among the first `rows` rows take the kept rows from beyond them
        moves = list(zip(sorted(i for i in gone if i < rows),
                         [i for i in range(rows, len(self._rows)) if i not in gone], strict=True))
        order = list(range(rows))
        for dst, src in moves:
            order[dst] = src
        self._rows = [self._rows[i] for i in order]
        mask = self._mask[order]
        trim = int((mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # leading pad cols
        self._mask = mask[:, trim:]
        index = torch.tensor(order, device=self.device)
        for layer in self._cache.layers:
            if isinstance(layer, _AppendLayer):
                layer.keep(moves, rows, trim)
            else:
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
        if self._plain:
            cache.layers = [_AppendLayer() for _ in cache.layers]
        return cache

    def _append_rows(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """The new rows join below the batch, both right-aligned (left-padded) to the wider."""
        if self._cache is None:
            self._cache, self._mask = cache, mask
            return
        width = max(self._mask.shape[1], mask.shape[1])
        grow_batch, grow_new = width - self._mask.shape[1], width - mask.shape[1]
        self._mask = torch.cat([F.pad(self._mask, (grow_batch, 0)), F.pad(mask, (grow_new, 0))])
        for mine, new in zip(self._cache.layers, cache.layers, strict=True):
            if isinstance(mine, _AppendLayer):
                mine.add(new.keys, new.values)
                continue
            # keys/values: [B, kv_heads, T, head_dim]; pad dim 2 on the left
            mine.keys = torch.cat([F.pad(mine.keys, (0, 0, grow_batch, 0)),
                                   F.pad(new.keys, (0, 0, grow_new, 0))])
            mine.values = torch.cat([F.pad(mine.values, (0, 0, grow_batch, 0)),
                                     F.pad(new.values, (0, 0, grow_new, 0))])
