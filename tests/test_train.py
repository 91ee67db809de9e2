"""The absl training binary, run as users run it (subprocess)."""

import re
import subprocess
import sys

import pytest

import harness
import processes

STEP_LINE = re.compile(r"\] step=(\d+) loss=([0-9.]+) accuracy=([0-9.]+)")
FINAL_LINE = re.compile(r"^final step=(\d+) loss=([0-9.]+) accuracy=([0-9.]+)$", re.M)


def _train(*flags, check=True, timeout=300, optimized=False):
  # 1200 steps: XLA's optimisations save more running than they cost compiling.
  env = processes.env(optimized=optimized)
  proc = subprocess.run([sys.executable, "-m", "examples.train", *flags],
                        capture_output=True, text=True, env=env, timeout=timeout)
  if check and proc.returncode:
    raise AssertionError(f"train {flags} failed:\n{proc.stderr[-3000:]}")
  return proc


def _losses(proc):
  return {int(m[1]): float(m[2]) for m in STEP_LINE.finditer(proc.stderr)}


def _final(proc):
  (match,) = FINAL_LINE.findall(proc.stdout)
  return int(match[0]), float(match[1]), float(match[2])


def test_defaults_learn_the_task_and_sample_decodes_with_the_cache():
  proc = _train("--sample", optimized=True)
  step, _, accuracy = _final(proc)
  assert step == 1200 and accuracy >= 0.95, proc.stdout
  assert proc.stdout.count("final step=") == 1
  assert "sample prompt:" in proc.stdout and "sample expected:" in proc.stdout
  assert "-> right (8/8)" in proc.stdout, proc.stdout


# In place of learned positions: ALiBi (learnable slopes) or T5's learned buckets train (their
# gradients reach the slopes and tables), and decode through the cache with the bias. Both reach
# the defaults' accuracy bar (docs/guide/scores.md: ALiBi at 1200 steps, T5 at 2000), too long
# to run here.
@pytest.mark.parametrize("bias", ["alibi", "t5"])
def test_position_biases_train_and_decode(bias):
  proc = _train(f"--position_bias={bias}", "--steps=60", "--log_every=20", "--sample",
                "--num_layers=1")
  losses = _losses(proc)
  assert losses[60] < losses[40] < losses[20], losses
  assert "sample batch: 8 prompts" in proc.stdout, proc.stdout


def test_splash_and_reference_attention_give_the_same_losses():
  flags = ("--steps=25", "--log_every=1", "--num_layers=1")
  splash = _losses(_train(*flags, "--attention=splash"))
  reference = _losses(_train(*flags, "--attention=reference"))
  assert sorted(splash) == list(range(1, 26)) and sorted(reference) == list(range(1, 26))
  for step in splash:
    assert abs(splash[step] - reference[step]) < 1e-3, (step, splash[step], reference[step])


def test_sharded_training_matches_single_device():
  # Heads over tp and the load-balanced sequence over sp, attended Ulysses-style (8 heads: 1
  # per device after tp and sp; the kernel sees the whole sequence, the prefix-LM ids are
  # gathered). dp=2,sp=4 runs across two processes (test_multihost, the same flags); the ring's
  # values and gradients are checked under load-balanced mask objects (test_mask_objects).
  single = _losses(_train(*harness.SHARDED_TRAINING_FLAGS))
  proc = _train(*harness.SHARDED_TRAINING_FLAGS, "--cpu_devices=8", "--mesh=sp=2,tp=4",
                "--sequence_strategy=ulysses", "--load_balanced")
  assert "(Ulysses over" in proc.stderr, proc.stderr[-2000:]
  sharded = _losses(proc)
  assert abs(single[20] - sharded[20]) < 1e-3, (single, sharded)


def test_resumed_bfloat16_run_trains_and_ends_like_an_uninterrupted_one(tmp_path):
  # bfloat16 compute here too: one run of each program serves both checks.
  flags = ("--steps=20", "--log_every=5", "--checkpoint_every=5", "--num_layers=1",
           "--dtype=bfloat16")
  whole = _train(*flags, f"--checkpoint_dir={tmp_path / 'whole'}")
  first = _train(*flags, f"--checkpoint_dir={tmp_path / 'split'}", "--stop_after_steps=10")
  assert "final step=" not in first.stdout and max(_losses(first)) == 10
  second = _train(*flags, f"--checkpoint_dir={tmp_path / 'split'}")
  assert "resumed from" in second.stderr and min(_losses(second)) == 15
  assert _final(second) == _final(whole)
  assert {s: l for s, l in _losses(second).items()} == {
      s: l for s, l in _losses(whole).items() if s >= 15}
  losses = _losses(whole)
  assert losses[20] < losses[10] < losses[5] < 4.5, losses


@pytest.mark.parametrize("flags,needle", [
    (("--cpu_devices=8", "--mesh=dp=3"), "needs 3 devices"),
    (("--mesh=dp=2,xx=4",), "--mesh must look like"),
    (("--num_heads=4", "--num_kv_heads=3"), "multiple of --num_kv_heads"),
    (("--seq_len=1",), "--seq_len must be >= 3"),
    (("--attention=reference", "--num_kv_heads=2"), "no GQA"),
    (("--attention=reference", "--prefix_lm"), "--prefix_lm needs --attention=splash"),
    (("--attention=reference", "--position_bias=alibi"), "--position_bias needs --attention=splash"),
    (("--cpu_devices=8", "--mesh=dp=8", "--load_balanced"), "needs an sp axis"),
    (("--cpu_devices=8", "--mesh=sp=8", "--load_balanced", "--seq_len=40"), "2 * sp = 16"),
])
def test_bad_flags_exit_with_one_line(flags, needle):
  proc = _train(*flags, check=False, timeout=120)
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith("error:") and needle in proc.stderr
