"""The latent cache of a preference set (`data.latent_cache=DIR`): VAE latents of the chosen
and rejected images and the prompts' text conditioning, computed once and memory-mapped.

    python scripts/cache_latents.py algorithm=dpo data=pairs data.pairs=PAIRS data.latent_cache=DIR
    (or the first run with data.latent_cache=DIR builds it before training)

Layout of DIR:
    building.json         the key of the cache being built (written first)
    shard_<start>_<end>/  entries [start, end): chosen.npy, rejected.npy, cond_<field>.npy,
                          valid.npy (False: an image that did not decode, skipped)
    rows.npy              the data's good row numbers, entry i = pair at position i
    manifest.json         the key, shards, fields and counts (written last: its presence
                          means the cache is complete)
Each shard is written to a temporary directory and renamed into place (`omni.atomic`), so an
interrupted build leaves whole shards only, and the next build continues after them.

The key names what the numbers depend on: the model family, a fingerprint of the VAE and of
the text encoders and tokenizers (file contents), the resolution, the maximum text length,
the model dtype and the data files (names, sizes, modification times). A cache whose key
differs from the run's is refused with a message naming each difference.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from tqdm import tqdm

from omni.atomic import write_directory, write_text
from omni.data.pair_loader import PairImages, chunks, pair_loader
from omni.data.preferences import uint8_to_batch

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
ENCODE_CHUNK = 32  # pairs decoded and encoded at a time
SHARD_BYTES = 256 * 2**20  # a shard holds about this much
WHOLE_HASH_LIMIT = 256 * 2**20  # larger weight files are fingerprinted by sampled blocks
SAMPLE_BLOCK = 2**20


# ----------------------------------------------------------------------------- the key


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha1(str(size).encode())
    with path.open("rb") as stream:
        if size <= WHOLE_HASH_LIMIT:
            for block in iter(lambda: stream.read(SAMPLE_BLOCK), b""):
                digest.update(block)
        else:  # head, middle and tail of a multi-GB text encoder
            for offset in (0, size // 2, size - SAMPLE_BLOCK):
                stream.seek(offset)
                digest.update(stream.read(SAMPLE_BLOCK))
    return digest.hexdigest()[:16]


def component_digest(folder: Path) -> Optional[str]:
    """A digest of every file of a pipeline component folder (None if it has none)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha1()
    for path in files:
        digest.update(f"{path.relative_to(folder)}:{_file_digest(path)}\n".encode())
    return digest.hexdigest()[:16]


def encoder_fingerprint(model_dir: Path, text_encoders) -> Dict[str, Optional[str]]:
    """Digests of what encodes the data: the VAE, each text encoder and each tokenizer."""
    names = ["vae", *text_encoders, *sorted(p.name for p in model_dir.glob("tokenizer*"))]
    return {name: component_digest(model_dir / name) for name in names}


def cache_key(cfg, source, family, model_dir: Path) -> dict:
    """What the cached numbers depend on (see the module docstring)."""
    data_files = [
        [p.name, size, mtime] for (p, size, mtime) in ((Path(f), s, m) for f, s, m in source.fingerprint()["files"])
    ]
    return {
        "version": CACHE_VERSION,
        "family": family.name,
        "encoders": encoder_fingerprint(Path(model_dir), family.text_encoders),
        "resolution": cfg.rollout.resolution,
        **({"num_frames": cfg.rollout.num_frames} if family.video else {}),  # image caches keep their key
        "max_sequence_length": cfg.model.max_sequence_length,
        "dtype": cfg.model.dtype,
        "vae_inversion_steps": cfg.model.vae_inversion_steps,
        "data": data_files,
        "model": str(model_dir),  # for messages: which checkpoint the encoders came from
    }


AUTO = "auto"


def cache_directory(setting: Optional[str], key: dict, cache_dir, inversion_steps: int) -> Optional[Path]:
    """Where the run's latent cache lives (`data.latent_cache`): a directory the user named;
    for "auto", when the images are encoded by inverting the decoder (`inversion_steps`
    passes a pair, the tiny models), a directory under `cache_dir` named by the key, so runs
    on the same model and data share it; otherwise None (pairs encoded as training reaches them)."""
    if not setting or (setting == AUTO and not inversion_steps):
        return None
    if setting != AUTO:
        return Path(setting).expanduser()
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "latents" / f"{key['family']}-{digest}"


