"""Llama checkpoints whose greedy answers are scripted: real models for a real server.

Tool calling can only be tested end to end with a model that answers with a tool call. A
random tiny model never does, and no checkpoint may be downloaded, so this one is built
to: every layer's output projections are zero, so the residual stream carries the last
token's embedding unchanged to the final norm and the LM head; embeddings are one-hot, so
the next token is a function of the current one alone (a bigram table, `NEXT`). The
word-level tokenizer makes each piece of the scripted answers one token, so every token
of an answer is distinct and the chain runs to EOS. Its chat template has a tool format
in the manner of Llama 3.1 (tool definitions as JSON in the first user turn, calls as
`{"name", "parameters"}`, results under an `ipython` header), with one scripted twist: the
generation prompt after a tool result is `<answer>`, so the same model answers the tool
result in prose rather than calling again.
"""

from __future__ import annotations

import json
from pathlib import Path

CALL = ['{"name":', '"get_weather",', '"parameters":', '{"city":', '"Paris"}}']
PROSE = ["It", "is", "sunny", "in", "Paris."]
PLAIN = ["Hello", "from", "a", "plain", "chat."]
SPECIAL = ["<unk>", "<s>", "</s>"]
MARKERS = ["<user>", "<system>", "<assistant>", "<answer>", "<ipython>", "<eot>", "[INST]",
           "[/INST]", "Functions:"]
WORDS = SPECIAL + MARKERS + CALL + PROSE + PLAIN
#: the next token after each token, greedy; every other token is followed by EOS
NEXT = {"<assistant>": CALL[0], **dict(zip(CALL, CALL[1:], strict=False)),
        "<answer>": PROSE[0], **dict(zip(PROSE, PROSE[1:], strict=False)),
        "[/INST]": PLAIN[0], **dict(zip(PLAIN, PLAIN[1:], strict=False))}
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


def build_scripted_checkpoint(out: Path) -> Path:
    """Write the scripted model (config, safetensors, tokenizer with TOOL_TEMPLATE) to `out`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # decode joins words with a space
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", model_max_length=256,
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = TOOL_TEMPLATE
    size = 32  # hidden size: at least the vocabulary, for one-hot embeddings
    config = LlamaConfig(vocab_size=size, hidden_size=size, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=vocab["<s>"],
                         eos_token_id=vocab["</s>"], tie_word_embeddings=False,
                         torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    eos = vocab["</s>"]
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream passes through untouched
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        head = torch.zeros(size, size)
        for word, i in vocab.items():
            head[vocab[NEXT[word]] if word in NEXT else eos, i] = 1.0
        for i in range(len(vocab), size):  # ids past the words: EOS too
            head[eos, i] = 1.0
        model.lm_head.weight.copy_(head * 8)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE  # inline: what transformers < 4.47 reads
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
