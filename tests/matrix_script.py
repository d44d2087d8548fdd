"""The differential matrix, run by tests/test_matrix.py in one process of 8 CPU devices.

Each row of a pairwise covering array over (model, layout, policy, accumulation, model
state, fault, half_residuals, batch) trains 3 steps on a mesh of data=4 x model=2 and on
one device with the same global batch (its micro-batches holding the same rows as the
mesh's), and reports how the two differ; then ``EXTRA_ROWS`` (an optimizer state holding
the parameters' arrays, a state resumed from a step of another policy). Prints one
``ROW <json>`` line per row.
"""

import itertools
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxamp

P = jax.sharding.PartitionSpec

FACTORS = {
    "model": ["nnx", "linen", "equinox"],
    "layout": ["replicated", "fsdp", "fsdp over two axes, prefetch", "logical rules",
               "fsdp, whole model"],
    "policy": ["float32", "mixed_bfloat16", "mixed_float16", "float16", "mixed_fp8",
               "mixed_fp8_current", "p=f32,c=f16,fp8=delayed"],
    "accum": [1, 2],
    "state": ["none", "batchnorm", "counters"],
    "fault": ["none", "inf on one device"],
    "residuals": ["half", "plain"],  # make_train_step's half_residuals on (default), off
    # "typed key": the batch also holds two typed PRNG keys per row (Equinox users'
    # dropout keys), and the loss adds noise drawn from each row's first.
    "batch": ["arrays", "typed key"],
}
# Rows after the covering array's, each varying what a factor would (issue 46): an
# optimizer state holding the parameters' own arrays, and a state made by a step of
# another policy (its loss-scale and FP8 state fitted to the row's policy at the first
# step). Not factors: the covering array, and the rows it has been checked on, stay.
EXTRA = {"optimizer": "sgd", "resume": "none", "net": "mlp", "master": "default"}
EXTRA_ROWS = [
    dict(model="nnx", layout="fsdp", policy="mixed_float16", accum=1, state="none",
         fault="none", residuals="half", batch="arrays",
         optimizer="sgd, average of the params", resume="mixed_bfloat16"),
    dict(model="linen", layout="replicated", policy="mixed_fp8", accum=1, state="none",
         fault="none", residuals="half", batch="arrays",
         optimizer="sgd, average of the params", resume="mixed_float16"),
    # OCP MX FP8 (issue 43): block scales along each product's contraction.
    dict(model="nnx", layout="fsdp", policy="mixed_mxfp8", accum=2, state="none",
         fault="inf on one device", residuals="half", batch="arrays", **EXTRA),
    dict(model="linen", layout="replicated", policy="mixed_mxfp8", accum=1,
         state="batchnorm", fault="none", residuals="plain", batch="typed key", **EXTRA),
    dict(model="equinox", layout="logical rules", policy="mixed_mxfp8", accum=1,
         state="none", fault="inf on one device", residuals="half", batch="arrays",
         **EXTRA),
    # Block-scaled FP8 (jaxamp/block.py): FSDP-gathered kernels quantized in blocks, an
    # inf on one device's rows skipped everywhere, micro-batches.
    # (One row: the matrix runs in one subprocess under a 15-minute limit, and this
    # emulation pads the matrix's 16 features and 4 rows per device to 128.)
    dict(model="nnx", layout="fsdp", policy="mixed_fp8_block", accum=2, state="none",
         fault="inf on one device", residuals="half", batch="arrays", **EXTRA),
    # FP8 convolutions (issue 43): a small CNN in each library, its conv layers' delayed
    # amaxes maxed over the devices as a Dense's.
    dict(model="nnx", layout="fsdp", policy="mixed_fp8", accum=2, state="none",
         fault="inf on one device", residuals="half", batch="arrays", optimizer="sgd",
         resume="none", net="cnn"),
    dict(model="linen", layout="replicated", policy="mixed_fp8", accum=1, state="none",
         fault="none", residuals="half", batch="arrays", optimizer="sgd", resume="none",
         net="cnn"),
    dict(model="equinox", layout="replicated", policy="mixed_fp8", accum=1, state="none",
         fault="none", residuals="half", batch="arrays", optimizer="sgd", resume="none",
         net="cnn"),
    # FSDP's FP8 kernel gather (issue 43 item 3, ShardingConfig.fp8_gather on by default):
    # under current scaling each FP8 kernel is gathered as E4M3 and a scale, per layer
    # (Linen's read slices) and for the whole model (Equinox), an inf on one device's rows.
    dict(model="linen", layout="fsdp", policy="mixed_fp8_current", accum=2, state="none",
         fault="inf on one device", residuals="half", batch="arrays", **EXTRA),
    dict(model="equinox", layout="fsdp, whole model", policy="mixed_fp8_current", accum=1,
         state="none", fault="inf on one device", residuals="plain", batch="arrays",
         **EXTRA),
    # Issue 44: bfloat16 params without float32 master weights, the optimizer state in
    # bfloat16 (Adam's moments, momentum), a skipped step and accumulation (stochastic),
    # FSDP's two axes and BatchNorm (Kahan).
    dict(model="nnx", layout="fsdp", policy="bfloat16", accum=2, state="none",
         fault="inf on one device", residuals="half", batch="arrays", optimizer="adam",
         resume="none", master="stochastic"),
    dict(model="linen", layout="fsdp over two axes, prefetch", policy="bfloat16", accum=1,
         state="batchnorm", fault="inf on one device", residuals="half", batch="arrays",
         optimizer="momentum", resume="none", master="kahan"),
]
# The one-device run every row is compared with is the matrix's "one device" layout.
REDUCTION = {"*calls": "same", "*examples": "sum", "*total": "sum", "*peak": "max"}
LOGICAL = [("embed", ("data", "model")), ("mlp", None)]  # MaxText-style: two axes
STEPS, BATCH, DATA = 3, 16, 4


