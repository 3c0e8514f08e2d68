"""What the user asked the planner for, validated with bounds (pydantic, as the
profiles and the facts are): the command line takes its defaults from here, and
a PlanOptions built in code (serve-tiny, tests, tools) gets the same checks."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

# Bounds of what a user may ask for, far beyond any 3090 (or any GPU): a value past
# them is a typo, refused as a usage error before it reaches the planner or vLLM.
MAX_KV_CACHE_BYTES = 1 << 50  # 1 PiB of VRAM per card
MAX_MODEL_LEN = (1 << 31) - 1  # vLLM's positions are int32
MAX_MTP_TOKENS = 16  # draft tokens per step
MAX_LAYERS_PER_RANK = 1024  # config_check's num_hidden_layers bound


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class PlanOptions:
    """What the user asked for; None means "derive it"."""

    model_dir: str | None = None
    table_path: str | None = None
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    served_model_name: Annotated[str, Field(min_length=1)] = "qwen3.8-flash-next"
    kv_cache_memory_bytes: Annotated[int, Field(ge=1, le=MAX_KV_CACHE_BYTES)] | None = None
    max_model_len: Annotated[int, Field(ge=1, le=MAX_MODEL_LEN)] | None = None
    pp_layer_partition: str | None = None
    """VLLM_PP_LAYER_PARTITION from the environment, honoured like vLLM does."""
    generation_config_dir: str | None = None
    """Passed as --generation-config when the checkpoint's own lacks sampling keys."""
    mtp: Annotated[int, Field(ge=0, le=MAX_MTP_TOKENS)] | None = None
    """Draft tokens per step with the checkpoint's MTP layer: 0 serves without MTP,
    N > 0 with N; None keeps the profile's [mtp] (profiles.with_mtp)."""
