"""The weight-only quantized forms (Linear.weight_wq) of a ModelRunner's linears: the GGUF file's
own tensors under --quantization gguf, or on-the-fly quantization under --torchao-config.

The forms are made once, when the model loads, and attached again whenever the derived forms are
rebuilt (weight updates, release / resume: model_executor/weight_sync.py). A form is attached only
while its layer's fp32 weight is exactly its dequantization, the invariant linear() relies on
(small batches read the form, larger ones the fp32 weight):
- at load, a GGUF form that differs from the fp32 weight of the file's conversion is an error (the
  conversion does not come from this file);
- after a weight update changed a layer, a GGUF form is dropped (the file no longer describes the
  layer, which serves in fp32 from then on) and an on-the-fly one is made anew from the new
  weight, which is then replaced by its dequantization.
A MoE layer's quantized experts (FusedMoE.experts_wq, from a GGUF file only) follow the same rule,
all the layer's experts together, with one difference: they are the only copy (the loader built
the layer without fp32 experts and attached the file's forms, model_loader/gguf_experts.py), so a
weight update first brings back the fp32 experts of the layers it writes (weight_sync.py) and the
next attach drops them again where they did not change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from radixserve.layers.group_quant import ACT_BLOCK, WQ_KERNEL, GroupQuantWeight, with_int8_activations
from radixserve.layers.group_quant_ops import take_rows
from radixserve.layers.linear import Linear
from radixserve.layers.moe.fused_moe_a8 import MOE_A8_KERNEL
from radixserve.layers.moe.fused_moe_cpu import DROPPED_WQ_MAX_TOKENS
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.quantized import DequantScratch, ExpertsWq, mark_int8_activations
from radixserve.layers.vocab_parallel import VocabParallelEmbedding
from radixserve.layers.weight_only import parse_torchao_config, quantize_weight_only
from radixserve.model_loader.errors import ModelLoadError
from radixserve.utils.process import release_free_memory

logger = logging.getLogger(__name__)

Form = tuple[str, Linear, GroupQuantWeight]
ExpertForm = tuple[str, FusedMoE, ExpertsWq]
EmbeddingForm = tuple[str, VocabParallelEmbedding, GroupQuantWeight]


class WeightOnlyForms:
    def __init__(
        self,
        method: str,
        forms: list[Form],
        requantize: Callable[[torch.Tensor], GroupQuantWeight | None] | None,
        expert_forms: list[ExpertForm] | None = None,
        a8_panels: bool = False,
        embedding: EmbeddingForm | None = None,
    ) -> None:
        self.method = method
        # A GGUF file's quantized token embedding (untied models): served from the form alone.
        self.embedding = embedding
        self.a8_panels = a8_panels  # --cpu-wq-int8-activations: repack for the panel kernel too
        self.forms = [(name, layer, self._mark(form)) for name, layer, form in forms]
        # Marked, without panels: whether the experts serve on panels is the tuning's choice
        # (Crossovers.moe_a8), made after this (serve_experts).
        self.expert_forms = [
            (name, moe, mark_int8_activations(f, panels=False)) for name, moe, f in expert_forms or []
        ]
        self.requantize = requantize  # None: forms that cannot be remade (a file's tensors)
        self.expert_scratch = DequantScratch()  # one for every MoE layer (layers/moe/quantized.py)
        self._attached = False

    def _mark(self, form: GroupQuantWeight) -> GroupQuantWeight:
        """Every form whose groups allow it may take int8 activations; whether any product does is
        the installed crossovers' wq_a8_max_tokens (0 unless measured faster here or forced), or,
        with the panels (forced only: they cost a second copy of the weights), up to 16 rows."""
        if form.group_size % ACT_BLOCK:
            return form
        return with_int8_activations(form, panels=self.a8_panels)

    def attach(self) -> None:
        """Set each layer's weight_wq (module docstring for what happens to changed layers)."""
        kept: list[Form] = []
        dropped: list[str] = []
        for name, layer, form in self.forms:
            if not equals_dequantization(layer.weight, form):
                if not self._attached:
                    raise ModelLoadError(
                        f"{self.method}: the fp32 weight of {name} is not the dequantization of its "
                        "quantized form; the converted folder does not come from this file (delete it "
                        "to convert again)"
                    )
                if self.requantize is None or (form := self.requantize(layer.weight)) is None:
                    dropped.append(name)
                    continue
                form = self._mark(form)
                _replace_weight(layer, form)
            layer.weight_wq = form
            kept.append((name, layer, form))
        if dropped:
            logger.warning(
                "%s: %d linears changed since their quantized form was made and serve in fp32 now: %s",
                self.method,
                len(dropped),
                ", ".join(dropped[:4]),
            )
        self.forms = kept
        self._attach_experts()
        self._attach_embedding()
        if not self._attached:
            self._attached = True
            self._log()

    def _attach_experts(self) -> None:
        """Serve each MoE layer from its forms (dropping its fp32 experts) while the fp32 experts are
        the forms' dequantization; a layer still dropped was not written since, and keeps them."""
        kept: list[ExpertForm] = []
        for name, moe, form in self.expert_forms:
            if moe.fp32_dropped:
                # No fp32 experts: never loaded (the loader attached the file's forms to a layer
                # built without them, gguf_experts.py), or dropped and not written since. `form` is
                # the attached one, marked for int8 activations.
                moe.attach_quantized(form, self.expert_scratch)
                kept.append((name, moe, form))
                continue
            w13, w2 = form.dequantize()
            if torch.equal(moe.w13_weight, w13) and torch.equal(moe.w2_weight, w2):
                del w13, w2
                moe.attach_quantized(form, self.expert_scratch)
                kept.append((name, moe, form))
                continue
            if not self._attached:
                raise ModelLoadError(
                    f"{self.method}: the fp32 experts of {name} are not the dequantization of the file's "
                    "expert tensors; the converted folder does not come from this file (delete it to "
                    "convert again)"
                )
            moe.detach_quantized()
            logger.warning("%s: the experts of %s changed and serve in fp32 now", self.method, name)
        self.expert_forms = kept

    def _attach_embedding(self) -> None:
        """Drop the embedding's fp32 block while it is the form's dequantization (the lookups read
        the form: layers/vocab_parallel.py); a block written since serves in fp32 from then on."""
        if self.embedding is None:
            return
        name, embed, form = self.embedding
        if embed.fp32_dropped:  # not written since it was dropped
            embed.weight_wq = form
            return
        if not equals_dequantization(embed.weight, form):
            if not self._attached:
                raise ModelLoadError(
                    f"{self.method}: the fp32 weight of {name} is not the dequantization of the file's "
                    "token_embd; the converted folder does not come from this file (delete it to convert again)"
                )
            embed.weight_wq = self.embedding = None
            logger.warning("%s: %s changed and serves in fp32 now", self.method, name)
            return
        embed.drop_fp32(form)
        release_free_memory()

    def serve_experts(self, on_panels: bool) -> None:
        """With `on_panels` (the installed Crossovers.moe_a8), every MoE layer's experts get their
        stacked int8-activation panels and serve from them alone: each layer's forms are replaced
        one layer at a time (the forms' integers freed as the next layer packs, so the peak is one
        layer above the file's bytes). Without it, or where the panels cannot be stacked, the
        exact forms stay."""
        if not on_panels or not self.expert_forms or not MOE_A8_KERNEL:
            return
        served = 0
        for i, (name, moe, form) in enumerate(self.expert_forms):
            panels = mark_int8_activations(form, panels=True)
            if panels.w13_panels is None:  # per-form panels would be a second copy: keep exact
                continue
            if moe.experts_wq is form:
                moe.attach_quantized(panels, self.expert_scratch)
            self.expert_forms[i] = (name, moe, panels)
            served += 1
            del form, panels
        # The forms' integers were many small blocks glibc keeps in its arenas once freed: hand
        # them back, or RSS stays at both copies (measured: +1.35 GiB on the 4-layer Q4_0 file).
        release_free_memory()
        logger.info(
            "%s: %d of %d MoE layers' experts serve on int8 activations from their 8-row panels "
            "(one call a layer; %.0f MiB, the forms' own integers dropped)",
            self.method,
            served,
            len(self.expert_forms),
            sum(f.nbytes() for _, _, f in self.expert_forms) / 2**20,
        )

    def _log(self) -> None:
        marked = sum(f.int8_activations for _, _, f in self.forms)
        marked += sum(f.w13[0].int8_activations for _, _, f in self.expert_forms if f.w13)
        logger.info(
            "%s: %d of %d linears and MoE layers can take int8 activations (groups of multiples of 32 "
            "inputs), in batches of up to wq_a8_max_tokens tokens (logged with the crossovers; 0: none)",
            self.method,
            marked,
            len(self.forms) + len(self.expert_forms),
        )
        wq_bytes = sum(form.nbytes() for _, _, form in self.forms)
        fp32_bytes = sum(layer.weight.numel() * 4 for _, layer, _ in self.forms)
        if self.expert_forms:
            logger.info(
                "%s: %d MoE layers' experts weight-only quantized, without an fp32 copy (%.0f MiB instead "
                "of %.0f MiB of fp32; groups of up to %d tokens read the integers, larger ones dequantize "
                "one expert at a time)",
                self.method,
                len(self.expert_forms),
                sum(form.nbytes() for _, _, form in self.expert_forms) / 2**20,
                sum((m.w13_weight.numel() + m.w2_weight.numel()) * 4 for _, m, _ in self.expert_forms)
                / 2**20,
                DROPPED_WQ_MAX_TOKENS,
            )
        logger.info(
            "%s: %d linears weight-only quantized (%.0f MiB read per step instead of %.0f MiB of fp32) "
            "for batches of up to wq_max_tokens tokens, run by %s",
            self.method,
            len(self.forms),
            wq_bytes / 2**20,
            fp32_bytes / 2**20,
            "sgl-kernel's linear_wq"
            if WQ_KERNEL
            else "the torch reference (sgl-kernel's linear_wq not built)",
        )


