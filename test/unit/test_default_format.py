"""The built-in model's default format (configs/default_format.py): its own GGUF tensors
(--quantization gguf) on CPU when no format flag is given; fp32 where sgl-kernel lacks linear_wq
or a flag given asks for what gguf does not combine with; every other model untouched."""

from __future__ import annotations

import logging

import pytest

from radixserve.layers import group_quant
from radixserve.model_loader import gguf_source
from radixserve.server_args import ServerArgs, prepare_server_args

LOGGER = "radixserve.configs.default_format"


@pytest.fixture
def with_wq_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision as on a build with linear_wq, whatever this checkout's build has."""
    monkeypatch.setattr(group_quant, "WQ_KERNEL", True)


def _resolve(**kwargs: object) -> ServerArgs:
    return ServerArgs(**{"device": "cpu", **kwargs}).resolve()


@pytest.mark.parametrize("model_path", [None, "default", "SmolLM2-135M-Instruct", ""])
def test_builtin_model_defaults_to_its_gguf_tensors(with_wq_kernel, model_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        args = _resolve(model_path=model_path)
    assert args.quantization == "gguf"
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "serving its own GGUF tensors" in lines[0] and "unquant" in lines[0]
    # The CLI without flags resolves alike; the resolved value is what get_server_info reports.
    assert prepare_server_args(["--device", "cpu"]).resolve().quantization == "gguf"


def test_unquant_serves_fp32(with_wq_kernel) -> None:
    assert _resolve(quantization="unquant").quantization is None
    assert (
        prepare_server_args(["--device", "cpu", "--quantization", "unquant"]).resolve().quantization is None
    )


def test_other_models_are_untouched(with_wq_kernel, tiny_llama_path, tmp_path, monkeypatch) -> None:
    assert _resolve(model_path=tiny_llama_path).quantization is None
    # The built-in model's converted folder named as a path is a --model-path like any other.
    assert _resolve(model_path=str(tmp_path)).quantization is None
    # A .gguf path selects gguf by SGLang's rule (load format gguf), not by this default.
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    # resolve() also converts the file into the folder it loads: not this stand-in's business.
    monkeypatch.setattr(gguf_source, "ensure_gguf_converted", lambda p: f"{p}.converted")
    args = _resolve(model_path=str(path))
    assert (args.quantization, args.load_format) == ("gguf", "gguf")


def test_explicit_format_flags_win(with_wq_kernel) -> None:
    assert _resolve(quantization="w8a8_int8").quantization == "w8a8_int8"
    args = _resolve(torchao_config="int8wo")
    assert (args.quantization, args.torchao_config) == (None, "int8wo")


def test_without_linear_wq_the_builtin_model_serves_fp32(monkeypatch, caplog) -> None:
    monkeypatch.setattr(group_quant, "WQ_KERNEL", False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert _resolve().quantization is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "serving fp32" in lines[0] and "no linear_wq" in lines[0]
    # Asked for by name, gguf still serves (on the torch reference).
    assert _resolve(quantization="gguf").quantization == "gguf"


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"cpu_fp16_weights": True}, "--cpu-fp16-weights"),
        ({"cpu_bf16_gemm": True}, "--cpu-bf16-gemm"),
        ({"dtype": "bfloat16"}, "--dtype bfloat16"),
        ({"is_embedding": True}, "--is-embedding"),
        ({"load_format": "dummy"}, "--load-format dummy"),
    ],
)
def test_flags_gguf_does_not_combine_with_fall_back_to_fp32(with_wq_kernel, kwargs, reason, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        args = _resolve(**kwargs)  # the flag is honoured, not refused
    assert args.quantization is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "serving fp32" in lines[0] and reason in lines[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 8},  # shares the layers
        {"speculative_algorithm": "NGRAM"},
        {"tp_size": 2},
        {"pp_size": 2},
        {"dp_size": 2},
        {"disable_cpu_weight_prepack": True},
        {"disable_cpu_fused_decode": True},
        {"attention_backend": "torch_native"},
        {"dtype": "float32"},
        {"load_format": "safetensors"},
    ],
)
def test_flags_that_combine_with_gguf_keep_it(with_wq_kernel, kwargs) -> None:
    assert _resolve(**kwargs).quantization == "gguf"


def test_no_default_off_cpu(with_wq_kernel) -> None:
    from radixserve.configs.default_format import default_quantization

    assert default_quantization(ServerArgs(), "cuda") is None
    assert default_quantization(ServerArgs(), "cpu") == "gguf"


def test_every_tp_size_of_the_builtin_model_holds_whole_groups(builtin_model_path) -> None:
    """gguf refuses a --tp-size whose row-parallel shard splits a 32-input group; for the built-in
    model no TP size the layout accepts does, so TP needs no fp32 fallback (checked here, so a
    change of the layout rules that breaks this shows up)."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.distributed.layout import LayoutError, ParallelLayout

    cfg = ModelConfig.from_path(builtin_model_path)
    inter = cfg.hf_config.intermediate_size
    accepted = []
    for tp in range(1, 17):
        layout = ParallelLayout(tp, 1, 1, 0, 1)
        try:
            layout.check_model(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, inter)
        except LayoutError:
            continue
        accepted.append(tp)
        for rank in range(tp):
            heads = layout.attention_heads(cfg.num_heads, cfg.num_kv_heads, rank)
            o_proj_inputs = (heads.q_start * cfg.head_dim, heads.q_count * cfg.head_dim)
            down_inputs = (rank * inter // tp, inter // tp)
            assert all(v % 32 == 0 for v in (*o_proj_inputs, *down_inputs)), (tp, rank)
    assert accepted == [1, 2, 3]
