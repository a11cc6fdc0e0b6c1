"""Loading the model's HF tokenizer: the main process (TokenizerManager, Engine) and the scheduler
process (stop strings, grammars) load it alike, without importing each other's modules."""

from __future__ import annotations

import json
import os
from typing import Any

from radixserve.server_args import ServerArgs


class ConfigFacts:
    """The few fields of a model's config.json that AutoTokenizer reads when tokenizer_config.json
    names its class: model_type (and model_name), _name_or_path, tokenizer_class.

    AutoTokenizer otherwise builds the model's config class itself, and importing any of
    transformers' model config classes imports its weight-loading stack (torch.distributed.tensor,
    sympy): ~1.3 CPU s of every server launcher's start that the tokenizer does not need."""

    def __init__(self, path: str, config: dict[str, Any]) -> None:
        self.model_type = config["model_type"]
        self._name_or_path = path
        self.tokenizer_class = config.get("tokenizer_class")
        if "model_name" in config:
            self.model_name = config["model_name"]


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def config_facts(path: str) -> ConfigFacts | None:
    """ConfigFacts for `path`, or None where AutoTokenizer's choice of class would read more of the
    config than these facts (no tokenizer_class in tokenizer_config.json, an auto_map, a
    model_type transformers does not know, no readable config.json): it then loads the config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    tokenizer_config = _read_json(os.path.join(path, "tokenizer_config.json"))
    config = _read_json(os.path.join(path, "config.json"))
    if tokenizer_config is None or config is None:
        return None
    if not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config or "auto_map" in config:
        return None
    if config.get("model_type") not in CONFIG_MAPPING_NAMES:
        return None
    return ConfigFacts(path, config)


def load_tokenizer(server_args: ServerArgs) -> Any:
    """The HF tokenizer of the model folder, with --chat-template applied (a file or a string)."""
    from transformers import AutoTokenizer

    path = server_args.tokenizer_path or server_args.model_path
    facts = config_facts(path) if os.path.isdir(path) else None
    tokenizer = AutoTokenizer.from_pretrained(path, **({"config": facts} if facts else {}))
    template = server_args.chat_template
    if template:
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        tokenizer.chat_template = template
    return tokenizer
