"""HiCache's per-tier series for /metrics, from each replica's /get_server_info "hicache" entry
(the scheduler owns the tiers, so /metrics asks it, as it asks for the replicas' loads). Names are
SGLang's where it has one (backuped_tokens_total, prefetched_tokens_total, load_back_tokens_total,
hicache_host_used_tokens, ...); the rest are ours, with the hicache_ prefix."""

from __future__ import annotations

from typing import Any

from radixserve.utils.metrics import PerReplicaCounter, with_model_name

# (metric name, kind, help, the hicache entry's field). Counters are cumulative since the start.
SERIES = (
    ("hicache_host_total_tokens", "gauge", "Tokens the host tier (L2) holds.", "host_tokens"),
    ("hicache_host_used_tokens", "gauge", "Tokens with an L2 copy.", "host_used_tokens"),
    ("hicache_backup_tokens_total", "counter", "Tokens copied L1 -> L2.", "backup_tokens"),
    ("hicache_backup_bytes_total", "counter", "Bytes copied L1 -> L2.", "backup_bytes"),
    ("load_back_tokens_total", "counter", "Tokens loaded back L2 -> L1.", "load_back_tokens"),
    ("load_back_bytes_total", "counter", "Bytes loaded back L2 -> L1.", "load_back_bytes"),
    ("hicache_load_back_seconds_total", "counter", "Time spent loading back L2 -> L1.", "load_back_time_s"),
    (
        "backuped_tokens_total",
        "counter",
        "Tokens written to the storage tier (L3).",
        "storage_written_tokens",
    ),
    ("prefetched_tokens_total", "counter", "Tokens read from the storage tier (L3).", "storage_read_tokens"),
    ("hicache_storage_hit_pages_total", "counter", "L3 pages found and read.", "storage_hit_pages"),
    (
        "hicache_storage_miss_pages_total",
        "counter",
        "L3 pages looked up and not found.",
        "storage_miss_pages",
    ),
    ("hicache_storage_read_bytes_total", "counter", "Bytes read from L3 page files.", "storage_read_bytes"),
    (
        "hicache_storage_written_bytes_total",
        "counter",
        "Bytes written to L3 page files.",
        "storage_written_bytes",
    ),
    (
        "hicache_storage_read_seconds_total",
        "counter",
        "Time the prefetch thread spent reading.",
        "storage_read_time_s",
    ),
    (
        "hicache_storage_corrupt_files_total",
        "counter",
        "L3 files refused (checksum, size, key).",
        "storage_corrupt_files",
    ),
    (
        "hicache_storage_dropped_writes_total",
        "counter",
        "L3 backup batches dropped (queue full).",
        "storage_dropped_writes",
    ),
    ("hicache_storage_bytes", "gauge", "Bytes of page files in the L3 directory.", "storage_bytes"),
)


def render_hicache(states: list[dict[str, Any]], model_name: str | None = None) -> str:
    """The series for the replicas' internal states (one per dp_rank), labelled `model_name` as
    the request metrics are; "" without HiCache."""
    entries = [(st.get("dp_rank", 0), st["hicache"]) for st in states if st.get("hicache")]
    if not entries:
        return ""
    dp_size = max(d for d, _ in entries) + 1
    lines: list[str] = []
    for name, kind, help_text, field in SERIES:
        if field not in entries[0][1]:
            continue  # an L3 series without L3
        series = PerReplicaCounter(name, help_text, dp_size, kind)
        for d, entry in entries:
            series.add(float(entry[field]), d if dp_size > 1 else None)
        lines += series.render()
    return "\n".join(with_model_name(lines, model_name)) + "\n"
