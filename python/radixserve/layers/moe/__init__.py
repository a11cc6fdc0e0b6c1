"""Mixture-of-experts: routing (topk.py), the expert kernels (fused_moe_native.py is the reference,
fused_moe_cpu.py the grouped fast path) and the FusedMoE layer that holds the stacked expert
weights (layer.py)."""