# Rows compared at a time: the dequantization of a whole LM head (151936 x 2048) would be 1.2 GB
# of fp32 beside its weight, the peak of a GGUF load; a block is ~64 MB at hidden size 2048.
_COMPARE_ROWS = 8192


def equals_dequantization(weight: torch.Tensor, form: GroupQuantWeight) -> bool:
    """Whether `weight` is exactly `form`'s dequantization, compared a block of rows at a time."""
    if tuple(weight.shape) != (form.out_features, form.in_features):
        return False
    for start in range(0, form.out_features, _COMPARE_ROWS):
        rows = slice(start, min(start + _COMPARE_ROWS, form.out_features))
        if not torch.equal(weight[rows], take_rows(form, rows).dequantize()):
            return False
    return True


def _replace_weight(layer: Linear, form: GroupQuantWeight) -> None:
    with torch.no_grad():
        layer.weight.copy_(form.dequantize())


def _torchao_forms(config: str, model: torch.nn.Module, a8_panels: bool) -> WeightOnlyForms:
    bits, group_size = parse_torchao_config(config)
    forms: list[Form] = []
    skipped: list[str] = []
    # SGLang's filter: the linears whose name has "proj" (the decoder's; not the LM head).
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or "proj" not in name:
            continue
        form = quantize_weight_only(layer.weight, bits, group_size)
        if form is None:
            skipped.append(name)
            continue
        _replace_weight(layer, form)
        forms.append((name, layer, form))
    if skipped:
        logger.info(
            "--torchao-config %s: %d linears whose in_features the group size does not divide stay fp32 "
            "(as torchao leaves them), e.g. %s",
            config,
            len(skipped),
            skipped[0],
        )
    return WeightOnlyForms(
        f"--torchao-config {config}",
        forms,
        lambda weight: quantize_weight_only(weight, bits, group_size),
        a8_panels=a8_panels,
    )


def create_weight_only(runner: Any) -> WeightOnlyForms | None:  # noqa: ANN401 - ModelRunner
    """The runner's weight-only forms for --quantization gguf or --torchao-config, else None."""
    args = runner.server_args
    if args.quantization == "gguf":
        from radixserve.model_loader.gguf_source import gguf_source
        from radixserve.model_loader.gguf_weights import gguf_embedding_form, gguf_linear_forms

        source = gguf_source(runner.model_config.path)
        if source is None:
            raise ModelLoadError(
                f"--quantization gguf serves GGUF files: pass --model-path to a .gguf file (or the "
                f"built-in model); {runner.model_config.path} is not a GGUF conversion"
            )
        forms, expert_forms = gguf_linear_forms(source, runner.model, runner.lm_head)
        return WeightOnlyForms(
            "--quantization gguf",
            forms,
            None,
            expert_forms,
            a8_panels=args.cpu_wq_int8_activations,
            embedding=gguf_embedding_form(source, runner.model),
        )
    if args.torchao_config:
        return _torchao_forms(args.torchao_config, runner.model, args.cpu_wq_int8_activations)
    return None
