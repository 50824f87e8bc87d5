"""docs/configuration.md is scripts/config_table.py's output: every field a model or the ingress accepts stays
documented, with the default, limits and meaning the code declares."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_the_generated_one():
    spec = importlib.util.spec_from_file_location("config_table", REPO / "scripts" / "config_table.py")
    assert spec is not None and spec.loader is not None
    config_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config_table)
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == config_table.render(), f"docs/configuration.md is stale: run {config_table.REGENERATE}"


def test_every_engine_knob_and_memory_field_is_in_the_reference():
    from deployments.engine_fields import ADVANCED_KNOBS, FIXED_KNOBS
    from engine.config import knobs

    reference = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    for name in knobs():
        if name not in FIXED_KNOBS:
            assert f"| `{name}` |" in reference, name
    assert set(ADVANCED_KNOBS) <= set(knobs())
    for name in ("kv_memory_fraction", "kv_budget_bytes"):
        assert f"| `{name}` |" in reference
