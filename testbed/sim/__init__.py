"""The simulator backend: the SimPy process that drives the core's step loop on a simulated
clock, and the cost models that say how long each step takes (analytic roofline; fitted to a
measured engine profile)."""
