"""Checkpoints whose greedy answers are scripted: real models for a real server.

Tool calling and reasoning can only be tested end to end with a model that answers with a
tool call or thinks aloud. A random tiny model never does, and no checkpoint may be
downloaded, so these are built to: every layer's output projections are zero, so the
residual stream carries the last token's embedding unchanged to the final norm and the LM
head; embeddings are one-hot, so the next token is a function of the current one alone (a
bigram table, `Script.next`). The word-level tokenizer makes each piece of the scripted
answers one token (decoded joined by spaces), so every token of an answer is distinct and
the chain runs to EOS. Each family's script is built with that family's transformers class
and special tokens (but Qwen2.5's, see SCRIPTS):

- `llama`: a chat template in the manner of Llama 3.1 (tool definitions as JSON in the
  first user turn, calls as `{"name", "parameters"}`, results under an `ipython` header),
  with one scripted twist: the generation prompt after a tool result is `<answer>`, so the
  same model answers the tool result in prose rather than calling again.
- `qwen2.5`, `qwen3`, `mistral`: the family's published chat template (the presets of
  handlers/presets, verbatim from the Hub), so the tool format is found the way a real
  checkpoint's is. Qwen2.5 answers its generation prompt (`<|im_start|>assistant`) with a
  `<tool_call>`; Mistral v0.3 answers `[/INST]` with `[TOOL_CALLS] [...]`, whose control
  token is special, as in Mistral's tokenizer (the served text lacks it); Qwen3 thinks
  between `<think>` and `</think>` and then answers, and with `enable_thinking: false`
  (its template closes an empty block, ending the prompt with `</think>`) answers at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

CALL = ['{"name":', '"get_weather",', '"parameters":', '{"city":', '"Paris"}}']
PROSE = ["It", "is", "sunny", "in", "Paris."]
PLAIN = ["Hello", "from", "a", "plain", "chat."]
THOUGHT = ["The", "user", "wants", "the", "weather."]
QWEN_CALL = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":',
             '"Paris"}}', "</tool_call>"]
MISTRAL_CALL = ["[TOOL_CALLS]", '[{"name":', '"get_weather",', '"arguments":', '{"city":',
                '"Paris"}}]']
SPECIAL = ["<unk>", "<s>", "</s>"]
MARKERS = ["<user>", "<system>", "<assistant>", "<answer>", "<ipython>", "<eot>", "[INST]",
           "[/INST]", "Functions:"]
WORDS = SPECIAL + MARKERS + CALL + PROSE + PLAIN
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ ' <ipython> ' + m['content'] + ' <eot>' }}"
    "{% elif m.get('tool_calls') %}{{ ' <assistant>' }}"
    "{% for c in m['tool_calls'] %}{{ ' {\"name\": \"' + c['function']['name'] "
    "+ '\", \"parameters\": ' + (c['function']['arguments'] | tojson) + '}' }}{% endfor %}"
    "{{ ' <eot>' }}"
    "{% else %}{{ ' <' + m['role'] + '> ' }}"
    "{% if loop.first and tools %}{{ 'Functions: ' }}"
    "{% for t in tools %}{{ (t | tojson) + ' ' }}{% endfor %}{% endif %}"
    "{{ m['content'] + ' <eot>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if messages[-1]['role'] == 'tool' %}{{ ' <answer>' }}{% else %}{{ ' <assistant>' }}"
    "{% endif %}{% endif %}")


def chain(*runs: list[str], after: str) -> dict[str, str]:
    """`after` -> the first word of the joined runs, each word -> the next; the last word
    is followed by EOS (no entry)."""
    words = [w for run in runs for w in run]
    return {after: words[0], **dict(zip(words, words[1:], strict=False))}


@dataclass(frozen=True)
class Script:
    """One family's scripted checkpoint: its transformers class, chat template (inline
    Jinja or a preset name), tokens and greedy chains."""

    model_type: str
    template: str
    words: tuple[str, ...]  # the vocabulary, special tokens first
    next: dict[str, str]
    bos: str | None = "<s>"
    eos: str = "</s>"
    special: tuple[str, ...] = ()  # dropped from decoded text besides bos/eos/unk
    added: tuple[str, ...] = ()  # matched whole in text, decoded as text
    extra: dict = field(default_factory=dict)  # more config keys

    def chat_template(self) -> str:
        from handlers.presets.chat_templates import PRESETS

        return PRESETS.get(self.template, self.template)


QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SCRIPTS = {
    "llama": Script("llama", TOOL_TEMPLATE, tuple(WORDS), {
        **chain(CALL, after="<assistant>"), **chain(PROSE, after="<answer>"),
        **chain(PLAIN, after="[/INST]")}),
    # Llama's class: transformers 5 reads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer,
    # a byte-level BPE with its own pre-tokenizer, which no word-level vocabulary can be
    "qwen2.5": Script("llama", "qwen2.5", ("<unk>", *QWEN_SPECIAL, "assistant", *QWEN_CALL),
                      chain(QWEN_CALL, after="assistant"), bos=None, eos="<|im_end|>",
                      special=QWEN_SPECIAL, added=("<tool_call>", "</tool_call>")),
    "qwen3": Script("qwen3", "qwen3", ("<unk>", *QWEN_SPECIAL, "assistant", "<think>",
                                       "</think>", *THOUGHT, *PROSE),
                    chain(["<think>"], THOUGHT, ["</think>"], PROSE, after="assistant"),
                    bos=None, eos="<|im_end|>",
                    special=QWEN_SPECIAL, added=("<think>", "</think>"),
                    extra={"head_dim": 16}),
    "mistral": Script("mistral", "mistral", (*SPECIAL, "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                             "[/AVAILABLE_TOOLS]", *MISTRAL_CALL),
                      chain(MISTRAL_CALL, after="[/INST]"),
                      special=("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                               "[/AVAILABLE_TOOLS]"), extra={"sliding_window": None}),
}
#: the transformers classes a model_type is built with
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM")}


def build_tokenizer(script: Script):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(script.words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # decode joins words with a space
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=script.bos,
                                        eos_token=script.eos, unk_token="<unk>",
                                        model_max_length=256,
                                        clean_up_tokenization_spaces=False)
    if script.special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(script.special)})
    if script.added:
        tokenizer.add_tokens([AddedToken(w, special=False, normalized=False)
                              for w in script.added])
    tokenizer.chat_template = script.chat_template()
    return tokenizer


def build_scripted_checkpoint(out: Path, family: str = "llama") -> Path:
    """Write the scripted model of `family` (config, safetensors, tokenizer with its chat
    template) to `out`."""
    import torch
    import transformers

    script = SCRIPTS[family]
    tokenizer = build_tokenizer(script)
    vocab = {w: i for i, w in enumerate(script.words)}
    assert len(tokenizer) == len(vocab), "every token is a word of the vocabulary"
    size = 32  # hidden size: at least the vocabulary, for one-hot embeddings
    config_class, model_class = (getattr(transformers, n) for n in CLASSES[script.model_type])
    eos = vocab[script.eos]
    config = config_class(vocab_size=size, hidden_size=size, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                          max_position_embeddings=256,
                          bos_token_id=vocab[script.bos] if script.bos else None,
                          eos_token_id=eos, tie_word_embeddings=False,
                          torch_dtype="float32", **script.extra)
    model = model_class(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream passes through untouched
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        head = torch.zeros(size, size)
        for word, i in vocab.items():
            head[vocab[script.next[word]] if word in script.next else eos, i] = 1.0
        for i in range(len(vocab), size):  # ids past the words: EOS too
            head[eos, i] = 1.0
        model.lm_head.weight.copy_(head * 8)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = tokenizer.chat_template  # inline: what transformers < 4.47 reads
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


#: characters a JSON answer's structure is made of: the JSON model prefers tokens holding them
JSON_PUNCTUATION = set('"{}[],:0123456789')


def build_json_checkpoint(out: Path) -> Path:
    """A Llama checkpoint with a byte-level vocabulary (the tiny demo model's BPE, so JSON
    decodes byte for byte) whose logits are the same at every position: EOS highest, then
    short tokens holding JSON punctuation, then the rest, each with a small fixed jitter
    that breaks ties. Under a grammar its greedy answer is the shortest-leaning valid
    answer -- EOS as soon as the grammar allows it, strings closed and containers ended
    where they may be -- so structured-output answers end with `stop` and can be checked;
    without one it answers EOS at once. Its template is TOOL_TEMPLATE (Llama 3.1's JSON tool
    calls), so forced tool calls use that format. Every layer's output projections are
    zero and every embedding the same vector, so the residual stream is that vector at the
    final norm, whatever the input."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from archive_tools.demo_model import build_demo_model

    build_demo_model(out, "tiny", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    model.config.tie_word_embeddings = False
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    pieces = [tokenizer.decode([i]) for i in range(vocab)]
    bias = torch.tensor([(5.0 if 0 < len(p) <= 3 and JSON_PUNCTUATION & set(p) else 0.0)
                         + ((i * 2654435761) % 1000) / 2000.0 for i, p in enumerate(pieces)])
    bias[eos] = 20.0
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream passes through untouched
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)  # RMSNorm(ones) = ones: logit i = bias[i]
        model.lm_head.weight = torch.nn.Parameter(bias[:, None].repeat(1, hidden) / hidden)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(out, save_jinja_files=False)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE  # inline: what transformers < 4.47 reads
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out
