"""Tests for jaxamp.train.devices: data parallel on 8 CPU devices against one device."""

import os
import textwrap

import pytest

from train_helpers import ROOT, run_script


_MESH_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    import jax, numpy as np, optax
    import jaxamp
    from train_helpers import loss_fn, init, make_batches, leaves
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8,), ('data',))
    batches = make_batches(3, size=32)
    # float32: only summation order differs. bfloat16: each device rounds its own partial
    # products, and Adam magnifies differences in near-zero gradients (bf16 spacing 2**-8).
    for policy, atol in [('float32', 1e-5), ('mixed_bfloat16', 2e-3)]:
      out = {{}}
      for name, kw in [('single', {{}}), ('mesh', dict(sharding=jaxamp.ShardingConfig(mesh=mesh)))]:
        tx = optax.chain(jaxamp.dynamic_loss_scale(2.0**8), optax.adam(1e-2))
        train = jaxamp.make_train_step(loss_fn, tx, policy=policy, **kw)
        state = init(train, 'nnx', batchnorm=False)
        for b in batches:
          state, metrics = train.step(state, b)
        out[name] = (leaves(state.params), float(metrics['loss']), float(metrics['loss_scale']))
        if name == 'mesh':
          assert len(state.params['l1']['kernel'][...].sharding.device_set) == 8
          bad = dict(batches[0], x=batches[0]['x'].copy()); bad['x'][31, 0] = np.inf
          state2, m2 = train.step(state, bad)   # only the last device sees the inf
          assert not bool(m2['grads_finite'])
          assert float(m2['loss_scale']) == float(metrics['loss_scale']) / 2
          for a, b in zip(leaves(state2.params), out['mesh'][0]):
            np.testing.assert_array_equal(a, b)
      for a, b in zip(out['single'][0], out['mesh'][0]):
        np.testing.assert_allclose(a, b, rtol=atol, atol=atol)
      np.testing.assert_allclose(out['single'][1], out['mesh'][1], rtol=10 * atol)
      assert out['single'][2] == out['mesh'][2]

    # A batch committed in another layout (one device, replicated, split on its second
    # axis) is moved to the step's batch sharding, not refused: same step as from host.
    from jax.sharding import NamedSharding, PartitionSpec as P
    train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy='float32',
                                   sharding=jaxamp.ShardingConfig(mesh=mesh),
                                   memory=jaxamp.MemoryConfig(donate=False))
    state = init(train, 'nnx', batchnorm=False)
    host = batches[0]
    want = leaves(train.step(state, host)[0].params)
    for put in (lambda x: jax.device_put(x, jax.devices()[5]),
                lambda x: jax.device_put(x, NamedSharding(mesh, P())),
                lambda x: jax.device_put(x, NamedSharding(mesh, P(None, 'data')))
                if x.ndim == 2 else jax.device_put(x, jax.devices()[1])):
      committed = {{k: put(v) for k, v in host.items()}}
      for a, b in zip(leaves(train.step(state, committed)[0].params), want):
        np.testing.assert_array_equal(a, b)
      train.eval_step(state, committed)

    # Aux over devices and micro-batches: counts summed, flags or-ed, as the whole batch's.
    from train_helpers import counting_loss
    b = dict(batches[0], y=np.where(batches[0]['y'] == 3, 0, batches[0]['y']))
    b['y'][5] = 3  # one device's first micro-batch
    auxes = []
    for kw in ({{}}, dict(sharding=jaxamp.ShardingConfig(mesh=mesh), grad_accum_steps=2)):
      train = jaxamp.make_train_step(counting_loss, optax.sgd(0.0), policy='float32',
                                     has_aux=True, **kw)
      _, m = train.step(init(train, 'nnx', batchnorm=False), b)
      auxes.append((int(m['n_right']), int(m['rows']), bool(m['saw_3']),
                    round(float(m['accuracy']), 6)))
    assert auxes[0] == auxes[1] and auxes[0][1:3] == (32, True), auxes

    # BatchNorm told the mesh axis normalizes with the whole batch's statistics: as one
    # device (each device's own statistics, without it). Shards of different means.
    from flax import nnx
    class SyncNet(nnx.Module):
      def __init__(self, axis_name):
        self.l1 = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(16, axis_name=axis_name, rngs=nnx.Rngs(0))
        self.l2 = nnx.Linear(16, 4, rngs=nnx.Rngs(1))
      def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))
    b = dict(batches[0], x=batches[0]['x'] + np.repeat(np.arange(8.0), 4)[:, None])
    got = {{}}
    on_mesh = dict(sharding=jaxamp.ShardingConfig(mesh=mesh))
    for name, kw, axis in [('single', {{}}, None), ('synced', on_mesh, 'data'),
                           ('local', on_mesh, None)]:
      train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy='float32', **kw)
      state, _ = train.step(train.init(SyncNet(axis)), b)
      got[name] = leaves(state.params) + leaves(state.model_state)
    for a, c in zip(got['single'], got['synced']):
      np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5)
    assert max(np.abs(a - c).max() for a, c in zip(got['single'], got['local'])) > 1e-2

    # NNX dropout: every device draws its own masks (one example per device here).
    import jax.numpy as jnp
    from flax import nnx
    class Drop(nnx.Module):
      def __init__(self):
        self.w = nnx.Param(jnp.zeros(16))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
      def __call__(self, x):
        return self.drop(x) @ self.w[...]
    train = jaxamp.make_train_step(lambda m, b: jnp.mean(m(b['x'])), optax.sgd(1.0),
                                   policy='float32', sharding=jaxamp.ShardingConfig(mesh=mesh))
    state, _ = train.step(train.init(Drop()), {{'x': np.ones((8, 16), np.float32)}})
    w = np.asarray(state.params['w'][...])
    # the mean of 8 devices' masks/keep: shared masks could only give 0 or 2
    assert set(np.round(-w, 4).tolist()) - {{0.0, 2.0}}, w

    # gradients averaged across devices in bfloat16
    bf16_mean = jaxamp.ShardingConfig(mesh=mesh, grad_reduce_dtype=jnp.bfloat16)
    for name, kw in [('single', {{}}), ('mesh', dict(sharding=bf16_mean))]:
      train = jaxamp.make_train_step(loss_fn, optax.sgd(0.1), policy='float32', **kw)
      state = init(train, 'nnx', batchnorm=False)
      if name == 'mesh':
        assert 'all-reduce' in train._programs.step_jit.lower(state, batches[0]).compile().as_text()
      for b in batches:
        state, metrics = train.step(state, b)
      out[name] = leaves(state.params)
    for a, b in zip(out['single'], out['mesh']):
      np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)  # bf16 sums: 8-bit mantissa
    print('MESH-OK')
""")


@pytest.mark.slow
def test_data_parallel_on_8_devices_matches_single_device(tmp_path):
  script = _MESH_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
  out = run_script(script, tmp_path, "mesh.py",
                    {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
                                  + os.environ.get("XLA_FLAGS", ""),  # conftest's, too
                     "JAX_PLATFORMS": "cpu"})
  assert "MESH-OK" in out
