"""Fused speculation of the fake (NeuronFusedSpecModel and its postprocessors).

With enable_fused_speculation the context graphs run target and draft, and one fused graph
per token bucket runs S = speculation_length draft steps and one target step that
verifies them. Draft and target each keep their own KV-cache lines (seq_id -> position ->
(token, position id)), written where the real graphs write, so a call that would corrupt a
line on Inf2 changes that sequence's tokens here.

Not a module of the real package (there all of it is in models/model_base.py); it lives
apart so that model_base.py stays readable. Citations: aws-neuron/
neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/ (MB = models/
model_base.py, MW = models/model_wrapper.py, AB = models/application_base.py).
"""

from __future__ import annotations

import torch

from neuronx_distributed_inference.modules.generation import sampling

ACCEPTANCE_PADDING_TOKEN = -1  # MB:L1692


def check_config(model) -> None:
    """At construction (NeuronBaseForCausalLM.__init__, MB:L3099-L3110)."""
    nc = model.neuron_config
    if not model.fused:
        if nc.speculation_length > 0:  # enable_speculation (MB:L3105-L3106)
            raise NotImplementedError("fake: speculation without enable_fused_speculation (the "
                                      "speculation_model with a separate draft) is not modelled")
        return
    # enable_fused_spec reads the draft's config (MB:L3120-L3127)
    if model.fused_spec_config is None:
        raise AttributeError("'NoneType' object has no attribute 'draft_config'")
    if nc.speculation_length < 1:
        raise NotImplementedError("fake: fused speculation with speculation_length "
                                  f"{nc.speculation_length} is not modelled")
    if nc.async_mode:
        raise NotImplementedError("fake: async_mode with fused speculation (modules/"
                                  "async_execution.py:L190-L306, is_fused_speculation) is not "
                                  "modelled")


def check_trace(model) -> None:
    """What tracing NeuronFusedSpecModel asserts (compile time)."""
    nc = model.neuron_config
    draft_nc = model.fused_spec_config.draft_config.neuron_config
    # the draft is made greedy: its sampling config is edited in place (MB:L1675-L1678)
    if draft_nc.on_device_sampling_config is None:
        raise AttributeError("'NoneType' object has no attribute 'do_sample'")
    # _context_encoding_forward / _token_gen_forward (MB:L1807, L1869)
    assert nc.on_device_sampling_config
    if draft_nc.quantized:
        # the trace converts the draft too (MW:L1514-L1527) but its weights are read from
        # draft_model_path as they are (AB:L658-L671): what that gives is not modelled
        raise NotImplementedError("fake: a quantized draft is not modelled")
    for bucket in model.cte_buckets:
        # inside the context graph, an input of length 1 or speculation_length takes the
        # token-generation path (MB:L3020-L3024); the real trace does not refuse it
        if bucket in (1, nc.speculation_length):
            raise NotImplementedError(
                f"fake: context bucket {bucket} equals 1 or speculation_length "
                f"{nc.speculation_length}, so the fused context graph would run token "
                "generation (MB:L3020-L3024); what that computes is not modelled")


def draft_weights(model):
    """The draft's HF model from its own checkpoint, read at every load (AB:L658-L671)."""
    from neuronx_distributed_inference.models.model_base import hf_from_pretrained

    spec = model.fused_spec_config
    draft_nc = spec.draft_config.neuron_config
    # built with the target's class (worker_cls), from the draft's own config and weights
    model.check_weights(spec.draft_config)
    hf = hf_from_pretrained(model.hf_class(spec.draft_config),
                            str(spec.draft_model_path).rstrip("/"))
    model._hook_kv_cache(hf, draft_nc)
    return hf.to(draft_nc.torch_dtype).eval()


def context(model, ids, mask, pos, seq_ids, sampling_params) -> list[torch.Tensor]:
    """_context_encoding_forward (MB:L1792-L1852): target and draft each encode the prompt
    into their line; _cte_postprocessor (MB:L2798-L2839): the target's token, then -1s."""
    nc = model.neuron_config
    spec_len = nc.speculation_length
    logits = model._context(ids, mask, pos, seq_ids)  # writes the target's lines
    for r in range(ids.shape[0]):
        line = int(seq_ids[r]) if nc.is_continuous_batching else r % nc.ctx_batch_size
        model._draft_kv[line] = dict(model._kv[line])  # the same padded bucket
    n = ids.shape[0]
    tokens = sampling.sample(logits[:, -1, :], sampling_params, nc.on_device_sampling_config)
    padded = torch.cat([tokens.reshape(n, 1).to(torch.int32),
                        torch.full((n, spec_len - 1), ACCEPTANCE_PADDING_TOKEN,
                                   dtype=torch.int32)], dim=1)
    next_pos_ids = mask.sum(dim=1).to(torch.int32).reshape(n, 1)  # cur_len
    return [padded, padded[:, :1], _next_mask(next_pos_ids, nc.seq_len, pos.dtype),
            next_pos_ids]


