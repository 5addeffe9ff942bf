"""What the Neuron SDKs' transformers 4.x read of a checkpoint's JSON files (neuron, nxdi).

A checkpoint saved by transformers 5 and packaged without `inf2serve prepare` loads under
5.x and fails under the 4.x (4.36 to 4.57) a Neuron worker runs, after the compile. These
rules, read from each 4.x line's source, look at the JSON files alone, so packaging and
the worker's start (handlers/checkpoint_checks.py) apply them alike: what 4.x refuses or
misreads everywhere is refused, what only some 4.x lines misread is a warning. `prepare`
rewrites every one of them (archive_tools/checkpoint_compat.py), and `validate
--checkpoint` also loads the files under real 4.x installs (archive_tools/transformers4.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

#: the backends whose workers run a Neuron SDK's transformers 4.x
NEURON_BACKENDS = ("neuron", "nxdi")
#: tokenizer classes 5.x writes that 4.x lacks -> the 4.x class that loads the same files
TOKENIZER_CLASS_4X = {"TokenizersBackend": "PreTrainedTokenizerFast"}
PREPARE_FIX = ("run `inf2serve prepare SRC OUT` on it, which writes what transformers 4.36+ "
               "and 5.x both read, and package OUT")


@dataclass
class Findings:
    problems: list[str] = field(default_factory=list)  # a 4.x line fails to load it
    warnings: list[str] = field(default_factory=list)  # some 4.x lines misread part of it


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # absent or damaged: the load checks name it
    return data if isinstance(data, dict) else {}


def check_files(checkpoint: Path) -> Findings:
    """The rules, on tokenizer_config.json, config.json and tokenizer.json."""
    out = Findings()
    tok_path = checkpoint / "tokenizer_config.json"
    tok = _json(tok_path)
    cls = tok.get("tokenizer_class")
    if cls in TOKENIZER_CLASS_4X:
        # models/auto/tokenization_auto.py (4.36.2:L785, 4.48.3:L932, 4.57.6:L1154) raise
        # "Tokenizer class ... does not exist or is not currently imported."
        out.problems.append(f"{tok_path}: tokenizer_class {cls!r} (transformers 5's) does not "
                            "exist in transformers 4.x, the Neuron SDKs', so no worker could "
                            f"load the tokenizer; {PREPARE_FIX}")
    extra = tok.get("extra_special_tokens")
    if isinstance(extra, list):
        # 4.48.3 tokenization_utils_base.py:L1190 (4.57.6 the same): special_tokens.keys()
        out.problems.append(f"{tok_path}: extra_special_tokens is a list (transformers 5's "
                            "form); transformers 4.48+ read a mapping there and fail "
                            f"(\"'list' object has no attribute 'keys'\"); {PREPARE_FIX}")
    config_path = checkpoint / "config.json"
    config = _json(config_path)
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        # 4.x's LlamaConfig reads rope_theta (default 10000.0) and rope_scaling, as does
        # transformers-neuronx (aws-neuron/transformers-neuronx@1ade6d7:src/
        # transformers_neuronx/llama/config.py:L43-L48); rope_parameters is 5.x's only
        theta, kind = rope["rope_theta"], rope.get("rope_type", "default")
        if config.get("rope_theta") is None and (theta != 10000.0 or kind != "default"):
            out.problems.append(f"{config_path}: RoPE is only under rope_parameters (rope_theta "
                                f"{theta}, rope_type {kind!r}), which transformers 4.x and "
                                "transformers-neuronx do not read: they would use rope_theta "
                                f"10000 and no scaling, and answer wrongly; {PREPARE_FIX}")
    model = _json(checkpoint / "tokenizer.json").get("model") or {}
    merges = model.get("merges") if isinstance(model, dict) else None
    if model.get("type") == "BPE" and merges and not isinstance(merges[0], str):
        out.warnings.append(f"{checkpoint / 'tokenizer.json'}: BPE merges are stored as pairs, "
                            "which tokenizers < 0.20 (transformers 4.36 to 4.44) cannot parse; "
                            f"newer SDKs read them. For every SDK, {PREPARE_FIX}")
    if (checkpoint / "chat_template.jinja").is_file() and not tok.get("chat_template"):
        out.warnings.append(f"{checkpoint / 'chat_template.jinja'}: transformers < 4.47 read the "
                            "chat template only from tokenizer_config.json, so on those SDKs "
                            f"chat requests would answer 400; {PREPARE_FIX}")
    return out
