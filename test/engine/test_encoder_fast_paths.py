"""The encoder's (BERT, XLM-R) speed-ups keep HF's results: the last layer computed past attention
for the pooled rows only, through either attention backend, ragged and uniform batches."""

import pytest
from test_embedding_parity import assert_close, hf_outputs, tokenize

from radixserve.testing.inprocess import InProcessScheduler

UNIFORM = [[(11 * i + 7 * j) % 300 + 3 for j in range(24)] for i in range(3)]


def rows_into_last_ffn(sched: InProcessScheduler) -> list[int]:
    """Records the row count of the last layer's FFN (its second linear's input) at each forward."""
    model = sched.worker.model_runner.model
    seen: list[int] = []
    model.encoder.layer[-1].output.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
@pytest.mark.parametrize("kind", ["bert", "bert_cls", "xlmr", "xlmr_cls"])
def test_last_layer_runs_the_pooled_rows_only(tiny_embedding_dir, kind, backend):
    """CLS pooling (bert, both classifiers) reads one row per request: the last layer's FFN runs
    on one row per request, and the outputs still equal HF's. Mean pooling (xlmr) reads every row."""
    from radixserve.layers.attention import cpu_backend

    if backend == "cpu" and not cpu_backend.cpu_kernels_available():
        pytest.skip("sgl-kernel's CPU extension is not built")
    path = tiny_embedding_dir(kind)
    batches = [UNIFORM, tokenize(path)]  # equal lengths, then ragged
    sched = InProcessScheduler(path, max_total_tokens=4096, attention_backend=backend, page_size=16)
    try:
        seen = rows_into_last_ffn(sched)
        for b, inputs in enumerate(batches):
            refs = hf_outputs(kind, path, inputs)
            seen.clear()
            for i, ids in enumerate(inputs):
                sched.submit_embedding(f"{b}.{i}", ids)
            res = sched.run_until_idle()
            for i, ref in enumerate(refs):
                assert_close(res[f"{b}.{i}"].embedding, ref)
            expected = sum(map(len, inputs)) if kind == "xlmr" else len(inputs)
            assert sum(seen) == expected
    finally:
        sched.close()
