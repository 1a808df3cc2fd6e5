"""The contract every policy and backend shares: requests and their progress, the paged KV
block manager, the view a policy reads, the plan it returns, the policy protocol and registry,
the cost-model interface, model and hardware specs, and the one step loop.

It imports nothing above it (no policies, traces, backends, Hydra or the application), so a
backend or a policy depends on this package alone.
"""
