"""The slime CPU harness: slime's own code end to end, with stand-ins only where a CPU machine
cannot have the real thing. See `run.py` for what is slime's and what stands in."""
