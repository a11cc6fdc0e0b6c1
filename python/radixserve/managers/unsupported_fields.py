"""SGLang's /generate fields that radixserve does not serve, and those it may ignore.

A client that sends one of REFUSED with a value other than its "off" value (null, false, an empty
list, object or string) gets a 400 naming the field, instead of an answer that silently left it
out. IGNORED are SGLang's hints and bookkeeping fields whose absence changes no output; they (and
any field SGLang does not define either) are accepted and dropped (docs/http_api.md, "Fields").
"""

from __future__ import annotations

from typing import Any

# image_data is served by models that take images; a text-only model refuses it with a 400 at
# input_validation (multimodal/processor.py: image_refusal).
_MULTIMODAL = "radixserve takes images only (docs/multimodal.md)"

REFUSED: dict[str, str] = {
    "video_data": _MULTIMODAL,
    "audio_data": _MULTIMODAL,
    "modalities": _MULTIMODAL,
    "mm_hashes": _MULTIMODAL,
    "mm_content_hashes": _MULTIMODAL,
    "use_audio_in_video": _MULTIMODAL,
    "video_config": _MULTIMODAL,
    "images_config": _MULTIMODAL,
    "max_dynamic_patch": _MULTIMODAL,
    "min_dynamic_patch": _MULTIMODAL,
    "image_max_dynamic_patch": _MULTIMODAL,
    "video_max_dynamic_patch": _MULTIMODAL,
    "positional_embed_overrides": "use input_embeds for a prompt given as embeddings",
    "return_sampling_mask": "sampling masks are not returned",
    "return_flat_raw_top_logprobs": "top logprobs are returned as nested lists only",
    "return_flat_raw_top_logprobs_b64": "top logprobs are returned as nested lists only",
    "return_routed_experts": "routed experts are not returned",
    "return_indexer_topk": "indexer top-k is not returned",
    "return_entropy": "entropy is not returned",
    "return_prompt_token_ids": "prompt token ids are not returned apart from logprobs",
    "require_reasoning": "per-request reasoning control is not supported",
    "max_thinking_tokens": "per-request thinking budgets are not supported",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
    "session_id": "use session_params to continue a session",
    "extra_key": "extra cache keys are not supported",
    "bootstrap_pair_key": "prefill/decode pairing keys other than bootstrap_room are not supported",
    "decode_tp_size": "the decode side's layout comes from its bootstrap, not the request",
}

# Accepted and dropped: observability and routing hints, and fields SGLang sets internally.
IGNORED = (
    "log_metrics",
    "custom_labels",
    "conversation_id",
    "external_trace_header",
    "received_time",
    "routing_key",
    "kv_router_hint",
    "http_worker_ipc",
    "background",
    "return_bytes",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "encoder_urls",
    "lora_id",
)


def _is_off(value: Any) -> bool:  # noqa: ANN401 - any JSON value
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def refuse_unsupported(body: Any) -> None:  # noqa: ANN401 - the raw request body
    """ValueError (-> 400) naming the first REFUSED field the body sets."""
    if not isinstance(body, dict):
        return
    for name, why in REFUSED.items():
        if name in body and not _is_off(body[name]):
            raise ValueError(f"'{name}' is not supported: {why}.")
