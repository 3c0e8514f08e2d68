"""The PLE table's manifest beside the flat file (TABLE.json), read as data.

`flashnext table prepare` writes it; the patched vLLM reads `f"{path}.json"` to
learn the file's layout (none: packed) and refuses a table whose manifest is
unreadable or names another shape. Preflight judges what this returns.
`probe_manifest` never raises.
"""

from __future__ import annotations

import os

from flashnext.facts.schema import ManifestFacts

# A manifest is a few hundred bytes; anything this large is some other file.
MAX_MANIFEST_BYTES = 1 << 20


def manifest_path(table_path: str | os.PathLike[str]) -> str:
    """Where vLLM looks for the manifest of `table_path`: the same path plus ".json"."""
    return f"{os.path.abspath(os.fspath(table_path))}.json"


def _json_kind(value: object) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), "null"
    )


def probe_manifest(table_path: str | os.PathLike[str]) -> ManifestFacts:
    """The manifest beside `table_path`: missing, unreadable (error), or its JSON object."""
    path = manifest_path(table_path)
    from flashnext.facts.jsonfile import JsonFileError, parse_json, read_limited

    try:
        raw = read_limited(path, "table manifest", MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return ManifestFacts(path=path)
    except JsonFileError as exc:  # a FIFO or device there, or over 1 MiB
        return ManifestFacts(path=path, exists=True, error=str(exc).removeprefix(f"{path}: "))
    except OSError as exc:
        return ManifestFacts(path=path, exists=True, error=f"cannot read ({exc.strerror})")
    try:
        doc = parse_json(raw, path, "table manifest")
    except JsonFileError as exc:
        why = str(exc).removeprefix(f"{path}: ").removesuffix(", so not a table manifest")
        return ManifestFacts(path=path, exists=True, error=why)
    if not isinstance(doc, dict):
        return ManifestFacts(
            path=path, exists=True, error=f"not a JSON object (a JSON {_json_kind(doc)})"
        )
    return ManifestFacts(path=path, exists=True, doc=doc)
