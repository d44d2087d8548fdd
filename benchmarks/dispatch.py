"""Dispatch cost of a train step on a model so small that dispatch is the whole step.

One ``nnx.Linear(8, 8)``, a batch of 4, SGD: jaxamp's ``train.step(state, batch)``
against a hand-written ``jax.jit(step, donate_argnums=0)`` doing the same training (the
same optax SGD from the same parameters; under ``mixed_bfloat16`` the model's ``dtype``
set to bfloat16 by hand, the loss in float32), under float32 and mixed_bfloat16. Each is
called as a training loop calls it: ``--calls`` calls, then one ``block_until_ready``.
For reference, in the same rounds:

- ``jax.jit(train.step_fn)``: jaxamp's program under the user's own ``jax.jit``, without
  ``train.step``'s Python around it;
- the hand-written step carrying what jaxamp's state carries and returning its metrics
  (a step count, the loss-scale counters, the exact skip under
  ``lax.cond``, loss, scale, finiteness, gradient norm, skip count);
- the same step with that state's counters and step packed into one ``uint32``
  array and the metrics into another (bit casts inside the program): what a state and
  metrics format with fewer arrays would cost per call;
- ``train.step`` on a state it did not return (``state._replace()`` each call: the
  user's own TrainState), which takes the state check;
- ``lax.scan`` over ``train.step_fn`` and over the hand-written step: ``--calls`` steps
  in one call, per step.

A second table holds a model with many parameters: 75 ``nnx.Linear(8, 8)`` in a row
(150 parameter arrays) trained with Adam, where jaxamp's ``train.step`` meets two
hand-written steps, one holding ``nnx.split``'s ``nnx.State`` (each of its nodes and
``nnx.Variable`` s flattened by Python code on every call) and one holding the nested
dicts ``nnx.to_pure_dict`` makes of it (flattened in C++).

Rounds interleave the candidates, in an order reversed every other round and rotated;
the ratio is the median of the per-round ratios, with a bootstrap interval. Writes
``RESULTS.md`` and ``results.json`` (every round's time) into ``--out``.

    python benchmarks/dispatch.py --out benchmarks/dispatch
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import optax  # pylint: disable=g-import-not-at-top
from flax import nnx  # pylint: disable=g-import-not-at-top

import jaxamp  # pylint: disable=g-import-not-at-top
from benchmarks import report  # pylint: disable=g-import-not-at-top
from benchmarks.measure import Measurement, _order  # pylint: disable=g-import-not-at-top

POLICIES = ("float32", "mixed_bfloat16")
LIMIT = 1.20  # issue 32: train.step / the plain jitted step
F32, U32 = jnp.float32, jnp.uint32
JAXAMP, STEP_FN, PLAIN, SAME, PACKED, REWRAPPED = (
    "jaxamp train.step", "jax.jit(train.step_fn)", "plain jax.jit step",
    "plain, jaxamp's state and metrics", "plain, the same packed in two arrays",
    "train.step, a state it did not return")
SCAN_JAXAMP, SCAN_PLAIN = "lax.scan(train.step_fn), per step", "lax.scan(plain step), per step"
DEEP_STATE, DEEP_DICT = "plain jax.jit step, nnx.State", "plain jax.jit step, plain dicts"
DEEP_LAYERS = 75


@dataclasses.dataclass
class Candidate:
  name: str
  call: Callable[[Any, Any], Any]  # (state, batch) -> (state, out), as a loop calls it
  state: Any
  batch: Any
  steps_per_call: int = 1
  arrays: tuple[int, int] | None = None  # arrays into and out of one call


def loss_of(model: Any, x: jax.Array) -> jax.Array:
  return jnp.mean(model(x).astype(F32) ** 2)


def linear(dtype: Any = None) -> nnx.Linear:
  return nnx.Linear(8, 8, dtype=dtype, rngs=nnx.Rngs(0))


def plain_steps(policy: str) -> tuple[Callable[..., Any], Callable[..., Any], Any, Any]:
  """The hand-written step, the same step with jaxamp's state and metrics, that one
  packed, and their first states (float32 parameters; bfloat16 compute set on the layer by hand)."""
  graphdef, params = nnx.split(linear(jnp.bfloat16 if policy == "mixed_bfloat16" else None))
  opt = optax.sgd(0.1)

  def grads(params, x):
    return jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p), x))(params)

  def step(state, x):
    params, opt_state = state
    loss, g = grads(params, x)
    updates, opt_state = opt.update(g, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  def same_outputs(state, x):
    (params, opt_state), (scale, growth, _, skipped), count = state
    loss, g = grads(params, x)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(v.astype(F32))) for v in jax.tree.leaves(g)))
    finite = jnp.isfinite(norm)

    def apply():
      updates, new_opt = opt.update(g, opt_state, params)
      return optax.apply_updates(params, updates), new_opt

    kept = jax.lax.cond(finite, apply, lambda: (params, opt_state))
    skipped = skipped + jnp.where(finite, 0, 1)
    counters = (scale, jnp.where(finite, growth + 1, 0), finite, skipped)
    metrics = {"loss": loss, "loss_scale": scale, "grads_finite": finite, "grad_norm": norm,
               "skipped_steps": skipped}
    return (kept, counters, count + 1), metrics

  words = lambda *xs: jnp.stack([
      x.astype(U32) if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, U32)
      for x in xs])

  def packed(state, x):
    kept, w = state
    as_ = lambda i, dtype: jax.lax.bitcast_convert_type(w[i], dtype)
    counters = (as_(0, F32), as_(1, jnp.int32), w[2] != 0, as_(3, jnp.int32))
    (kept, counters, count), m = same_outputs((kept, counters, as_(4, jnp.int32)), x)
    return (kept, words(*counters, count)), words(
        *m.values())

  copy = lambda: jax.tree.map(jnp.copy, (params, opt.init(params)))
  counters = (jnp.ones([], F32), jnp.zeros([], jnp.int32), jnp.asarray(True),
              jnp.zeros([], jnp.int32))
  count = jnp.zeros([], jnp.int32)
  return step, same_outputs, packed, copy(), (copy(), counters, count), (copy(), words(
      *counters, count))


def arrays(state: Any, batch: Any, out: Any) -> tuple[int, int]:
  return len(jax.tree.leaves((state, batch))), len(jax.tree.leaves(out))


def candidates(policy: str, calls: int) -> list[Candidate]:
  """Fresh models and states for one policy's candidates (each consumes its state)."""
  x = jax.random.normal(jax.random.key(1), (4, 8), F32)
  xs = jnp.broadcast_to(x, (calls, 4, 8)) + 0  # a scan's batches, on the device
  make = lambda: jaxamp.make_train_step(loss_of, optax.sgd(0.1), policy=policy)
  trains = [make() for _ in range(4)]
  states = [t.init(linear()) for t in trains]
  step, same, packed, plain_state, same_state, packed_state = plain_steps(policy)
  plain_jit = jax.jit(step, donate_argnums=0)
  same_jit = jax.jit(same, donate_argnums=0)
  packed_jit = jax.jit(packed, donate_argnums=0)
  step_fn_jit = jax.jit(trains[1].step_fn, donate_argnums=0)
  rewrapped = trains[2]

  def scan(step):
    return jax.jit(lambda s, xs: jax.lax.scan(step, s, xs), donate_argnums=0)

  def counted(name, call, state, batch, steps=1):
    out = jax.eval_shape(call, state, batch)
    return Candidate(name, call, state, batch, steps, arrays(state, batch, out))

  return [
      counted(JAXAMP, trains[0].step, states[0], x),
      counted(PLAIN, plain_jit, plain_state, x),
      counted(STEP_FN, step_fn_jit, states[1], x),
      counted(SAME, same_jit, same_state, x),
      counted(PACKED, packed_jit, packed_state, x),
      counted(REWRAPPED, lambda s, b: rewrapped.step(s._replace(), b), states[2], x),
      counted(SCAN_JAXAMP, scan(trains[3].step_fn), states[3], xs, calls),
      counted(SCAN_PLAIN, scan(step), plain_steps(policy)[3], xs, calls),
  ]


