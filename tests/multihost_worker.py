"""One process of a two-process test: attention under a mesh that spans processes.

The sequence is a ring over sp = 2 (one shard per process: K/V blocks cross the
process boundary every step), the heads over tp = 4 within each process.

  python tests/multihost_worker.py OUT.npy --coordinator_address=... --num_processes=2 \
      --process_id=I --cpu_devices=4
"""

from absl import app
from absl import flags

FLAGS = flags.FLAGS


def inputs():
  """The global inputs, the same in every process (and in the single-process test)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  q = rng.normal(size=(4, 32, 8, 16)).astype(np.float32)
  k = rng.normal(size=(4, 32, 2, 16)).astype(np.float32)
  v = rng.normal(size=(4, 32, 2, 16)).astype(np.float32)
  seg = np.zeros((4, 32), np.int32)
  seg[:, 20:] = 1
  seg[1, -3:] = -1
  sinks = rng.normal(size=(8, 2)).astype(np.float32)
  return q, k, v, seg, sinks


CONFIG = dict(sliding_window=(9, 0), logits_soft_cap=5.0)


def main(argv):
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", FLAGS.cpu_devices)
  jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                             heartbeat_timeout_seconds=10)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import splash_hk as sh  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((2, 4), ("sp", "tp"))
  axes = sh.MeshAxes(batch=None, heads="tp", sequence="sp", sequence_strategy="ring")
  q, k, v, seg, sinks = inputs()
  glob = lambda a: jax.make_array_from_callback(
      a.shape, NamedSharding(mesh, P(None, "sp") if a.ndim > 1 else P()), lambda idx: a[idx])
  config = sh.AttentionConfig(**CONFIG)

  @jax.jit
  def run(q, k, v, seg, sinks):
    def loss(q, k, v, sinks):
      out = sh.attention(q, k, v, config=config, q_segment_ids=seg, softmax_aux=sinks, mesh=mesh,
                         axes=axes)
      assert sh.explain(q, k, v, config=config, q_segment_ids=seg, softmax_aux=sinks, mesh=mesh,
                        axes=axes).ring
      return jnp.sum(out.attention_outputs ** 2), out.attention_outputs
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
    return out, grads

  out, grads = run(glob(q), glob(k), glob(v), glob(seg), glob(sinks))
  gathered = [np.asarray(multihost_utils.process_allgather(a, tiled=True)) for a in (out, *grads)]
  if jax.process_index() == 0:
    np.savez(argv[1], *gathered)
  jax.distributed.shutdown()


if __name__ == "__main__":
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
  flags.DEFINE_integer("num_processes", 1, "Processes.")
  flags.DEFINE_integer("process_id", 0, "This process.")
  flags.DEFINE_integer("cpu_devices", 4, "CPU devices of this process.")
  app.run(main)
