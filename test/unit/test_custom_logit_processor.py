"""custom_logit_processor: SGLang's to_str() form is read with pickletools and never executed; only
built-in processors (under SGLang's module name too) and the operator's modules load; the rows of a
batch follow filter/merge, and a failing processor fails only its rows."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from radixserve.sampling.custom_logit_processor import (
    SGLANG_MODULE,
    DisallowedTokensLogitsProcessor,
    Qwen3ThinkingBudgetLogitProcessor,
    load_processor,
    pickled_reference,
)
from radixserve.sampling.custom_rows import CustomRows
from radixserve.testing.logit_processors import FailingLogitProcessor, OnlyTokensLogitProcessor

OPERATOR_MODULES = ("radixserve.testing.logit_processors",)


def spec(data: bytes) -> str:
    return json.dumps({"callable": data.hex()})


@pytest.mark.parametrize("protocol", range(6))
def test_a_class_reference_is_read_at_every_protocol(protocol: int) -> None:
    data = pickle.dumps(DisallowedTokensLogitsProcessor, protocol=protocol)
    assert pickled_reference(data) == (
        DisallowedTokensLogitsProcessor.__module__,
        "DisallowedTokensLogitsProcessor",
    )


def test_sglangs_module_name_maps_onto_the_built_in_processors() -> None:
    """What SGLang's client sends for its built-ins (dill pickles an importable class by name)."""
    for name in ("DisallowedTokensLogitsProcessor", "Qwen3ThinkingBudgetLogitProcessor"):
        data = f"c{SGLANG_MODULE}\n{name}\n.".encode()
        assert type(load_processor(spec(data), ())).__name__ == name
    assert isinstance(
        load_processor(DisallowedTokensLogitsProcessor.to_str(), ()), DisallowedTokensLogitsProcessor
    )


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_unexecuted(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    refused = [
        pickle.dumps(Payload(marker)),  # a call: refused at its first opcode past the reference
        pickle.dumps(os.system),  # a reference, but not to an allowed class
        b"cos\nsystem\n.",
        b"not a pickle",
    ]
    for data in refused:
        with pytest.raises(ValueError):
            load_processor(spec(data), OPERATOR_MODULES)
    for bad in ("{}", "[1]", '{"callable": "zz"}'):
        with pytest.raises(ValueError):
            load_processor(bad, OPERATOR_MODULES)
    assert not marker.exists()


def test_only_listed_modules_and_processor_classes_load() -> None:
    mine = OnlyTokensLogitProcessor.to_str()
    with pytest.raises(ValueError, match="not allowed"):
        load_processor(mine, ())
    assert isinstance(load_processor(mine, OPERATOR_MODULES), OnlyTokensLogitProcessor)
    not_a_processor = spec(pickle.dumps(SimpleNamespace))
    with pytest.raises(ValueError, match="not allowed"):
        load_processor(not_a_processor, OPERATOR_MODULES)
    base = spec(f"c{SGLANG_MODULE}\nThinkingBudgetLogitProcessor\n.".encode())  # no token ids
    with pytest.raises(ValueError):
        load_processor(base, ())


def req(processor: object, params: dict | None, output: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        custom_logit_processor=processor,
        sampling_params=SimpleNamespace(custom_params=params),
        origin_input_ids=[1, 2],
        output_ids=output or [],
    )


def test_rows_follow_the_batch_and_a_failing_processor_fails_its_rows_only() -> None:
    ban, only, fail = DisallowedTokensLogitsProcessor(), OnlyTokensLogitProcessor(), FailingLogitProcessor()
    rows = CustomRows.from_reqs(
        [req(ban, {"token_ids": [0]}), req(None, None), req(only, {"token_ids": [3]})]
    )
    assert rows is not None and CustomRows.from_reqs([req(None, None)]) is None
    merged = CustomRows.merge(rows, CustomRows.from_reqs([req(fail, {})]), 3, 1)
    logits = torch.zeros(4, 5)
    merged.apply(logits)
    assert logits[0, 0] == -float("inf") and torch.isfinite(logits[0, 1:]).all()
    assert torch.equal(logits[1], torch.zeros(5))  # no processor: untouched
    assert torch.isfinite(logits[2]).tolist() == [False, False, False, True, False]
    assert torch.isnan(logits[3]).all()  # the sampler then fails that request alone
    kept = merged.filter([1, 2])
    assert kept is not None and kept.processors == [None, only]
    assert merged.filter([1]) is None


def test_thinking_budget_forces_a_new_line_then_the_end_of_thinking() -> None:
    proc = Qwen3ThinkingBudgetLogitProcessor()
    start, end, newline = proc.THINKING_START_TOKEN_ID, proc.THINKING_END_TOKEN_ID, proc.NEW_LINE_TOKEN_ID
    thinking = SimpleNamespace(origin_input_ids=[start], output_ids=[5, 6, 7])
    logits = torch.zeros(1, end + 1)
    proc(logits, [{"thinking_budget": 2, "__req__": thinking}])
    assert int(logits.argmax()) == newline
    thinking.output_ids.append(newline)
    logits = torch.zeros(1, end + 1)
    proc(logits, [{"thinking_budget": 2, "__req__": thinking}])
    assert int(logits.argmax()) == end
    logits = torch.zeros(1, end + 1)
    proc(logits, [{"thinking_budget": 100, "__req__": thinking}])
    assert torch.equal(logits, torch.zeros(1, end + 1))  # within its budget: untouched
