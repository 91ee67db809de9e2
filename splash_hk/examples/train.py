r"""Trains a Haiku language model on splash attention: associative recall, end to end.

  python -m splash_hk.examples.train                       # defaults: < 3 min on 2 CPU cores
  python -m splash_hk.examples.train --cpu_devices=8 --mesh=dp=2,tp=4
  python -m splash_hk.examples.train --checkpoint_dir=/tmp/ckpt --sample
  python -m splash_hk.examples.launch -- python -m splash_hk.examples.train   # 2 processes

With --coordinator_address/--num_processes/--process_id it is one process of
a multi-process run (jax.distributed, gloo collectives on CPU): each process
builds only its rows of every batch, process 0 logs and writes checkpoints.

Prints `final step=N loss=X accuracy=Y` (answer-token loss and accuracy on a
held-out batch) as its last line.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

from absl import app
from absl import flags
from absl import logging

_STEPS = flags.DEFINE_integer("steps", 1200, "Training steps.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Sequences per step (global).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 31, "Model input length; the task has (seq_len+1)//4 pairs.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "Transformer layers.")
_MODEL_SIZE = flags.DEFINE_integer("model_size", 64, "Embedding size.")
_NUM_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads.")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", None, "Key/value heads (GQA); default num_heads.")
_SLIDING_WINDOW = flags.DEFINE_integer("sliding_window", None, "Causal sliding window (left size).")
_NUM_SINKS = flags.DEFINE_integer("num_sinks", 0, "Learnable attention sinks per head.")
_ATTENTION = flags.DEFINE_enum("attention", "splash", ["splash", "reference"],
                               "splash: sh.MultiHeadAttention; reference: Haiku's hk.MultiHeadAttention.")
_PLATFORM = flags.DEFINE_enum("platform", "auto", ["auto", "splash", "triton", "xla", "reference"],
                              "splash_hk platform.")
_MESH = flags.DEFINE_string("mesh", None, 'Device mesh, e.g. "dp=2,tp=4" (axes dp, fsdp, tp).')
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", None, "Virtual CPU devices (set before JAX starts).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype (params f32).")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Peak AdamW learning rate.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the parameters and the data.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 100, "Steps between log lines.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 200, "Steps between held-out evaluations.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None, "Save/resume params, optimizer, step.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Steps between checkpoints.")
_SAMPLE = flags.DEFINE_bool("sample", False, "After training, answer a prompt with KV-cache decoding.")
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


def _fail(message: str):
  sys.stderr.write(f"error: {message}\n")
  sys.exit(1)


def _parse_mesh(spec: str) -> dict[str, int]:
  axes = {}
  for part in spec.split(","):
    name, _, size = part.partition("=")
    if name not in ("dp", "fsdp", "tp") or not size.isdigit() or int(size) < 1 or name in axes:
      _fail(f'--mesh must look like "dp=2,tp=4" (axes dp, fsdp, tp, each once), got {spec!r}.')
    axes[name] = int(size)
  return axes


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  if _CPU_DEVICES.value:
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
    _run()
  except Exception as e:  # pylint: disable=broad-except
    if jax.process_count() == 1 or isinstance(e, SystemExit):
      raise
    _fail(f"process {jax.process_index()}: the multi-process run failed (a peer may have died): "
          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def _run():
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import jmp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  import splash_hk as sh  # pylint: disable=g-import-not-at-top
  from splash_hk.examples import model as model_lib  # pylint: disable=g-import-not-at-top
  from splash_hk.examples import paths  # pylint: disable=g-import-not-at-top
  from splash_hk.examples import recall  # pylint: disable=g-import-not-at-top

  try:
    task = recall.RecallTask.for_seq_len(_SEQ_LEN.value)
    attention_config = sh.AttentionConfig(
        causal=True, platform=_PLATFORM.value,
        sliding_window=None if _SLIDING_WINDOW.value is None else (_SLIDING_WINDOW.value, 0))
    config = model_lib.ModelConfig(
        vocab_size=task.vocab_size, max_len=task.seq_len, num_layers=_NUM_LAYERS.value,
        model_size=_MODEL_SIZE.value, num_heads=_NUM_HEADS.value, num_kv_heads=_NUM_KV_HEADS.value,
        num_sinks=_NUM_SINKS.value, attention=_ATTENTION.value, attention_config=attention_config)
  except ValueError as e:
    _fail(str(e))
  for name, value in (("steps", _STEPS.value), ("batch_size", _BATCH_SIZE.value),
                      ("log_every", _LOG_EVERY.value), ("eval_every", _EVAL_EVERY.value),
                      ("checkpoint_every", _CHECKPOINT_EVERY.value)):
    if value < 1:
      _fail(f"--{name} must be >= 1, got {value}.")

  multi_process = jax.process_count() > 1
  if multi_process and _SAMPLE.value:
    _fail("--sample decodes in one process; run it without --num_processes.")
  if multi_process and _BATCH_SIZE.value % jax.process_count():
    _fail(f"--batch_size ({_BATCH_SIZE.value}) must divide over {jax.process_count()} processes.")
  mesh = None
  mesh_spec = _MESH.value or (f"dp={jax.device_count()}" if multi_process else None)
  if mesh_spec:
    axes = _parse_mesh(mesh_spec)
    needed = int(np.prod(list(axes.values())))
    if needed != jax.device_count():
      _fail(f"--mesh={mesh_spec} needs {needed} devices but there are {jax.device_count()} "
            "(set --cpu_devices on CPU).")
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
  if _DTYPE.value == "bfloat16":
    hk.mixed_precision.set_policy(model_lib.Transformer, jmp.get_policy(
        "params=float32,compute=bfloat16,output=float32"))

  forward = hk.transform(lambda tokens: model_lib.Transformer(config, mesh)(tokens))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, _LEARNING_RATE.value, warmup_steps=max(1, _STEPS.value // 20),
      decay_steps=_STEPS.value, end_value=_LEARNING_RATE.value / 10)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, weight_decay=0.01))

  def loss_and_accuracy(params, batch):
    logits = forward.apply(params, None, batch["inputs"]).astype(jnp.float32)  # [B, T, V]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, T]
    weights = batch["weights"]
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    total = jnp.sum(weights)
    return jnp.sum(nll * weights) / total, jnp.sum(correct * weights) / total

  @jax.jit
  def train_step(params, opt_state, batch):
    (loss, accuracy), grads = jax.value_and_grad(loss_and_accuracy, has_aux=True)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, accuracy

  evaluate = jax.jit(loss_and_accuracy)

  def data(seed, step, batch_size):
    """This process's rows of a global batch, as arrays sharded over the batch axes."""
    if mesh is None:
      return task.batch(seed, step, batch_size)
    spec = sh.sharding.stable_spec(PartitionSpec(("dp", "fsdp")), (batch_size, 1), mesh, keep=(0,))
    sharding = NamedSharding(mesh, spec)
    rows = sorted({idx[0].indices(batch_size) for idx in
                   sharding.addressable_devices_indices_map((batch_size, 1)).values()})
    start, stop = rows[0][0], rows[-1][1]
    local = task.batch(seed, step, batch_size, slice(start, stop))
    return {k: jax.make_array_from_process_local_data(sharding, v, (batch_size, *v.shape[1:]))
            for k, v in local.items()}

  def replicate(tree):
    return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))

  def to_host(tree):  # replicated arrays: every process holds the whole value
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)

  def scalar(x) -> float:
    return x if isinstance(x, float) else float(to_host(x))

  params = forward.init(jax.random.PRNGKey(_SEED.value), task.batch(_SEED.value, 0, 2)["inputs"])
  opt_state = optimizer.init(params)
  step = 0
  checkpoint_dir = paths.user_path(_CHECKPOINT_DIR.value) if _CHECKPOINT_DIR.value else None
  checkpoint = None if not checkpoint_dir else os.path.join(checkpoint_dir, "checkpoint.pkl")
  if checkpoint and os.path.exists(checkpoint):
    with open(checkpoint, "rb") as f:
      state = pickle.load(f)
    params, opt_state, step = state["params"], state["opt_state"], state["step"]
    logging.info("resumed from %s at step %d", checkpoint, step)
  params, opt_state = replicate(params), replicate(opt_state)

  def save(step):
    state = {"step": step, "params": to_host(params), "opt_state": to_host(opt_state)}
    if jax.process_index():
      return
    os.makedirs(checkpoint_dir, exist_ok=True)
    tmp = checkpoint + f".tmp{os.getpid()}"
    with open(tmp, "wb") as f:
      pickle.dump(state, f)
    os.replace(tmp, checkpoint)  # atomic: a killed run leaves the previous checkpoint whole

  eval_batch = data(_SEED.value + 1, 0, _EVAL_BATCH)
  head_size = config.model_size // config.num_heads
  heads = lambda n: jax.ShapeDtypeStruct((_BATCH_SIZE.value, task.seq_len, n, head_size), jnp.float32)
  kv_heads = heads(config.num_kv_heads or config.num_heads)
  decision = sh.explain(heads(config.num_heads), kv_heads, kv_heads, config=attention_config)
  logging.info("recall task: %d pairs, seq_len %d, vocab %d; attention=%s mesh=%s; backend: %s",
               task.num_pairs, task.seq_len, task.vocab_size, _ATTENTION.value, _MESH.value,
               decision.reason)
  progress = None
  if sys.stderr.isatty() and not jax.process_index():
    import tqdm  # pylint: disable=g-import-not-at-top
    progress = tqdm.tqdm(total=_STEPS.value, initial=step, desc="train", unit="step")
  started, first_step = time.time(), step
  loss = accuracy = float("nan")
  while step < _STEPS.value:
    batch = data(_SEED.value, step, _BATCH_SIZE.value)
    params, opt_state, loss, accuracy = train_step(params, opt_state, batch)
    if multi_process:  # one program at a time: gloo collectives of overlapping programs can deadlock
      jax.block_until_ready(loss)
    step += 1
    if step % _LOG_EVERY.value == 0 or step == _STEPS.value:
      loss, accuracy = scalar(loss), scalar(accuracy)
      tokens_per_s = (step - first_step) * _BATCH_SIZE.value * task.seq_len / (time.time() - started)
      if progress is not None:
        progress.set_postfix(loss=f"{loss:.4f}", accuracy=f"{accuracy:.3f}", tok_s=f"{tokens_per_s:.0f}")
      else:
        logging.info("step=%d loss=%.6f accuracy=%.4f tokens/s=%.0f", step, loss, accuracy, tokens_per_s)
    if step % _EVAL_EVERY.value == 0 and step != _STEPS.value:
      eval_loss, eval_accuracy = to_host(evaluate(params, eval_batch))
      logging.info("eval step=%d loss=%.6f accuracy=%.4f", step, eval_loss, eval_accuracy)
    if checkpoint and (step % _CHECKPOINT_EVERY.value == 0 or step == _STEPS.value):
      save(step)
    if progress is not None:
      progress.update(1)
    if _STOP_AFTER_STEPS.value is not None and step - first_step >= _STOP_AFTER_STEPS.value:
      logging.info("stopping at step %d (--stop_after_steps)", step)
      return
  if progress is not None:
    progress.close()

  if _SAMPLE.value:
    _sample(task, config, params, mesh)
  eval_loss, eval_accuracy = to_host(evaluate(params, eval_batch))
  if not jax.process_index():
    loss, accuracy = scalar(loss), scalar(accuracy)
    print(f"train step={step} loss={loss:.6f} accuracy={accuracy:.4f}")
    print(f"final step={step} loss={float(eval_loss):.6f} accuracy={float(eval_accuracy):.4f}",
          flush=True)


