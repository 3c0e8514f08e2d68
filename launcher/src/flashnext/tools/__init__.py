"""Tools around the served model: bench.py (decode and prefill against a running
server), report.py (facts, plan, preflight and versions as one redacted file). The
checkpoint skeleton generator stays at flashnext.skeleton: the planner's reference
inventory (assess) and the GPU harness import it there."""