class Deep(nnx.Module):
  """``DEEP_LAYERS`` ``nnx.Linear(8, 8)`` in a row: many parameters, little work."""

  def __init__(self, dtype: Any = None):
    rngs = nnx.Rngs(0)
    self.layers = nnx.List([nnx.Linear(8, 8, dtype=dtype, rngs=rngs)
                            for _ in range(DEEP_LAYERS)])

  def __call__(self, x: jax.Array) -> jax.Array:
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return x


def deep_candidates(policy: str) -> list[Candidate]:
  """jaxamp's step and two hand-written ones (``nnx.State``; plain dicts) on :class:`Deep`
  with Adam, under ``policy`` (bfloat16 compute set by hand for the hand-written ones)."""
  x = jax.random.normal(jax.random.key(1), (4, 8), F32)
  opt = optax.adam(1e-3)
  train = jaxamp.make_train_step(loss_of, opt, policy=policy)
  graphdef, params = nnx.split(Deep(jnp.bfloat16 if policy == "mixed_bfloat16" else None))

  def step(state, x):
    params, opt_state = state
    loss, g = jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p), x))(params)
    updates, opt_state = opt.update(g, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  plain = lambda p: jax.tree.map(jnp.copy, (p, opt.init(p)))
  jitted = jax.jit(step, donate_argnums=0)  # one program, two state layouts
  cands = [(JAXAMP, train.step, train.init(Deep())), (DEEP_STATE, jitted, plain(params)),
           (DEEP_DICT, jitted, plain(nnx.to_pure_dict(params)))]
  return [Candidate(name, call, state, x, 1,
                    arrays(state, x, jax.eval_shape(call, state, x)))
          for name, call, state in cands]


def measure(cs: list[Candidate], rounds: int, calls: int, warmup: int
            ) -> tuple[dict[str, Measurement], dict[str, list[float]]]:
  """Per candidate: wall seconds per step of each round (a Measurement) and process CPU
  seconds per step (this process's threads, XLA's included: a busy machine delays it
  less than the wall clock)."""
  wall = {c.name: Measurement(c.name, "", None, 0.0, {}, []) for c in cs}
  cpu: dict[str, list[float]] = {c.name: [] for c in cs}
  states = {}
  for c in cs:
    state = c.state
    for _ in range(1 if c.steps_per_call > 1 else warmup):
      state, out = c.call(state, c.batch)
    jax.block_until_ready((state, out))
    states[c.name] = state
    c.state = None
  for r in range(rounds):
    for k in _order(len(cs), r):
      c = cs[k]
      state, n = states[c.name], (1 if c.steps_per_call > 1 else calls)
      start, start_cpu = time.perf_counter(), time.process_time()
      for _ in range(n):
        state, out = c.call(state, c.batch)
      jax.block_until_ready((state, out))
      steps = n * c.steps_per_call
      wall[c.name].round_step_s.append((time.perf_counter() - start) / steps)
      cpu[c.name].append((time.process_time() - start_cpu) / steps)
      states[c.name] = state
  return wall, cpu


def same_training(policy: str, steps: int = 5) -> float:
  """Largest parameter difference between jaxamp's step and the plain one after
  ``steps`` steps from the same parameters: the two do the same training."""
  train = jaxamp.make_train_step(loss_of, optax.sgd(0.1), policy=policy)
  state = train.init(linear())
  step, _, _, plain_state, _, _ = plain_steps(policy)
  x = jax.random.normal(jax.random.key(1), (4, 8), F32)
  for _ in range(steps):
    state, _ = train.step(state, x)
    plain_state, _ = jax.jit(step)(plain_state, x)
  return max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(state.params), jax.tree.leaves(plain_state[0])))


