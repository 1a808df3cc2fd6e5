"""Measuring a real backend's step times: the engine and vLLM profiles a cost model is fitted from, and the engine's benchmark against plain torch."""
