"""The latent cache with the real tiny SD3 encoders: what it holds is what the encoders give,
later runs memory-map it without scanning, a cache made for another resolution, VAE or data
is refused naming the difference, an interrupted build continues after its whole shards,
and pairs whose image does not decode are kept out (or stop a run without skip_bad_rows)."""

import json
import shutil

import numpy as np
import pytest
import torch

from omni.algorithms.dpo_pairs import PairData
from omni.data import latent_cache
from omni.data.pair_loader import PairImages, collate_pairs
from omni.data.synthetic_pairs import write_synthetic_pairs
from omni.models import get_family
from omni.rollout.diffusers_engine import load_diffusers_engine
from omni.validation import validate
from tests.conftest import compose_config
from tests.data.damage import scramble_png_pixels, truncate


@pytest.fixture(scope="module")
def small_pairs(tmp_path_factory):
    return write_synthetic_pairs(tmp_path_factory.mktemp("pairs"), 12, resolution=64, seed=1)


@pytest.fixture(scope="module")
def engine(tiny_sd3_dir):
    return load_diffusers_engine(get_family("sd3"), tiny_sd3_dir, torch.device("cpu"), torch.float32, 4, load_base=True)


def _cfg(tiny_cache, pairs, cache_dir, *overrides):
    return validate(
        compose_config(
            [
                f"model.cache_dir={tiny_cache}",
                "algorithm=dpo",
                "data=pairs",
                f"data.pairs={pairs}",
                f"data.latent_cache={cache_dir}",
                *overrides,
            ]
        )
    )


def _build(cfg, engine):
    data = PairData(cfg)
    data.ensure_cache(engine, cfg.rollout.resolution, cfg.model.max_sequence_length, progress=False)
    return data


def test_cache_holds_the_encodings_and_is_memory_mapped(tiny_cache, small_pairs, engine, tmp_path):
    cfg = _cfg(tiny_cache, small_pairs, tmp_path / "cache")
    built = _build(cfg, engine)
    positions = np.array([10, 3, 7, 3])
    chosen, rejected, cond, valid = built.cache.read(positions)
    dataset = PairImages(built.source, built.rows, positions, cfg.rollout.resolution, "data.pairs", False)
    decoded = collate_pairs(dataset.__getitems__(range(len(positions))))
    # the same numbers as encoding these pairs now, up to the encoders' batch-size rounding
    assert torch.allclose(chosen, engine.encode_images(decoded.chosen), atol=1e-4)
    assert torch.allclose(rejected, engine.encode_images(decoded.rejected), atol=1e-4)
    fresh = engine.encode_prompts(decoded.prompts, 1.0, cfg.model.max_sequence_length)
    assert cond.tensors().keys() == fresh.tensors().keys()
    assert all(torch.allclose(cond.tensors()[k], fresh.tensors()[k], atol=1e-4) for k in fresh.tensors())
    assert valid.all() and torch.equal(chosen[1], chosen[3])
    assert not torch.allclose(chosen, rejected, atol=1e-2)
    later = PairData(cfg)  # a later run: the manifest is read, the data not scanned
    assert later.cache is not None and later.stats == built.stats and (later.rows == built.rows).all()
    assert isinstance(later.cache.arrays[0]["chosen"], np.memmap)


def test_cache_for_another_resolution_vae_or_data_is_refused(tiny_cache, tiny_sd3_dir, small_pairs, engine, tmp_path):
    cache = tmp_path / "cache"
    _build(_cfg(tiny_cache, small_pairs, cache), engine)
    with pytest.raises(ValueError, match=r"made with rollout.resolution=64, this run has rollout.resolution=32"):
        PairData(_cfg(tiny_cache, small_pairs, cache, "rollout.resolution=32"))
    # another VAE: the same checkpoint with one weight changed
    other = tmp_path / "other-model"
    shutil.copytree(tiny_sd3_dir, other)
    weights = next((other / "vae").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    family = get_family("sd3")
    made = json.loads((cache / "manifest.json").read_text())["key"]
    run = {**made, "encoders": latent_cache.encoder_fingerprint(other, family.text_encoders), "model": str(other)}
    assert latent_cache.key_differences(made, run) == [
        f"its VAE differs from this run's (vae/ of {tiny_sd3_dir} vs {other})"
    ]
    # other data: one more pair in the file
    grown = tmp_path / "grown.jsonl"
    grown.write_text(small_pairs.read_text() + small_pairs.read_text().splitlines()[0] + "\n")
    shutil.copytree(small_pairs.parent / "images", tmp_path / "images")
    with pytest.raises(ValueError, match="made from other preference data"):
        PairData(_cfg(tiny_cache, grown, cache))


def test_interrupted_build_continues_after_whole_shards(tiny_cache, small_pairs, engine, tmp_path, monkeypatch):
    monkeypatch.setattr(latent_cache, "ENCODE_CHUNK", 4)
    monkeypatch.setattr(latent_cache, "SHARD_BYTES", 1)  # a shard per chunk
    cache = tmp_path / "cache"
    cfg = _cfg(tiny_cache, small_pairs, cache)
    whole = _build(cfg, engine).cache.read(np.arange(12))
    shards = sorted(cache.glob("shard_*"))
    assert len(shards) == 3
    # as a build killed after its first shard leaves it
    for leftover in [cache / "manifest.json", cache / "rows.npy", *shards[1:]]:
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    (cache / "building.json").write_text(
        json.dumps({"key": latent_cache.cache_key(cfg, PairData(cfg).source, get_family("sd3"), tiny_cache / "x")})
    )
    with pytest.raises(ValueError, match="was made for another model or data"):  # a half-built cache of another model
        _build(cfg, engine)
    (cache / "building.json").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in shards[0].iterdir()}
    again = _build(cfg, engine).cache.read(np.arange(12))
    assert {p.name: p.stat().st_mtime_ns for p in shards[0].iterdir()} == kept
    assert sorted(p.name for p in cache.glob("shard_*")) == [p.name for p in shards]
    assert torch.equal(whole[0], again[0]) and torch.equal(whole[1], again[1])
    assert all(torch.equal(whole[2].tensors()[k], again[2].tensors()[k]) for k in whole[2].tensors())


