"""ParallelLayout: rank numbering (SGLang's), nodes, layer split, KV-head split, core shares, and the
layouts refused at start with a message naming the flag to change."""

import pytest

from radixserve.distributed.layout import LayoutError, ParallelLayout


def test_rank_numbering_is_stage_major():
    layout = ParallelLayout(tp_size=2, pp_size=3)
    assert layout.world_size == 6
    assert [(i.tp_rank, i.pp_rank) for i in map(layout.rank_info, range(6))] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
        (0, 2),
        (1, 2),
    ]
    assert layout.tp_group_ranks(1) == [2, 3]
    assert layout.pp_group_ranks(1) == [1, 3, 5]
    assert layout.rank_of(2, 1) == 5


def test_nodes_take_consecutive_ranks_and_rank_0_is_on_node_0():
    node1 = ParallelLayout(tp_size=2, pp_size=2, nnodes=2, node_rank=1)
    assert node1.local_ranks() == (2, 3)  # the second pipeline stage
    assert ParallelLayout(tp_size=2, pp_size=2, nnodes=2).local_ranks() == (0, 1)
    info = node1.rank_info(3)
    assert (info.node_rank, info.local_rank) == (1, 1)


@pytest.mark.parametrize(
    "layers, pp, expected",
    [
        (30, 2, [(0, 15), (15, 30)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        (2, 2, [(0, 1), (1, 2)]),
        (5, 1, [(0, 5)]),
    ],
)
def test_stage_layers_cover_every_layer_once(layers, pp, expected):
    layout = ParallelLayout(pp_size=pp)
    assert [layout.stage_layers(layers, p) for p in range(pp)] == expected


def _heads(tp, heads, kv):
    layout = ParallelLayout(tp_size=tp)
    return [tuple(vars(layout.attention_heads(heads, kv, r)).values()) for r in range(tp)]


def test_attention_heads_split_by_kv_group():
    # (q_start, q_count, kv_start, kv_count) per rank
    assert _heads(2, 4, 2) == [(0, 2, 0, 1), (2, 2, 1, 1)]
    assert _heads(2, 9, 3) == [(0, 6, 0, 2), (6, 3, 2, 1)]  # SmolLM2-135M: uneven, whole groups
    assert _heads(4, 8, 2) == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]  # replicated
    assert _heads(2, 4, 1) == [(0, 2, 0, 1), (2, 2, 0, 1)]
    assert _heads(1, 9, 3) == [(0, 9, 0, 3)]


@pytest.mark.parametrize(
    "layout, message",
    [
        (ParallelLayout(tp_size=3, nnodes=2), "--nnodes"),
        (ParallelLayout(nnodes=2, node_rank=2), "--node-rank"),
        (ParallelLayout(tp_size=0), "--tp-size"),
        (ParallelLayout(tp_size=2, ep_size=4), "--ep-size 4 must divide --tp-size 2"),
        (ParallelLayout(tp_size=4, ep_size=3), "--ep-size 3 must divide"),
    ],
)
def test_impossible_layouts_are_refused(layout, message):
    with pytest.raises(LayoutError, match=message):
        layout.check()


@pytest.mark.parametrize(
    "tp, pp, heads, kv, inter, layers, message",
    [
        (4, 1, 9, 3, 128, 2, "KV heads"),  # 4 ranks cannot share 3 KV heads evenly
        (4, 1, 6, 2, 128, 2, "KV heads"),  # 6 heads over 4 ranks
        (1, 1, 9, 2, 128, 2, "KV groups"),
        (2, 1, 4, 2, 129, 2, "MLP width"),
        (1, 3, 4, 2, 128, 2, "layers"),
    ],
)
def test_layouts_the_model_cannot_take_are_refused(tp, pp, heads, kv, inter, layers, message):
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(tp_size=tp, pp_size=pp).check_model(layers, heads, kv, inter)


def test_model_layouts_that_fit_pass():
    ParallelLayout(tp_size=4, pp_size=2).check_model(30, 12, 2, 1536)  # kv replicated in pairs
    ParallelLayout(tp_size=2).check_model(2, 4, 1, 128)  # one KV head, replicated
    ParallelLayout(tp_size=2).check_model(30, 9, 3, 1536)  # the built-in model: 2 + 1 KV heads


def test_cores_are_split_between_the_ranks_of_a_node(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    layout = ParallelLayout(tp_size=2)
    assert layout.cpu_cores(0, None) == (2, [0, 1])
    assert layout.cpu_cores(1, None) == (2, [2, 3])
    assert layout.cpu_cores(1, 2) == (1, [1])  # --cpu-threads caps the total
    four = ParallelLayout(tp_size=2, pp_size=4)  # more ranks than cores: 1 thread each, unpinned
    assert four.cpu_cores(5, None) == (1, [])


def test_data_parallel_replicas_take_consecutive_blocks_of_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    single = ParallelLayout(dp_size=2)  # dp=2 of one rank: two cores each
    assert [single.cpu_cores(0, None, d) for d in (0, 1)] == [(2, [0, 1]), (2, [2, 3])]
    tp2 = ParallelLayout(tp_size=2, dp_size=2)  # dp=2 x tp=2: one core per rank
    assert [tp2.cpu_cores(r, None, d) for d in (0, 1) for r in (0, 1)] == [(1, [c]) for c in range(4)]
    assert ParallelLayout(tp_size=2, dp_size=4).cpu_cores(1, None, 3) == (1, [])  # 8 ranks, 4 cores
