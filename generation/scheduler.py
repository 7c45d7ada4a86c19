"""Continuous batching with chunked prefill, cache-aware admission and preemption by recompute.

Each step: every running sequence with exactly one token to compute joins the decode batch (one
[B, 1] forward); running prefills get the next chunk (leaving `WAITING_SHARE` of the budget while requests
wait); then waiting requests are admitted in the
configured order (`EngineConfig.scheduling`) while the per-step token budget and pool allow. A request whose next uncached block is being
computed right now by another prefill waits one step, so it hits the cache instead of duplicating
that work (SGLang's in-batch prefix check). When the pool runs dry even after eviction, the
youngest running sequence is preempted: its blocks go back and it is recomputed later, tokens kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from generation.block_manager import BlockManager
from generation.config import EngineConfig
from generation.prefix_cache import PrefixCache
from generation.sequence import Sequence, Status

LPM_QUEUE_LIMIT = 128  # past this many waiting requests, sorting by match costs more than it saves
# While requests wait, running prefills leave this share of a step's token budget to admitting them: a long
# prompt's chunks took every step's whole budget, so a short request behind it waited for its whole prefill
# (24 s behind two 8,000-token prompts of SmolLM2) before its first token. The long prefill runs a quarter
# slower only while others wait (vLLM bounds concurrent long prefills to the same end).
WAITING_SHARE = 0.25


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src block, dst block)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, cache: PrefixCache) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.cache = cache
        self.bs = blocks.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.unschedulable: Sequence | None = None  # set when a request cannot fit even with nothing running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- block accounting -------------------------------------------------------------------

    def _alloc(self) -> int | None:
        block = self.blocks.allocate()
        if block is None and self.cache.evict(1):
            block = self.blocks.allocate()
        return block

    def _grow(self, seq: Sequence, upto: int, plan: StepPlan) -> bool:
        """Give `seq` private blocks for positions [num_computed, upto); False (nothing held back) if the pool is dry."""
        first = seq.num_computed // self.bs
        if first < len(seq.block_table) and seq.num_computed % self.bs and self.blocks.shared(seq.block_table[first]):
            fresh = self._alloc()
            if fresh is None:
                return False
            src = seq.block_table[first]
            plan.copies.append((src, fresh))
            self.blocks.decref(src)
            seq.block_table[first] = fresh
        added = []
        while len(seq.block_table) < self.blocks.blocks_for(upto):
            block = self._alloc()
            if block is None:
                for b in added:
                    seq.block_table.pop()
                    self.blocks.decref(b)
                return False
            added.append(block)
            seq.block_table.append(block)
        return True

    def _grow_or_preempt(self, seq: Sequence, upto: int, plan: StepPlan) -> bool:
        planned = {id(s) for s in plan.decode} | {id(s) for s, _ in plan.prefill}
        while not self._grow(seq, upto, plan):
            victim = next(v for v in reversed(self.running) if id(v) not in planned)  # seq itself is unplanned
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def release(self, seq: Sequence) -> None:
        """Offer the sequence's computed blocks to the cache, then drop its own references."""
        handle = self.cache.insert(seq.all_ids[: seq.num_computed], seq.block_table, seq.salt)
        self.cache.lock(handle)
        self.cache.unlock(seq.cache_handle)
        self.cache.unlock(handle)
        seq.cache_handle = None
        for b in seq.block_table:
            self.blocks.decref(b)
        seq.block_table = []

    def cache_progress(self, seq: Sequence) -> None:
        """After a prefill chunk, publish its full blocks so concurrent requests can share them."""
        handle = self.cache.insert(seq.all_ids[: seq.num_computed], seq.block_table, seq.salt)
        if handle is not None and handle is not seq.cache_handle:
            self.cache.lock(handle)
            self.cache.unlock(seq.cache_handle)
            seq.cache_handle = handle

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    # ---- admission ------------------------------------------------------------------------------

    def _match(self, seq: Sequence) -> tuple[list[int], object, int]:
        """Blocks to adopt and tokens they cover; capped so the last known token is always computed (it
        yields the next token's logits), and so are the positions whose prompt log-probs are still owed."""
        known = seq.all_ids
        cap = len(known) - 1
        if seq.prompt_logits_from is not None:
            cap = min(cap, seq.prompt_logits_from)
        if seq.pin is not None:
            n = min(seq.pin.num_computed, cap)
            return list(seq.pin.blocks[: self.blocks.blocks_for(n)]), seq.pin.handle, n
        blocks, handle = self.cache.match(known[:cap], seq.salt)
        return blocks, handle, len(blocks) * self.bs

    def _order_waiting(self) -> list[Sequence]:
        queue = list(self.waiting)
        order = self.cfg.scheduling
        if order == "fcfs" or len(queue) > LPM_QUEUE_LIMIT or self.cfg.cache_backend == "none":
            return queue
        matches = {id(s): self._match(s)[0] for s in queue}
        if order == "lpm":
            return sorted(queue, key=lambda s: -len(matches[id(s)]))
        # dfs-weight: walk the tree of matched prefixes, heaviest subtree (most waiting requests) first,
        # so requests sharing a cached prefix run back to back while it is still resident.
        tree: dict = {}
        for s in queue:
            node = tree
            for b in matches[id(s)]:
                node = node.setdefault(b, {})
            node.setdefault(None, []).append(s)

        def weight(node: dict) -> int:
            return len(node.get(None, [])) + sum(weight(c) for k, c in node.items() if k is not None)

        order: list[Sequence] = []

        def visit(node: dict) -> None:
            order.extend(node.get(None, []))
            kids = [c for k, c in node.items() if k is not None]
            for child in sorted(kids, key=weight, reverse=True):
                visit(child)

        visit(tree)
        return order

    def _next_block_key(self, seq: Sequence, computed: int) -> tuple | None:
        upto = (computed // self.bs + 1) * self.bs
        if upto > len(seq) - 1:
            return None
        return (seq.salt, tuple(seq.all_ids[:upto]))

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self.unschedulable = None
        budget = self.cfg.max_num_batched_tokens
        admitting = self.cfg.chunked_prefill and self.waiting and len(self.running) < self.cfg.max_num_seqs
        reserve = int(budget * WAITING_SHARE) if admitting else 0  # for step 3, whatever steps 1-2 take
        # 1) decodes, oldest first, then 2) running prefills continue; when a block cannot be found even
        # after eviction, the youngest sequence not yet planned this step is preempted (possibly itself)
        for phase in ("decode", "prefill"):
            for seq in list(self.running):
                if seq not in self.running or (seq.num_uncomputed == 1) != (phase == "decode"):
                    continue
                n = 1
                if phase == "prefill":
                    n = (seq.num_uncomputed if not self.cfg.chunked_prefill
                         else min(seq.num_uncomputed, budget - reserve if budget > reserve else budget))
                    if n <= 0 or (not self.cfg.chunked_prefill and n > budget and plan):
                        continue
                if not self._grow_or_preempt(seq, seq.num_computed + n, plan):
                    continue
                if phase == "decode":
                    plan.decode.append(seq)
                else:
                    plan.prefill.append((seq, n))
                budget -= n
        # 3) admit waiting requests
        inflight = {self._next_block_key(s, s.num_computed) for s, _ in plan.prefill} - {None}
        for seq in self._order_waiting():
            if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            blocks, handle, hit = self._match(seq)
            key = self._next_block_key(seq, hit)
            if self.cfg.cache_backend != "none" and key is not None and key in inflight:
                continue  # its next block is being computed now: hit it next step
            need = len(seq) - hit
            n = need if not self.cfg.chunked_prefill else min(need, budget)
            if not self.cfg.chunked_prefill and n > budget and plan:
                break
            for b in blocks:
                self.blocks.incref(b)
            seq.block_table = blocks
            seq.num_computed = hit
            self.cache.lock(handle)
            seq.cache_handle = handle
            if not self._grow(seq, hit + n, plan):
                self.cache.unlock(handle)
                seq.cache_handle = None
                for b in seq.block_table:
                    self.blocks.decref(b)
                seq.block_table, seq.num_computed = [], 0
                if not plan and not self.running:
                    self.unschedulable = seq
                break
            self.waiting.remove(seq)
            if seq.admissions == 0:  # a readmission after preemption is recompute, not a new prompt
                seq.cached_tokens = hit
                self.prompt_tokens += len(seq)
                self.hit_tokens += hit
            seq.admissions += 1
            seq.status = Status.RUNNING
            self.running.append(seq)
            if need == 1:
                plan.decode.append(seq)
            else:
                plan.prefill.append((seq, n))
                if key is not None:
                    inflight.add(key)
            budget -= n
        return plan

    def finish(self, seq: Sequence, reason: str, keep: bool = False) -> None:
        """Retire a sequence, waiting or running (an abort is a finish); `keep` leaves its blocks for a pin."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if not keep:
            self.release(seq)
