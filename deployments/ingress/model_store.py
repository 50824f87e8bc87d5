"""The list of models loaded through the admin API, kept on disk so a restarted cluster restores them.

Serve forgets applications added at run time when the cluster restarts (DESIGN.md).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from pydantic import ValidationError

from deployments.config import ModelConfig

logger = logging.getLogger("ray.serve.orchard")
STATE_FILE = "models.json"


class ModelStore:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / STATE_FILE

    def load(self) -> list[ModelConfig]:
        if not self.path.is_file():
            return []
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            logger.error("cannot read %s (%s); starting without API-loaded models", self.path, exc)
            return []
        entries = raw.get("models") if isinstance(raw, dict) else None
        if not isinstance(entries, list):
            logger.error("%s holds no list of models; starting without API-loaded models", self.path)
            return []
        configs = []
        for entry in entries:
            try:
                configs.append(ModelConfig.model_validate(entry))
            except ValidationError as exc:  # one bad entry must not hide the others
                logger.warning("not restoring stored model %s: %s", _entry_name(entry), _one_line(exc))
        return configs

    def save(self, configs: list[ModelConfig]) -> None:
        """Write atomically: a crash mid-write leaves the previous list intact."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"models": [c.model_dump(mode="json", exclude_defaults=True) for c in configs]}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".models-", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(payload, out, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _entry_name(entry: object) -> str:
    if isinstance(entry, dict):
        name = entry.get("model_id") or entry.get("model_path")
        if isinstance(name, str):
            return f"'{name[:80]}'" + ("..." if len(name) > 80 else "")
    return "(unnamed)"


def _one_line(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in exc.errors())
