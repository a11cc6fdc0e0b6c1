"""EAGLE / EAGLE3: a draft head (models/llama_eagle.py) that reads the target's hidden states. Runs
in the model worker, beside the target, with its own KV pool over the target's slots (DraftRuntime,
as a STANDALONE draft model).

The head's input at target position j is the pair (token x_j, the target's hidden state h_{j-1});
its output predicts x_{j+1}. SGLang runs that pair at position j - 1 (its draft extends shift the
tokens left by one); so do we (RoPE position j - 1), but the pair's K/V lives in **the slot of
position j**, so that a slot's draft K/V depends only on the tokens up to its own position, as its
target K/V does: a radix-cache hit on a prefix then finds the draft's K/V of that prefix too, and
nothing ever depends on a token after a cached prefix. The draft therefore reads the target's
req_to_token table one column to the right (draft position i = the slot of target position i + 1);
target position 0 has no pair.

The target's hidden states (EAGLE: the final normed states; EAGLE3: the residual stream entering
three layers, projected by the head's fc) are kept per slot in `hidden_pool` [slots, hidden]:
- after every forward the target runs, its rows' hidden states are stored (a verify step stores the
  accepted path's only, at the positions they are accepted for), and the draft extends over the
  new positions with the target's hidden states (SGLang's DRAFT_EXTEND), which writes the draft's
  K/V of every token the target keeps;
- a verify step drafts from the request's last token x_c with h_{c-1} from the pool; each further
  draft step feeds the draft's own output state back (SGLang's draft decode). Chains (topk 1) and
  trees (topk > 1, draft_tree.py's construction) are both supported.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from radixserve.speculative.draft_model import DraftRuntime
from radixserve.speculative.draft_tree import fill_tree_drafts
from radixserve.speculative.layer_skip_draft import fill_chain_drafts

if TYPE_CHECKING:
    from radixserve.mem_cache.memory_pool import ReqToTokenPool
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

EAGLE_ARCHITECTURES = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}


class ShiftedTable:
    """The target's req_to_token seen one column to the right (a view: same storage)."""

    def __init__(self, pool: ReqToTokenPool) -> None:
        self.req_to_token = pool.req_to_token[:, 1:]
        self.max_context_len = pool.max_context_len - 1


