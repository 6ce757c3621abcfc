"""Seconds per Flow-GRPO training step: flow_grpo's own SD3 trainer against ours, on the same
work (what is compared and how: the docstring of `omni.bench.flow_grpo`).

    python scripts/bench_flow_grpo.py --flow-grpo /path/to/flow_grpo --flow-grpo-python ENV/bin/python --rounds 3
    python scripts/bench_flow_grpo.py                  # ours only (no flow_grpo checkout given)
"""

from omni.bench.flow_grpo import main

if __name__ == "__main__":
    main()
