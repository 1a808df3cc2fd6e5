"""A wider check than the recorded scenarios: draw N random scenarios, run each through real
Sarathi-Serve (sarathi_scheduler_real.py) and through our `sarathi` policy in the simulator
(tests/test_sarathi_referee.py's run_ours), and report every scenario whose steps differ.
Needs the Sarathi-Serve source (--src / $SARATHI_SRC) and the testbed; nothing is written.

    PYTHONPATH=. python experiments/sarathi_referee/sweep.py --src /work/src/sarathi --draw narrow -n 600
    PYTHONPATH=. python experiments/sarathi_referee/sweep.py --src /work/src/sarathi --draw wide -n 1500

Where Sarathi-Serve hangs, only the steps before its last one are compared (as the test does).
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "tests"), os.path.join(HERE, "..", "..")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=os.environ.get("SARATHI_SRC"))
    ap.add_argument("--draw", choices=["narrow", "wide"], default="wide")
    ap.add_argument("-n", type=int, default=600)
    args = ap.parse_args()
    import sarathi_scheduler_real as real_driver

    real_driver.bootstrap(args.src)
    import make_scenarios as M
    from test_sarathi_referee import run_ours

    draw = M.wide_random_scenario if args.draw == "wide" else M.random_scenario
    same = hangs = differ = 0
    for seed in range(args.n):
        drawn = draw(seed)
        if drawn is None:
            continue
        sc = M.scenario(f"{args.draw}_{seed}", *drawn)
        real = real_driver.run(sc)
        rs = [{k: s[k] for k in ("step", "tokens", "preempted")} for s in real["steps"]]
        ours = run_ours(sc)
        if real["hang"]:
            hangs += 1
            m = len(rs) - (1 if rs and not rs[-1]["tokens"] else 0)
            ours, rs = ours[:m], rs[:m]
        if ours == rs:
            same += real["hang"] is None
            continue
        differ += 1
        i = next(i for i in range(max(len(ours), len(rs))) if i >= min(len(ours), len(rs)) or ours[i] != rs[i])
        print("DIFFERENT", sc["name"], drawn, "\n  ours:", ours[i] if i < len(ours) else None,
              "\n  real:", rs[i] if i < len(rs) else None)
    print(f"{args.draw}: identical {same}, real hangs (prefix identical unless listed) {hangs}, different {differ}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
