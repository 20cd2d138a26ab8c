"""Bring your own prompts: JSONL or Parquet rows with a prompt column and an answer column.

Rows that cannot be used (broken JSON, missing or non-text fields) are counted per reason and
reported, never a crash; a column that no row has is a clear error naming the columns seen.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from laminar.config import ConfigError, DatasetConfig
from laminar.types import PromptItem


@dataclass
class LoadReport:
    path: str
    total_rows: int = 0
    malformed: Counter = field(default_factory=Counter)  # reason -> rows skipped

    @property
    def num_malformed(self) -> int:
        return sum(self.malformed.values())

    def summary(self) -> str:
        kept = self.total_rows - self.num_malformed
        text = f"{self.path}: {kept} of {self.total_rows} rows used"
        if self.malformed:
            text += "; skipped " + ", ".join(f"{n} {why}" for why, n in self.malformed.most_common())
        return text


def load_dataset(cfg: DatasetConfig) -> tuple[list[PromptItem], LoadReport]:
    path = Path(cfg.path)
    if not path.is_file():
        raise ConfigError(f"task.dataset.path='{cfg.path}' does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows, report = _read_jsonl(path)
    elif suffix == ".parquet":
        rows, report = _read_parquet(path, cfg)
    else:
        raise ConfigError(f"task.dataset.path='{cfg.path}' has an unknown format '{suffix}'; "
                          "use .jsonl or .parquet")
    columns_seen: set[str] = set()
    for row in rows:
        columns_seen.update(row)
    for key, column in (("prompt_column", cfg.prompt_column), ("answer_column", cfg.answer_column)):
        if rows and column not in columns_seen:
            raise ConfigError(f"task.dataset.{key}='{column}' is not a column of {cfg.path}; "
                              f"columns found: {', '.join(sorted(columns_seen)) or '(none)'}")
    items: list[PromptItem] = []
    for row in rows:
        prompt, answer = row.get(cfg.prompt_column), row.get(cfg.answer_column)
        if prompt is None or answer is None:
            report.malformed["rows missing a field"] += 1
        elif not isinstance(prompt, str) or not isinstance(answer, (str, int, float)):
            report.malformed["rows with a non-text field"] += 1
        elif not prompt.strip():
            report.malformed["rows with an empty prompt"] += 1
        else:
            items.append(PromptItem(index=len(items), prompt=prompt, answer=str(answer)))
    if not items:
        raise ConfigError(f"task.dataset.path='{cfg.path}' has no usable rows ({report.summary()})")
    return items, report


def _read_jsonl(path: Path) -> tuple[list[dict], LoadReport]:
    report = LoadReport(str(path))
    rows = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            report.total_rows += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                report.malformed["lines of broken JSON"] += 1
                continue
            if not isinstance(row, dict):
                report.malformed["lines that are not objects"] += 1
                continue
            rows.append(row)
    return rows, report


def _read_parquet(path: Path, cfg: DatasetConfig) -> tuple[list[dict], LoadReport]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise ConfigError(f"task.dataset.path='{cfg.path}' is not a readable Parquet file: {e}") from None
    report = LoadReport(str(path), total_rows=table.num_rows)
    for key, column in (("prompt_column", cfg.prompt_column), ("answer_column", cfg.answer_column)):
        if column not in table.column_names:
            raise ConfigError(f"task.dataset.{key}='{column}' is not a column of {cfg.path}; "
                              f"columns found: {', '.join(table.column_names)}")
    return table.select([cfg.prompt_column, cfg.answer_column]).to_pylist(), report
