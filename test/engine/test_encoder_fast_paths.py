"""The encoder's (BERT, XLM-R) speed-ups keep HF's results: the last layer computed for the pooled
rows only, through either attention backend, ragged and uniform batches."""

import pytest
import torch
from test_embedding_parity import assert_close, hf_outputs, tokenize

from radixserve.testing.inprocess import InProcessScheduler

UNIFORM = [[(11 * i + 7 * j) % 300 + 3 for j in range(24)] for i in range(3)]


def rows_into(module: torch.nn.Module) -> list[int]:
    """Records the row count of `module`'s input at each forward."""
    seen: list[int] = []
    module.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
@pytest.mark.parametrize("kind", ["bert", "bert_cls", "xlmr", "xlmr_cls"])
def test_last_layer_runs_the_pooled_rows_only(tiny_embedding_dir, kind, backend):
    """CLS pooling (bert, both classifiers) reads one row per request: the last layer's FFN runs
    on one row per request, and so does its query projection where the backend attends the
    step's own K/V (cpu); the outputs still equal HF's. Mean pooling (xlmr) reads every row."""
    from radixserve.layers.attention import cpu_backend

    if backend == "cpu" and not cpu_backend.cpu_kernels_available():
        pytest.skip("sgl-kernel's CPU extension is not built")
    path = tiny_embedding_dir(kind)
    batches = [UNIFORM, tokenize(path)]  # equal lengths, then ragged
    sched = InProcessScheduler(path, max_total_tokens=4096, attention_backend=backend, page_size=16)
    try:
        last = sched.worker.model_runner.model.encoder.layer[-1]
        ffn, queries = rows_into(last.output), rows_into(last.attention.self.query)
        for b, inputs in enumerate(batches):
            refs = hf_outputs(kind, path, inputs)
            ffn.clear(), queries.clear()
            for i, ids in enumerate(inputs):
                sched.submit_embedding(f"{b}.{i}", ids)
            res = sched.run_until_idle()
            for i, ref in enumerate(refs):
                assert_close(res[f"{b}.{i}"].embedding, ref)
            tokens = sum(map(len, inputs))
            assert sum(ffn) == (tokens if kind == "xlmr" else len(inputs))
            assert sum(queries) == (len(inputs) if kind != "xlmr" and backend == "cpu" else tokens)
    finally:
        sched.close()


@pytest.mark.parametrize("lens", [[5, 5, 5], [3, 9, 1, 6]])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_pooled_row_attention_is_that_row_of_the_full_attention(lens, kv_heads):
    from radixserve.layers.attention.encoder import bidirectional_attention, pooled_row_attention
    from radixserve.layers.attention.radix_attention import RadixAttention

    torch.manual_seed(0)
    layer = RadixAttention(4, 8, 8**-0.5, kv_heads, 0)
    tokens = sum(lens)
    q, k, v = torch.randn(tokens, 4, 8), torch.randn(tokens, kv_heads, 8), torch.randn(tokens, kv_heads, 8)
    full = bidirectional_attention(q, k, v, lens, layer)
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    for rows in (starts, starts + torch.tensor(lens) - 1):  # CLS rows, last rows
        got = pooled_row_attention(q[rows], k, v, lens, layer)
        torch.testing.assert_close(got, full[rows], atol=1e-6, rtol=1e-5)