KEY_NAMES = {
    "version": "cache format version",
    "family": "model.family",
    "resolution": "rollout.resolution",
    "num_frames": "rollout.num_frames",
    "max_sequence_length": "model.max_sequence_length",
    "dtype": "model.dtype",
    "vae_inversion_steps": "model.vae_inversion_steps",
}


def key_differences(made: dict, run: dict) -> List[str]:
    """Each way the key a cache was made with differs from this run's, in words."""
    found = []
    for field, name in KEY_NAMES.items():
        if made.get(field) != run.get(field):
            found.append(f"it was made with {name}={made.get(field)}, this run has {name}={run.get(field)}")
    for component in sorted(set(made.get("encoders", {})) | set(run.get("encoders", {}))):
        if made.get("encoders", {}).get(component) != run["encoders"].get(component):
            what = "VAE" if component == "vae" else component
            found.append(
                f"its {what} differs from this run's ({component}/ of {made.get('model')} vs {run.get('model')})"
            )
    if made.get("data") != run.get("data"):
        found.append("it was made from other preference data (data.pairs files, sizes or modification times differ)")
    return found


def check_key(directory: Path, made: dict, run: dict) -> None:
    differences = key_differences(made, run)
    if differences:
        raise ValueError(
            f"data.latent_cache={directory} was made for another model or data: "
            + "; ".join(differences)
            + ". Remove it, or choose another data.latent_cache directory"
        )


# ----------------------------------------------------------------------------- arrays


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: keep its bits
        return tensor.contiguous().view(torch.int16).numpy()
    return tensor.contiguous().numpy()


