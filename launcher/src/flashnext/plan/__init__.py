"""Pure planning over facts: partition.py (layers per PP rank, as vLLM), placement.py
(which card holds each tensor), qsa_sizing.py and host_pools.py (KV and pinned host
pool sizing), planner.py (the Plan), command.py (a Plan → the `vllm serve` argv)."""
