"""Write scenarios.json: the crafted scenarios of tests/test_policies_sglang.py (and the
driver's first four), translated to the shared format, plus seeded random ones.

    python experiments/sglang_referee/make_scenarios.py      # rewrites scenarios.json

Format (one object per scenario): name, kv_tokens, page_size, chunked_prefill_size,
max_prefill_tokens, max_running_requests, context_len, schedule_policy (SGLang's spelling:
fcfs, lpm, dfs-weight, lof), ignore_eos, env (optional: SGLANG_* variables), requests: [{id,
arrival_step, prompt_len, output_len, prefix_ids, prefix_block_tokens}]. Every request fits
the KV alone (prompt + output + 2 < kv_tokens) and its output is below SGLang's clip
(max_new_tokens_for_memory), so no scenario stalls or is truncated.
"""
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))


def scen(name, kv, reqs, policy="fcfs", chunk=8192, max_prefill=16384, cap=4096, ctx=10000,
         ignore_eos=True, ratio=None):
    out = dict(name=name, kv_tokens=kv, page_size=1, chunked_prefill_size=chunk,
               max_prefill_tokens=max_prefill, max_running_requests=cap, context_len=ctx,
               schedule_policy=policy, ignore_eos=ignore_eos, requests=[])
    if ratio is not None:
        out["env"] = {"SGLANG_INIT_NEW_TOKEN_RATIO": ratio}
    for i, (arr, p, o, *rest) in enumerate(reqs):
        ids, b = (rest + [(), 1])[:2] if rest else ((), 1)
        out["requests"].append(dict(id=i, arrival_step=arr, prompt_len=p, output_len=o,
                                    prefix_ids=list(ids), prefix_block_tokens=b))
    return out


def crafted():
    # tests/test_policies_sglang.py; a sim arrival during step k (0-based) is arrival_step k + 1
    r42 = [(0, 10, 20), (1, 10, 20)]
    return [
        scen("admit_strict_joins", 100, [(0, 40, 20), (0, 17, 20)]),
        scen("admit_strict_refused", 100, [(0, 40, 20), (0, 18, 20)]),
        scen("refusal_holds_admission", 100, [(0, 40, 50), (0, 10, 10)], ignore_eos=False),
        scen("retract_latest_of_equals", 42, r42, ignore_eos=False, ratio=0.0),
        scen("retract_none_with_fixed_lengths", 42, r42, ignore_eos=True, ratio=0.0),
        scen("retracted_goes_behind_waiting", 42, r42 + [(4, 10, 20)], ignore_eos=False, ratio=0.0),
        scen("chunked_continues_first", 1000, [(0, 40, 2), (0, 5, 2)], chunk=16),
        scen("lpm_defers_shared_prefix", 1000, [(0, 128, 2, (1, 2), 64), (0, 128, 2, (1, 2), 64),
                                                (0, 64, 2, (9,), 64)], policy="lpm", chunk=192),
        scen("fcfs_shared_prefix", 1000, [(0, 128, 2, (1, 2), 64), (0, 128, 2, (1, 2), 64),
                                          (0, 64, 2, (9,), 64)], policy="fcfs", chunk=192),
        # the driver's original four
        scen("driver_retract", 200, [(0, 10, 100)] * 3, chunk=64, max_prefill=64, cap=8),
        scen("driver_chunked", 1024, [(0, 200, 4), (1, 10, 4)], chunk=64, max_prefill=64, cap=8),
        scen("driver_lpm", 1024, [(0, 32, 1, (1,), 32), (3, 30, 2), (3, 35, 2, (1,), 32), (3, 30, 2),
                                  (3, 34, 2, (1,), 32)], policy="lpm", chunk=512, max_prefill=40, cap=8),
        scen("driver_refused", 128, [(0, 60, 30), (1, 60, 8)], chunk=256, max_prefill=256, cap=8),
    ]


def random_scenario(seed, kind):
    rng = random.Random(seed)
    n = rng.randint(4, 12)
    policy = {"lpm": "lpm", "dfs": "dfs-weight", "lof": "lof"}.get(kind, rng.choice(["fcfs", "lpm", "dfs-weight", "lof"]))
    pressure = kind in ("retract", "mixed")
    kv = rng.randint(60, 130) if pressure else rng.randint(60, 300)
    chunk = rng.choice([8, 16, 32, 64]) if kind in ("chunked", "mixed") else rng.choice([64, 128, 8192])
    max_prefill = rng.choice([16, 32, 64, 128, 16384]) if kind in ("chunked", "mixed") else rng.choice([128, 16384])
    cap = rng.randint(2, 4) if kind in ("cap", "mixed") else 4096
    ignore_eos = kind not in ("retract", "mixed") and rng.random() < 0.5
    ratio = rng.choice([0.0, 0.0, 0.1, 0.2]) if kind in ("retract", "mixed") else None
    b = rng.choice([4, 8, 16])
    spread = rng.choice([0, 3, 10]) if pressure else rng.choice([0, 5, 20, 60])
    reqs = []
    for _ in range(n):
        p = rng.randint(3, 20) if pressure else rng.randint(3, 60)
        o = rng.randint(15, 60) if pressure else rng.randint(1, 40)
        p = min(p, kv // 2)
        o = max(1, min(o, kv - p - 4))
        ids = ()
        if kind in ("lpm", "dfs", "prefix", "lof", "mixed") and rng.random() < 0.8:
            root = rng.randint(1, 2)
            ids = (root,) + tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 4)))
        # under pressure, arrivals one after another: each admission sees only its own output
        # (the running ones count at the low ratio), so later decode outgrows the KV
        arr = len(reqs) * rng.randint(1, 4) if pressure else rng.randint(0, spread)
        reqs.append((arr, p, o, ids, b))
    reqs.sort(key=lambda r: r[0])
    return scen(f"random_{kind}_{seed}", kv, reqs, policy=policy, chunk=chunk, max_prefill=max_prefill,
                cap=cap, ctx=4096, ignore_eos=ignore_eos, ratio=ratio)


KINDS = ["retract", "retract", "retract", "retract", "chunked", "chunked", "chunked", "lpm", "lpm", "lpm",
         "dfs", "dfs", "dfs", "prefix", "lof", "cap", "cap", "mixed", "mixed", "mixed", "mixed"]


# seeds from a wider sweep (KINDS * 3 from seed 100) whose runs diverge from SGLang on which cached
# tokens survive eviction: kept as documented divergences (tests/test_sglang_referee.py)
EVICTION_ORDER = [(102, "retract"), (123, "retract"), (128, "lpm"), (135, "lof"), (141, "mixed"),
                  (151, "lpm"), (155, "prefix")]


def main():
    out = crafted() + [random_scenario(seed, kind) for seed, kind in enumerate(KINDS, start=1)]
    out += [random_scenario(seed, kind) for seed, kind in EVICTION_ORDER]
    with open(os.path.join(HERE, "scenarios.json"), "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(s, separators=(",", ":")) for s in out) + "\n]\n")
    print(len(out), "scenarios")


if __name__ == "__main__":
    main()