def token_generation(model, ids, mask, pos, seq_ids, sampling_params) -> list[torch.Tensor]:
    """The fused graph on every line of the batch (MW:L569-L698 pads and sorts as for plain
    token generation), then _tkg_postprocessor per row, in the caller's order."""
    from neuronx_distributed_inference.models.model_base import (
        FUSED_SPECULATION_MODEL_TAG,
        seq_bucket,
    )

    nc = model.neuron_config
    spec_len = nc.speculation_length
    # the input plus the S positions the step writes must fit a bucket (MW:L826-L841)
    bucket = seq_bucket(model.tkg_buckets, mask.shape[1], FUSED_SPECULATION_MODEL_TAG,
                        nc.allow_input_truncation, spec_len)
    if mask.shape[1] > bucket:  # MW:L810-L819
        raise ValueError(f"Attention mask supplied (length={mask.shape[1]}) is longer than "
                         f"max_length ({nc.max_length} tokens).")
    n, batch = ids.shape[0], nc.tkg_batch_size
    if n > batch:
        raise NotImplementedError("fake: more token-generation rows than tkg_batch_size")
    given = seq_ids.tolist()
    if n == batch:  # a full batch runs as given: row i is cache line i (MW:L1342-L1348)
        lines = list(range(n))
    else:
        if len(set(given)) != n:
            raise RuntimeError(f"fake: duplicate seq_ids {given}; the real padding mixes "
                               "rows silently")
        for s in given:
            if not 0 <= s < batch:  # index_select(logits, 0, seq_ids) (MW:L695)
                raise IndexError("index out of range in self")
        lines = given
    steps = [_step(model, line, int(ids[r, 0]), int(pos[r, 0]), sampling_params[r])
             for r, line in enumerate(lines)]
    if n < batch:
        # the lines not in the call run row 0's inputs on their own caches (MW:L611-L656).
        # Fake only: they get row 0's drafts written, where the device would write drafts
        # of their own; either way their lines no longer hold their own sequence there.
        p0, candidates = int(pos[0, 0]), steps[0][1]
        for line in set(range(batch)) - set(given):
            for j in range(spec_len):
                model._check_line(line)
                model._draft_kv.setdefault(line, {})[p0 + j] = (candidates[j], p0 + j)
                model._kv.setdefault(line, {})[p0 + j] = (candidates[j], p0 + j)
    target = torch.tensor([t for t, _ in steps], dtype=torch.int64)  # [n, S]
    drafts = torch.tensor([c[1:] for _, c in steps], dtype=torch.int64)  # [n, S]: d1..dS
    return tkg_postprocessor(drafts, target, mask, pos, spec_len)


def tkg_postprocessor(candidate_tokens, target_tokens, attention_mask, position_ids,
                      speculation_length) -> list[torch.Tensor]:
    """MB:L2841-L2897: the target's tokens up to and including the first whose draft it
    did not choose, -1 after; positions advance by that count. The same rule sampled or
    greedy: every kept token is a target sample after an identical prefix."""
    candidate_new_tokens = candidate_tokens[:, :-1]  # d1..d_{S-1}: dS only filled the cache
    selected_tokens = target_tokens[:, :-1]
    n_matches = ((candidate_new_tokens != selected_tokens).cumsum(dim=-1) < 1).sum(
        dim=-1, keepdim=True) + 1
    accepted_mask = (torch.arange(target_tokens.shape[1]).expand(target_tokens.shape)
                     < n_matches)
    accepted = torch.where(accepted_mask, target_tokens,
                           torch.full_like(target_tokens, ACCEPTANCE_PADDING_TOKEN)
                           ).to(torch.int32)
    next_pos_ids = (position_ids + n_matches).to(torch.int32)
    n = accepted.shape[0]
    first_pad = (accepted != ACCEPTANCE_PADDING_TOKEN).to(torch.int).sum(dim=1)
    index = (first_pad + (speculation_length - 1)) % speculation_length
    next_input_ids = accepted[torch.arange(n), index].reshape(n, 1)
    return [accepted, next_input_ids,
            _next_mask(next_pos_ids, attention_mask.shape[1], position_ids.dtype),
            next_pos_ids]


def _step(model, line: int, token: int, position: int, params: torch.Tensor
          ) -> tuple[list[int], list[int]]:
    """_token_gen_forward for one line (MB:L1854-L1971): the draft runs S single-token steps
    at position..position+S-1, greedy (MB:L1675-L1678), the S-th only to fill its cache;
    the target takes [token, d1..d_{S-1}] at the same positions and samples S tokens with
    the row's parameters. Returns (target tokens, candidates [token, d1..dS])."""
    nc = model.neuron_config
    spec_len = nc.speculation_length
    draft_vocab = model.fused_spec_config.draft_config.vocab_size
    model._check_line(line)
    draft, target = model._draft_kv.setdefault(line, {}), model._kv.setdefault(line, {})
    candidates = [token]
    for i in range(spec_len):
        q = position + i
        if not 0 <= q < nc.max_length:
            raise IndexError(f"fake: position {q} outside the KV cache (max_length "
                             f"{nc.max_length})")
        draft[q] = (candidates[-1], q)
        logits = _logits_at(model, draft, q, model._draft_hf, draft_vocab)
        candidates.append(int(torch.argmax(logits)))
    for j in range(spec_len):
        target[position + j] = (candidates[j], position + j)
    logits = torch.stack([_logits_at(model, target, position + j, model._hf, None)
                          for j in range(spec_len)])  # [S, vocab]
    tokens = sampling.sample(logits, params.reshape(1, 3).expand(spec_len, 3),
                             nc.on_device_sampling_config)
    return [int(t) for t in tokens], candidates


def _logits_at(model, cache: dict, q: int, hf, vocab_size) -> torch.Tensor:
    """Logits after position q of a line: the cache below q, then q's own token."""
    prior = [cache.get(j, (0, j)) for j in range(q + 1)]
    model._reading_cache = True
    try:
        return model._logits([t for t, _ in prior], [p for _, p in prior], hf, vocab_size)
    finally:
        model._reading_cache = False


def _next_mask(next_pos_ids, length: int, dtype) -> torch.Tensor:
    n = next_pos_ids.shape[0]
    mask = torch.arange(length).view(1, -1).expand(n, length)
    return (next_pos_ids.expand(n, length) - 1 >= mask).to(dtype)