def test_pairs_that_do_not_decode_are_left_out_or_stop_the_run(tiny_cache, engine, tmp_path):
    jsonl = write_synthetic_pairs(tmp_path / "pairs", 6, resolution=64)
    image = tmp_path / "pairs" / "images" / "pair_00002_chosen.png"
    image.write_bytes(scramble_png_pixels(image.read_bytes()))  # whole chunks, pixels that do not decode
    with pytest.raises(ValueError, match=r"pairs.jsonl, line 3: cannot read image"):
        _build(_cfg(tiny_cache, jsonl, tmp_path / "strict"), engine)
    built = _build(_cfg(tiny_cache, jsonl, tmp_path / "lenient", "data.skip_bad_rows=true"), engine)
    assert built.stats["skipped_bad"] == 1
    assert built.cache.read(np.arange(6))[3].tolist() == [True, True, False, True, True, True]
    with pytest.raises(
        ValueError, match=r"line 3: cannot read image.*built skipping 1 bad row.*data.skip_bad_rows=true"
    ):
        PairData(_cfg(tiny_cache, jsonl, tmp_path / "lenient"))


@pytest.mark.parametrize("damage", ["manifest", "shard_file", "shard_dir", "rows"])
def test_damaged_cache_is_named_with_how_to_rebuild(tiny_cache, small_pairs, engine, tmp_path, damage):
    """A truncated manifest or shard, or a missing shard directory, is named with the way to
    rebuild, when the run opens the cache (before any model loads), not a bare
    JSONDecodeError / ValueError / KeyError at the first read."""
    cache = tmp_path / "cache"
    cfg = _cfg(tiny_cache, small_pairs, cache)
    _build(cfg, engine)
    shard = next(cache.glob("shard_*"))
    broken = {
        "manifest": cache / "manifest.json",
        "shard_file": shard / "chosen.npy",
        "shard_dir": shard,
        "rows": cache / "rows.npy",
    }[damage]
    shutil.rmtree(broken) if broken.is_dir() else truncate(broken, 0.5)
    with pytest.raises(latent_cache.CacheDamaged) as raised:
        PairData(cfg)
    assert f"data.latent_cache={cache}: {broken} " in str(raised.value)
    assert f"rebuild the cache: remove {cache} and run again" in str(raised.value)


def test_default_cache_is_shared_under_the_model_cache_when_encoding_inverts_the_decoder(
    tiny_cache, small_pairs, engine
):
    """data.latent_cache=auto (the default): the tiny models' pairs (100 decoder passes an
    image) are encoded once, into a directory under model.cache_dir named by the model and the
    data, that a later run opens without scanning; a real VAE's encoder streams."""
    overrides = [f"model.cache_dir={tiny_cache}", "algorithm=dpo", "data=pairs", f"data.pairs={small_pairs}"]
    cfg = validate(compose_config(overrides))
    assert cfg.data.latent_cache == "auto" and cfg.model.vae_inversion_steps == 100
    first = _build(cfg, engine)
    assert first.cache_dir.parent == tiny_cache / "latents" and latent_cache.is_complete(first.cache_dir)
    later = PairData(cfg)
    assert later.cache is not None and later.cache_dir == first.cache_dir
    assert PairData(validate(compose_config([*overrides, "model.vae_inversion_steps=0"]))).cache_dir is None
    assert PairData(validate(compose_config([*overrides, "data.latent_cache=null"]))).cache_dir is None
