"""The pairs offline DPO trains on, as `PairBatch`es of latents and text conditioning.

Read before any model loads: the data is scanned (bad rows named or skipped and counted) or,
with a complete `data.latent_cache`, its manifest is checked against the run and the scan
skipped. Then one of two providers serves batches:
  * `StreamedPairs`: the pairs are read and decoded in a DataLoader (`data.num_workers`)
    and encoded by the worker's VAE and text encoders, 32 train positions at a time, as
    the steps reach them;
  * `CachedPairs`: each step's latents and embeddings are read from the memory-mapped cache
    (`omni.data.latent_cache`), built once from the stream if it is not complete yet.
Both serve the same pairs in the same order (`omni.data.pair_loader`). The numbers differ
only by the encoders' rounding for another batch (the cache encodes 32 pairs at a time in
file order, the stream 32 at a time in training order): latents agree to ~1e-5 on the CPU.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from omni.data import latent_cache
from omni.data.pair_loader import PairImages, TrainBatches, batch_positions, chunks, pair_loader, split_positions
from omni.data.pair_sources import PairSource, open_pair_source, scan
from omni.models import get_family
from omni.models.base import Conditioning

logger = logging.getLogger(__name__)

EVAL_CHUNK = 64  # held-out pairs scored at a time
ENCODE_CHUNK = 32  # training pairs decoded and encoded at a time


@dataclass
class PairBatch:
    """Latents of chosen and rejected images and their prompts' conditioning, row-aligned."""

    x0_chosen: torch.Tensor
    x0_rejected: torch.Tensor
    cond: Conditioning

    def __len__(self) -> int:
        return len(self.x0_chosen)

    def select(self, rows) -> "PairBatch":
        return PairBatch(
            self.x0_chosen[rows].clone(), self.x0_rejected[rows].clone(), self.cond.apply(lambda t: t[rows].clone())
        )

    @staticmethod
    def cat(parts: List["PairBatch"]) -> "PairBatch":
        conds = [p.cond for p in parts]
        return PairBatch(
            torch.cat([p.x0_chosen for p in parts]),
            torch.cat([p.x0_rejected for p in parts]),
            type(conds[0]).cat(conds),
        )


def model_dir(model) -> Path:
    """The checkpoint directory whose encoders a run uses (the tiny model is built on first use)."""
    if model.tiny_seed is not None:
        return Path(get_family(model.family).tiny_path(model.cache_dir, model.tiny_seed))
    return Path(model.path).expanduser()


class PairData:
    """The data of a run: its source, its good rows and counts, and the split (read before
    any model loads)."""

    def __init__(self, cfg, key: str = "data.pairs"):
        data = cfg.data
        self.cfg, self.key = cfg, key
        family = get_family(cfg.model.family)
        self.source: PairSource = open_pair_source(data.pairs, key, cfg.rollout.num_frames if family.video else None)
        self.source.edit = family.edit
        self.cache: Optional[latent_cache.LatentCache] = None
        self.first_bad: Optional[str] = None
        self.conditioning = family.conditioning
        wanted = data.latent_cache and (data.latent_cache != latent_cache.AUTO or cfg.model.vae_inversion_steps)
        self.cache_key = latent_cache.cache_key(cfg, self.source, family, model_dir(cfg.model)) if wanted else None
        self.cache_dir = (
            None
            if self.cache_key is None
            else latent_cache.cache_directory(
                data.latent_cache, self.cache_key, cfg.model.cache_dir, cfg.model.vae_inversion_steps
            )
        )
        if self.cache_dir is not None and latent_cache.is_complete(self.cache_dir):
            self.cache = latent_cache.open_cache(self.cache_dir, self.cache_key, self.conditioning, data.skip_bad_rows)
            self.rows, self.stats = self.cache.rows, dict(self.cache.stats)
        else:
            found = scan(self.source, key, data.skip_bad_rows)
            self.rows, self.stats, self.first_bad = found.good_rows, found.stats, found.first_bad
        self.train, held_out = split_positions(len(self.rows), data.pairs_eval_fraction, cfg.seed)
        self.held_out = held_out[: data.pairs_eval_max]  # the rest of the share is neither trained on nor scored
        if len(self.held_out) < len(held_out):
            logger.info(
                "evaluating on %d of the %d held-out pairs (data.pairs_eval_max=%d)",
                len(self.held_out),
                len(held_out),
                data.pairs_eval_max,
            )

    def ensure_cache(self, encoder, resolution: int, max_sequence_length: int, progress: bool) -> None:
        """Build the latent cache with `encoder` (a worker or a rollout engine) unless it is
        complete, then open it."""
        data = self.cfg.data
        if self.cache is not None:
            return
        with latent_cache.build_lock(self.cache_dir):
            if not latent_cache.is_complete(self.cache_dir):  # another run may have built it meanwhile
                logger.info(
                    "encoding the %d pairs once into the latent cache %s (data.latent_cache)",
                    len(self.rows),
                    self.cache_dir,
                )
                latent_cache.build_cache(
                    self.cache_dir,
                    self.cache_key,
                    self.source,
                    self.rows,
                    self.stats,
                    encoder,
                    resolution,
                    max_sequence_length,
                    data.skip_bad_rows,
                    self.first_bad,
                    data.num_workers,
                    progress,
                )
            cache = latent_cache.open_cache(self.cache_dir, self.cache_key, self.conditioning, data.skip_bad_rows)
        if len(cache.rows) != len(self.rows) or not np.array_equal(cache.rows, self.rows):
            raise ValueError(
                f"data.latent_cache={self.cache_dir} holds other rows than this run's scan of data.pairs; remove it "
                "to rebuild"
            )
        self.cache, self.stats = cache, dict(cache.stats)

    def provider(self, worker, options, progress: bool) -> "Provider":
        """The batches of the run: from the cache (built now if missing), or streamed."""
        if self.cache_dir is not None:
            self.ensure_cache(worker, options.resolution, options.max_sequence_length, progress)
            return CachedPairs(self)
        return StreamedPairs(self, worker, options)


