"""Loading the model's HF tokenizer: the main process (TokenizerManager, Engine) and the scheduler
process (stop strings, grammars) load it alike, without importing each other's modules."""

from __future__ import annotations

import os
from typing import Any

from radixserve.server_args import ServerArgs


def load_tokenizer(server_args: ServerArgs) -> Any:
    """The HF tokenizer of the model folder, with --chat-template applied (a file or a string)."""
    from transformers import AutoTokenizer

    path = server_args.tokenizer_path or server_args.model_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    template = server_args.chat_template
    if template:
        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        tokenizer.chat_template = template
    return tokenizer