def _to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def _save_npy(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as stream:
        np.save(stream, array)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- building


def is_complete(directory) -> bool:
    return (Path(directory).expanduser() / "manifest.json").is_file()


@contextlib.contextmanager
def build_lock(directory: Path):
    """Held while a cache is checked and built: two runs that want the same cache (the
    default one under model.cache_dir) build it once, the second reading what the first built.
    An advisory flock, released by the kernel however the holder ends."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "a+") as stream:
        fcntl.flock(stream, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(stream, fcntl.LOCK_UN)


def _as_list(items):
    return items


def _existing_shards(directory: Path) -> List[Tuple[int, int, str]]:
    found = []
    for path in directory.glob("shard_*_*"):
        if path.is_dir():
            start, end = (int(x) for x in path.name.split("_")[1:3])
            found.append((start, end, path.name))
    return sorted(found)


def _write_shard(
    directory: Path, start: int, end: int, parts: Dict[str, List[np.ndarray]], dtypes: Dict[str, str]
) -> str:
    def write(tmp: Path) -> None:
        for name, arrays in parts.items():
            np.save(tmp / f"{name}.npy", np.concatenate(arrays))
        (tmp / "dtypes.json").write_text(json.dumps(dtypes))

    name = f"shard_{start:09d}_{end:09d}"
    write_directory(directory / name, write)
    return name


def _encode_chunk(
    items, encoder, max_sequence_length: int
) -> Tuple[Dict[str, torch.Tensor], Dict[str, str], np.ndarray]:
    """Latents and conditioning of a chunk of decoded pairs (unreadable ones as zeros)."""
    good = [item for item in items if not isinstance(item, str)]
    valid = np.array([not isinstance(item, str) for item in items])
    if not good:
        raise ValueError("a chunk of pairs without any readable image; run with fewer bad rows")
    images = lambda side: uint8_to_batch(torch.stack([item[side] for item in good]))  # noqa: E731
    tensors = {"chosen": encoder.encode_images(images(1)), "rejected": encoder.encode_images(images(2))}
    cond = encoder.encode_prompts([item[0] for item in good], 1.0, max_sequence_length)
    tensors.update({f"cond_{name}": value for name, value in cond.tensors().items()})
    out, dtypes = {}, {}
    for name, value in tensors.items():
        full = torch.zeros((len(items), *value.shape[1:]), dtype=value.dtype)
        full[torch.from_numpy(valid)] = value
        out[name], dtypes[name] = full, str(value.dtype).removeprefix("torch.")
    return out, dtypes, valid


def build_cache(
    directory,
    key: dict,
    source,
    rows: np.ndarray,
    stats: dict,
    encoder,
    resolution: int,
    max_sequence_length: int,
    skip_bad_rows: bool = False,
    first_bad: Optional[str] = None,
    num_workers: int = 0,
    progress: bool = False,
) -> Path:
    """Encode every good pair (positions 0..len(rows)-1) with `encoder` (`encode_images`,
    `encode_prompts`: a worker or a rollout engine) into shards under `directory`, after the
    shards an interrupted build left; then write rows.npy and the manifest. A pair whose
    image does not decode is an error naming its file and row, or with `skip_bad_rows` an
    entry marked invalid and counted in the stats as a bad row."""
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    building = directory / "building.json"
    if building.is_file():
        try:
            made = json.loads(building.read_text())["key"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise damaged(directory, building, f"is not readable ({type(error).__name__}: {error})") from None
        check_key(directory, made, key)
    write_text(building, json.dumps({"key": key}))
    shards = _existing_shards(directory)
    start = shards[-1][1] if shards else 0
    dataset = PairImages(source, rows, np.arange(len(rows)), resolution, "data.pairs", skip_bad_rows)
    stats = dict(stats)
    todo = [list(range(start + c[0], start + c[-1] + 1)) for c in chunks(len(rows) - start, ENCODE_CHUNK)]
    loader = pair_loader(dataset, todo, num_workers, collate_fn=_as_list)
    parts: Dict[str, List[np.ndarray]] = {}
    dtypes: Dict[str, str] = {}
    shard_start, held = start, 0
    for items in tqdm(loader, desc="caching latents", total=len(todo), disable=not progress):
        tensors, dtypes, valid = _encode_chunk(items, encoder, max_sequence_length)
        for message in (item for item in items if isinstance(item, str)):
            logger.warning("skipping a preference pair whose image does not decode: %s", message)
            first_bad = first_bad or message
        for name, value in {**tensors, "valid": torch.from_numpy(valid)}.items():
            parts.setdefault(name, []).append(_to_numpy(value))
            held += parts[name][-1].nbytes
        stop = shard_start + sum(len(v) for v in parts["valid"])
        if held >= SHARD_BYTES or stop == len(rows):
            shards.append((shard_start, stop, _write_shard(directory, shard_start, stop, parts, dtypes)))
            parts, shard_start, held = {}, stop, 0
    if not dtypes:  # every shard was already there: read the dtypes back
        dtypes = _shard_dtypes(directory / shards[0][2])
    valid = [_load_array(directory, directory / name / "valid.npy", end - begin) for begin, end, name in shards]
    stats["skipped_bad"] += sum(int((~np.asarray(v)).sum()) for v in valid)
    _save_npy(directory / "rows.npy", np.asarray(rows, dtype=np.int64))
    manifest = {
        "key": key,
        "count": len(rows),
        "shards": [list(s) for s in shards],
        "dtypes": dtypes,
        "stats": stats,
        "first_bad": first_bad,
    }
    write_text(directory / "manifest.json", json.dumps(manifest, indent=1))
    building.unlink()
    return directory


def _shard_dtypes(shard: Path) -> Dict[str, str]:
    try:
        return json.loads((shard / "dtypes.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise damaged(
            shard.parent, shard / "dtypes.json", f"is not readable ({type(error).__name__}: {error})"
        ) from None


# ----------------------------------------------------------------------------- reading


class CacheDamaged(ValueError):
    """A file of a complete cache is missing, truncated or unreadable."""


def rebuild_hint(directory: Path) -> str:
    return (
        f"rebuild the cache: remove {directory} and run again (a run builds a missing cache before training), "
        "or build it ahead with python scripts/cache_latents.py and the run's overrides"
    )


def damaged(directory: Path, path: Path, what: str) -> CacheDamaged:
    return CacheDamaged(f"data.latent_cache={directory}: {path} {what}; {rebuild_hint(directory)}")


def _read_manifest(directory: Path) -> dict:
    path = directory / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise damaged(directory, path, f"is not a readable manifest ({type(error).__name__}: {error})") from None
    missing = [
        k for k in ("key", "count", "shards", "dtypes", "stats") if not isinstance(manifest, dict) or k not in manifest
    ]
    if missing:
        raise damaged(directory, path, f"lacks {missing}")
    return manifest


def _load_array(directory: Path, path: Path, rows: Optional[int]) -> np.ndarray:
    """The array of `path`, memory-mapped, checked to hold `rows` entries (None: any)."""
    try:
        array = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        raise damaged(directory, path, "is missing") from None
    except (OSError, ValueError, EOFError) as error:  # numpy's truncated header or data
        raise damaged(directory, path, f"is truncated or not a .npy array ({error})") from None
    if rows is not None and len(array) != rows:
        raise damaged(directory, path, f"holds {len(array)} entries, the manifest says {rows}")
    return array


def _load_shard(directory: Path, start: int, end: int, name: str, fields) -> Dict[str, np.ndarray]:
    shard = directory / name
    if not shard.is_dir():
        raise damaged(directory, shard, f"(the shard of entries {start}-{end} in manifest.json) is missing")
    return {field: _load_array(directory, shard / f"{field}.npy", end - start) for field in fields}


class LatentCache:
    """A complete cache, memory-mapped: `read(positions)` gathers entries from its shards.
    Every file the manifest names is opened and its length checked here, so a missing or
    truncated one is named before any model loads."""

    def __init__(self, directory: Path, manifest: dict, conditioning: type):
        self.directory, self.manifest, self.conditioning = directory, manifest, conditioning
        self.rows = _load_array(directory, directory / "rows.npy", int(manifest["count"]))
        self.stats = manifest["stats"]
        self.starts = np.asarray([s[0] for s in manifest["shards"]], dtype=np.int64)
        fields = [*manifest["dtypes"], "valid"]
        self.arrays = [_load_shard(directory, start, end, name, fields) for start, end, name in manifest["shards"]]

    def __len__(self) -> int:
        return int(self.manifest["count"])

    def read(self, positions: np.ndarray):
        """(chosen latents, rejected latents, conditioning, valid) of the entries at `positions`."""
        positions = np.asarray(positions, dtype=np.int64)
        shard_of = np.searchsorted(self.starts, positions, side="right") - 1
        gathered: Dict[str, np.ndarray] = {}
        for shard in np.unique(shard_of):
            mask = shard_of == shard
            local = positions[mask] - self.starts[shard]
            for name, array in self.arrays[shard].items():
                if name not in gathered:
                    gathered[name] = np.empty((len(positions), *array.shape[1:]), dtype=array.dtype)
                gathered[name][mask] = array[local]
        dtypes = self.manifest["dtypes"]
        tensors = {name: _to_torch(value, dtypes[name]) for name, value in gathered.items() if name != "valid"}
        cond = self.conditioning.from_tensors({k[5:]: v for k, v in tensors.items() if k.startswith("cond_")})
        return tensors["chosen"], tensors["rejected"], cond, gathered["valid"].astype(bool)


def open_cache(directory, key: dict, conditioning: type, skip_bad_rows: bool) -> LatentCache:
    """The complete cache at `directory`, after checking it was made for this run's key."""
    directory = Path(directory).expanduser()
    manifest = _read_manifest(directory)
    check_key(directory, manifest["key"], key)
    if manifest["stats"].get("skipped_bad") and not skip_bad_rows:
        raise ValueError(
            f"{manifest.get('first_bad') or 'the preference data has bad rows'} (data.latent_cache={directory} was "
            f"built skipping {manifest['stats']['skipped_bad']} bad row(s)); set data.skip_bad_rows=true to train "
            "without them"
        )
    return LatentCache(directory, manifest, conditioning)