def _sample(task, config, params, mesh):
  """Prefills pairs + first query with a KV cache, then decodes each answer one token at a time."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from splash_hk.examples import model as model_lib  # pylint: disable=g-import-not-at-top

  if config.attention == "reference":
    decode_config = config
    config = model_lib.ModelConfig(**{**decode_config.__dict__, "attention": "splash"})

  def step_fn(tokens, positions, caches):
    return model_lib.Transformer(config, mesh)(tokens, positions, caches)

  apply = jax.jit(hk.transform(step_fn).apply)
  caches = hk.transform(lambda: model_lib.Transformer(config, mesh).init_caches(1)).apply({}, None)
  example = task.batch(_SEED.value + 2, 0, 1)
  tokens = example["inputs"][0]
  prompt = task.prompt_len()
  logits, caches = apply(params, None, tokens[None, :prompt], jnp.arange(prompt)[None], caches)
  predicted, expected = [], []
  position = prompt
  for i in range(task.num_pairs):
    answer = int(jnp.argmax(logits[0, -1]))
    predicted.append(answer)
    expected.append(int(example["targets"][0, prompt - 1 + 2 * i]))
    if i + 1 == task.num_pairs:
      break
    next_query = int(tokens[prompt + 2 * i + 1])
    for token in (answer, next_query):  # decode: one token per call, T == 1
      logits, caches = apply(params, None, jnp.array([[token]]), jnp.array([[position]]), caches)
      position += 1
  name = lambda t: f"k{t}" if t < task.num_keys else f"v{t - task.num_keys}"
  pairs = " ".join(name(int(t)) for t in tokens[:2 * task.num_pairs])
  queries = " ".join(name(int(t)) for t in tokens[2 * task.num_pairs::2])
  print(f"sample prompt: {pairs} | queries: {queries}")
  print(f"sample answer: {' '.join(name(t) for t in predicted)}")
  print(f"sample expected: {' '.join(name(t) for t in expected)} -> "
        f"{'right' if predicted == expected else 'wrong'} "
        f"({sum(p == e for p, e in zip(predicted, expected))}/{len(expected)})")


if __name__ == "__main__":
  app.run(main)