def eagle3_capture_layers(draft_hf_config: object, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input EAGLE3 reads (SGLang's convention: the residual stream
    entering layer i, i.e. layer i - 1's output). `eagle_aux_hidden_state_layer_ids` in the
    head's config (top level or under eagle_config) names the layers whose *output* is read;
    the default is SGLang's: entering layers 2, L // 2 and L - 3."""
    eagle_config = getattr(draft_hf_config, "eagle_config", None) or {}
    ids = getattr(draft_hf_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    L = num_target_layers
    layers = (2, L // 2, L - 3) if ids is None else tuple(int(i) + 1 for i in ids)
    if len(layers) != 3 or len(set(layers)) != 3 or not all(0 <= i <= L for i in layers):
        raise ValueError(
            f"EAGLE3 reads three distinct target layers; got layer inputs {layers} for a target with "
            f"{L} layers (set eagle_aux_hidden_state_layer_ids in the head's config.json)"
        )
    return tuple(sorted(layers))


class EagleDraft:
    def __init__(
        self, target: ModelRunner, config: ModelConfig, server_args: ServerArgs, algorithm: str
    ) -> None:
        expected = EAGLE_ARCHITECTURES[algorithm]
        if config.architecture != expected:
            raise ValueError(
                f"--speculative-algorithm {algorithm} needs a {expected} head in "
                f"--speculative-draft-model-path; {config.path} is {config.architecture}"
            )
        tc = target.model_config
        if config.vocab_size != tc.vocab_size:
            raise ValueError(
                f"The EAGLE head's vocabulary ({config.vocab_size}) differs from the target's ({tc.vocab_size})"
            )
        self.aux_layers: tuple[int, ...] = ()
        if algorithm == "EAGLE3":
            self.aux_layers = eagle3_capture_layers(config.hf_config, tc.num_layers)
            target_h = getattr(config.hf_config, "target_hidden_size", None) or config.hidden_size
        else:
            target_h = config.hidden_size
        if target_h != tc.hidden_size:
            raise ValueError(
                f"The {algorithm} head expects target hidden states of width {target_h}; the target's "
                f"are {tc.hidden_size}"
            )
        self.runtime = DraftRuntime(
            target, config, server_args, lambda m: [m.lm_head] if m.lm_head is not None else []
        )
        self.model = self.runtime.model
        assert target.lm_head is not None and target.model.model.embed_tokens is not None
        self.model.attach_target(target.model.model.embed_tokens, target.lm_head)
        self.kv_pool = self.runtime.kv_pool
        self.target_table = target.req_to_token_pool
        self.table = ShiftedTable(target.req_to_token_pool)
        self.vocab_size = tc.vocab_size
        # Indexed by KV slot, like the KV pools (whose page 0 is padding: size + page_size rows).
        self.hidden_pool = torch.zeros(
            target.max_total_num_tokens + target.page_size,
            config.hidden_size,
            dtype=config.dtype,
            device=target.device,
        )
        self.topk = server_args.speculative_eagle_topk or 1
        self.num_steps = server_args.speculative_num_steps or 0
        self._carry: dict = {}  # draft output states fed to the next draft step (see fill_drafts)
        logger.info(
            "%s head: draft vocabulary %d, target layers read %s, hidden-state pool %.2f GiB",
            algorithm,
            self.model.draft_vocab_size,
            self.aux_layers or "final (normed)",
            self.hidden_pool.numel() * self.hidden_pool.element_size() / 2**30,
        )

    @classmethod
    def from_server_args(cls, target: ModelRunner, server_args: ServerArgs) -> EagleDraft:
        assert server_args.speculative_draft_model_path and server_args.speculative_algorithm
        config = ModelConfig.from_path(
            server_args.speculative_draft_model_path,
            server_args.context_length,
            server_args.dtype,
            server_args.device or "cpu",
            draft_head=True,
        )
        return cls(target, config, server_args, server_args.speculative_algorithm)

    # ------------------------------------------------------------------ the worker's calls
    def shadow(self, batch: ModelWorkerBatch) -> None:
        """Nothing before the target's forward: the head's K/V needs the target's hidden states
        (after_target writes it)."""

    @torch.inference_mode()
    def fill_drafts(self, batch: ModelWorkerBatch) -> None:
        # after_target rewrites the K/V of every accepted row from the target's states, so the
        # drafting passes need not write the last draft's.
        self._carry = {}
        if self.topk > 1:
            fill_tree_drafts(batch, self._row_logits, self.topk, self.num_steps, write_every_row=False)
        else:
            fill_chain_drafts(batch, self._next_tokens, write_every_row=False)
        self._carry = {}

    @torch.inference_mode()
    def after_target(
        self, batch: ModelWorkerBatch, hidden: torch.Tensor, paths: list[list[int]] | None
    ) -> None:
        """Store the target's hidden states of the rows it keeps and run the head over those
        positions (the draft extend). `paths`: a verify step's accepted rows per request (root
        excluded); None when every row is kept (prefill, decode)."""
        if hidden.shape[0] == 0:  # an idle batch
            return
        h = self.model.project(hidden)  # [num_tokens, hidden]
        bs = batch.batch_size
        if batch.extend_seq_lens is not None and batch.extend_prefix_lens is not None:
            lens, prefix = list(batch.extend_seq_lens), list(batch.extend_prefix_lens)
        else:  # a decode batch: one token at position seq_len - 1
            lens, prefix = [1] * bs, (batch.seq_lens - 1).tolist()
        ids, locs = batch.input_ids, batch.out_cache_loc
        if paths is not None:
            # The root and the accepted rows, at the positions they are accepted for (their
            # target K/V was moved to those rows' slots: tree_kv.py).
            src, dst = [], []
            start = 0
            for n, path in zip(lens, paths):
                rows = [0, *path]
                src.extend(start + r for r in rows)
                dst.extend(start + i for i in range(len(rows)))
                start += n
            lens = [1 + len(p) for p in paths]
            ids, locs, h = ids[src], locs[dst], h[src]
        self.hidden_pool[locs.to(self.hidden_pool.device)] = h.to(self.hidden_pool.dtype)
        self._draft_extend(batch.req_pool_indices, prefix, lens, ids, locs)

    # ------------------------------------------------------------------ internals
    def _draft_extend(
        self,
        req_pool_indices: torch.Tensor,  # [bs]
        prefix: list[int],  # [bs] target position of each request's first row
        lens: list[int],  # [bs]
        ids: torch.Tensor,  # [sum(lens)] tokens at those positions
        locs: torch.Tensor,  # [sum(lens)] their slots
    ) -> None:
        """The head over target positions prefix_b .. prefix_b + lens_b - 1 of every request
        (position 0 has no pair and is skipped), reading h_{j-1} from the pool."""
        keep_rows: list[int] = []
        reqs: list[int] = []
        d_prefix: list[int] = []
        d_lens: list[int] = []
        start = 0
        for b, (p, n) in enumerate(zip(prefix, lens)):
            first = 1 if p == 0 else 0
            if n - first > 0:
                keep_rows.extend(range(start + first, start + n))
                reqs.append(b)
                d_prefix.append(p + first - 1)
                d_lens.append(n - first)
            start += n
        if not reqs:
            return
        rows = torch.tensor(keep_rows, dtype=torch.int64)
        pool_rows = req_pool_indices[reqs]
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND,
            input_ids=ids[rows],
            req_pool_indices=pool_rows,
            seq_lens=torch.tensor([p + n for p, n in zip(d_prefix, d_lens)], dtype=torch.int64),
            out_cache_loc=locs[rows],
            sampling_info=None,
            extend_seq_lens=d_lens,
            extend_prefix_lens=d_prefix,
            extend_num_tokens=len(keep_rows),
        )
        # Row j (draft position j - 1) reads h_{j-1}: the slot of target position j - 1.
        prev_pos = torch.cat([torch.arange(p, p + n) for p, n in zip(d_prefix, d_lens)])
        owner = torch.repeat_interleave(pool_rows, torch.tensor(d_lens))
        self._run(batch, self._pool_hidden(owner, prev_pos))

    def _pool_hidden(self, req_pool_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        table = self.target_table.req_to_token
        slots = table[req_pool_rows.to(table.device), positions.to(table.device)].to(torch.int64)
        return self.hidden_pool[slots.to(self.hidden_pool.device)]

    def _run(self, batch: ModelWorkerBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fb = self.runtime.forward_batch(batch, self.table)
        return self.model(fb.input_ids, fb.positions, fb, hidden)

    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        """The head's logits over the target's vocabulary [rows, vocab] (EAGLE3's reduced draft
        vocabulary scattered through d2t; other tokens -inf)."""
        assert self.model.lm_head is not None
        logits = self.model.lm_head(states).float()
        if self.model.uses_target_lm_head:
            return logits.cpu()
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"), device=logits.device)
        full[:, self.model.hot_token_ids] = logits
        return full.cpu()

    def _to_draft_coords(self, batch: ModelWorkerBatch) -> ModelWorkerBatch:
        """A batch laid out in target positions, as the head runs it: one position earlier."""
        prefix = batch.extend_prefix_lens
        return dataclasses.replace(
            batch,
            seq_lens=batch.seq_lens - 1,
            extend_prefix_lens=None if prefix is None else [p - 1 for p in prefix],
        )

    def _next_tokens(self, step: ModelWorkerBatch) -> torch.Tensor:
        """A chain's draft step (DECODE, one row per request): the first step of a request reads
        the target's h_{c-1}, later ones the head's own previous output."""
        reqs = step.req_pool_indices.tolist()
        fresh = [i for i, r in enumerate(reqs) if r not in self._carry]
        hidden = torch.empty(len(reqs), self.hidden_pool.shape[1], dtype=self.hidden_pool.dtype)
        if fresh:
            idx = torch.tensor(fresh)
            hidden[idx] = self._pool_hidden(step.req_pool_indices[idx], step.seq_lens[idx] - 2)
        for i, r in enumerate(reqs):
            if r in self._carry:
                hidden[i] = self._carry[r]
        to_logits, to_next = self._run(self._to_draft_coords(step), hidden.to(self.hidden_pool.device))
        for i, r in enumerate(reqs):
            self._carry[r] = to_next[i]
        return self._logits(to_logits).argmax(dim=-1)

    def _row_logits(self, step: ModelWorkerBatch, rows: list[int]) -> torch.Tensor:
        """A tree's draft pass (DRAFT_EXTEND over each tree so far): the root reads the target's
        h_{c-1}, every other row its parent's output from the previous pass (the pass recomputes
        the earlier rows with the same inputs, so those outputs are the same)."""
        assert step.spec_tree_parents is not None and step.extend_prefix_lens is not None
        reqs = step.req_pool_indices.tolist()
        roots = torch.tensor([p - 1 for p in step.extend_prefix_lens])
        root_hidden = self._pool_hidden(step.req_pool_indices, roots)  # [bs, hidden]
        parts: list[torch.Tensor] = []
        for b, (r, parents) in enumerate(zip(reqs, step.spec_tree_parents)):
            parts.append(root_hidden[b : b + 1])
            parts.extend(self._carry[(r, p)].unsqueeze(0) for p in parents[1:])
        to_logits, to_next = self._run(self._to_draft_coords(step), torch.cat(parts))
        at = 0
        for r, parents in zip(reqs, step.spec_tree_parents):
            for j in range(len(parents)):
                self._carry[(r, j)] = to_next[at + j]
            at += len(parents)
        if not rows:
            return torch.empty(0)
        return self._logits(to_logits[rows])
