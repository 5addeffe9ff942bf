"""Chat template presets: Jinja sources looked up by exact name (`handler.chat_template`).

Data only, with the one rule that tells inline Jinja from a preset name or a file name:
`handlers.config` checks a configured name against them at packaging time, and
handlers/api/chat_template.py renders them. `llama-2` and `llama-3` are short templates
written here; the others are the families' published templates, verbatim from the Hugging
Face Hub (templates/, read on first use), with their tool formats and Qwen3's thinking
switch: `qwen2.5` is Qwen/Qwen2.5-7B-Instruct's (every Qwen2.5 Instruct size has it),
`qwen3` Qwen/Qwen3-8B's, `mistral` mistralai/Mistral-7B-Instruct-v0.3's. They are for a
checkpoint saved without its template (a converted or merged one); a checkpoint that has
its own template needs none.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from importlib import resources

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

#: preset name -> file under templates/
PUBLISHED = {"qwen2.5": "qwen2.5.jinja", "qwen3": "qwen3.jinja", "mistral": "mistral.jinja"}


@functools.cache
def _published(name: str) -> str:
    return resources.files(__package__).joinpath("templates", PUBLISHED[name]).read_text("utf-8")


class _Presets(Mapping[str, str]):
    """Name -> Jinja source; a published template's file is read when first asked for."""

    def __init__(self, inline: dict[str, str]) -> None:
        self._inline = inline

    def __getitem__(self, name: str) -> str:
        if name in self._inline:
            return self._inline[name]
        if name in PUBLISHED:
            return _published(name)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter((*self._inline, *PUBLISHED))

    def __len__(self) -> int:
        return len(self._inline) + len(PUBLISHED)


PRESETS: Mapping[str, str] = _Presets({"llama-2": LLAMA2_CHAT, "llama-3": LLAMA3_CHAT})
#: the remedy for a model without a chat template: packaging warns with it, a chat request
#: is answered 400 with it (a base model needs no template; completions still work)
NO_TEMPLATE_FIX = f"set handler.chat_template ({', '.join(PRESETS)}) or use /v1/completions"


def is_inline(setting: str) -> bool:
    return "{{" in setting or "{%" in setting