def refused(row):
  """Whether make_train_step or init refuses ``row``: Equinox keeps model state in
  eqx.nn.State, which loss_fn(model, batch) cannot hand back."""
  return row["model"] == "equinox" and row["state"] != "none"


def pairwise(factors):
  """A small list of rows in which every pair of two factors' values appears in a row
  that runs; each pair that makes a row refused gets one row of its own."""
  names = list(factors)
  pairs = lambda row: {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}
  candidates = [dict(zip(names, values)) for values in itertools.product(*factors.values())]
  uncovered = set().union(*(pairs(row) for row in candidates if not refused(row)))
  rows = []
  while uncovered:
    best = max((row for row in candidates if not refused(row)),
               key=lambda row: len(pairs(row) & uncovered))  # first of the best
    uncovered -= pairs(best)
    rows.append(best)
  for state in factors["state"]:
    row = {name: values[0] for name, values in factors.items()}
    row.update(model="equinox", state=state)
    if refused(row):
      rows.append(row)
  return rows


def all_rows():
  """The covering array's rows, then EXTRA_ROWS; every row has EXTRA's keys."""
  return ([{**row, **EXTRA} for row in pairwise(FACTORS)]
          + [{**EXTRA, **row} for row in EXTRA_ROWS])


def averaged_params(decay=0.5):
  """An optax element keeping an average of the parameters, initialised from the
  parameters themselves: the optimizer state holds their arrays."""

  def update_fn(updates, state, params=None):
    return updates, jax.tree.map(lambda a, p, u: decay * a + (1 - decay) * (p + u), state,
                                 params, updates)

  return optax.GradientTransformation(lambda params: params, update_fn)


