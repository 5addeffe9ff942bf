"""The model families `inf2serve demo-model --arch` writes, as data.

Each family is what a newcomer meets in its real checkpoints, shrunk: the config
conventions of its published models (Qwen2's q/k/v bias and tied embeddings in the
small sizes, Qwen3's q/k norms and explicit head_dim, Mistral v0.3's full attention
and v0.1's 4096-token sliding window, Mixtral's eight experts with two per token),
the special tokens its chat and tool formats are written in, and its real chat
template, copied verbatim from the model's public tokenizer_config.json into
archive_tools/data/ (`template_source` names where). Building the model is left to
transformers' own classes: a checkpoint is what `save_pretrained` writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

# Llama-2 chat, as demo-model has always written it (the llama-2 preset's format).
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}{{ bos_token + '[INST] <<SYS>>\\n' + system + "
    "'\\n<</SYS>>\\n\\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class Family:
    """One `--arch`: tokens, template and the transformers config to build."""

    name: str
    model_type: str
    #: (size, token ids by name, tiny) -> the transformers config; ids hold bos/eos/pad
    build_config: Callable[[Any, dict[str, int], bool], Any]
    template_file: str  # under archive_tools/data/; "" = LLAMA2_CHAT_TEMPLATE
    template_source: str
    special: tuple[str, ...]  # special tokens (skipped when decoding), first ids in this order
    added: tuple[str, ...] = ()  # added tokens that decode as text (special=False)
    bos: str | None = "<s>"
    eos: str = "</s>"
    unk: str | None = "<unk>"
    pad: str | None = None
    #: generation_config.json's eos_token_id, in order (default: eos alone)
    stop: tuple[str, ...] = ()

    def chat_template(self) -> str:
        if not self.template_file:
            return LLAMA2_CHAT_TEMPLATE
        data = resources.files("archive_tools").joinpath(f"data/{self.template_file}")
        return data.read_text("utf-8")

    @property
    def stop_tokens(self) -> tuple[str, ...]:
        return self.stop or (self.eos,)


def _common(size, ids: dict[str, int], tiny: bool) -> dict[str, Any]:
    return dict(vocab_size=size.vocab, hidden_size=size.hidden,
                intermediate_size=size.intermediate, num_hidden_layers=size.layers,
                num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                max_position_embeddings=size.max_positions,
                initializer_range=0.08 if tiny else 0.02, torch_dtype="float32")


def _llama(size, ids, tiny):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(size, ids, tiny), bos_token_id=ids["<s>"],
                       eos_token_id=ids["</s>"], tie_word_embeddings=False)


def _qwen2(size, ids, tiny):
    """Qwen2.5's config.json: rope_theta 1e6, no sliding window (use_sliding_window false,
    sliding_window and max_window_layers present), bos <|endoftext|> and eos <|im_end|>, tied
    embeddings as in the 0.5B-3B sizes (7B and up untie). The q/k/v bias is no config key:
    transformers' Qwen2Attention always has it."""
    from transformers import Qwen2Config

    return Qwen2Config(**_common(size, ids, tiny), rope_theta=1e6, use_sliding_window=False,
                       sliding_window=size.max_positions, max_window_layers=size.layers,
                       bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                       tie_word_embeddings=True)


def _qwen3(size, ids, tiny):
    """Qwen3's config.json: an explicit head_dim wider than hidden / heads (Qwen3-0.6B: 1024
    hidden, 16 heads, head_dim 128), q/k RMSNorm (no key: Qwen3Attention always has them), no
    attention bias, rope_theta 1e6, tied embeddings in the 0.6B-4B sizes."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common(size, ids, tiny), head_dim=2 * size.hidden // size.heads,
                       attention_bias=False, rope_theta=1e6, use_sliding_window=False,
                       sliding_window=None, max_window_layers=size.layers,
                       bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                       tie_word_embeddings=True)


def _mistral(sliding_window: int | None, rope_theta: float):
    def build(size, ids, tiny):
        from transformers import MistralConfig

        return MistralConfig(**_common(size, ids, tiny), head_dim=size.hidden // size.heads,
                             sliding_window=sliding_window, rope_theta=rope_theta,
                             bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                             tie_word_embeddings=False)
    return build


def _mixtral(size, ids, tiny):
    """Mixtral-8x7B's config.json: 8 local experts, 2 per token, no sliding window,
    rope_theta 1e6; each expert an MLP of intermediate_size."""
    from transformers import MixtralConfig

    return MixtralConfig(**_common(size, ids, tiny), head_dim=size.hidden // size.heads,
                         num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                         rope_theta=1e6, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                         tie_word_embeddings=False)


LLAMA_SPECIAL = ("<unk>", "<s>", "</s>")
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Mistral's v3 tokenizer: ids 3-9 are its control tokens, special in tokenizer_config.json
MISTRAL_V3_SPECIAL = LLAMA_SPECIAL + ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                      "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
TEMPLATE_NOTE = ("verbatim from the chat_template of {repo}'s tokenizer_config.json on the "
                      "Hugging Face Hub")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "llama", _llama, "", "inf2serve's Llama-2 chat template (the llama-2 preset's "
           "format), as demo-model has always written it", LLAMA_SPECIAL),
    Family("qwen2", "qwen2", _qwen2, "chat_template.qwen2.5.jinja",
           TEMPLATE_NOTE.format(repo="Qwen/Qwen2.5-7B-Instruct") + " (one template for "
           "every Qwen2.5 Instruct size): ChatML turns, tools in <tools>, calls in <tool_call>",
           QWEN_SPECIAL, added=("<tool_call>", "</tool_call>"), bos=None, eos="<|im_end|>",
           unk=None, pad="<|endoftext|>", stop=("<|im_end|>", "<|endoftext|>")),
    Family("qwen3", "qwen3", _qwen3, "chat_template.qwen3.jinja",
           TEMPLATE_NOTE.format(repo="Qwen/Qwen3-8B") + " (the release's revision, as "
           "llama.cpp vendors it in models/templates/Qwen-Qwen3-0.6B.jinja, differs only in "
           "not reading non-string content): <think> reasoning, enable_thinking",
           QWEN_SPECIAL, added=("<tool_call>", "</tool_call>", "<tool_response>",
                                "</tool_response>", "<think>", "</think>"),
           bos=None, eos="<|im_end|>", unk=None, pad="<|endoftext|>",
           stop=("<|im_end|>", "<|endoftext|>")),
    Family("mistral", "mistral", _mistral(None, 1e6), "chat_template.mistral-v0.3.jinja",
           TEMPLATE_NOTE.format(repo="mistralai/Mistral-7B-Instruct-v0.3") + " (Mistral's "
           "'v3' template): [AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS]",
           MISTRAL_V3_SPECIAL),
    Family("mistral-v0.1", "mistral", _mistral(4096, 1e4), "chat_template.mistral-v1.jinja",
           TEMPLATE_NOTE.format(repo="mistralai/Mistral-7B-Instruct-v0.2") + " (Mistral's "
           "'v1' template, also Mistral-7B-Instruct-v0.1's and Mixtral-8x7B-Instruct-v0.1's)",
           LLAMA_SPECIAL),  # sliding_window 4096, rope_theta 10000: Mistral-7B-v0.1's
    Family("mixtral", "mixtral", _mixtral, "chat_template.mistral-v1.jinja",
           TEMPLATE_NOTE.format(repo="mistralai/Mixtral-8x7B-Instruct-v0.1") + " (Mistral's "
           "'v1' template: [INST] turns, no tool format)", LLAMA_SPECIAL),
)}
