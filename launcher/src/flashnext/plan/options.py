"""What the user asked the planner for: a module of its own with no imports, so the
command line takes its defaults from here without loading the planner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked for; None means "derive it"."""

    model_dir: str | None = None
    table_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "qwen3.8-flash-next"
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    pp_layer_partition: str | None = None
    """VLLM_PP_LAYER_PARTITION from the environment, honoured like vLLM does."""
    generation_config_dir: str | None = None
    """Passed as --generation-config when the checkpoint's own lacks sampling keys."""
