r"""Trains a Haiku language model on splash attention: associative recall, end to end.

  python -m examples.train                       # defaults: < 3 min on 2 CPU cores
  python -m examples.train --cpu_devices=8 --mesh=dp=2,tp=4
  python -m examples.train --checkpoint_dir=/tmp/ckpt --sample
  python -m examples.train.launch -- python -m examples.train   # 2 processes

With --coordinator_address/--num_processes/--process_id it is one process of
a multi-process run (jax.distributed, gloo collectives on CPU): each process
builds only its rows of every batch, process 0 logs and writes checkpoints.

Prints `final step=N loss=X accuracy=Y` (answer-token loss and accuracy on a
held-out batch) as its last line.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec
import jmp
import numpy as np
import optax
import tqdm

import splash_hk as sh
from splash_hk import platforms
from splash_hk.sharding.axes import SEQUENCE_STRATEGIES
from examples.train import batches as batches_lib
from examples.train import checkpoint as checkpoint_lib
from examples.train import model as model_lib
from examples.train import recall
from examples.train import sampling

_STEPS = flags.DEFINE_integer("steps", 1200, "Training steps.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Sequences per step (global).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 31, "Model input length; the task has (seq_len+1)//4 pairs.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer layers.")
_MODEL_SIZE = flags.DEFINE_integer("model_size", 64, "Embedding size.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads.")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", None, "Key/value heads (GQA); default num_heads.")
_SLIDING_WINDOW = flags.DEFINE_integer("sliding_window", None, "Causal sliding window (left size).")
_NUM_SINKS = flags.DEFINE_integer("num_sinks", 0, "Learnable attention sinks per head.")
_ATTENTION_DROPOUT = flags.DEFINE_float(
    "attention_dropout", 0.0, "Attention dropout rate in training (on the probabilities; the "
    "library's hash, keyed per step from --seed). 0: none.")
_POSITION_BIAS = flags.DEFINE_enum(
    "position_bias", "none", list(model_lib.POSITION_BIASES),
    "In place of learned absolute positions: ALiBi (learnable slopes) or T5's learned "
    "relative-position buckets, as a bias on the attention logits.")
_PREFIX_LM = flags.DEFINE_bool(
    "prefix_lm", False, "Prefix-LM: the recall task's key-value pairs see each other whole (a "
    "Bidirectional mask object over the prefix); the queries and answers stay causal.")
_ATTENTION = flags.DEFINE_enum("attention", "splash", ["splash", "reference"],
                               "splash: sh.MultiHeadAttention; reference: Haiku's hk.MultiHeadAttention.")
_PLATFORM = flags.DEFINE_enum("platform", "auto", list(platforms.names()),
                              "splash_hk platform.")
_MESH = flags.DEFINE_string("mesh", None, 'Device mesh, e.g. "dp=2,tp=4" or "dp=2,sp=4" (axes dp, '
                            "fsdp, tp, and sp: the sequence).")
_SEQUENCE_STRATEGY = flags.DEFINE_enum(
    "sequence_strategy", "all_gather", list(SEQUENCE_STRATEGIES),
    "How a sequence sharded over sp is attended: all_gather (every device gets all keys), ring "
    "(keys travel), ulysses (all-to-all: each device attends the whole sequence for its heads).")
_LOAD_BALANCED = flags.DEFINE_bool(
    "load_balanced", False, "Put each batch in load-balanced (dual-chunk) order over sp, so causal "
    "work is even; needs sp in --mesh and a --seq_len that 2 * sp divides.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None, "Virtual CPU devices (set before JAX starts).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype (params f32).")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Peak AdamW learning rate.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the parameters and the data.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 100, "Steps between log lines.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 200, "Steps between held-out evaluations.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None, "Save/resume params, optimizer, step.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Steps between checkpoints.")
_SAMPLE = flags.DEFINE_bool("sample", False, "After training, decode a batch of prompts of different "
                            "lengths with the KV cache.")
_SAMPLE_ROWS = flags.DEFINE_integer("sample_rows", 8, "Prompts --sample decodes together.")
_SAMPLE_CACHE_LEN = flags.DEFINE_integer(
    "sample_cache_len", None, "Slots of --sample's KV caches (default: just enough); a long "
    "cache shows that decoding costs what the filled slots cost.")
_STOP_AFTER_STEPS = flags.DEFINE_integer(
    "stop_after_steps", None, "Exit after this many steps of this run, as if preempted (after "
    "checkpointing); a later run with the same flags resumes from --checkpoint_dir.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 for a multi-process run; unset = one process.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index in a multi-process run.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout", 20,
                                  "Seconds without a peer's heartbeat before a multi-process run fails.")
_EVAL_BATCH = 256
_MESH_AXES = ("dp", "fsdp", "tp", "sp")


def _fail(message: str):
  sys.stderr.write(f"error: {message}\n")
  sys.exit(1)


# Flags -> the run's static pieces.


def _parse_mesh(spec: str) -> dict[str, int]:
  axes = {}
  for part in spec.split(","):
    name, _, size = part.partition("=")
    if name not in _MESH_AXES or not size.isdigit() or int(size) < 1 or name in axes:
      _fail(f'--mesh must look like "dp=2,tp=4" (axes {", ".join(_MESH_AXES)}, each once), '
            f"got {spec!r}.")
    axes[name] = int(size)
  return axes


def make_mesh() -> jax.sharding.Mesh | None:
  """The --mesh flag as a mesh (a multi-process run without one uses dp over all devices)."""
  spec = _MESH.value or (f"dp={jax.device_count()}" if jax.process_count() > 1 else None)
  if not spec:
    return None
  axes = _parse_mesh(spec)
  needed = int(np.prod(list(axes.values())))
  if needed != jax.device_count():
    _fail(f"--mesh={spec} needs {needed} devices but there are {jax.device_count()} "
          "(set --cpu_devices on CPU).")
  return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def make_axes(mesh) -> sh.MeshAxes:
  """Mesh axes for attention: batch over dp/fsdp, heads over tp, the sequence over sp."""
  sequence = "sp" if mesh is not None and "sp" in mesh.shape else None
  if _LOAD_BALANCED.value and sequence is None:
    _fail("--load_balanced needs an sp axis in --mesh, e.g. --mesh=dp=2,sp=4.")
  if _LOAD_BALANCED.value and _SEQ_LEN.value % (2 * mesh.shape["sp"]):
    _fail(f"--load_balanced needs a --seq_len that 2 * sp = {2 * mesh.shape['sp']} divides, got "
          f"{_SEQ_LEN.value}.")
  return sh.MeshAxes(batch=("dp", "fsdp"), heads="tp", sequence=sequence,
                     sequence_strategy=_SEQUENCE_STRATEGY.value,
                     load_balanced=_LOAD_BALANCED.value)


def make_task_and_model(axes: sh.MeshAxes) -> tuple[recall.RecallTask, model_lib.ModelConfig]:
  """The recall task and the model config, from the flags (one error line if they clash)."""
  for name, value in (("steps", _STEPS.value), ("batch_size", _BATCH_SIZE.value),
                      ("log_every", _LOG_EVERY.value), ("eval_every", _EVAL_EVERY.value),
                      ("checkpoint_every", _CHECKPOINT_EVERY.value)):
    if value < 1:
      _fail(f"--{name} must be >= 1, got {value}.")
  try:
    task = recall.RecallTask.for_seq_len(_SEQ_LEN.value)
    window = None if _SLIDING_WINDOW.value is None else (_SLIDING_WINDOW.value, 0)
    attention_config = sh.AttentionConfig(platform=_PLATFORM.value,  # causal by default
                                          sliding_window=window)
    config = model_lib.ModelConfig(
        vocab_size=task.vocab_size, max_len=task.seq_len, num_layers=_NUM_LAYERS.value,
        model_size=_MODEL_SIZE.value, num_heads=_NUM_HEADS.value, num_kv_heads=_NUM_KV_HEADS.value,
        num_sinks=_NUM_SINKS.value, attention=_ATTENTION.value, attention_config=attention_config,
        axes=axes, prefix_len=2 * task.num_pairs if _PREFIX_LM.value else 0,
        position_bias=_POSITION_BIAS.value, attention_dropout=_ATTENTION_DROPOUT.value)
  except ValueError as e:
    _fail(str(e))
  return task, config


def make_optimizer() -> optax.GradientTransformation:
  """AdamW with warmup and cosine decay, gradients clipped to norm 1."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, _LEARNING_RATE.value, warmup_steps=max(1, _STEPS.value // 20),
      decay_steps=_STEPS.value, end_value=_LEARNING_RATE.value / 10)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


