"""Fake MixtralForSampling: Mistral's attention with a mixture-of-experts MLP, computed with
transformers' MixtralForCausalLM.

aws-neuron/transformers-neuronx@1ade6d7:src/transformers_neuronx/mixtral/ (config.py,
model.py, hlo.py).
"""

from __future__ import annotations

import torch

from transformers_neuronx.mistral.model import MistralForSampling


class MixtralForSampling(MistralForSampling):
    HF_CLASS = "MixtralForCausalLM"
    ROPE_THETA_DEFAULT = 1e6  # mixtral/config.py:L43

    def __init__(self, config, *, n_positions=2048, batch_size=1, amp="f32", tp_degree=2,
                 context_length_estimate=None, context_unroll=None, unroll=None,
                 neuron_config=None, **kwargs):  # real default: NeuronConfig()
        experts = config.num_local_experts  # mixtral/config.py:L46-L47
        config.num_experts_per_tok  # noqa: B018 (read, as the real config does)
        if experts % tp_degree != 0 and tp_degree % experts != 0:  # config.py:L58-L62
            raise ValueError("tp_degree needs to be 8, 16 or 32. Use f16 or bf16 or "
                             "tp_degree = 8.")
        self.experts = experts
        super().__init__(config, n_positions=n_positions, batch_size=batch_size, amp=amp,
                         tp_degree=tp_degree, context_length_estimate=context_length_estimate,
                         neuron_config=neuron_config)

    def _build_graphs(self) -> None:
        nc = self.neuron_config
        if nc.quant and self.experts > self.tp_degree:
            # inferred: with several experts per core the HLO slices each expert's weights
            # but hands gated_mlp the scales of all of them (mixtral/hlo.py:L110-L144)
            raise ValueError(f"fake (inferred): quantized experts with "
                             f"{self.experts // self.tp_degree} experts per core; the scales "
                             "are not sliced with the weights")
        super()._build_graphs()

    def _checkpoint_names(self, hf) -> list[str]:
        """load_weights reads each expert's w1/w2/w3 and the router gate by the hub names
        (mixtral/model.py:L72-L106), which transformers 5 keeps on disk but fuses in memory."""
        names = [n for n in hf.state_dict() if "block_sparse_moe." not in n and ".mlp." not in n]
        for i in range(self.config.num_hidden_layers):
            moe = f"model.layers.{i}.block_sparse_moe"
            names.append(f"{moe}.gate.weight")
            names += [f"{moe}.experts.{e}.{w}.weight" for e in range(self.experts)
                      for w in ("w1", "w2", "w3")]
        return names

    def _mlp_weights(self, layer_id: int) -> list[tuple[str, int]]:
        """The experts' weights quantize (allow_quantize=True, mixtral/model.py:L101-L106),
        the router gate does not (L92). w1/w3 concatenated [hidden, E x inter] get one scale
        per output channel; w2 concatenated as [hidden, E x inter] too, out_feature_dim 1
        (decoder.py:L1343-L1344), so its scales are per inter column: taken over dim 0 of
        the HF [hidden, inter] weight."""
        out = []
        for e in range(self.experts):
            base = f"block_sparse_moe.experts.{e}"
            out += [(f"{base}.w1", 1), (f"{base}.w3", 1), (f"{base}.w2", 0)]
        return out

    def _load_hf(self, hf, tensors: dict[str, torch.Tensor]) -> None:
        """The hub names into transformers' model: as they are under 4.x; under 5.x the
        experts are one gate_up_proj [E, 2 x inter, hidden] and down_proj [E, hidden, inter]
        and the router is mlp.gate."""
        state = hf.state_dict()
        if any(n.endswith("mlp.experts.gate_up_proj") for n in state):
            for i in range(self.config.num_hidden_layers):
                moe, mlp = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
                w = [[tensors.pop(f"{moe}.experts.{e}.{k}.weight") for e in range(self.experts)]
                     for k in ("w1", "w2", "w3")]
                tensors[f"{mlp}.experts.gate_up_proj"] = torch.stack(
                    [torch.cat([g, u]) for g, u in zip(w[0], w[2], strict=True)])
                tensors[f"{mlp}.experts.down_proj"] = torch.stack(w[1])
                tensors[f"{mlp}.gate.weight"] = tensors.pop(f"{moe}.gate.weight")
        hf.load_state_dict(tensors, strict=True)