def kernel_init(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class NNXNet(nnx.Module):
  def __init__(self, state, axis_name, rngs):
    self.l1 = nnx.Linear(16, 32, kernel_init=kernel_init(("embed", "mlp")), rngs=rngs)
    self.bn = (nnx.BatchNorm(32, axis_name=axis_name, rngs=rngs) if state == "batchnorm"
               else None)
    self.l2 = nnx.Linear(32, 8, kernel_init=kernel_init(("mlp", "embed")), rngs=rngs)
    self.counters = state == "counters"
    if self.counters:
      self.calls = nnx.Variable(jnp.zeros((), jnp.int32))
      self.examples = nnx.Variable(jnp.zeros((), jnp.int32))
      self.total = nnx.Variable(jnp.zeros((16,), jnp.float32))
      self.peak = nnx.Variable(jnp.full((16,), -1e9, jnp.float32))

  def __call__(self, x):
    if self.counters:
      self.calls[...] += 1
      self.examples[...] += x.shape[0]
      self.total[...] += x.astype(jnp.float32).sum(0)
      self.peak[...] = jnp.maximum(self.peak[...], x.astype(jnp.float32).max(0))
    h = self.l1(x)
    if self.bn is not None:
      h = self.bn(h)
    return self.l2(jax.nn.relu(h))


class LinenNet(nn.Module):
  state: str
  axis_name: str | None

  @nn.compact
  def __call__(self, x):
    if self.state == "counters":
      calls = self.variable("stats", "calls", lambda: jnp.zeros((), jnp.int32))
      examples = self.variable("stats", "examples", lambda: jnp.zeros((), jnp.int32))
      total = self.variable("stats", "total", lambda: jnp.zeros((16,), jnp.float32))
      peak = self.variable("stats", "peak", lambda: jnp.full((16,), -1e9, jnp.float32))
      if not self.is_initializing():
        calls.value += 1
        examples.value += x.shape[0]
        total.value += x.astype(jnp.float32).sum(0)
        peak.value = jnp.maximum(peak.value, x.astype(jnp.float32).max(0))
    init = nn.initializers.lecun_normal()
    h = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
    if self.state == "batchnorm":
      h = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(h)
    return nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(
        jax.nn.relu(h))


def equinox_net(state):
  """The same network in Equinox. Its state lives in eqx.nn.State, which a
  loss_fn(model, batch) cannot hand back: init refuses BatchNorm and counters."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class EqxNet(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear
    bn: object
    calls: object

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.l1, self.l2 = eqx.nn.Linear(16, 32, key=k1), eqx.nn.Linear(32, 8, key=k2)
      self.bn = eqx.nn.BatchNorm(32, axis_name="batch") if state == "batchnorm" else None
      self.calls = (eqx.nn.StateIndex(jnp.zeros((), jnp.int32)) if state == "counters"
                    else None)

    def __call__(self, x):
      return jax.vmap(self.l2)(jax.nn.relu(jax.vmap(self.l1)(x)))

  return EqxNet(jax.random.key(0))


class NNXCNN(nnx.Module):
  """A 16-feature row as a 4x4 one-channel image: a strided and a grouped convolution,
  then a dense head."""

  def __init__(self, rngs):
    self.c1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(8, 8, (3, 3), strides=(2, 2), feature_group_count=2, rngs=rngs)
    self.out = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.c1(x.reshape(-1, 4, 4, 1)))
    return self.out(jax.nn.relu(self.c2(h)).mean((1, 2)))


class LinenCNN(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = jax.nn.relu(nn.Conv(8, (3, 3))(x.reshape(-1, 4, 4, 1)))
    h = jax.nn.relu(nn.Conv(8, (3, 3), strides=2, feature_group_count=2)(h))
    return nn.Dense(8)(h.mean((1, 2)))


def equinox_cnn():
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class EqxCNN(eqx.Module):
    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d
    out: eqx.nn.Linear

    def __init__(self, key):
      k1, k2, k3 = jax.random.split(key, 3)
      self.c1 = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
      self.c2 = eqx.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, key=k2)
      self.out = eqx.nn.Linear(8, 8, key=k3)

    def __call__(self, x):
      def one(x):
        h = jax.nn.relu(self.c1(x.reshape(1, 4, 4)))
        return self.out(jax.nn.relu(self.c2(h)).mean((1, 2)))
      return jax.vmap(one)(x)

  return EqxCNN(jax.random.key(0))


def loss_fn(model, batch):
  x = batch["x"]
  if "key" in batch:  # each row's noise from its own key: the same on every layout
    x = x + 0.1 * jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(batch["key"][:, 0])
  return jnp.mean((model(x) - batch["y"]) ** 2)


def batches(fault, kind="arrays"):
  rng = np.random.RandomState(0)
  out = [{"x": rng.randn(BATCH, 16).astype(np.float32),
          "y": rng.randn(BATCH, 8).astype(np.float32)} for _ in range(STEPS)]
  if fault != "none":
    out[1]["x"][0, 0] = np.inf  # row 0: the first data device's
  if kind == "typed key":
    for i, b in enumerate(out):
      b["key"] = jax.random.split(jax.random.key(i), (BATCH, 2))
  return out


def micro_ordered(batch, accum):
  """The one-device batch whose micro-batches hold the rows the mesh's micro-batches
  hold: micro-batch i gathers every data device's i-th chunk."""
  if accum == 1:
    return batch
  per = BATCH // DATA // accum
  order = [d * (BATCH // DATA) + i * per + r
           for i in range(accum) for d in range(DATA) for r in range(per)]
  return jax.tree.map(lambda a: a[np.array(order)], batch)


def layout_sharding(layout, mesh):
  """The ShardingConfig of ``layout`` on ``mesh`` (None: one device)."""
  if mesh is None:
    return jaxamp.ShardingConfig(model_state_reduction=REDUCTION)
  if layout == "replicated":
    param_sharding = None
  elif layout == "fsdp":
    param_sharding = jaxamp.fsdp("data", min_size=1)
  elif layout == "fsdp, whole model":  # NNX models gather per layer by default
    param_sharding = jaxamp.fsdp("data", min_size=1, gather="model")
  elif layout == "fsdp over two axes, prefetch":  # each module's gathers one module ahead
    param_sharding = jaxamp.fsdp(("data", "model"), min_size=1, prefetch=True)
  else:
    param_sharding = jaxamp.annotated(LOGICAL)
  return jaxamp.ShardingConfig(mesh=mesh, batch_axis="data", param_sharding=param_sharding,
                               model_state_reduction=REDUCTION)


def made(row, mesh):
  """The train step and first state of ``row`` (on ``mesh``, or one device)."""
  axis_name = "data" if mesh is not None else None
  sharding = layout_sharding(row["layout"], mesh)
  # Adam's first steps are lr * sign(g): a gradient near 0 that a device order flips
  # moves a weight by 2 lr, so only the row without BatchNorm's statistics takes it.
  tx = {"adam": optax.adam(1e-2), "momentum": optax.sgd(0.1, momentum=0.9)}.get(
      row["optimizer"], optax.sgd(0.1))
  if row["optimizer"] not in ("sgd", "adam", "momentum"):
    tx = optax.chain(tx, averaged_params())
  master = ({} if row["master"] == "default"
            else dict(master_weights=row["master"], opt_state_dtype=jnp.bfloat16))
  step = lambda policy: jaxamp.make_train_step(
      loss_fn, tx, policy=policy, grad_accum_steps=row["accum"], sharding=sharding,
      memory=jaxamp.MemoryConfig(half_residuals=row["residuals"] == "half", **master))
  train = step(row["policy"])
  if row["net"] == "cnn":
    if row["model"] == "equinox":
      args = (equinox_cnn(),)
    elif row["model"] == "nnx":
      args = (NNXCNN(nnx.Rngs(0)),)
    else:
      x = jnp.zeros((BATCH, 16))
      args = (LinenCNN(), LinenCNN().init(jax.random.key(0), x), x)
  elif row["model"] == "equinox":
    args = (equinox_net(row["state"]),)
  elif row["model"] == "nnx":
    with nnx.use_eager_sharding(False):  # annotations only: the train step lays out
      args = (NNXNet(row["state"], axis_name, nnx.Rngs(0)),)
  else:
    module = LinenNet(row["state"], axis_name)
    x = jnp.zeros((BATCH, 16))
    if axis_name is not None:  # BatchNorm's axis exists only inside the mesh
      variables = LinenNet(row["state"], None).init(jax.random.key(0), x)
    else:
      variables = module.init(jax.random.key(0), x)
    args = (module, variables, x)
  state = train.init(*args)
  if row["resume"] != "none":  # the first state a step of another policy made
    state = step(row["resume"]).init(*args)
  return train, state


class Refused(Exception):
  """make_train_step or init refused the combination (a ValueError naming why)."""


def run(row, mesh):
  """Trains ``row`` on ``mesh`` (None: one device): per-step records, whether skipped
  steps left the params bit-identical, the state, and whether the step gathered
  parameters per layer."""
  try:
    train, state = made(row, mesh)
  except ValueError as e:
    raise Refused(str(e)) from e
  records, skips_exact = [], True
  for b in batches(row["fault"], row["batch"]):
    if mesh is None:
      b = micro_ordered(b, row["accum"])
    before = [np.asarray(p) for p in jax.tree.leaves(state.params)]
    state, metrics = train.step(state, b)
    if not bool(metrics["grads_finite"]):
      after = [np.asarray(p) for p in jax.tree.leaves(state.params)]
      skips_exact &= all(np.array_equal(x, y, equal_nan=True) for x, y in zip(before, after))
    records.append((int(metrics["skipped_steps"]), float(metrics["loss_scale"])))
  return records, skips_exact, state, train.plan.layer_gather


def replicas_agree(state):
  """Whether every replicated leaf holds the same value on every device."""
  for leaf in jax.tree.leaves(state):
    if not isinstance(leaf, jax.Array) or jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      continue
    if leaf.sharding.is_fully_replicated:
      shards = [np.asarray(s.data) for s in leaf.addressable_shards]
      if not all(np.array_equal(shards[0], s, equal_nan=True) for s in shards[1:]):
        return False
  return True


def largest(a_tree, b_tree, relative=False):
  """The largest difference between two trees' leaves (relative: to their magnitude)."""
  out = [0.0]
  for x, y in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    diff = np.abs(x - y)
    if relative:
      diff = diff / np.maximum(np.maximum(np.abs(x), np.abs(y)), 1e-30)
    out.append(float(np.max(diff)) if diff.size else 0.0)
  return max(out)


def compare(row, mesh, references):
  key = tuple(row[k] for k in ("model", "policy", "accum", "state", "fault", "residuals",
                               "batch", "optimizer", "resume", "net",
                               "master"))
  try:
    if key not in references:
      references[key] = run(row, None)
  except Refused as e:  # refused at make_train_step or init: say so, and why
    return {"refused": str(e)[:400]}
  try:
    ref_records, ref_exact, ref_state, _ = references[key]
    records, exact, state, layer_gather = run(row, mesh)
  except Exception as e:  # pylint: disable=broad-except
    return {"error": f"{type(e).__name__}: {str(e)[:400]}"}
  model_state = lambda s: [x for x in jax.tree.leaves(s.model_state)
                           if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
  return {
      "params": largest(state.params, ref_state.params),
      "model_state": largest(model_state(state), model_state(ref_state)),
      "fp8": (largest(state.fp8, ref_state.fp8, relative=True)
              if state.fp8 is not None else 0.0),
      "opt_state": largest(state.opt_state, ref_state.opt_state),
      "fp8_held": [state.fp8 is not None, ref_state.fp8 is not None],
      "records": records, "reference_records": ref_records,
      "skips_exact": bool(exact and ref_exact),
      "replicas_agree": replicas_agree(state),
      "layer_gather": layer_gather,
  }


def main():
  mesh = jax.make_mesh((DATA, 2), ("data", "model"))
  rows = all_rows()
  references = {}
  only = sys.argv[1:]  # row indices, to rerun a few
  for i, row in enumerate(rows):
    if only and str(i) not in only:
      continue
    print("ROW", json.dumps({"index": i, **row, **compare(row, mesh, references)}),
          flush=True)


if __name__ == "__main__":
  main()
