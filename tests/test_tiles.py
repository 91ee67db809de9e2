"""The TPU kernel's tiles: the tuning cache first, then the shipped table (exact band, else the
nearest measured one), then the rule; what a caller gives wins; `explain` names them and their
source; `python -m splash_hk.tune` measures candidates and writes the cache the library reads."""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import processes
import splash_hk as sh
from splash_hk.backends.tpu import tiles as tiles_lib

Q16K = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)
KEY = tiles_lib.Key("", "bfloat16", 128, 16384, "causal")  # what a TPU export from here reads


def _entry(key, bq, bkv, bkvc, fused):
  return {"key": dataclasses.asdict(key),
          "tiles": dict(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_bwd=bq,
                        block_kv_bwd=bkv, block_kv_compute_bwd=bkvc, fused_backward=fused)}


@pytest.fixture
def table(monkeypatch, tmp_path):
  """A shipped table of one entry (1024/2048/512, split backward) and an empty tuning cache."""
  monkeypatch.setattr(tiles_lib, "_shipped",
                      lambda: tiles_lib._parse([_entry(KEY, 1024, 2048, 512, False)], "table t"))
  monkeypatch.setenv(tiles_lib.CACHE_ENV, str(tmp_path / "tiles.json"))
  tiles_lib.for_call.cache_clear()
  yield tmp_path / "tiles.json"
  tiles_lib.for_call.cache_clear()


def _reason(**config):
  return sh.explain(Q16K, Q16K, Q16K, for_platform="tpu",
                    config=sh.AttentionConfig(**config)).reason


def test_the_rule_serves_shapes_no_table_holds():
  assert tiles_lib.rule(16384) == tiles_lib.Tiles(512, 1024, 512, 512, 1024, 512, True)
  assert tiles_lib.rule(200).blocks == (256, 256, 256, 256)  # one tile: the padded length
  assert "tiles 512/1024/512, backward 512/1024/512 fused (rule)" in _reason()


def test_the_table_then_its_nearest_band_then_the_tuning_cache_first(table):
  assert "tiles 1024/2048/512, backward 1024/2048/512 dq and dK/dV apart (table t)" in _reason()
  k8 = jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)
  nearest = sh.explain(k8, k8, k8, for_platform="tpu").reason
  assert "tiles 1024/2048/512" in nearest and "table t, band 16384" in nearest
  table.write_text(json.dumps({"version": 1, "entries": [_entry(KEY, 256, 512, 256, True)]}))
  tiles_lib.for_call.cache_clear()
  assert f"tiles 256/512/256, backward 256/512/256 fused (tuned {table})" in _reason()
  window = sh.explain(Q16K, Q16K, Q16K, for_platform="tpu",
                      config=sh.AttentionConfig(sliding_window=(1024, 0))).reason
  assert "(rule)" in window  # another mask kind: neither holds it


def test_what_the_caller_gives_wins_and_the_backward_follows_the_forward(table):
  said = _reason(block_sizes=sh.BlockSizes(block_q=256), fused_backward=True)
  assert "tiles 256/2048/512, backward 256/2048/512 fused (given, the rest from table t)" in said
  with pytest.raises(ValueError, match=r"block_kv_compute = 384 must divide block_kv = 512"):
    _reason(block_sizes=sh.BlockSizes(block_kv=512, block_kv_compute=384), platform="splash",
            allow_fallback=False)
  with pytest.raises(ValueError, match="fused_backward must be None"):
    sh.AttentionConfig(fused_backward=1)


def test_the_tuner_measures_candidates_and_the_library_reads_its_cache(tmp_path):
  """In interpret mode on CPU: the tuner's cache entry for a tiny shape, then read back."""
  cache = tmp_path / "tiles.json"
  done = subprocess.run(
      [sys.executable, "-m", "splash_hk.tune", "--shapes=1x128x1x1x128:causal", "--interpret",
       "--repeats=1", f"--cache={cache}", "--dtype=float32"],
      capture_output=True, text=True, env=processes.env(), timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "forward (128, 128, 128):" in done.stdout and "backward (128, 128, 128, False):" in done.stdout
  entry = json.loads(cache.read_text())["entries"][0]
  assert entry["key"] == dict(chip="", dtype="float32", head_dim=128, band=1024, mask="causal")
  assert entry["tiles"]["block_q"] == 128 and entry["measured"]["forward_ms"] > 0


@pytest.mark.parametrize("config,rows,keys,block_kv", [
    (dict(), 1, 8192, 8192),  # causal decode: one block of the whole cache (clamped to S)
    (dict(), 8, 40000, 16384),  # at most FEW_ROWS_KEYS a block
    (dict(sliding_window=(1000, 0)), 1, 8192, 1024),  # the window's span, in 256-key blocks
    (dict(chunk_size=300), 4, 8192, 512),
    (dict(), 9, 8192, 256),  # nine rows: the defaults
])
def test_few_rows_read_one_long_block_on_a_tpu(monkeypatch, config, rows, keys, block_kv):
  """The xla path's tiles for decode on a TPU (a loop step costs it more than a long block's
  reads); on a CPU the defaults."""
  from splash_hk import tiles
  from splash_hk.backends.xla import plan as xla_plan
  from splash_hk.types import Facts
  cpu = Facts.from_shapes(sh.AttentionConfig(**config), (2, rows, 8, 64), (2, keys, 2, 64))
  assert tiles.tiles_for(cpu)[1] == 256
  monkeypatch.setattr(tiles, "on_tpu", lambda: True)
  monkeypatch.setattr(xla_plan, "on_tpu", lambda: True)
  facts = Facts.from_shapes(sh.AttentionConfig(**config), (2, rows, 8, 64), (2, keys, 2, 64))
  _, fwd_kv, _, _ = tiles.tiles_for(facts)
  q = jnp.zeros((2, rows, 8, 64))
  x = sh.types.KernelInputs(*(None,) * len(sh.types.KernelInputs._fields))._replace(
      query=q, key=jnp.zeros((2, keys, 2, 64)))
  grid = xla_plan.Grid.of(x, 512, fwd_kv)
  assert grid.block_kv == block_kv
  assert grid.rows_per_group == 2  # the whole batch at once (8 rows x 16384 keys: not per row)
