"""The real backend: a transformers model running over the testbed's paged KV blocks.

`models` builds the model (checkpoint or random weights from a shipped config),
`kv_cache` holds the KV tensors indexed by the shared `BlockManager`'s block ids,
`attention` is the paged attention function transformers calls in every layer, and
`runner` turns one planned batch into one forward pass and the greedy next tokens.
"""
