"""config.json checked before any work is sized by it.

Two steps: when the checkpoint is read, each section the launcher reads has the
JSON type it must have (check_sections, a ModelFactsError); before a plan, every
integer key it reads has its type and bounds (model_derived.CONFIG_MAX), and the
keys the tensors also say agree with them (check_text_config, a ConfigValueError
naming the key; the planner prefixes config.json's path).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from flashnext.facts.model_derived import CONFIG_MAX, ConfigValueError, config_int
from flashnext.facts.schema import ModelFacts, ModelFactsError

# Keys whose 0 means "none" (no MoE, no MTP layer).
_ZERO_OK = frozenset({"num_experts", "num_experts_per_tok", "mtp_num_hidden_layers"})
_MINIMUM = {"ngram_size": 2}
# Sections read as a whole, and the JSON type each must be.
_SECTIONS: dict[str, tuple[type, str]] = {
    "text_config": (dict, "an object"),
    "quantization_config": (dict, "an object"),
    "architectures": (list, "a list of class names"),
    "model_type": (str, "a string"),
}
# Decoder layers of the text model: `layers.N.` outside the MTP layer and the vision tower.
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_NOT_DECODER = ("mtp.", "model.mtp.", "visual.", "model.visual.", "vision_tower.")


def check_sections(config: dict[str, Any], path: Path) -> None:
    """Each section the launcher reads has its JSON type, in config.json and in its
    text_config. Raises ModelFactsError naming the section."""
    text = config.get("text_config")
    places = [("", config)] + ([("text_config.", text)] if isinstance(text, dict) else [])
    for where, doc in places:
        for key, (kind, what) in _SECTIONS.items():
            value = doc.get(key)
            if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
                continue
            raise ModelFactsError(
                f"{path}: {where}{key} is a JSON {type(value).__name__}, not {what}; "
                "restore config.json from the published checkpoint"
            )
    archs = config.get("architectures") or []
    if not all(isinstance(a, str) for a in archs):
        raise ModelFactsError(
            f"{path}: architectures is {archs!r:.80}, not a list of class names; restore "
            "config.json from the published checkpoint"
        )


def check_text_config(model: ModelFacts) -> dict[str, Any]:
    """The text config, every integer key the launcher reads in bounds and the layer
    count equal to the tensors'. Raises ConfigValueError naming the key."""
    text = model.text_config
    if not isinstance(text, dict):
        raise ConfigValueError(f"text_config is {text!r:.80}, not an object")
    config_int(text, "num_hidden_layers")  # required
    for key in CONFIG_MAX:
        if key in text:
            config_int(text, key, minimum=0 if key in _ZERO_OK else _MINIMUM.get(key, 1))
    layers = text["num_hidden_layers"]
    _check_layers_against_tensors(model, layers)
    _check_layer_types(text.get("layer_types"), layers)
    experts, per_token = text.get("num_experts") or 0, text.get("num_experts_per_tok") or 0
    if experts and per_token > experts:
        raise ConfigValueError(
            f"num_experts_per_tok is {per_token}, more than num_experts {experts}"
        )
    return text


def _check_layer_types(layer_types: Any, layers: int) -> None:
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ConfigValueError(f"layer_types is {layer_types!r:.80}, not a list of strings")
    if len(layer_types) != layers:
        raise ConfigValueError(
            f"layer_types names {len(layer_types)} layers, num_hidden_layers is {layers}"
        )


def _check_layers_against_tensors(model: ModelFacts, layers: int) -> None:
    """The decoder layers the tensors hold (one class name per tensor kind, a few
    thousand) against num_hidden_layers; nothing to say without layer tensors."""
    found = set()
    for name in model.tensor_bytes_by_class():
        if name.startswith(_NOT_DECODER) or ".mtp." in name or ".visual." in name:
            continue
        m = _LAYER.search(name)
        if m:
            found.add(int(m.group(1)))
    if not found:
        return
    held = max(found) + 1
    if held != layers:
        raise ConfigValueError(
            f"num_hidden_layers is {layers}, but the checkpoint's tensors hold {held} decoder "
            f"layers (layers.0 to layers.{held - 1}): set num_hidden_layers to {held}"
        )
