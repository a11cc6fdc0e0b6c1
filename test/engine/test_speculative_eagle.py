"""EAGLE / EAGLE3 heads (tiny random heads in the HF formats SGLang loads) drafting for the tiny
Llama over the real TpModelWorker: greedy output token-identical to plain decoding, chains and
trees, page_size 1 and 16, both CPU attention backends, with radix hits and aborts, every run ending
with the pool back to full. Random heads rarely agree with the target, so the draft-extend
bookkeeping is checked directly: after a run, the head's K/V in every cached slot must equal the
K/V computed from scratch from HF transformers' hidden states of the target over the whole
accepted sequence (test_head_kv_matches_a_from_scratch_forward)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from scheduler_harness import shared_prefix_workload
from spec_harness import abort_mid_speculation
from test_speculative import WORKLOAD, _cached_sequences_are_accepted, _plain

from radixserve.configs.model_config import ModelConfig
from radixserve.speculative.eagle_draft import EagleDraft, eagle3_capture_layers
from radixserve.testing.tiny_models import TINY_DRAFT_VOCAB, TINY_VOCAB, make_tiny_eagle_head

ALGORITHM = {"eagle": "EAGLE", "eagle3": "EAGLE3"}
AUX_IDS = [-1, 0, 1]  # the tiny target has 2 layers: its embeddings and both layers' outputs


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_model_dir):
    """Random heads, each biased towards the token the tiny target emits most often on WORKLOAD
    (265 with these seeds; about 4% of its tokens), so that some drafts are accepted and the
    draft extend over accepted rows and tree moves actually run. The bias leaves the K/V's
    dependence on the target's hidden states in place (the check compares them exactly)."""
    root = tmp_path_factory.mktemp("eagle_heads")
    target = load_file(f"{tiny_model_dir('llama')}/model.safetensors")
    out = {
        "eagle": make_tiny_eagle_head("eagle", root / "eagle", seed=1),
        "eagle3": make_tiny_eagle_head("eagle3", root / "eagle3", seed=2, aux_layer_ids=AUX_IDS),
    }
    for kind, path in out.items():
        _favour(path, kind, FAVOURED, target["lm_head.weight"])
    return {k: str(v) for k, v in out.items()}


FAVOURED = 265


def _favour(path, kind: str, token: int, target_lm_head: torch.Tensor) -> None:
    w = load_file(f"{path}/model.safetensors")
    if kind == "eagle":  # the shared LM head scores fc's bias direction highest: w_T
        w["fc.bias"] = 20.0 * target_lm_head[token]
    else:  # a constant push along `ones` in the stream, which lm_head row i scores highest
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "bias": True}))
        w["fc.bias"] = torch.full((w["fc.weight"].shape[0],), 50.0)
        hot = (w["d2t"] + torch.arange(len(w["d2t"]))).tolist()
        i = hot.index(token) if token in hot else 0
        w["d2t"][i] = token - i  # draft id i maps to the favoured token
        w["t2d"] = torch.zeros_like(w["t2d"])
        w["t2d"][w["d2t"] + torch.arange(len(w["d2t"]))] = True
        w["lm_head.weight"][i] = 1.0
    save_file(w, f"{path}/model.safetensors")


def _spec(kind: str, head: str, topk: int) -> dict:
    return {
        "speculative_algorithm": ALGORITHM[kind],
        "speculative_draft_model_path": head,
        "speculative_eagle_topk": topk,
        "speculative_num_steps": 3,
        "speculative_num_draft_tokens": 4 if topk == 1 else 1 + 2 * 3,
        "disable_speculative_batch_backoff": True,
    }


class _Eagle:
    """An EagleDraft installed on a shared worker for one test (the worker has none otherwise)."""

    def __init__(
        self, workers, kind: str, head: str, backend: str, page_size: int, topk: int, pool: int = 4096
    ) -> None:
        self.worker, args = workers.get("llama", backend, page_size, pool)
        self.spec = _spec(kind, head, topk)
        config = ModelConfig.from_path(head, dtype="float32", draft_head=True)
        self.draft = EagleDraft(
            self.worker.inner.model_runner, config, dataclasses.replace(args, **self.spec), ALGORITHM[kind]
        )

    def __enter__(self) -> EagleDraft:
        self.worker.draft = self.draft
        return self.draft

    def __exit__(self, *exc: object) -> None:
        self.worker.draft = None