class Provider:
    """Training batches from a data position on, and held-out batches in chunks."""

    def __init__(self, data: PairData):
        self.data, self.cfg = data, data.cfg
        self.dropped = 0  # pairs left out of their batch for an image that did not decode

    def train_batches(self, consumed: int) -> Iterator:
        raise NotImplementedError

    def eval_batches(self) -> Iterator:
        raise NotImplementedError


class StreamedPairs(Provider):
    def __init__(self, data: PairData, worker, options):
        super().__init__(data)
        self.worker, self.options = worker, options

    def _dataset(self, positions: np.ndarray) -> PairImages:
        data = self.cfg.data
        return PairImages(
            self.data.source, self.data.rows, positions, self.options.resolution, self.data.key, data.skip_bad_rows
        )

    def _encode(self, decoded):
        if decoded.dropped:
            self.dropped += len(decoded.dropped)
            for message in decoded.dropped:
                logger.warning("skipping a preference pair whose image does not decode: %s", message)
        if not len(decoded):
            return None
        worker, length = self.worker, self.options.max_sequence_length
        cond = worker.encode_prompts(decoded.prompts, 1.0, length)
        return PairBatch(worker.encode_images(decoded.chosen), worker.encode_images(decoded.rejected), cond)

    def train_batches(self, consumed: int) -> Iterator:
        """Each step's pairs, encoded ENCODE_CHUNK train positions at a time: chunk k always
        holds positions [k * ENCODE_CHUNK, (k + 1) * ENCODE_CHUNK), whatever the batch size
        or the position a run resumes at, so every pair is encoded in the same company (the
        encoders round differently for another batch) and the encoders run on full batches."""
        batch_size, n_train = self.cfg.trainer.batch_size, len(self.data.train)
        start = consumed - consumed % ENCODE_CHUNK
        sampler = TrainBatches(start, ENCODE_CHUNK, n_train, self.cfg.seed)
        loader = iter(pair_loader(self._dataset(self.data.train), sampler, self.cfg.data.num_workers))
        held: List[Tuple[np.ndarray, Optional[PairBatch]]] = []  # (positions, their encodings) of whole chunks
        while True:
            while start < consumed + batch_size:
                decoded = next(loader)
                held.append((start + np.asarray(decoded.kept, dtype=np.int64), self._encode(decoded)))
                start += ENCODE_CHUNK
            parts = [
                pairs.select(
                    torch.from_numpy(np.flatnonzero((positions >= consumed) & (positions < consumed + batch_size)))
                )
                for positions, pairs in held
                if pairs is not None
            ]
            parts = [part for part in parts if len(part)]
            yield PairBatch.cat(parts) if parts else None
            consumed += batch_size
            held = [(positions, pairs) for positions, pairs in held if positions.size and positions.max() >= consumed]

    def eval_batches(self) -> Iterator:
        held_out = self.data.held_out
        loader = pair_loader(self._dataset(held_out), chunks(len(held_out), EVAL_CHUNK), self.cfg.data.num_workers)
        for decoded in loader:
            yield self._encode(decoded)


class CachedPairs(Provider):
    def _batch(self, positions: np.ndarray):
        chosen, rejected, cond, valid = self.data.cache.read(positions)
        if not valid.all():  # already counted in the cache's stats
            keep = torch.from_numpy(valid)
            chosen, rejected, cond = chosen[keep], rejected[keep], cond.apply(lambda t: t[keep])
        return PairBatch(chosen, rejected, cond) if len(chosen) else None

    def train_batches(self, consumed: int) -> Iterator:
        batch_size, train = self.cfg.trainer.batch_size, self.data.train
        while True:
            yield self._batch(train[batch_positions(consumed, batch_size, len(train), self.cfg.seed)])
            consumed += batch_size

    def eval_batches(self) -> Iterator:
        held_out = self.data.held_out
        for chunk in chunks(len(held_out), EVAL_CHUNK):
            yield self._batch(held_out[chunk])


def split_digest(positions: np.ndarray) -> str:
    """A short digest of the train positions: a resumed run must walk the same ones."""
    return hashlib.sha1(np.ascontiguousarray(positions, dtype=np.int64).tobytes()).hexdigest()[:16]
