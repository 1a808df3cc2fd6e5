"""SGLang's scheduler, rule for rule as SGLang 0.5.23 ships it (radix cache, page size 1).

Source: the sglang 0.5.23 wheel (PyPI), `python/sglang/srt/` as installed: `managers/scheduler.py`
(S), `managers/schedule_policy.py` (P), `managers/schedule_batch.py` (B),
`mem_cache/prefill_budget.py` (M), `managers/scheduler_components/new_token_ratio_tracker.py`
(R), `environ.py` (E). Line numbers are that release's.

Per step (`get_next_batch_to_run`, S L3894-4050): a prefill batch if one can be formed, else a
decode step of the running batch (prefill and decode never mix: `enable_mixed_chunk` is off by
default).

Prefill (`_get_new_batch_prefill_raw`, S L4079-4330):
- The waiting queue is a list SGLang keeps: arrivals are appended, a retracted request is
  appended at the back (`_add_request_to_queue`, S L3480-3495), and the cache-aware orders sort
  that list in place, so an order persists into the next step (ties keep the previous order).
- Nothing is admitted while the batch is marked full (`batch_is_full`, S L4100): it is set when
  an admission finds no KV (`AddReqResult.NO_TOKEN`, S L4266-4270) or the running-request cap
  is reached (S L4115-4118, L4224-4232), and cleared only when a request leaves the running
  batch (finishes or is retracted: S L3962-3964, L4544) or the batch empties (S L4093). The flag
  lives on the running batch, so a refusal while no request is decoding is forgotten by the next
  step (S L3952-3955 replaces the empty batch, L4093-4096). A request being chunked continues
  regardless: it is SGLang's `chunked_req` (S L4176-4184) until its last chunk, even a one-token
  chunk (a retracted request recomputing its outputs can be cut one token short of its end, which
  `RequestState.is_prefill` reads as decoding): that chunk too runs first, in a prefill step
  (`add_chunked_req`, P L1140-1222), and the request is not in the decode batch meanwhile.
- Orders (`SchedulePolicy.calc_priority`, P L213-280): `fcfs` (queue order); `lpm`: longest
  cached prefix first, and a request whose cached prefix is at most 32 tokens but which shares
  at least 32 tokens with a request earlier in the queue goes last, so one request caches a
  shared prefix before the rest reuse it (in-batch prefix caching, P L346-396, thresholds
  P L115-126); above 128 waiting requests, fcfs (P L304-315); `dfs_weight`: depth first over
  the radix tree, each request at its cached-prefix node, heavier subtrees first, a node's own
  requests after its children (`_dfs_weight_order`, base_prefix_cache.py L347-387); both are
  fcfs when the prefix cache is off (P L324-344); `lof`:
  longest max_new_tokens first (P L504-519).
- `PrefillAdder` (P L607-1710, M L62-170), in tokens: the budget is the free KV plus the
  evictable cache, less every running request's `min(max_new - generated, 4096) * ratio`
  (`_get_running_request_total_token_offset`, P L785-795; the ratio is 1 for a request sent with
  `ignore_eos`), less what this batch already reserved. The chunked request continues first
  (`add_chunked_req`, P L1140-1222) with `min(chunk budget, budget left)` tokens. A waiting
  request is admitted only if `uncached prompt + min(max_new - generated, 4096) + page_size` is
  strictly below the budget left with its cached prefix pinned (`add_one_req` P L1395-1412,
  `check_prefill` M L114-128, the pin P L1419); admitted, it reserves its page-rounded extend,
  one page and `min(max_new, 4096)` (`reserve` M L156-168, `_commit_prefill_admission`
  P L1685-1705). A prompt above the chunk budget is cut to it, page-aligned, and reserves no
  output yet (P L1640-1668); it becomes the one chunked request. The first refusal ends the
  step's admissions; so does a spent chunk or input budget (`budget_state`, P L874-893). The
  chunk budget is `chunked_prefill_size` (P L639, L1611) and only it cuts a prompt; the input
  budget (`max_prefill_tokens`) only stops further admissions once spent, so a step may hold up
  to max_prefill_tokens - 1 + a chunk (the preset's engine cap leaves room for that).
- The running-request cap is SGLang's own (`resolve_max_num_reqs`,
  mem_cache/kv_cache_configurator.py L3119-3132): KV tokens / context length * 512, clipped to
  [2048, 4096], at most half the KV tokens.

Decode (`update_running_batch`, S L4459-4549): if the running requests' next tokens do not fit
(`check_decode_mem`, B L3432-3449, after evicting the cache), retract (`retract_decode`,
B L3451-3530): sort by (outputs generated, -prompt length) descending (stable), then take from
the back (fewest outputs, then the longest prompt, then the latest joined) at least one request
and more until the rest's next tokens fit, never the last one; the ratio becomes
`min(1, (tokens generated + 20 * requests) / (their max_new sum + 1))` over those kept (R L36-44,
`SGLANG_RETRACT_DECODE_STEPS` = 20, E L649). Without retraction the ratio decays by
`(init - min) / 600` per decode step down to `min = init * 0.14` (R L21-34, E L646-648); it is
reset to `init` (0.7 x `schedule_conservativeness`) when the scheduler idles (S L5318).

KV (`kv.cache_decode_tokens=finished`, set by this preset): prompt tokens enter the cache when
the step that computes them completes (checkpoint_kv_cache after the forward), so a request
later in the same step cannot hit them, and a request whose same-step neighbour inserted the
same prefix first frees its duplicate and reads the tree's copy; decode tokens enter the cache
when the request finishes. A retracted request's decode tokens are freed uncached and its prompt
is released to the cache (`release_req`, B L2360-2395). The running batch keeps SGLang's order
(new requests appended; a retraction reorders it to the retraction sort, B L3532), which is the
stable-sort tie-break of the next retraction.

Eviction (radix_cache.py `evict` L552-580, modelled by testbed/core/radix_lru.py): the free
blocks that cache nothing are used first; beyond them the cache evicts whole radix leaves, the
least recently accessed first, where every lookup and insert re-stamps the path it walks. So
each plan lists, in SGLang's order, the lookups its scheduler makes (`Plan.touch`, replayed by
the loop before its admissions): `calc_priority` under `lpm` (at most 128 waiting) and
`dfs_weight` looks every waiting request up in queue order, whole sequence, before sorting
(`_compute_prefix_matches`, P L346-360); under `fcfs`, `lof` and `lpm` above 128 waiting it
re-stamps the first 128 waiting requests' prefixes, the head last, on every 32nd call
(`_touch_waiting_prefixes`, P L283-302, `WAITING_PREFIX_REFRESH_INTERVAL` P L139); then every
request the admission loop reaches is looked up, one token short of its sequence
(`init_next_round_input`, B L1692-1740, cap B L1766-1785), the refused one included. All of a
step's admissions lock their prefixes before its KV is allocated (alloc_for_extend,
mem_cache/allocation.py L374). A decode that does not fit first evicts for the whole decode
(`check_decode_mem` before `retract_decode`, S L4469, B L3432-3449: `Plan.free_first`), then each
retracted request's release evicts until 20 tokens per request kept are free and the kept
requests' next tokens fit (B L2389-2392, then the loop's `check_decode_mem`, B L3459-3461:
`Plan.keep_free`).

Checked step by step against SGLang's real scheduler code on 41 scenarios, all identical
(experiments/sglang_referee, tests/test_sglang_referee.py).

Not modelled: mixed chunked prefill, priority scheduling and priority preemption, the
`hrrn`/`random`/`routing-key`/`shortest-prefill-first` orders, the overlap schedule (SGLang's
default runs the scheduler one step ahead of the GPU), the paged allocator's page of slack per
request (with a page size above 1 SGLang evicts a page more per request than an extend or a
decode needs: mem_cache/allocation.py L175-201, L574-585), the insert after a one-token last
chunk of a recompute (its checkpoint waits for the request's finish here), the dfs_weight tree
forgetting evicted nodes (a re-inserted prefix keeps its first place among its siblings), the
clipping of max_new_tokens to the context at arrival (modelled in `_max_new`, but SGLang would
then also stop the request early), and an out-of-memory chunk continuation (SGLang would fail;
here the step decodes).
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register
from testbed.core.request import Status

ORDERS = ("fcfs", "lpm", "dfs_weight", "lof")
PREFIX_MATCH_QUEUE_MAX = 128  # WAITING_QUEUE_PREFIX_MATCH_MAX, P L136: lpm turns fcfs above it
WAITING_PREFIX_REFRESH_INTERVAL = 32  # P L139: a cache-agnostic order re-stamps the queue's prefixes every 32 calls
IN_BATCH_CHECK_THRESHOLD = 32  # IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD, P L115-118
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32  # IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD, P L122-126
_RID = attrgetter("req.id")  # a request state's id (the queue's rebuild)
_RUNNING = Status.RUNNING


@dataclass
class SGLangKnobs(PolicyKnobs):
    name: str = "sglang"
    schedule_policy: str = "fcfs"  # --schedule-policy (arg_groups/fields/schedule.py L81-99)
    chunked_prefill_size: int = bounded(8192, ge=0)  # 0: no chunking (SGLang's -1); 8192 on an 80 GB GPU (arg_groups/memory_hook.py L131-140)
    schedule_conservativeness: float = bounded(1.0, gt=0)
    init_new_token_ratio: float = bounded(0.7, ge=0, le=1)  # SGLANG_INIT_NEW_TOKEN_RATIO
    min_new_token_ratio_factor: float = bounded(0.14, ge=0, le=1)  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    new_token_ratio_decay_steps: int = bounded(600, ge=1)  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
    retract_decode_steps: int = bounded(20, ge=0)  # SGLANG_RETRACT_DECODE_STEPS
    clip_max_new_tokens: int = bounded(4096, ge=1)  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
    # --max-prefill-tokens: admissions stop once a step's prefill tokens reach it (budget_state,
    # P L883); the last admission may pass it by up to a chunk, so the engine's token cap
    # (scheduler.max_num_batched_tokens) must leave room above it
    max_prefill_tokens: int = bounded(16384, ge=1)
    max_running_requests: int = bounded(0, ge=0)  # 0: SGLang's rule from the KV size and context length
    # requests as a trace replay sends them (sglang.benchmark.serving sets ignore_eos, serving.py
    # L628): each stops at its trace length and the scheduler knows it (ratio 1 for it, P L787)
    ignore_eos: bool = True
    max_new_tokens: int = bounded(0, ge=0)  # >0: every request's max_new_tokens (at least its trace output)

    def __post_init__(self):
        super().__post_init__()
        if self.schedule_policy not in ORDERS:
            raise ValueError(f"policy.schedule_policy={self.schedule_policy!r}: expected one of {ORDERS}")


def _chain(ids) -> list:
    """Keys naming each prefix of a prefix-id list (key i: the first i + 1 ids)."""
    keys, key = [], 0
    for x in ids:
        key = hash((key, x))
        keys.append(key)
    return keys


def _covered(s) -> int:
    """Tokens of the request's prompt that its trace prefix ids name."""
    return min(s.req.prompt_len, len(s.req.prefix_hashes) * s.req.prefix_block_tokens)


