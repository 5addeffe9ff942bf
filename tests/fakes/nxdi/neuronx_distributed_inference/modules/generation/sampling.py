"""On-device sampling parameters of the fake: the real checks and the real [batch, 3] layout.

aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
modules/generation/sampling.py.
"""

from __future__ import annotations

import torch


def validate_sampling_params(params: torch.Tensor, on_device_sampling_config) -> None:
    """Rows of (top_k, top_p, temperature); raises ValueError as L99-L159 do."""
    if params.shape[1] != 3:
        raise ValueError(f"Expected tensor of shape (batch_size, 3), but got {params.shape}")
    params = params.to(torch.float32)
    top_k, top_p, temperature = params[:, 0], params[:, 1], params[:, 2]
    global_top_k = (on_device_sampling_config.global_topk
                    if not isinstance(on_device_sampling_config, dict)
                    else on_device_sampling_config["global_topk"])
    if not torch.all((top_k == -1) | ((top_k >= 0) & (top_k <= global_top_k))):  # L127-L132
        raise ValueError(f"Invalid top-k values found. top-k must be -1 or greater than 0 but "
                         f"less than or equal to {global_top_k=}. Found {top_k=}.")
    if not torch.equal(top_k, top_k.floor()):  # L136-L140
        raise ValueError(f"Invalid top-k values found. top-k values should be able to be "
                         f"represented as integer values, but found decimal parts. Found {top_k=}.")
    if not torch.all((top_p > 0.0) & (top_p <= 1.0)):  # L142-L147
        raise ValueError(f"Invalid top-p values found. top-p must be in the range (0.0, 1.0]. "
                         f"Found {top_p=}.")
    if not torch.all(temperature >= 0.0):  # L149-L154
        raise ValueError(f"Invalid temperature values found. Temperature must be greater than "
                         f"or equal to 0.0. Found {temperature=}.")
    if torch.any((temperature == 0.0) & ((top_k == -1) | (top_k == 0))):  # L155-L159
        raise ValueError("Invalid sampling parameters found. Temperature = 0 enables greedy "
                         "sampling. Please set top_k to 1")


def infer_sampling_params(params: torch.Tensor) -> torch.Tensor:
    """Temperature 0 means greedy: top_k and top_p become 1 (L162-L182)."""
    for i in range(params.shape[0]):
        if params[i, 2] == 0:
            params[i, 0] = 1
            params[i, 1] = 1
    return params


def prepare_sampling_params(batch_size, top_k=(1,), top_p=(1.0,), temperature=(1.0,)):
    """Stack per-row values into [batch, 3]; one value broadcasts (L185-L200)."""
    tk, tp, t = (v if torch.is_tensor(v) else torch.tensor(list(v) if isinstance(v, (list, tuple))
                                                          else [v])
                 for v in (top_k, top_p, temperature))
    assert tk.shape[0] == tp.shape[0] == t.shape[0], "sampling params shapes don't match."
    if tk.shape[0] == 1:
        tk, tp, t = (x.broadcast_to(batch_size) for x in (tk, tp, t))
    return torch.stack([tk, tp, t], dim=1)


def sample(logits: torch.Tensor, params: torch.Tensor, config) -> torch.Tensor:
    """The device sampler on [n, vocab] logits: one token id per row.

    Greedy rows (top_k 1, or do_sample off) take the argmax; others keep the global_topk
    best, then their own top-k (0/-1: uniform over those), top-p and temperature
    (sampling.py:L243-L466, the Sampler; its random draws are not reproduced bit for bit).
    """
    if not config.do_sample and not config.dynamic:
        return torch.argmax(logits, dim=-1)
    out = []
    for row, (k, p, temp) in zip(logits, params.tolist(), strict=True):
        if not config.dynamic:
            k, p, temp = config.top_k, config.top_p, config.temperature
        if int(k) == 1:
            out.append(torch.argmax(row))
            continue
        vals, idx = torch.topk(row.float(), min(config.global_topk, row.shape[-1]))
        if int(k) > 0:
            vals, idx = vals[: int(k)], idx[: int(k)]
        else:
            vals = torch.zeros_like(vals)  # top_k 0/-1: uniform (L133-L134 warns so)
        probs = torch.softmax(vals / max(float(temp), 1e-6), dim=-1)
        keep = (torch.cumsum(probs, 0) - probs) < float(p)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        out.append(idx[torch.multinomial(probs / probs.sum(), 1)[0]])
    return torch.stack(out)
