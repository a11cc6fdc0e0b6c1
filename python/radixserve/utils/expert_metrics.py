"""--enable-expert-distribution-metrics on /metrics: the tokens the router sent to each expert of
each MoE layer since start, from the replicas' internal states (their `expert_load`, read at each
scrape as the HiCache series are; layers/moe/expert_distribution.py counts them).

`sglang:moe_expert_tokens_total{layer, expert}` counts (token, expert) choices: a forward of T
tokens adds T x top_k to each MoE layer. Layers without experts (dense ones) are left out. SGLang's
own EPLB metric (`sglang:eplb_balancedness`, mean over GPUs / max over GPUs of each layer's load)
is about expert-parallel ranks; these raw counts give it and any other balance measure
(per expert, per layer) by a PromQL query.
"""

from __future__ import annotations

from typing import Any

from radixserve.utils.metrics import with_model_name

NAME = "sglang:moe_expert_tokens_total"


def render_expert_load(states: list[dict[str, Any]], model_name: str | None = None) -> str:
    """The series for the replicas' internal states (one per dp_rank); "" without the counts."""
    entries = [(st.get("dp_rank", 0), st["expert_load"]) for st in states if st.get("expert_load")]
    if not entries:
        return ""
    per_replica = len(entries) > 1
    lines = [
        f"# HELP {NAME} Tokens the router sent to each expert of each MoE layer (token x top_k choices).",
        f"# TYPE {NAME} counter",
    ]
    for dp_rank, load in entries:
        replica = f',dp_rank="{dp_rank}"' if per_replica else ""
        for layer, counts in enumerate(load):
            if not any(counts):
                continue  # a dense layer (or a MoE layer no token reached yet: all zero either way)
            lines += [f'{NAME}{{layer="{layer}",expert="{e}"{replica}}} {c}' for e, c in enumerate(counts)]
    return "\n".join(with_model_name(lines, model_name)) + "\n"
