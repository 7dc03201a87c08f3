"""Reading and writing row files (parquet, jsonl, json) as lists of plain dicts.

Datasets here are small enough to hold in memory as Python rows (prompts, not
pre-tokenised corpora), so every format is read into ``list[dict]`` once and validated
up front; every error names the file, and where it can the row (0-based) and column.
Nested verl columns (``reward_model.ground_truth``, ``extra_info``, chat ``prompt`` lists)
come back as dicts and lists in both formats.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

SUFFIXES = (".parquet", ".jsonl", ".json")


class DataFileError(ValueError):
    """A data file is missing, unreadable, empty, or has a bad column/row."""


def read_rows(path: str | Path) -> list[dict]:
    """All rows of one parquet/jsonl/json file, as dicts."""
    path = Path(path)
    if not path.exists():
        raise DataFileError(f"data file {path} does not exist; check the path (relative paths are from {Path.cwd()})")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            # one file: ParquetFile (read_table imports pyarrow.dataset, 0.2 s); a directory of parts: read_table
            rows = (pq.read_table(path) if path.is_dir() else pq.ParquetFile(path).read()).to_pylist()
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise DataFileError(f"data file {path} is not a readable parquet file: {exc}") from exc
    elif suffix in (".jsonl", ".json"):
        try:
            rows = _read_json(path) if suffix == ".json" else _read_jsonl(path)
        except UnicodeDecodeError:  # JSON is UTF-8 (a byte-order mark allowed)
            raise DataFileError(f"data file {path} is not UTF-8 text ({_first_non_utf8(path)}); "
                                "save it as UTF-8") from None
    else:
        raise DataFileError(f"data file {path}: unsupported suffix {suffix!r}; use one of {', '.join(SUFFIXES)}")
    if not rows:
        raise DataFileError(f"data file {path} has no rows; generate data with `minihf make-data` or check the file")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataFileError(f"data file {path}, row {i}: expected an object with named columns, got {type(row).__name__}")
    return rows


def _first_non_utf8(path: Path) -> str:
    """Where a file stops being UTF-8: its line and byte column (the decoder's own offset is
    into a chunk, not the file)."""
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"line {line_no}, byte {exc.start + 1}: {exc.reason}"
    return "a multi-byte character cut at the end"


def _read_json(path: Path) -> list:
    text = path.read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text) if text.strip() else []
    except json.JSONDecodeError:
        return _read_jsonl(path)  # many ".json" files are really JSON lines
    if not isinstance(data, list):
        raise DataFileError(f"data file {path}: a .json file must hold a list of row objects, got {type(data).__name__}")
    return data


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataFileError(f"data file {path}, line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
    return rows


def read_many(paths: str | Path | Sequence[str | Path]) -> list[tuple[Path, int, dict]]:
    """Rows of several files as ``(file, row_index_in_file, row)``, for error messages."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DataFileError("no data files given; pass at least one parquet/jsonl path")
    out = []
    for p in paths:
        out.extend((Path(p), i, row) for i, row in enumerate(read_rows(p)))
    return out


def require_columns(path: Path, rows: Iterable[dict], columns: Sequence[str]) -> None:
    """Raise naming the file and the missing column if any row lacks one of ``columns``."""
    for i, row in enumerate(rows):
        missing = [c for c in columns if c not in row]
        if missing:
            raise DataFileError(
                f"data file {path}, row {i}: missing column(s) {missing}; found {sorted(row)}. "
                f"Rows need {list(columns)} (verl format)"
            )


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as parquet or jsonl, chosen by the suffix, under a temporary name renamed
    into place when complete (an interrupted write leaves the old file, or none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix not in (".parquet", ".jsonl"):
        raise DataFileError(f"write_rows: unsupported suffix {path.suffix!r} for {path}; use .parquet or .jsonl")
    tmp = path.with_name(f".{path.name}.partial")
    try:
        _write_rows(rows, path, tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def _write_rows(rows: list[dict], path: Path, tmp: Path) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # every row's columns (from_pylist takes them from the first row and drops any other)
        columns = list(dict.fromkeys(k for row in rows for k in row))
        try:
            table = pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DataFileError(
                f"write_rows: cannot write {path} as parquet, a column mixes types ({exc}); "
                "give each column one type or write .jsonl"
            ) from exc
        pq.write_table(table, tmp)
    else:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def describe(value: Any) -> str:
    """Short type description for error messages."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