def _us(seconds: float) -> str:
  return f"{seconds * 1e6:.1f}" if seconds == seconds else "n/a"


def write(out: pathlib.Path, info: dict[str, Any], config: dict[str, Any],
          results: dict[str, Any], deep: dict[str, Any]) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.json").write_text(json.dumps(
      {"machine": info, "config": config, "results": results, "deep": deep}, indent=1,
      default=str))
  lines = [
      "# Dispatch: jaxamp's train step against a plain jitted step (issue 32)", "",
      f"Measured by `{info['command']}` on {info['date']} ({config['seconds']:.0f} s in "
      "all). Generated file: rerun the benchmark rather than editing it.", "",
      "## Machine", "", "|  |  |", "| --- | --- |",
      f"| backend / device | {info['backend']} / {info['device']} × {info['device_count']} |",
      f"| CPU | {info['cpu']}, {info['cpu_cores']} cores usable |",
      f"| Python / OS | {info['python']} / {info['platform']} |",
      "| jax / jaxlib | {jax} / {jaxlib} |".format(**info["versions"]),
      "| flax / optax | {flax} / {optax} |".format(**info["versions"]),
      f"| jaxamp | {info['versions']['jax-mixed-precision']}, git {info['git']} |",
      f"| load average (1 min), start / end | {config['load'][0]:.1f} / "
      f"{config['load'][1]:.1f} on {info['cpu_cores']} cores |", "",
      "## How to read it", "",
      f"One `nnx.Linear(8, 8)`, batch 4, `optax.sgd(0.1)`: the XLA program runs in a few "
      "microseconds, so a call's time is what it takes to hand it to XLA and collect its "
      f"results. Each round runs every candidate for {config['calls']} calls (a scan: "
      f"one call of {config['calls']} steps) and then one `block_until_ready`, in an "
      f"order rotated every round and reversed every other; {config['rounds']} rounds "
      f"after {config['warmup']} warm-up calls.",
      "",
      "- **µs/step**: median over the rounds of wall time per step; **IQR %**: the rounds' "
      "interquartile range over that median. **CPU µs/step**: this process's CPU time "
      "(all its threads, XLA's included) per step, which a busy machine inflates less.",
      "- **× plain**: the median of the per-round ratios to the plain jitted step of the "
      "same policy (the two ran in the same round), with its 95 % bootstrap interval.",
      "- **arrays in / out**: the arrays one call passes to the jitted program (the state's "
      "leaves and the batch) and gets back (the new state's and the metrics'); each costs "
      "the call work in jit's dispatch and XLA's buffer handling, whatever the program "
      "computes.", ""]
  for policy, r in results.items():
    lines += [f"## {policy}", "",
              "| candidate | µs/step | IQR % | CPU µs/step | × plain | 95 % interval "
              "| arrays in / out |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, c in r["candidates"].items():
      ratio = c.get("ratio_to_plain")
      lines.append("| {} | {} | {:.1f} | {} | {} | {} | {} |".format(
          name, _us(c["step_s"]), 100 * c["spread"], _us(c["cpu_step_s"]),
          f"{ratio[0]:.2f}" if ratio else "—",
          f"{ratio[1]:.2f}–{ratio[2]:.2f}" if ratio else "—",
          "{} / {}".format(*c["arrays"]) if c["arrays"] else "—"))
    lines.append("")
  lines += [f"## {DEEP_LAYERS * 2} parameters, Adam", "",
            f"{DEEP_LAYERS} `nnx.Linear(8, 8)` in a row, batch 4, `optax.adam(1e-3)`; "
            f"{max(config['calls'] // 10, 1)} calls per round. **× dicts**: to the "
            "hand-written step holding plain dicts, in the same rounds.", ""]
  for policy, r in deep.items():
    lines += [f"### {policy}", "", "| candidate | µs/step | IQR % | CPU µs/step | × dicts "
              "| 95 % interval | arrays in / out |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, c in r.items():
      ratio = c.get("ratio_to_plain")
      lines.append("| {} | {} | {:.1f} | {} | {} | {} | {} |".format(
          name, _us(c["step_s"]), 100 * c["spread"], _us(c["cpu_step_s"]),
          f"{ratio[0]:.2f}" if ratio else "—",
          f"{ratio[1]:.2f}–{ratio[2]:.2f}" if ratio else "—", "{} / {}".format(*c["arrays"])))
    lines.append("")
  lines += ["## Summary", ""]
  for policy, r in results.items():
    c = r["candidates"]
    ratio = c[JAXAMP]["ratio_to_plain"][0]
    verdict = "meets" if ratio <= LIMIT else "does **not** meet"
    lines.append(
        f"- **{policy}**: `train.step` / plain jitted step **{ratio:.2f}** ({verdict} the "
        f"≤ {LIMIT:.2f} target); `train.step` / `jax.jit(train.step_fn)` "
        f"{r['train_step_over_step_fn'][0]:.2f}; the plain step carrying jaxamp's state and "
        f"metrics / plain "
        f"{c[SAME]['ratio_to_plain'][0]:.2f}, with them packed in two arrays "
        f"{c[PACKED]['ratio_to_plain'][0]:.2f}; `train.step` / that step "
        f"{r['train_step_over_same'][0]:.2f}. A scan step costs "
        f"{_us(c[SCAN_JAXAMP]['step_s'])} µs (jaxamp) and {_us(c[SCAN_PLAIN]['step_s'])} µs "
        f"(plain). Largest parameter difference from the plain step after 5 steps: "
        f"{r['param_difference']:.1e}.")
  for policy, r in deep.items():
    lines.append(
        f"- {DEEP_LAYERS * 2} parameters with Adam, {policy}: `train.step` "
        f"{r[JAXAMP]['ratio_to_plain'][0]:.2f}× the hand-written step holding plain dicts, "
        f"the one holding `nnx.State` {r[DEEP_STATE]['ratio_to_plain'][0]:.2f}×.")
  own = max(r["train_step_over_step_fn"][0] for r in results.values())
  same = min(r["candidates"][SAME]["ratio_to_plain"][0] for r in results.values())
  packed = max(r["candidates"][PACKED]["ratio_to_plain"][0] for r in results.values())
  lines += ["", f"`train.step` over `jax.jit(train.step_fn)` is at most {own:.2f} here: that is "
            "what its Python adds per call (the state check, skipped for the state it "
            "returned or one laid out alike; the batch layout; the skip-streak counter). The "
            f"plain step carrying jaxamp's state and metrics is at least {same:.2f}× the plain "
            "one: the arrays that cross the jit boundary each call cost that, whoever writes "
            f"the step; packed into two arrays (counters and step; metrics), the same "
            f"work costs at most {packed:.2f}×, what a state and metrics format with fewer "
            "arrays would bring `train.step` (jaxamp's keeps named fields: "
            "`TrainState.step`, the loss-scale state's counters, a metrics dict). Where dispatch is the cost, run several steps per call: `lax.scan` "
            "over `train.step_fn` in your own `jax.jit` (docs/guides/train_step.md, \"Your "
            "own jit or scan\")."]
  (out / "RESULTS.md").write_text("\n".join(lines) + "\n")


def figures(cs: list[Candidate], wall: dict[str, Measurement], cpu: dict[str, list[float]],
            baseline: str, unpaired: tuple[str, ...] = ()) -> dict[str, Any]:
  """Per candidate: its times, arrays per call and ratio to ``baseline`` (paired by round;
  None for the baseline and for ``unpaired``)."""
  shapes = {c.name: c.arrays for c in cs}
  return {name: {"step_s": m.step_s, "spread": m.spread,
                 "cpu_step_s": statistics.median(cpu[name]), "arrays": shapes[name],
                 "round_step_s": m.round_step_s, "round_cpu_s": cpu[name],
                 "ratio_to_plain": (None if name == baseline or name in unpaired
                                    else report.paired_ratio(m, wall[baseline]))}
          for name, m in wall.items()}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path(__file__).resolve().parent / "dispatch")
  parser.add_argument("--rounds", type=int, default=51)
  parser.add_argument("--calls", type=int, default=200, help="calls per candidate per round")
  parser.add_argument("--warmup", type=int, default=50)
  parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
  args = parser.parse_args(argv)
  begin, load = time.perf_counter(), [os.getloadavg()[0]]
  info = report.machine()
  info["command"] = "python benchmarks/dispatch.py " + " ".join(
      sys.argv[1:] if argv is None else argv)
  results: dict[str, Any] = {}
  for policy in args.policies:
    cs = candidates(policy, args.calls)
    wall, cpu = measure(cs, args.rounds, args.calls, args.warmup)
    out = figures(cs, wall, cpu, PLAIN, unpaired=(SCAN_JAXAMP, SCAN_PLAIN))
    results[policy] = {
        "candidates": out,
        "train_step_over_step_fn": report.paired_ratio(wall[JAXAMP], wall[STEP_FN]),
        "train_step_over_same": report.paired_ratio(wall[JAXAMP], wall[SAME]),
        "param_difference": same_training(policy)}
    for name, c in out.items():
      ratio = f"  × plain {c['ratio_to_plain'][0]:.2f}" if c["ratio_to_plain"] else ""
      print(f"{policy:>15} {name:<42} {_us(c['step_s']):>8} µs/step  "
            f"(CPU {_us(c['cpu_step_s'])}){ratio}")
  deep: dict[str, Any] = {}
  for policy in args.policies:
    cs = deep_candidates(policy)
    wall, cpu = measure(cs, args.rounds, max(args.calls // 10, 1), max(args.warmup // 10, 1))
    deep[policy] = figures(cs, wall, cpu, DEEP_DICT)
    for name, c in deep[policy].items():
      ratio = f"  × dicts {c['ratio_to_plain'][0]:.2f}" if c["ratio_to_plain"] else ""
      print(f"{policy:>15} {DEEP_LAYERS * 2} params, {name:<32} {_us(c['step_s']):>8} "
            f"µs/step{ratio}")
  load.append(os.getloadavg()[0])
  config = {"rounds": args.rounds, "calls": args.calls, "warmup": args.warmup,
            "model": "nnx.Linear(8, 8), batch 4, optax.sgd(0.1)", "load": load,
            "seconds": time.perf_counter() - begin}
  write(args.out, info, config, results, deep)
  print(f"wrote {args.out / 'RESULTS.md'}")


if __name__ == "__main__":
  main()