def in_batch_deprioritized(queue, hit_of) -> set:
    """Ids of the waiting requests SGLang's lpm sends to the back: a small cached prefix, but at
    least 32 tokens shared with a request before it in the queue (P L346-396: each such request
    is matched against a scratch tree of the ones inserted before it, and inserted if not)."""
    inserted: dict = {}  # key of an id-prefix -> the most tokens an inserted request covers with it
    out = set()
    for s in queue:
        if hit_of[s.id] > IN_BATCH_CHECK_THRESHOLD:
            continue
        ids = s.req.prefix_hashes
        if not ids:
            continue  # shares no tokens with anyone
        p, cov = s.req.prefix_block_tokens, _covered(s)
        keys = _chain(ids)
        shared = 0
        for i, key in enumerate(keys):
            other = inserted.get(key)
            if other is None:
                break
            shared = min((i + 1) * p, cov, other)
        if shared >= IN_BATCH_DEPRIORITIZE_THRESHOLD:
            out.add(s.id)
        else:
            for key in keys:
                if inserted.get(key, -1) < cov:
                    inserted[key] = cov
    return out


def dfs_weight_order(queue, hit_of, created=None) -> list:
    """SGLang's dfs_weight order: each request placed at the radix node where its cached prefix
    ends, nodes visited depth first with heavier subtrees (more waiting requests below) first,
    a node's own requests after its children (base_prefix_cache.py L347-387). The tree is the
    requests' cached prefixes spelled in trace prefix ids: a prefix ending inside a trace block
    splits that block there (nodes nest by offset, as the radix tree splits a node where a match
    ends); a hit past the trace ids (a request re-hitting its own tokens) is a leaf of its own.
    Equal weights keep the radix tree's child order, the order the children were inserted
    (`created`: prefix-chain key -> insertion rank, kept by SGLangPolicy._note_inserted);
    children not in it come after, in queue order."""
    if not any([hit_of[s.id] for s in queue]):
        return list(queue)  # nothing cached: every request at the root, in queue order (its own requests come last)
    created = created or {}
    inf = float("inf")
    paths = []
    cuts: dict = {}  # chain key of a trace block -> offsets inside it where some hit ends
    for s in queue:
        h = hit_of[s.id]
        ids, p = s.req.prefix_hashes, s.req.prefix_block_tokens
        cov = min(h, _covered(s)) if h else 0
        chain = _chain(ids[:-(-cov // p)]) if cov else []
        if cov % p:
            cuts.setdefault(chain[-1], set()).add(cov % p)
        paths.append((s, h, cov, p, chain))
    root: dict = {"kids": {}, "here": [], "w": 0}
    for s, h, cov, p, chain in paths:
        node = root
        node["w"] += 1
        steps = []
        for j, key in enumerate(chain):
            end = min(p, cov - j * p)
            # the radix tree splits a block where any hit ends inside it (match_prefix splits)
            steps.extend((key, o) for o in sorted(cuts.get(key, ())) if o < end)
            steps.append((key, end))
        if h > cov:
            steps.append((("own", s.id), 0))
        for step in steps:
            kid = node["kids"].get(step)
            if kid is None:
                kid = node["kids"][step] = {"kids": {}, "here": [], "w": 0, "rank": created.get(step[0], inf)}
            node = kid
            node["w"] += 1
        node["here"].append(s)
    out: list = []
    stack = [(root, False)]
    while stack:
        node, visited = stack.pop()
        if visited:
            out.extend(node["here"])
            continue
        stack.append((node, True))
        kids = sorted(node["kids"].values(), key=lambda k: (-k["w"], k["rank"]))  # stable: then first seen
        stack.extend((k, False) for k in reversed(kids))
    return out


@register
class SGLangPolicy(BasePolicy):
    name = "sglang"
    Knobs = SGLangKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        k = self.knobs
        self.init_ratio = min(k.init_new_token_ratio * k.schedule_conservativeness, 1.0)  # R L21-26
        self.min_ratio = min(self.init_ratio * k.min_new_token_ratio_factor, 1.0)
        self.decay = (self.init_ratio - self.min_ratio) / k.new_token_ratio_decay_steps
        self.ratio = self.init_ratio
        self._decode_mark: int | None = None  # steps_done when the last unretracted decode plan was made
        self._queue: dict = {}  # SGLang's waiting queue, in its order: request id -> state
        self._admitted: list = []  # the requests the last plan admitted from it (`_sync_queue` drops them)
        self._full: set | None = None  # batch_is_full: the ids whose leaving clears it, or None
        self._batch_pos: dict = {}  # request id -> its place in SGLang's running batch
        self._batch: list = []  # that batch, in that order (a step that decodes the same batch reuses both)
        self._created: dict = {}  # radix child order: prefix-chain key -> rank of first insertion
        # SGLang's chunked_req (S L4176-4184): the request whose prompt a chunk cut, until its last
        # chunk. A retracted request recomputing its outputs can be cut one token short of the end,
        # which RequestState.is_prefill reads as decoding: it is still the chunked request, continued
        # by add_chunked_req (P L1140-1222) in a prefill step, not in the running (decode) batch
        self._chunked_id: int | None = None
        self._lookups: list = []  # this step's radix lookups, in order: (request, tokens looked up)
        self._refresh_calls = 0  # calc_priority calls that could refresh the queue's prefixes (P L296)
        self._max_new_of: dict[int, int] = {}  # request id -> _max_new (computed per request per step otherwise)
        self._sizes: tuple = ()  # (context, KV tokens, page) the cache above was computed for

    # --- bookkeeping --------------------------------------------------------------------------
    def is_steady(self, view) -> bool:
        """Decode steps repeat until something arrives or finishes when nothing waits, or when
        the batch is full (no admission until a request leaves); the ratio's decay is caught up
        from `view.steps_done`."""
        return not view.waiting or self._full is not None

    def _catch_up(self, view) -> None:
        """Decay the ratio once per decode step completed since the last decode plan."""
        if self._decode_mark is not None:
            steps = view.steps_done - self._decode_mark
            self.ratio = max(self.min_ratio, self.ratio - self.decay * steps)
            self._decode_mark = None

    def _sync_queue(self, view) -> None:
        """Drop admitted requests; append new arrivals (retracted ones were appended when retracted). Mostly
        the last plan's admissions left and a few arrivals came at the waiting list's end: those are applied,
        then checked in one pass (a loaded run's queue holds hundreds); anything else rebuilds the queue from
        the waiting list, as the check would."""
        waiting = view.waiting
        q = self._queue
        for s in self._admitted:
            if s.status is _RUNNING:
                q.pop(s.req.id, None)
        self._admitted = []
        arrived = []
        for s in reversed(waiting):
            if s.req.id in q:
                break
            arrived.append(s)
        for s in reversed(arrived):
            q[s.req.id] = s
        if len(q) == len(waiting):
            for s in waiting:  # (a loop: on Python 3.11 it reads `s.req.id` faster than attrgetter does in C)
                if s.req.id not in q:
                    break
            else:
                return
        for s in arrived:  # (undone: in the rebuild every new one goes in the waiting list's order)
            del q[s.req.id]
        ids = set(map(_RID, waiting))
        self._queue = q = {i: s for i, s in q.items() if i in ids}
        for rid, s in zip(map(_RID, waiting), waiting):
            if rid not in q:
                q[rid] = s

    def _max_new(self, s) -> int:
        """The request's max_new_tokens, clipped as SGLang clips it on arrival so that admission
        can pass: at most max_req_len - prompt - 1, max_req_len = min(context, KV tokens) - 1
        (S L2710-2717, tp_worker.py L568-571), and at most KV tokens - paged prompt - page - 1
        (`max_new_tokens_for_memory`, mem_cache/allocator/base.py L88-105). (SGLang would then
        stop the request early; here it still generates its trace length.)"""
        req = s.req
        got = self._max_new_of.get(req.id)  # fixed per request (the view's sizes do not change in a run)
        if got is not None:
            return got
        p, bs = req.prompt_len, self._page
        limit = min(min(self._context, self._kv_tokens) - 1 - p - 1, self._kv_tokens - -(-p // bs) * bs - bs - 1)
        got = self._max_new_of[req.id] = max(0, min(max(self.knobs.max_new_tokens, req.output_len), limit))
        return got

    def _max_running(self, view) -> int:
        if self.knobs.max_running_requests:
            return min(self.knobs.max_running_requests, view.max_num_seqs)
        tokens = view.num_blocks * view.block_size
        estimate = max(min(int(tokens / view.max_model_len * 512), 4096), 2048)
        return max(1, min(estimate, tokens // 2, view.max_num_seqs))

    def _order(self, view) -> list:
        """calc_priority: sort SGLang's queue in place (the order persists), noting the radix
        lookups it makes (they re-stamp what they match: SGLang's eviction order)."""
        queue = list(self._queue.values())
        policy = self.knobs.schedule_policy
        cache = view.prefix_caching
        if policy in ("lpm", "dfs_weight") and not cache:
            policy = "fcfs"  # a cache-aware order without the radix cache is fcfs (P L324-344)
        if policy == "lpm" and len(queue) > PREFIX_MATCH_QUEUE_MAX:
            policy = "fcfs"  # _determine_active_policy, P L304-315
        if policy in ("lpm", "dfs_weight"):
            # _compute_prefix_matches (P L346-360) looks every waiting request up, in queue order,
            # before sorting: each lookup re-stamps its cached path (its whole sequence, no one-token cap)
            # (only those whose lookup can match anything: another's lookup stamps nothing and hits 0)
            hitters = view.lookup_candidates(queue)
            self._lookups += [(s, s.known_len) for s in hitters]
            hits = view.prefix_hits(hitters)
            if policy == "dfs_weight" and not any(hits):
                return queue  # nothing cached: the queue's order stands (dfs_weight_order's first case)
            hit_of = {s.req.id: 0 for s in queue}
            hit_of.update(zip([s.req.id for s in hitters], hits))
            if policy == "lpm":
                back = in_batch_deprioritized(queue, hit_of)
                queue.sort(key=lambda s: float("inf") if s.id in back else -hit_of[s.id])
            else:
                queue = dfs_weight_order(queue, hit_of, self._created)
        elif policy == "lof":
            queue.sort(key=lambda s: -self._max_new(s))
        if cache and queue and policy != "dfs_weight" and policy != "lpm":
            self._refresh_prefixes(queue)
        if policy == "fcfs":
            return queue
        self._queue = {s.id: s for s in queue}
        return queue

    def _refresh_prefixes(self, queue) -> None:
        """`_touch_waiting_prefixes` (P L283-302): a cache-agnostic order (fcfs, lof, lpm above 128
        waiting) re-stamps the first 128 waiting requests' cached prefixes on every 32nd call of
        calc_priority with a non-empty queue, after sorting, the head last (so LRU evicts in reverse
        admission order)."""
        calls = self._refresh_calls
        self._refresh_calls = calls + 1
        if calls % WAITING_PREFIX_REFRESH_INTERVAL == 0:
            self._lookups.extend((s, s.known_len) for s in reversed(queue[:PREFIX_MATCH_QUEUE_MAX]))

    # --- the step -----------------------------------------------------------------------------
    def schedule(self, view) -> Plan:
        self._lookups = []
        plan = self._schedule(view)
        plan.touch = self._lookups
        return plan

    def _schedule(self, view) -> Plan:
        sizes = (view.max_model_len, view.num_blocks * view.block_size, view.block_size)
        if sizes != self._sizes:
            self._sizes = sizes
            self._context, self._kv_tokens, self._page = sizes
            self._max_new_of.clear()
        self._catch_up(view)
        self._sync_queue(view)
        running = view.running
        chunked = None
        chunked_id = self._chunked_id
        for s in running:  # the first still prefilling (RequestState.is_prefill, inlined: once per request per step)
            req = s.req
            if (req.prompt_len + s.num_generated - s.num_computed > 1 or s.num_generated == 0
                    or req.id == chunked_id):
                chunked = s
                break
        decoding = [s for s in running if s is not chunked] if chunked is not None else list(running)
        if self._batch_pos and decoding != self._batch:  # SGLang's running-batch order: kept across steps, new
            # ones appended (the same requests in the same order, compared by identity in C, are in it already)
            pos, inf = self._batch_pos, float("inf")
            keys = [pos.get(s.req.id, inf) for s in decoding]
            if keys != sorted(keys):  # (mostly in order already: the running order unless a retraction sorted it)
                decoding = [decoding[i] for i in sorted(range(len(keys)), key=keys.__getitem__)]  # stable, as sort
        if self._full is not None and (not decoding or not self._full <= {s.req.id for s in running}):
            self._full = None  # a request left the batch
        plan = self._prefill(view, decoding, chunked)
        if plan.items:
            if self.knobs.schedule_policy == "dfs_weight":
                self._note_inserted(plan)
            return plan
        if not running:  # idle: SGLang resets the ratio
            self.ratio = self.init_ratio
            return plan
        return self._decode(view, plan, decoding)

    def _prefill(self, view, decoding, chunked) -> Plan:
        k, plan = self.knobs, Plan()
        if (self._full is not None or not self._queue) and chunked is None:
            return plan
        allocatable = self._max_running(view) - len(decoding)
        if allocatable <= 0 and chunked is None:
            self._mark_full(view, plan)
            return plan
        queue = self._order(view)
        bs = view.block_size
        page = lambda n: -(-n // bs) * bs  # noqa: E731 (ceil_paged_tokens)
        ratio = 1.0 if k.ignore_eos else self.ratio
        clip, max_new_of = k.clip_max_new_tokens, self._max_new
        known = self._max_new_of  # `_max_new`'s cached value read inline: once per running request per step
        rem_total = view.free_blocks * bs - sum(
            [min((known[s.req.id] if s.req.id in known else max_new_of(s)) - s.num_generated, clip) * ratio
             for s in decoding])
        rem_input = k.max_prefill_tokens  # PrefillAdder(rem_input_tokens=max_prefill_tokens), S L4157-4164
        rem_chunk = k.chunked_prefill_size or None  # rem_chunk_tokens = chunked_prefill_size (P L639), not capped by rem_input
        cap = view.token_budget  # the engine's own limit on a step's tokens (not SGLang's: keep it above)

        if chunked is not None:  # add_chunked_req, P L1140-1222
            chunk = rem_chunk if rem_chunk is not None else cap
            avail = min(chunk, int(rem_total))  # available_chunk_tokens, M L139-142
            limit = avail if avail > 0 else chunk
            n = min(chunked.remaining, limit, cap)
            free = view.free_blocks  # what the loop can allocate (admissions below: SGLang's budget guarantees it)
            while n > 0 and view.blocks_needed(chunked, n) > free:
                n = min(n - 1, (len(chunked.blocks) + free) * bs - chunked.num_computed)
            if n <= 0:
                return plan  # no KV for its next chunk: decode (SGLang would run out of memory)
            truncated = n < chunked.remaining
            self._chunked_id = chunked.id if truncated else None
            plan.schedule(chunked, n)
            cap -= n
            rem_total -= page(n) + bs + (0 if truncated else min(self._max_new(chunked), k.clip_max_new_tokens))
            rem_input -= page(n)
            if rem_chunk is not None:
                rem_chunk -= page(n)
            if truncated:
                return plan  # the chunk budget (or the KV) is spent on it

        preview = view.kv_preview()
        pinned: set = set()  # cached blocks this batch's admissions pinned (tree_cache.lock)
        for s in queue:
            if rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
                break  # budget_state OTHER
            if len(plan.items) >= allocatable:
                self._mark_full(view, plan)
                break
            if self._full is not None:
                break
            self._lookups.append((s, s.known_len - 1))  # init_next_round_input matches it (B L1692-1740)
            hit, revive = preview.match(s)
            hit *= bs
            revived = [b for b in revive if b not in pinned]
            extend = s.known_len - hit
            max_new = min(max(self._max_new(s) - s.num_generated, 0), k.clip_max_new_tokens)
            if not extend + max_new + bs < rem_total - len(revived) * bs:  # check_prefill, M L114-128
                if plan.items or decoding:  # NO_TOKEN marks the batch full, S L4266-4270
                    self._mark_full(view, plan)
                    break
                if chunked is not None or not self._fits_alone(view, s):
                    break
                # alone and still refused: SGLang aborts a prompt this close to its KV size
                # (max_req_input_len = max_req_len - 5, tp_worker.py L572); the loop serves
                # every request that fits, so it runs here alone
            if rem_chunk is None and plan.items and page(extend) >= rem_input:
                break  # OTHER: without chunking only the first request may pass the input cap
            n, reserve_out = extend, min(self._max_new(s), k.clip_max_new_tokens)
            limit = min(rem_chunk, cap) if rem_chunk is not None else cap
            if page(extend) > limit:  # chunk it, page-aligned (P L1640-1668)
                n = limit // bs * bs  # the hit is whole pages, so the chunk's end is page-aligned
                if n <= 0:
                    break
                reserve_out = 0
            plan.schedule(s, n)
            self._admitted.append(s)
            cap -= n
            pinned.update(revived)
            rem_total -= page(n) + bs + reserve_out + len(revived) * bs
            rem_input -= page(n)
            if rem_chunk is not None:
                rem_chunk -= page(n)
            if n < extend:
                self._chunked_id = s.id
                break  # the new chunked request: the chunk budget is spent
            if rem_total <= 0:  # budget_state NO_TOKEN after a commit
                self._mark_full(view, plan)
                break
        return plan

    def _note_inserted(self, plan) -> None:
        """Remember the order prefixes enter the radix tree (each prefilled request inserts its
        prompt; a new child goes last among its siblings, radix_cache.py _insert_helper).
        Eviction is not tracked: a re-inserted prefix keeps its first rank."""
        created = self._created
        for s, _ in plan.items:
            if not s.req.prefix_hashes:
                continue
            p, cov = s.req.prefix_block_tokens, _covered(s)
            for key in _chain(s.req.prefix_hashes[:-(-cov // p)]):
                if key not in created:
                    created[key] = len(created)

    @staticmethod
    def _fits_alone(view, s) -> bool:
        return s.req.total_len <= view.num_blocks * view.block_size

    def _mark_full(self, view, plan) -> None:
        """batch_is_full is a flag on SGLang's running batch (S L4125, L4232, L4282). On an
        empty running batch it is lost: the next step either replaces that batch with the
        prefill batch just run (S L3952-3955) or clears the flag (S L4093-4096). So only a
        refusal with requests already decoding holds admission."""
        if not any(not s.is_prefill and s.id != self._chunked_id for s in view.running):
            return
        self._full = {s.req.id for s in view.running} | {s.req.id for s, _ in plan.items}

    def _decode(self, view, plan: Plan, decoding) -> Plan:
        free = view.free_blocks
        bs = view.block_size  # view.blocks_needed(s, 1) of a running request, inlined: once per request per step
        need = 0
        for s in decoding:
            n = -(-(s.num_computed + 1) // bs) - len(s.blocks)
            if n > 0:
                need += n
        if need <= free:
            self._decode_mark = view.steps_done  # decays once this step is done
        else:
            # check_decode_mem (S L4469) has evicted what the cache could for the whole decode
            plan.free_first = need * view.block_size
            # retract_decode: most-preferred to keep first; retract from the back, at least one
            keep = sorted(decoding, key=lambda s: (s.num_generated, -s.req.prompt_len), reverse=True)
            plan.keep_free = {}
            first = True
            while (first or need > free) and len(keep) > 1:
                first = False
                victim = keep.pop()
                plan.preempt_request(victim)
                need -= view.blocks_needed(victim, 1)
                free += view.reclaimable_blocks(victim)
                # release_req evicts the cache until 20 tokens per request still kept are free
                # (B L2389-2392), then the retract loop's check_decode_mem until the kept requests'
                # next tokens fit (B L3459-3461): the victim's own just-released prompt, as the
                # rest of the cache went for the whole decode
                plan.keep_free[victim.id] = max(self.knobs.retract_decode_steps * len(keep), need * view.block_size)
                self._queue[victim.id] = victim  # to the back of the waiting queue
            decoding = keep  # filter_batch(keep_indices=sorted order) reorders the batch (B L3532)
            generated = sum(s.num_generated for s in keep)
            max_new = sum(self._max_new(s) for s in keep)
            self.ratio = min(1.0, (generated + self.knobs.retract_decode_steps * len(keep)) / (max_new + 1))
            self._decode_mark = None  # no decay on a retracting step
            self._full = None  # the batch shrank
        if decoding != self._batch:  # (RequestState compares by identity)
            self._batch_pos = {s.req.id: i for i, s in enumerate(decoding)}
            self._batch = decoding
        plan.items += [(s, 1) for s in decoding[:view.token_budget]]  # plan.schedule(s, 1) each
        return plan
