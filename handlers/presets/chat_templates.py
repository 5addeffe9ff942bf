"""Chat template presets: Jinja sources looked up by exact name (`handler.chat_template`).

Data only, with the one rule that tells inline Jinja from a preset name or a file name:
`handlers.config` checks a configured name against them at packaging time, and
handlers/api/chat_template.py renders them.
"""

from __future__ import annotations

# Llama-2 chat: [INST] turns, optional <<SYS>> block folded into the first user turn,
# roles must alternate user/assistant; each user turn opens with BOS, each answer ends with EOS.
LLAMA2_CHAT = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant/user/... after an optional "
    "system message') }}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system %}"
    "{{ bos_token + '[INST] <<SYS>>\\n' + system.strip() + '\\n<</SYS>>\\n\\n' "
    "+ message['content'].strip() + ' [/INST]' }}"
    "{% else %}{{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}{% endif %}"
    "{% else %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Llama-3 / 3.1 Instruct chat: each message as a header block ended by <|eot_id|>, BOS once
# at the start, and an open assistant header as the generation prompt. Tools are not
# rendered here (a checkpoint's own template, left empty in the config, does that).
LLAMA3_CHAT = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

PRESETS: dict[str, str] = {"llama-2": LLAMA2_CHAT, "llama-3": LLAMA3_CHAT}
#: the remedy for a model without a chat template: packaging warns with it, a chat request
#: is answered 400 with it (a base model needs no template; completions still work)
NO_TEMPLATE_FIX = f"set handler.chat_template ({', '.join(PRESETS)}) or use /v1/completions"


def is_inline(setting: str) -> bool:
    return "{{" in setting or "{%" in setting
