"""Reading a checkpoint's JSON files (config.json, generation_config.json) with errors that name the file."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["read_json_object"]


def read_json_object(path: str) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; a ValueError naming the file when it is not valid JSON or not an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