# Data.


def replicate(tree, mesh):
  return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def to_host(tree):
  """Replicated arrays to NumPy (every process holds the whole value)."""
  return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)


def scalar(x) -> float:
  return x if isinstance(x, float) else float(to_host(x))


# One step.


def make_steps(forward: hk.Transformed, optimizer: optax.GradientTransformation):
  """(train_step, evaluate): jitted; both return the answer-token loss and accuracy."""

  def loss_and_accuracy(params, batch, rng=None):
    logits = forward.apply(params, rng, batch["inputs"], batch.get("positions"),
                           rng is not None)  # [B, T, V]; training (dropout) when given a key
    logits = logits.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, T]
    weights = batch["weights"]
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    total = jnp.sum(weights)
    return jnp.sum(nll * weights) / total, jnp.sum(correct * weights) / total

  @jax.jit
  def train_step(params, opt_state, batch, rng):
    (loss, accuracy), grads = jax.value_and_grad(loss_and_accuracy, has_aux=True)(params, batch,
                                                                                 rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, accuracy

  return train_step, jax.jit(loss_and_accuracy)


# The loop.


@dataclasses.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: int
  loss: Any = float("nan")
  accuracy: Any = float("nan")


def train(state: TrainState, train_step, evaluate, batches, eval_batch, seq_len: int,
          checkpoint: str | None) -> bool:
  """Runs steps until --steps (True) or --stop_after_steps (False), logging and checkpointing."""
  multi_process = jax.process_count() > 1
  progress = None
  if sys.stderr.isatty() and not jax.process_index():
    progress = tqdm.tqdm(total=_STEPS.value, initial=state.step, desc="train", unit="step")
  started, first_step = time.time(), state.step
  while state.step < _STEPS.value:
    batch = batches(_SEED.value, state.step, _BATCH_SIZE.value)
    rng = jax.random.fold_in(jax.random.PRNGKey(_SEED.value), state.step)  # dropout's key
    state.params, state.opt_state, state.loss, state.accuracy = train_step(
        state.params, state.opt_state, batch, rng)
    if multi_process:  # one program at a time: gloo collectives of overlapping programs can deadlock
      jax.block_until_ready(state.loss)
    state.step += 1
    if state.step % _LOG_EVERY.value == 0 or state.step == _STEPS.value:
      loss, accuracy = scalar(state.loss), scalar(state.accuracy)
      tokens_per_s = ((state.step - first_step) * _BATCH_SIZE.value * seq_len
                      / (time.time() - started))
      if progress is not None:
        progress.set_postfix(loss=f"{loss:.4f}", accuracy=f"{accuracy:.3f}", tok_s=f"{tokens_per_s:.0f}")
      else:
        logging.info("step=%d loss=%.6f accuracy=%.4f tokens/s=%.0f", state.step, loss, accuracy,
                     tokens_per_s)
    if state.step % _EVAL_EVERY.value == 0 and state.step != _STEPS.value:
      eval_loss, eval_accuracy = to_host(evaluate(state.params, eval_batch))
      logging.info("eval step=%d loss=%.6f accuracy=%.4f", state.step, eval_loss, eval_accuracy)
    if checkpoint and (state.step % _CHECKPOINT_EVERY.value == 0 or state.step == _STEPS.value):
      checkpoint_lib.save(checkpoint, state.step, to_host(state.params), to_host(state.opt_state))
    if progress is not None:
      progress.update(1)
    if _STOP_AFTER_STEPS.value is not None and state.step - first_step >= _STOP_AFTER_STEPS.value:
      logging.info("stopping at step %d (--stop_after_steps)", state.step)
      return False
  if progress is not None:
    progress.close()
  return True


# Main.


def fit(mesh, axes: sh.MeshAxes, task: recall.RecallTask, config: model_lib.ModelConfig):
  """Builds the model and trains it to --steps, resuming from --checkpoint_dir: (state,
  evaluate, eval_batch), or None when --stop_after_steps ended the run first."""
  if _BATCH_SIZE.value % jax.process_count():
    _fail(f"--batch_size ({_BATCH_SIZE.value}) must divide over {jax.process_count()} processes.")
  if _DTYPE.value == "bfloat16":
    hk.mixed_precision.set_policy(model_lib.Transformer, jmp.get_policy(
        "params=float32,compute=bfloat16,output=float32"))
  forward = hk.transform(lambda tokens, positions=None, is_training=False: model_lib.Transformer(
      config, mesh)(tokens, positions, is_training=is_training))
  optimizer = make_optimizer()
  train_step, evaluate = make_steps(forward, optimizer)
  params = forward.init(jax.random.PRNGKey(_SEED.value), task.batch(_SEED.value, 0, 2)["inputs"])
  checkpoint = checkpoint_lib.path(_CHECKPOINT_DIR.value)
  try:
    params, opt_state, step = checkpoint_lib.restore(checkpoint, params, optimizer.init(params))
  except checkpoint_lib.CheckpointError as e:
    _fail(str(e))
  state = TrainState(replicate(params, mesh), replicate(opt_state, mesh), step)
  batches = batches_lib.make_batches(task, mesh, axes)
  eval_batch = batches(_SEED.value + 1, 0, _EVAL_BATCH)
  head_size = config.model_size // config.num_heads
  heads = lambda n: jax.ShapeDtypeStruct((_BATCH_SIZE.value, task.seq_len, n, head_size), jnp.float32)
  kv_heads = heads(config.num_kv_heads or config.num_heads)
  positions = jnp.broadcast_to(jnp.arange(task.seq_len), (_BATCH_SIZE.value, task.seq_len))
  decision = sh.explain(heads(config.num_heads), kv_heads, kv_heads, config=config.module_config,
                        mesh=mesh, axes=axes, mask=config.mask(positions, None))
  logging.info("recall task: %d pairs, seq_len %d, vocab %d; attention=%s mesh=%s; backend: %s",
               task.num_pairs, task.seq_len, task.vocab_size, _ATTENTION.value, _MESH.value,
               decision.reason)
  if not train(state, train_step, evaluate, batches, eval_batch, task.seq_len, checkpoint):
    return None
  return state, evaluate, eval_batch


def run() -> None:
  """Builds the run from the flags, trains, then (optionally) samples and evaluates."""
  mesh = make_mesh()
  axes = make_axes(mesh)
  task, config = make_task_and_model(axes)
  if jax.process_count() > 1 and _SAMPLE.value:
    _fail("--sample decodes in one process; run it without --num_processes.")
  fitted = fit(mesh, axes, task, config)
  if fitted is None:
    return
  state, evaluate, eval_batch = fitted
  if _SAMPLE.value:
    sampling.sample(task, config, state.params, mesh, rows=_SAMPLE_ROWS.value,
                    capacity=_SAMPLE_CACHE_LEN.value or task.seq_len + 1, seed=_SEED.value + 2)
  eval_loss, eval_accuracy = to_host(evaluate(state.params, eval_batch))
  if not jax.process_index():
    print(f"train step={state.step} loss={scalar(state.loss):.6f} "
          f"accuracy={scalar(state.accuracy):.4f}")
    print(f"final step={state.step} loss={float(eval_loss):.6f} accuracy={float(eval_accuracy):.4f}",
          flush=True)


def main(argv):
  del argv
  if _CPU_DEVICES.value:  # before any backend starts (importing jax starts none)
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  if _COORDINATOR.value:
    if not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
      _fail(f"--process_id must be in [0, --num_processes), got {_PROCESS_ID.value}.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                               heartbeat_timeout_seconds=_HEARTBEAT.value)
    if jax.process_index():
      logging.set_verbosity(logging.WARNING)
  try:
    run()
  except Exception as e:  # pylint: disable=broad-except
    if jax.process_count() == 1 or isinstance(e, SystemExit):
      raise
    _fail(f"process {jax.process_index()}: the multi-process run failed (a peer may have died): "
          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


if __name__ == "__main__":
  app.run(main)
