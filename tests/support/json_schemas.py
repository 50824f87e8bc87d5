"""The structured-output acceptance suite: JSON schemas, and a validator for what was generated.

Every string has a maxLength (or a fixed shape) and every number bounds, so even a random
model's output is finite: the tests can demand finish_reason "stop" for every schema.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

NAME = {"type": "string", "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_user": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": NAME},
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "bounded_int_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 50},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "size": {"enum": ["S", "M", "L", "XL"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "celsius": {"type": "number", "minimum": -40, "maximum": 60},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        },
        "required": ["score", "celsius", "ratio"],
        "additionalProperties": False,
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "pin": {"type": "string", "pattern": "^[0-9]{4}$"},
        },
        "required": ["code", "pin"],
        "additionalProperties": False,
    },
    "string_formats": {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "at": {"type": "string", "format": "time"},
        },
        "required": ["day", "id", "at"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": NAME,
            "subtitle": {"type": "string", "maxLength": 8},
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"item": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["item", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "nested_arrays": {
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["grid"],
        "additionalProperties": False,
    },
    "boolean_and_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["ok", "note"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "enum": ["none"]}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
    "const_and_flags": {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "kind": {"type": "string", "enum": ["a", "b"]},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["version", "kind", "flags"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -10, "maximum": 10},
                    "y": {"type": "integer", "minimum": -10, "maximum": 10},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "date_time_and_tags": {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date-time"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        },
        "required": ["when", "tags"],
        "additionalProperties": False,
    },
    "top_level_enum_array": {
        "type": "array",
        "items": {"type": "string", "enum": ["low", "mid", "high"]},
        "minItems": 1,
        "maxItems": 3,
    },
    "deep_nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 5}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
}


def schema_text(name: str) -> str:
    return json.dumps(SCHEMAS[name])


def parse_and_validate(text: str, schema: dict[str, Any]) -> Any:
    """The parsed document; raises if the text is not JSON or breaks the schema (formats included)."""
    document = json.loads(text)
    jsonschema.validate(document, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return document


__all__ = ["SCHEMAS", "parse_and_validate", "schema_text"]
