"""Preference rows read lazily, by row number, from the files that hold them.

`open_pair_source(path)` gives a `PairSource` over
  * JSONL: one file, or a folder or glob of `.jsonl` files; a byte offset per line is kept,
    so reading a row seeks to it;
  * parquet: one file, or a folder or glob of shards (needs pyarrow); a row is read from its
    row group (the cost of random access is one row group: write shards with small ones);
  * a `datasets` directory written by `save_to_disk` (needs datasets): memory-mapped Arrow.
Rows are numbered 0.. across all files in sorted name order. A source holds no row in memory;
it keeps per row at most its offset and line number (JSONL), and it reopens its files in
each process that uses it (a DataLoader's workers), so it can be pickled.

`scan(source, key, skip_bad_rows)` reads every row once, in order and a few at a time, and
checks it (`omni.data.preferences.check_row`: columns, prompt, label, and that each image is whole),
returning the numbers of the good rows and the counts. A bad row is an error naming its file
and row, or with `skip_bad_rows` is skipped, counted and logged. `load_preference_pairs`
reads a whole (small) set, decoded, into memory, for tests and tools.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from omni.data.preferences import BadRow, PreferencePair, TiedRow, check_row, decode_row

logger = logging.getLogger(__name__)

SCAN_BATCH = 256  # rows read at a time while scanning a table


def _import(module: str, what: str, package: str, library: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as error:
        raise ImportError(f"reading {what} needs {library}: pip install {package}") from error


class PairSource:
    """Random access to the rows of a preference data set (see the module docstring)."""

    base_dir: Path  # image paths in rows are relative to it
    # A video model's pairs: clips of this many frames (`omni.data.preferences`); None: images.
    num_frames: Optional[int] = None
    # Whether the model edits: each pair must name its source image(s) (True) or none (False);
    # None: not checked.
    edit: Optional[bool] = None

    def __len__(self) -> int:
        raise NotImplementedError

    def where(self, row: int) -> Tuple[Path, str]:
        """The file holding `row` and its place in it ("line 3", "row 7"), 1-based."""
        raise NotImplementedError

    def rows(self, numbers: Sequence[int]) -> List[object]:
        """The rows (dicts, or a BadRow for an unreadable line), in the order asked."""
        raise NotImplementedError

    def scan_rows(self) -> Iterator[Tuple[int, object]]:
        """(row number, row) for every row, in order, a few at a time."""
        raise NotImplementedError

    def fingerprint(self) -> Dict[str, object]:
        """What identifies the files read (names, sizes, modification times)."""
        return {"files": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in self.files]}

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_open")}


def _decode_line(raw: bytes):
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return BadRow(f"not UTF-8 text ({error.reason} at byte {error.start})")
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        return BadRow(f"not valid JSON: {error}")


class JsonlSource(PairSource):
    """Non-blank lines of one or more JSONL files."""

    def __init__(self, files: Sequence[Path]):
        self.files = list(files)
        self.base_dir = self.files[0].parent
        offsets, lines, file_ids = array("q"), array("q"), array("i")  # 8 bytes a row, not a Python int
        for file_id, path in enumerate(self.files):
            position = 0
            with path.open("rb") as stream:
                for number, raw in enumerate(stream, start=1):
                    if raw.strip():
                        offsets.append(position)
                        lines.append(number)
                        file_ids.append(file_id)
                    position += len(raw)
        self.offsets = np.frombuffer(offsets, dtype=np.int64)
        self.lines = np.frombuffer(lines, dtype=np.int64)
        self.file_ids = np.frombuffer(file_ids, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, row: int) -> Tuple[Path, str]:
        return self.files[self.file_ids[row]], f"line {self.lines[row]}"

    def _read(self, row: int):
        if not hasattr(self, "_open_streams"):
            self._open_streams = {}
        file_id = int(self.file_ids[row])
        if file_id not in self._open_streams:
            self._open_streams[file_id] = self.files[file_id].open("rb")
        stream = self._open_streams[file_id]
        stream.seek(int(self.offsets[row]))
        return _decode_line(stream.readline())

    def rows(self, numbers: Sequence[int]) -> List[object]:
        return [self._read(int(n)) for n in numbers]

    def scan_rows(self) -> Iterator[Tuple[int, object]]:
        row = 0
        for path in self.files:
            with path.open("rb") as stream:
                for raw in stream:
                    if raw.strip():
                        yield row, _decode_line(raw)
                        row += 1


class ParquetSource(PairSource):
    """Rows of one or more parquet files; a row is located by (file, row group, offset)."""

    def __init__(self, files: Sequence[Path]):
        pq = _import("pyarrow.parquet", f"the parquet file {files[0]}", "pyarrow", "pyarrow")
        self.files = list(files)
        self.base_dir = self.files[0].parent
        group_rows, group_files = [], []
        for file_id, path in enumerate(self.files):
            try:
                metadata = pq.read_metadata(path)
            except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a damaged footer
                raise ValueError(f"{path}: not a readable parquet file ({error})") from None
            for group in range(metadata.num_row_groups):
                group_rows.append(metadata.row_group(group).num_rows)
                group_files.append(file_id)
        # row group g holds rows [group_starts[g], group_starts[g + 1])
        self.group_starts = np.concatenate([[0], np.cumsum(group_rows, dtype=np.int64)])
        self.group_files = np.asarray(group_files, dtype=np.int32)
        file_starts = [self.group_starts[np.searchsorted(self.group_files, f)] for f in range(len(self.files))]
        self.file_starts = np.asarray(file_starts, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.group_starts[-1])

    def where(self, row: int) -> Tuple[Path, str]:
        file_id = int(np.searchsorted(self.file_starts, row, side="right") - 1)
        return self.files[file_id], f"row {row - self.file_starts[file_id] + 1}"

    def _file(self, file_id: int):
        import pyarrow.parquet as pq

        if not hasattr(self, "_open_files"):
            self._open_files = {}
        if file_id not in self._open_files:
            self._open_files[file_id] = pq.ParquetFile(self.files[file_id])
        return self._open_files[file_id]

    def rows(self, numbers: Sequence[int]) -> List[object]:
        numbers = np.asarray(numbers, dtype=np.int64)
        groups = np.searchsorted(self.group_starts, numbers, side="right") - 1
        found: Dict[int, object] = {}
        for group in np.unique(groups):  # each row group read once per batch
            wanted = numbers[groups == group]
            file_id = int(self.group_files[group])
            first_group = int(np.searchsorted(self.group_files, file_id))
            table = self._file(file_id).read_row_group(int(group) - first_group)
            taken = table.take(wanted - self.group_starts[group]).to_pylist()
            found.update(zip(wanted.tolist(), taken))
        return [found[int(n)] for n in numbers]

    def scan_rows(self) -> Iterator[Tuple[int, object]]:
        row = 0
        for file_id in range(len(self.files)):
            for batch in self._file(file_id).iter_batches(batch_size=SCAN_BATCH):
                for values in batch.to_pylist():
                    yield row, values
                    row += 1


class SavedDatasetSource(PairSource):
    """A `datasets` directory (memory-mapped Arrow); image features are read undecoded, so a
    corrupt image is a row error of ours."""

    def __init__(self, path: Path):
        self.path, self.base_dir = path, path
        self.files = sorted(p for p in path.rglob("*") if p.is_file())
        self._open_dataset = None
        self.n_rows = len(self._dataset())

    def _dataset(self):
        if getattr(self, "_open_dataset", None) is None:
            datasets = _import("datasets", f"the saved dataset {self.path}", "datasets", "the datasets library")
            try:
                dataset = datasets.load_from_disk(str(self.path))
            except FileNotFoundError as error:
                raise ValueError(
                    f"{self.path} is a directory but not a dataset saved with save_to_disk: {error}"
                ) from error
            except Exception as error:  # pyarrow's OSError / ArrowInvalid for a cut or damaged file
                raise ValueError(self._damaged(error)) from None
            if isinstance(dataset, datasets.DatasetDict):
                if "train" not in dataset and len(dataset) != 1:
                    raise ValueError(f"{self.path} holds splits {list(dataset)}; save one split or name it 'train'")
                dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
            for name, feature in dataset.features.items():
                if isinstance(feature, datasets.Image):
                    dataset = dataset.cast_column(name, datasets.Image(decode=False))
            self._open_dataset = dataset
        return self._open_dataset

    def _damaged(self, error: Exception) -> str:
        """Which Arrow file of the directory does not read, and what to do."""
        import pyarrow as pa

        for path in sorted(self.path.rglob("*.arrow")):
            try:
                with pa.memory_map(str(path)) as source:
                    pa.ipc.open_stream(source).read_all()
            except Exception as bad:
                return (
                    f"{path}: truncated or not an Arrow file ({bad}); write the saved dataset {self.path} "
                    "again with save_to_disk (or copy it whole)"
                )
        return (
            f"the saved dataset {self.path} does not load ({type(error).__name__}: {error}); write it again with "
            "save_to_disk"
        )

    def __len__(self) -> int:
        return self.n_rows

    def where(self, row: int) -> Tuple[Path, str]:
        return self.path, f"row {row + 1}"

    def rows(self, numbers: Sequence[int]) -> List[object]:
        columns = self._dataset()[[int(n) for n in numbers]]
        return [dict(zip(columns, values)) for values in zip(*columns.values())]

    def scan_rows(self) -> Iterator[Tuple[int, object]]:
        row = 0
        for columns in self._dataset().iter(batch_size=SCAN_BATCH):
            for values in zip(*columns.values()):
                yield row, dict(zip(columns, values))
                row += 1


def _expand(path_text: str, key: str) -> List[Path]:
    """The files a path, folder or glob names."""
    if glob.has_magic(path_text):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(path_text)) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"{key}={path_text}: no file matches the pattern")
        return files
    path = Path(path_text).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{key}={path}: preference data not found")
    if path.is_file():
        return [path]
    for suffix in (".parquet", ".jsonl"):
        files = sorted(path.glob(f"*{suffix}"))
        if files:
            return files
    return []  # a folder without shards: a saved dataset, or nothing usable


def open_pair_source(path: str | os.PathLike, key: str = "data.pairs", num_frames: Optional[int] = None) -> PairSource:
    """A source over the preference data at `path` (file, folder of shards, glob, or
    save_to_disk directory), whose rows hold clips of `num_frames` frames (None: images);
    raises naming `key` when there is nothing to read."""
    source = _open_source(path, key)
    source.num_frames = num_frames
    return source


def _open_source(path, key: str) -> PairSource:
    files = _expand(str(path), key)
    if not files:
        return SavedDatasetSource(Path(path).expanduser())
    suffixes = {f.suffix for f in files}
    if suffixes == {".jsonl"}:
        return JsonlSource(files)
    if suffixes == {".parquet"}:
        return ParquetSource(files)
    raise ValueError(
        f"{key}={path}: unsupported preference file(s) {sorted(suffixes)}; expected .jsonl, .parquet "
        "(a file, a folder or a glob of them) or a save_to_disk directory"
    )


@dataclass
class ScanResult:
    good_rows: np.ndarray  # int64 row numbers of the pairs, in order
    stats: Dict[str, int]  # rows, pairs, skipped_bad, skipped_ties
    first_bad: Optional[str] = None  # the message of the first bad row skipped


def bad_row_message(source: PairSource, row: int, key: str, error: Exception) -> str:
    path, where = source.where(row)
    return f"{key}={path}, {where}: {error}"


def scan(source: PairSource, key: str = "data.pairs", skip_bad_rows: bool = False) -> ScanResult:
    """Check every row (see the module docstring); raises on the first bad row unless
    `skip_bad_rows`, and when no pair is left."""
    good, first_bad = array("q"), None
    stats = {"rows": 0, "pairs": 0, "skipped_bad": 0, "skipped_ties": 0}
    for row, values in source.scan_rows():
        stats["rows"] += 1
        try:
            if isinstance(values, BadRow):
                raise values
            check_row(values, source.base_dir, source.num_frames, source.edit)
            good.append(row)
        except TiedRow:
            stats["skipped_ties"] += 1
        except BadRow as error:
            message = bad_row_message(source, row, key, error)
            if not skip_bad_rows:
                raise ValueError(message) from error
            stats["skipped_bad"] += 1
            first_bad = first_bad or message
            logger.warning("skipping a bad preference row: %s", message)
    stats["pairs"] = len(good)
    name = f"{key}={source.files[0] if len(source.files) == 1 else source.base_dir}"
    if stats["skipped_bad"]:
        logger.warning("%s: skipped %d bad row(s) of %d", name, stats["skipped_bad"], stats["rows"])
    if not good:
        raise ValueError(f"{name}: no preference pairs ({stats})")
    return ScanResult(np.frombuffer(good, dtype=np.int64), stats, first_bad)


def load_preference_pairs(
    path: str | os.PathLike, key: str = "data.pairs", skip_bad_rows: bool = False, num_frames: Optional[int] = None
) -> Tuple[List[PreferencePair], Dict[str, int]]:
    """All pairs of a (small) preference set, decoded, in memory, and the counts {"rows",
    "pairs", "skipped_bad", "skipped_ties"}; training streams them instead
    (`omni.data.pair_loader`)."""
    source = open_pair_source(path, key, num_frames)
    found = scan(source, key, skip_bad_rows)
    pairs = []
    for row, values in zip(found.good_rows.tolist(), source.rows(found.good_rows)):
        try:
            pairs.append(decode_row(values, source.base_dir, source.num_frames))
        except BadRow as error:  # a body that fails to decode behind a readable header
            if not skip_bad_rows:
                raise ValueError(bad_row_message(source, row, key, error)) from error
            found.stats["skipped_bad"] += 1
    found.stats["pairs"] = len(pairs)
    return pairs, found.stats