def _run(run, workload=WORKLOAD) -> dict[str, list[int]]:
    for rid, prompt, n in workload:
        run.submit(rid, prompt, n)
    run.run_until_idle()
    return dict(run.outputs)


CASES = [
    ("eagle", "cpu", 1, 1),
    ("eagle", "cpu", 16, 2),
    ("eagle", "torch_native", 16, 1),
    ("eagle3", "cpu", 16, 1),
    ("eagle3", "cpu", 1, 2),
    ("eagle3", "torch_native", 1, 2),
]


@pytest.mark.parametrize(("kind", "backend", "page_size", "topk"), CASES)
def test_eagle_heads_are_exact(kind, backend, page_size, topk, heads, workers, make_run):
    reference = _plain(make_run, backend, page_size)
    with _Eagle(workers, kind, heads[kind], backend, page_size, topk) as draft:
        run = make_run(backend, page_size, **_spec(kind, heads[kind], topk))
        assert _run(run) == reference
        stats = run.scheduler.output.stats
        assert stats.spec_num_rounds > 0 and stats.spec_num_drafts > 0, vars(stats)
        assert stats.spec_num_accepted > 0, vars(stats)  # accepted rows' draft extend ran
        assert sum(1 for c in run.cached_tokens.values() if c > 0) >= 2  # radix hits
        _cached_sequences_are_accepted(run, [p + reference[rid] for rid, p, _ in WORKLOAD])
        _head_kv_matches(draft, run, heads[kind], kind)
        run.close()  # asserts no KV slot or row leaked: the pool is full again


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_abort_mid_speculation(kind, heads, workers, make_run):
    reference = _plain(make_run, "cpu", 16)
    with _Eagle(workers, kind, heads[kind], "cpu", 16, 2):
        run = make_run("cpu", 16, **_spec(kind, heads[kind], 2))
        abort_mid_speculation(run, reference, WORKLOAD, {rid for rid, _, _ in WORKLOAD[1::3]})
        run.close()


