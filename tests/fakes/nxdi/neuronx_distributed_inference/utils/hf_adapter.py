"""load_pretrained_config of the fake: the HF config's fields become InferenceConfig attributes.

aws-neuron/neuronx-distributed-inference@cd3abf3:src/neuronx_distributed_inference/
utils/hf_adapter.py:L36-L80.
"""

from __future__ import annotations

from types import SimpleNamespace


def load_pretrained_config(model_path_or_name=None, hf_config=None):
    def load_config(self):
        from transformers import AutoConfig, PretrainedConfig

        if (model_path_or_name is None) == (hf_config is None):  # L43-L46
            raise ValueError('Please provide only one of "model_path_or_name" or "hf_config"')
        config = (AutoConfig.from_pretrained(model_path_or_name)
                  if model_path_or_name is not None else hf_config)
        config_dict = config.to_dict()
        if config.transformers_version is not None:
            config_dict["transformers_version"] = config.transformers_version
        hf_dtype = config_dict.get("dtype", config_dict.get("torch_dtype", None))
        if hf_dtype is not None:  # L58-L67: the checkpoint's dtype unless the user set one
            if self.neuron_config is not None and not self.neuron_config.overrides_torch_dtype:
                from neuronx_distributed_inference.models.config import to_torch_dtype

                dtype = hf_dtype
                self.neuron_config.torch_dtype = (to_torch_dtype(dtype) if isinstance(dtype, str)
                                                  else dtype)
            config_dict.pop("dtype", None)
            config_dict.pop("torch_dtype", None)
        for k, v in config_dict.items():
            if isinstance(getattr(config, k, None), PretrainedConfig):
                config_dict[k] = SimpleNamespace(**v)
        rope = config_dict.get("rope_parameters") or {}
        if "rope_theta" not in config_dict and "rope_theta" in rope:
            # fake only: transformers 5 keeps the theta under rope_parameters; the real
            # library pins transformers 4.57 (setup.py at cd3abf3), where it is top level
            config_dict["rope_theta"] = rope["rope_theta"]
        self.__dict__.update(config_dict)
        if hasattr(config, "attribute_map"):
            self.attribute_map = config.attribute_map

    return load_config
