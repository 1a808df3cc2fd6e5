"""A scheduler research testbed for LLM serving: one step loop, a simulator and an engine."""
