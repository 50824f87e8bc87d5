"""Print docs/configuration.md: every field a model application (or an admin load) and the ingress application accept,
read from the pydantic models themselves (deployments/config.py; the engine's knobs come from engine/config.py).

    .venv/bin/python scripts/config_table.py > docs/configuration.md

tests/unit/test_config_reference.py fails while the committed file differs from this output.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, wherever it runs from

from deployments.bodega import ALIASES, BODEGA_ONLY_FIELDS, DRAFT_FIELDS  # noqa: E402
from deployments.config import AdvancedOptions, ModelConfig
from deployments.replica_options import Autoscaling, RayActorOptions
from deployments.ingress_config import AdminLoadLimits, IngressConfig, MemoryBudget, RagConfig
from deployments.mcp_config import McpConfig, McpServerConfig
from deployments.engine_fields import ADVANCED_KNOBS, FIXED_KNOBS, SERVING_DEFAULTS, EngineKnobs  # noqa: E402
from deployments.speculative import SpeculativeOptions  # noqa: E402

REGENERATE = ".venv/bin/python scripts/config_table.py > docs/configuration.md"
HEADER = ("| field | type | default | limits | meaning |", "|---|---|---|---|---|")
# Our field (dotted below a nested model) -> Bodega's name for it.
BODEGA_NAMES = {ours: bodega for bodega, ours in ALIASES.items()} | {f"speculative.{name}": name for name in DRAFT_FIELDS}
SCALARS = {int: "integer", float: "number", bool: "boolean", str: "string", SecretStr: "string (secret)"}


def type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        named = [type_name(arg) for arg in args if arg is not type(None)]
        return " or ".join(named + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object (below)"
    return SCALARS[annotation]


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        made = field.default_factory()
        return "(below)" if isinstance(made, BaseModel) else f"`{made!r}`"
    if field.default is PydanticUndefined:
        return "required"
    value = field.default
    if value is None or isinstance(value, bool):
        return f"`{'null' if value is None else str(value).lower()}`"
    return f"`{value}`"


def limits_text(field: FieldInfo) -> str:
    limits = []
    for item in field.metadata:
        for attribute, text in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >=")):
            if getattr(item, attribute, None) is not None:
                limits.append(f"{text} {getattr(item, attribute)}")
        if getattr(item, "pattern", None) is not None:
            limits.append(f"matches `{item.pattern}`")
    return ", ".join(limits)


def rows(model: type[BaseModel], names: list[str] | None = None, prefix: str = "") -> list[str]:
    """A table of these fields of `model` (all: None); Bodega's names in a last column where any has one."""
    names = names or list(model.model_fields)
    with_bodega = any(prefix + name in BODEGA_NAMES for name in names)
    lines = [HEADER[0] + (" Bodega's name |" if with_bodega else ""), HEADER[1] + ("---|" if with_bodega else "")]
    for name in names:
        field = model.model_fields[name]
        if not field.description:
            raise SystemExit(f"{model.__name__}.{name} has no description: every field is documented")
        cells = [f"`{name}`", type_name(field.annotation), default_text(field), limits_text(field), field.description]
        if with_bodega:
            cells.append(f"`{BODEGA_NAMES[prefix + name]}`" if prefix + name in BODEGA_NAMES else "")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def bodega_only_rows() -> list[str]:
    lines = ["| Bodega's field | what it does here |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in BODEGA_ONLY_FIELDS.items()]
    return lines


def model_section() -> list[str]:
    engine = list(EngineKnobs.model_fields)
    own = [name for name in ModelConfig.model_fields if name not in engine]
    serving_defaults = ", ".join(f"`{name}`" for name in SERVING_DEFAULTS)
    return [
        "## A model", "",
        "The `args` of a model's application in serve_config.yaml, and the body of `POST /v1/admin/load-model` "
        "(`deployments/config.py`'s `ModelConfig`). Unknown fields are refused by name; Bodega's names are accepted "
        "(`deployments/bodega.py`).", "",
        *rows(ModelConfig, own), "",
        "### The engine's fields", "",
        "Declared once by the engine (`engine/config.py`'s `EngineConfig`: default, limits, meaning) and validated "
        f"by it; {serving_defaults} have serving defaults of their own (`deployments/engine_fields.py`). The "
        f"engine's {', '.join(f'`{name}`' for name in FIXED_KNOBS)} keep their defaults when served.", "",
        *rows(ModelConfig, engine), "",
        "### `advanced`", "",
        "Internal knobs with measured defaults: change them to measure, not to tune. "
        f"{', '.join(f'`{name}`' for name in ADVANCED_KNOBS)} are the engine's.", "",
        *rows(AdvancedOptions), "",
        "### `speculative`", "",
        "Speculative decoding (null or absent: off); output is the model's own either way.", "",
        *rows(SpeculativeOptions, prefix="speculative."), "",
        "### `ray_actor_options`", "",
        "Ray's resources for each replica (the ingress's `ray_actor_options` take the same fields).", "",
        *rows(RayActorOptions), "",
        "### `autoscaling`", "",
        "Serve's autoscaling of the model's replicas (its `autoscaling_config`; null: `num_replicas`, fixed). On "
        "a GPU host give each replica a GPU (`ray_actor_options.num_gpus: 1`); on the CPU replicas share the cores.",
        "",
        *rows(Autoscaling), "",
        "### Bodega's fields", "",
        "Besides the names in the tables above, a model accepts these of Bodega's fields:", "",
        *bodega_only_rows(),
    ]


def ingress_section() -> list[str]:
    return [
        "## The ingress", "",
        "The `args` of the ingress application in serve_config.yaml (`deployments/ingress_config.py`'s `IngressConfig`). "
        "Unknown fields are refused by name.", "",
        *rows(IngressConfig), "",
        "### `rag`", "",
        "The RAG deployment beside the ingress (`/v1/rag/*`; null turns the routes off).", "",
        *rows(RagConfig), "",
        "### `admin_loads`", "",
        "What `POST /v1/admin/load-model` may reserve (serve_config.yaml's own models are the operator's and are not "
        "bounded), how many loads run at once, and how long one may take to serve.", "",
        *rows(AdminLoadLimits), "",
        "### `memory`", "",
        "One memory budget across the node's models ([operations.md](operations.md#a-memory-budget-across-models)): "
        "models loaded through the API are counted by their footprint before they load.", "",
        *rows(MemoryBudget), "",
        "### `mcp`", "",
        "The MCP servers the ingress's tool loop may use, and its bounds ([mcp.md](mcp.md)).", "",
        *rows(McpConfig), "",
        "Each of `servers` (`deployments/mcp_config.py`'s `McpServerConfig`):", "",
        *rows(McpServerConfig),
    ]


def render() -> str:
    lines = [
        f"<!-- Generated by scripts/config_table.py from the pydantic models: do not edit. Regenerate: {REGENERATE} -->",
        "", "# Configuration reference", "",
        "Every field serve_config.yaml and the admin API accept. `null` is YAML's and JSON's empty value.", "",
        *model_section(), "", *ingress_section(),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
