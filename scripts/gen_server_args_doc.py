"""Write docs/server_args.md from ServerArgs' field metadata (the same text as --help).

.venv/bin/python scripts/gen_server_args_doc.py          # rewrite the page
.venv/bin/python scripts/gen_server_args_doc.py --check  # exit 1 if the page is stale
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from radixserve.server_args import ServerArgs

DOC = Path(__file__).resolve().parent.parent / "docs" / "server_args.md"


def render() -> str:
    lines = [
        "# Server arguments",
        "",
        "Generated from `python/radixserve/server_args.py` by `scripts/gen_server_args_doc.py`;",
        "`python -m radixserve.launch_server --help` prints the same text. Flags keep SGLang's names.",
        "",
        "| flag | default | meaning |",
        "|---|---|---|",
    ]
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        default = "auto" if f.default is None else repr(f.default)
        help_text = f.metadata.get("help", "")
        if "choices" in f.metadata:
            help_text += " Choices: " + ", ".join(map(str, f.metadata["choices"])) + "."
        if f.metadata.get("aliases"):
            help_text += " Also: " + ", ".join(f"`{a}`" for a in f.metadata["aliases"]) + "."
        lines.append(f"| `{flag}` | `{default}` | {help_text} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run scripts/gen_server_args_doc.py")
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
