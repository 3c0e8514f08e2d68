"""flashnext: serve Qwen3.8-Flash-Next on 3x RTX 3090 with a patched vLLM 0.33.0."""

__version__ = "0.1.0"

VLLM_VERSION = "0.33.0"
"""The vLLM release the patch series is written against (pins/ holds its hashes)."""
