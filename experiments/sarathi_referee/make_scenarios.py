"""Write scenarios.json for the Sarathi-Serve referee.

The crafted scenarios of tests/test_policies_sarathi.py (same inputs), then seeded random ones
drawn with the generator of its `test_random_scenarios_match_the_reference_model` (tight
caches, small chunks), keeping seeds that put the cache under pressure: the first ones with
decode preemptions, partial-prefill victims, a binding max_num_seqs, and a binding watermark;
then seven of a wider draw (`wide_random_scenario`: up to 14 requests, arrival ties, chunk and
max_num_seqs down to 1).
Watermark: Sarathi-Serve's default 0.01 everywhere (BlockSpaceManagerRegistry.get passes none,
base_scheduler.py:38-43, so base_block_space_manager.py:57 applies).

    python experiments/sarathi_referee/make_scenarios.py
"""
from __future__ import annotations

import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
# the policy's random test's draw, and its reference model (only to pick seeds with pressure)
from sarathi_reference import RefSarathi, RefSeq, random_scenario  # noqa: E402


def scenario(name, reqs, num_blocks, block_size, chunk_size, max_num_seqs=128):
    return {"name": name, "block_size": block_size, "num_blocks": num_blocks, "chunk_size": chunk_size,
            "max_num_seqs": max_num_seqs, "watermark": 0.01,
            "requests": [{"id": i, "arrival_step": a, "prompt_len": p, "output_len": o}
                         for i, (a, p, o) in enumerate(reqs)]}


CRAFTED = [
    scenario("decodes_then_partial_prefills_then_new_chunked",
             [(0, 10, 3), (0, 6, 2), (2, 20, 2), (3, 5, 1)], 64, 4, 8),
    scenario("preempts_with_no_free_block", [(0, 6, 4), (0, 6, 3)], 4, 4, 16),
    scenario("victim_is_the_newest_partial_prefill", [(0, 4, 6), (0, 20, 2)], 7, 4, 8),
    scenario("recompute_with_one_token_left", [(0, 4, 15), (2, 1, 20)], 6, 4, 8),
    scenario("watermark_keeps_out", [(0, 400, 2), (0, 396, 2)], 200, 4, 512),
    scenario("watermark_exact", [(0, 400, 2), (0, 392, 2)], 200, 4, 512),
    scenario("watermark_admits_alone", [(0, 792, 4)], 200, 4, 512),
    scenario("only_the_watermark_keeps_out_alone", [(0, 796, 4)], 200, 4, 512),
    scenario("max_num_seqs_counts_partial_prefills", [(0, 20, 3), (0, 30, 2), (0, 4, 1)], 64, 4, 32, 2),
    scenario("fast_forward_tight_cache", [(0, 6, 40)] * 4, 30, 4, 16, 8),
]


def wide_random_scenario(seed):
    """A wider draw (more requests, arrival ties, max_num_seqs down to 1, chunk down to 1)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8, 16])
    nb = rng.choice([4, 6, 8, 10, 12, 16, 24, 40, 100])
    chunk = rng.choice([1, 2, 3, 5, 8, 16, 32, 512])
    reqs = sorted((rng.randint(0, 20), rng.randint(1, 60), rng.randint(1, 40)) for _ in range(rng.randint(1, 14)))
    reqs = [r for r in reqs if -(-(r[1] + r[2]) // bs) <= nb]
    return (reqs, nb, bs, chunk, rng.choice([1, 2, 3, 4, 128])) if reqs else None


def main():

    picked, want = [], {"preempt": 8, "prefill_victim": 6, "max_num_seqs": 4, "watermark": 4}
    for seed in range(600):
        drawn = random_scenario(seed)
        if drawn is None:
            continue
        reqs, nb, bs, chunk, mns = drawn
        ref = RefSarathi(nb, bs, chunk, mns)
        tags = set()
        step = 0
        while step < 500 and (step <= max(a for a, _, _ in reqs) or ref.running or ref.waiting):
            for i, (a, p, o) in enumerate(reqs):
                if a == step:
                    ref.add(RefSeq(i, float(a), p, o))
            stage = {s.id: s.stage_done() for s in ref.running}
            items, pre = ref.schedule()
            for v in pre:
                tags.add("preempt" if stage.get(v, True) else "prefill_victim")
            if len(ref.running) >= mns and ref.waiting:
                tags.add("max_num_seqs")
            if ref.waiting and not ref._can_allocate(ref.waiting[0]) and ref.free >= ref._blocks(ref.waiting[0]):
                tags.add("watermark")
            ref.complete(items)
            step += 1
        for t in sorted(tags):
            if want.get(t, 0) > 0:
                want[t] -= 1
                picked.append(scenario(f"random_{t}_{seed}", reqs, nb, bs, chunk, mns))
                break
        if not any(want.values()):
            break
    # seven wide draws with many preemptions (seeds fixed; each finishes under Sarathi-Serve)
    for seed in (13, 58, 65, 101, 147, 209, 252):
        reqs, nb, bs, chunk, mns = wide_random_scenario(seed)
        picked.append(scenario(f"random_wide_{seed}", reqs, nb, bs, chunk, mns))
    with open(os.path.join(HERE, "scenarios.json"), "w") as f:
        json.dump(CRAFTED + picked, f, indent=1)
    print(len(CRAFTED), "crafted +", len(picked), "random")


if __name__ == "__main__":
    main()