@pytest.mark.parametrize(("kind", "page_size", "topk"), [("eagle", 16, 2), ("eagle3", 1, 1)])
def test_eagle_retraction_and_chunked_prefill(kind, page_size, topk, heads, workers, make_run):
    """A pool just above one request's need (retractions) and 64-token prefill chunks (a chunk's
    first pair reads the previous chunk's last state from the pool): exact, and the head's K/V of
    every cached slot still matches the from-scratch computation."""
    workload = shared_prefix_workload(seed=1)
    largest = max(len(p) + n for _, p, n in workload)
    pool = -(-(largest + 8) // page_size) * page_size
    reference = _plain(make_run, "cpu", page_size, workload=workload, pool=pool, chunked_prefill_size=64)
    with _Eagle(workers, kind, heads[kind], "cpu", page_size, topk, pool=pool) as draft:
        run = make_run("cpu", page_size, pool=pool, chunked_prefill_size=64, **_spec(kind, heads[kind], topk))
        assert _run(run, workload) == reference
        stats = run.scheduler.output.stats
        assert stats.num_retracted_reqs > 0 and stats.spec_num_rounds > 0, vars(stats)
        _head_kv_matches(draft, run, heads[kind], kind)
        run.close()


# ------------------------------------------------------------------------------ draft-extend check
def _head_kv_matches(draft: EagleDraft, run, head: str, kind: str) -> None:
    """Every cached token path p: the head's K/V in the slot of position j (j >= 1) must be layer
    0's K/V of the pair (p[j], h_{j-1}), h from HF transformers over p, at RoPE position j - 1
    (computed here from the checkpoint's tensors, not through the engine's modules)."""
    from transformers import AutoModelForCausalLM

    target_path = run.args.model_path
    hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    w = load_file(f"{head}/model.safetensors")
    cfg = json.loads(open(f"{head}/config.json").read())
    cache = run.scheduler.mem.tree_cache
    k_buf, v_buf = draft.kv_pool.get_kv_buffer(0)
    checked = 0
    stack = [(cache.root, [], [])]
    while stack:
        node, tokens, slots = stack.pop()
        for child in node.children.values():
            t = tokens + list(child.key)
            s = slots + child.value.tolist()
            stack.append((child, t, s))
            if not child.children and len(t) > 1:  # a leaf: check its whole path once
                k, v = _reference_kv(hf, w, cfg, kind, t)
                got_k = k_buf[torch.tensor(s[1:])].reshape(len(t) - 1, -1)
                got_v = v_buf[torch.tensor(s[1:])].reshape(len(t) - 1, -1)
                torch.testing.assert_close(got_k, k, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got_v, v, rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked >= 2


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_kv(hf, w: dict, cfg: dict, kind: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    states = out.hidden_states  # embeddings, then each layer's output (the last one normed)
    embed = hf.model.embed_tokens.weight[torch.tensor(tokens[1:])]  # the pairs' tokens x_1 ..
    if kind == "eagle":
        h = states[-1][0, :-1]  # final normed states h_0 .. h_{n-2}
        x = torch.cat([embed, h], -1) @ w["fc.weight"].T + w["fc.bias"]  # layer 0: no input norm
        prefix = "layers.0."
    else:
        # eagle_aux_hidden_state_layer_ids [-1, 0, 1]: the embeddings, layer 0's output, layer 1's
        # output before the final norm (HF's last hidden state is normed: recompute it).
        assert len(hf.model.layers) == 2
        with torch.no_grad():
            pre_norm = _pre_norm_last(hf, tokens)
        aux = torch.cat([states[0][0], states[1][0], pre_norm], -1)[:-1]
        hid = aux @ w["fc.weight"].T + w["fc.bias"]
        eps = cfg["rms_norm_eps"]
        x = torch.cat(
            [
                _rms(embed, w["midlayer.input_layernorm.weight"], eps),
                _rms(hid, w["midlayer.hidden_norm.weight"], eps),
            ],
            -1,
        )
        prefix = "midlayer."
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // heads
    k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(-1, kv_heads, d)
    v = x @ w[prefix + "self_attn.v_proj.weight"].T
    positions = torch.arange(len(tokens) - 1)  # pair j sits at position j - 1
    cos, sin = hf.model.rotary_emb(v, positions.unsqueeze(0))
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
    half = d // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], -1)
    k = k * cos + rotated * sin
    return k.reshape(len(tokens) - 1, -1), v


def _pre_norm_last(hf, tokens: list[int]) -> torch.Tensor:
    """The tiny target's last layer output before the final norm."""
    captured = {}
    handle = hf.model.norm.register_forward_hook(lambda m, args, out: captured.setdefault("x", args[0]))
    try:
        hf(torch.tensor([tokens]))
    finally:
        handle.remove()
    return captured["x"][0]


# ------------------------------------------------------------------------------ loader
def test_loader_keys_sharing_and_d2t(heads, workers):
    worker, args = workers.get("llama", "cpu", 1)
    runner = worker.inner.model_runner
    # EAGLE: the checkpoint's fc / layers load; its embed_tokens is ignored, the target's embedding
    # and LM head are used (as SGLang does).
    spec = _spec("eagle", heads["eagle"], 1)
    eagle = EagleDraft(
        runner,
        ModelConfig.from_path(heads["eagle"], dtype="float32", draft_head=True),
        dataclasses.replace(args, **spec),
        "EAGLE",
    )
    w = load_file(f"{heads['eagle']}/model.safetensors")
    m = eagle.model
    torch.testing.assert_close(m.fc.weight, w["fc.weight"])
    torch.testing.assert_close(m.fc.bias, w["fc.bias"])
    q, k, _ = m.layers[0].self_attn.qkv_proj.weight.split([64, 32, 32])
    torch.testing.assert_close(q, w["layers.0.self_attn.q_proj.weight"])
    torch.testing.assert_close(k, w["layers.0.self_attn.k_proj.weight"])
    assert isinstance(m.layers[0].input_layernorm, torch.nn.Identity)
    assert m.embed_tokens is runner.model.model.embed_tokens and m.lm_head is runner.lm_head
    assert eagle.aux_layers == () and eagle.kv_pool is not runner.token_to_kv_pool

    # EAGLE3: own LM head over the draft vocabulary, target embedding, d2t -> target ids.
    spec = _spec("eagle3", heads["eagle3"], 1)
    e3 = EagleDraft(
        runner,
        ModelConfig.from_path(heads["eagle3"], dtype="float32", draft_head=True),
        dataclasses.replace(args, **spec),
        "EAGLE3",
    )
    w3 = load_file(f"{heads['eagle3']}/model.safetensors")
    m3 = e3.model
    assert e3.aux_layers == (0, 1, 2)
    assert m3.embed_tokens is runner.model.model.embed_tokens and m3.lm_head is not runner.lm_head
    torch.testing.assert_close(m3.lm_head.weight, w3["lm_head.weight"])
    torch.testing.assert_close(m3.midlayer.hidden_norm.weight, w3["midlayer.hidden_norm.weight"])
    assert m3.midlayer.self_attn.qkv_proj.weight.shape == (128, 128)  # q/k/v over 2h inputs
    hot = w3["d2t"] + torch.arange(TINY_DRAFT_VOCAB)
    assert torch.equal(m3.hot_token_ids, hot)
    assert set(torch.nonzero(w3["t2d"])[:, 0].tolist()) == set(hot.tolist()) and FAVOURED in hot
    # Logits over the target vocabulary: draft id i lands on target id hot[i], others are -inf.
    states = torch.randn(3, 64)
    full = e3._logits(states)
    assert full.shape == (3, TINY_VOCAB)
    torch.testing.assert_close(full[:, hot], m3.lm_head(states).float())
    others = torch.ones(TINY_VOCAB, dtype=torch.bool)
    others[hot] = False
    assert torch.isinf(full[:, others]).all()

    # SGLang's default aux layers (the residual stream entering layers 2, L/2, L-3) and the override.
    assert eagle3_capture_layers(type("C", (), {})(), 30) == (2, 15, 27)
    cfg = type("C", (), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}})()
    assert eagle3_capture_layers(cfg, 30) == (2, 15, 27)
    with pytest.raises(ValueError, match="three distinct"):
        eagle3_capture_layers(type("C", (), {})(), 2)  # SGLang's default does not fit 2 layers
    # The wrong head for the algorithm is refused.
    with pytest.raises(ValueError, match="needs a LlamaForCausalLMEagle3 head"):
        EagleDraft(
            runner, ModelConfig.from_path(heads["eagle"], dtype="float32", draft_head=True), args, "EAGLE3"
        )


def test_worker_builds_the_head_from_server_args(heads, tiny_model_dir):
    """--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR: the worker loads the
    head (the draft-head architecture is accepted there only) and the target captures its layers."""
    from radixserve.model_executor.worker_stack import build_model_worker
    from radixserve.model_loader.errors import ModelLoadError
    from radixserve.server_args import ServerArgs

    target = str(tiny_model_dir("llama"))
    args = ServerArgs(
        model_path=target,
        device="cpu",
        max_total_tokens=512,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=heads["eagle3"],
    ).resolve()
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (
        3,
        1,
        4,
    )
    worker = build_model_worker(args, ModelConfig.from_path(target, dtype="float32"))
    assert isinstance(worker.draft, EagleDraft) and worker.draft.aux_layers == (0, 1, 2)
    assert worker.draft.hidden_pool.shape == (512 + 1, 64)  # a row per KV slot, padding page included
    with pytest.raises(ModelLoadError, match="Unsupported model architecture"):
        ModelConfig.from_path(heads["eagle3"])  # a head is no target model
