"""Training fidelity over seeds: jaxamp's policies against float32 and a hand-set half model.

flaxmodels' ResNet-18 (random init, ``output='logits'``, BatchNorm statistics updated)
trains on scikit-learn's digits with Adam 1e-3 at batch 32, once per seed, as:

- ``float32``: the unmodified model, a plain ``jax.jit`` step;
- ``hand-set bfloat16``: ``flaxmodels.ResNet18(..., dtype=jnp.bfloat16)`` (params
  float32: flaxmodels has no ``param_dtype``), the same plain step;
- ``jaxamp <policy>``: the unmodified model through
  ``jaxamp.make_train_step(loss_fn, optax.adam(1e-3), policy=...)``, for ``float32``,
  ``mixed_bfloat16`` and ``mixed_float16``.

Within a seed every candidate starts from the same variables and sees the same batches,
so differences between candidates are paired. Per candidate the harness reports, over
seeds, the mean of the last 10 training losses (also after 40 steps, issue 32's
setting), the held-out loss and accuracy (BatchNorm running statistics), and each
jaxamp candidate's paired difference to its reference. A one-batch probe then shows how
far one gradient moves from float32's under each precision, including a bfloat16
rounding of the input alone.

Data: digits' 8x8 images scaled to [0, 1], upsampled to 32x32 (bilinear,
``jax.image.resize``: the size the ResNet-18 test in ``tests/test_thirdparty.py``
trains at; the stem's stride and max-pool leave 8x8, layer 4 runs at 1x1) and repeated
to 3 channels; the model's own ImageNet normalisation stays on. A fixed stratified
split holds out 20 % (360 images) for the test figures; each seed reshuffles the
1437 training images every epoch.

``output='logits'``: flaxmodels' default, ``'softmax'``, would put the cross-entropy's
log-softmax on probabilities (a loss that cannot fall below 1.46). The default 100 steps
(2.2 epochs) keep 5 seeds x 5 candidates near half an hour on a busy 2-core CPU (about
0.5-1 s a step there); ``--steps`` asks for more.

    python benchmarks/fidelity.py --out benchmarks/fidelity   # the committed numbers
    python benchmarks/fidelity.py --seeds 2 --steps 20 --out /tmp/fid  # checks it runs
    python benchmarks/fidelity.py --render --out benchmarks/fidelity  # redraws the tables
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import flaxmodels  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import stats
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jaxamp
from benchmarks import report

BATCH = 32
SIZE = 32
LR = 1e-3
LAST = 10  # the training losses averaged at the end of a run
ISSUE_STEPS = 40  # issue 32's single-seed runs
REFERENCE = {"jaxamp float32": "float32", "jaxamp mixed_bfloat16": "hand-set bfloat16",
             "jaxamp mixed_float16": "hand-set bfloat16"}


# --- data and model ----------------------------------------------------------------------


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Train and test images (N, 32, 32, 3) in [0, 1] and their labels."""
  data = load_digits()
  images = jax.image.resize(jnp.asarray(data.images / 16.0, jnp.float32),
                            (len(data.images), SIZE, SIZE), "linear")
  images = np.repeat(np.asarray(images)[..., None], 3, axis=-1)
  return tuple(train_test_split(images, data.target.astype(np.int32), test_size=0.2,
                                random_state=0, stratify=data.target))


def batches(seed: int, n: int, steps: int) -> np.ndarray:
  """(steps, BATCH) indices: a fresh permutation per epoch, the remainder dropped."""
  rng = np.random.default_rng(seed)
  per_epoch = n // BATCH
  epochs = -(-steps // per_epoch)
  order = np.concatenate([rng.permutation(n)[:per_epoch * BATCH] for _ in range(epochs)])
  return order[:steps * BATCH].reshape(steps, BATCH)


def resnet(dtype: Any = jnp.float32, normalize: bool = True):
  return flaxmodels.ResNet18(output="logits", pretrained=None, num_classes=10,
                             normalize=normalize, dtype=dtype)


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


def scores(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
  return {"loss": xent(logits, labels),
          "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


# --- candidates ----------------------------------------------------------------------------


@dataclasses.dataclass
class Candidate:
  """One way to train: ``init(variables per seed) -> states``, ``step(state, (x, y)) ->
  (state, metrics)`` and ``evaluate(state, (x, y)) -> {'loss', 'accuracy'}``, each
  compiled once and used for every seed."""

  name: str
  init: Callable[[Sequence[Any]], list[Any]]
  step: Callable[[Any, Any], tuple[Any, dict[str, Any]]]
  evaluate: Callable[[Any, Any], dict[str, Any]]


def plain(name: str, module) -> Candidate:
  """The hand-written step: ``module`` as built, its params float32, optax Adam."""
  tx = optax.adam(LR)

  def step(state, batch):
    params, batch_stats, opt_state = state
    x, y = batch

    def loss(p):
      logits, new = module.apply({"params": p, "batch_stats": batch_stats}, x, train=True,
                                 mutable=["batch_stats"])
      return xent(logits, y), new["batch_stats"]

    (value, batch_stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), batch_stats, opt_state), {"loss": value}

  def evaluate(state, batch):
    params, batch_stats, _ = state
    return scores(module.apply({"params": params, "batch_stats": batch_stats}, batch[0],
                               train=False), batch[1])

  def init(per_seed):
    states = []
    for variables in per_seed:
      params = jax.tree.map(jnp.copy, variables["params"])
      states.append((params, jax.tree.map(jnp.copy, variables["batch_stats"]),
                     tx.init(params)))
    return states

  return Candidate(name, init, jax.jit(step, donate_argnums=0), jax.jit(evaluate))


def with_jaxamp(policy: str, module, example: jax.Array) -> Candidate:
  """The unmodified model through ``jaxamp.make_train_step``."""

  def loss_fn(model, batch):
    return xent(model(batch[0], train=True), batch[1])

  def eval_fn(model, batch):
    return scores(model(batch[0], train=False), batch[1])

  train = jaxamp.make_train_step(loss_fn, optax.adam(LR), policy=policy, eval_fn=eval_fn)

  def init(per_seed):
    # Every init makes the step's jitted function anew (a compile at its first call); a
    # state fits the step of any later init of the same model, so all seeds' states are
    # made first and the last init's step, compiled once, runs them all.
    return [train.init(module, jax.tree.map(jnp.copy, variables), example, train=False)
            for variables in per_seed]

  return Candidate(f"jaxamp {policy}", init, train.step, train.eval_step)


# --- training ------------------------------------------------------------------------------


def run(candidate: Candidate, per_seed: Sequence[Any], seeds: Sequence[int], data,
        steps: int) -> list[dict[str, Any]]:
  """Trains ``candidate`` once per seed; per seed its losses and held-out scores."""
  x_train, x_test, y_train, y_test = data
  runs = []
  states = candidate.init(per_seed)
  for i, seed in enumerate(seeds):
    state, states[i] = states[i], None  # the step donates it
    losses, metrics = [], {}
    start = time.perf_counter()
    for idx in batches(seed, len(x_train), steps):
      state, metrics = candidate.step(state, (x_train[idx], y_train[idx]))
      losses.append(metrics["loss"])
    losses = [float(v) for v in jax.device_get(losses)]
    seconds = time.perf_counter() - start
    held_out = jax.device_get(candidate.evaluate(state, (x_test, y_test)))
    runs.append({
        "seed": seed, "losses": losses, "seconds": seconds,
        "test_loss": float(held_out["loss"]), "test_accuracy": float(held_out["accuracy"]),
        "skipped_steps": int(metrics.get("skipped_steps", 0)),
        "final_loss_scale": float(metrics.get("loss_scale", 1.0)),
    })
    print(f"  {candidate.name:24s} seed {seed}: last {LAST} {np.mean(losses[-LAST:]):.4f}  "
          f"test loss {runs[-1]['test_loss']:.4f} acc {runs[-1]['test_accuracy']:.4f}  "
          f"({seconds:.0f} s)", flush=True)
    del state
  return runs


# --- one gradient, several precisions ------------------------------------------------------


def gradient_probe(variables: Any, x: np.ndarray, y: np.ndarray) -> list[dict[str, Any]]:
  """How far one gradient (first batch, seed 0's init) moves from another's.

  Each loss and gradient is one ``jax.jit(jax.value_and_grad(...))`` of a forward pass
  in training mode. The last pair runs the model with ``normalize=False`` on inputs
  already normalised in float32, which leaves the two bfloat16 models one difference
  fewer: where the model's own input normalisation runs.
  """
  stats_ = variables["batch_stats"]
  mean, std = jnp.array([0.485, 0.456, 0.406]), jnp.array([0.229, 0.224, 0.225])
  x = jnp.asarray(x)
  normalized = (x - mean) / std

  def grad(apply, inputs, scale=1.0):
    def loss(params):
      logits, _ = apply({"params": params, "batch_stats": stats_}, inputs, train=True,
                        mutable=["batch_stats"])
      return xent(logits, y) * scale, logits

    (value, logits), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    return value / scale, logits.astype(jnp.float32), jax.tree.map(lambda a: a / scale, g)

  amp = lambda policy, **kw: jaxamp.linen.with_policy(resnet(**kw), policy).apply
  got = {
      "float32": grad(resnet().apply, x),
      "jaxamp float32": grad(amp("float32"), x),
      "float32, input rounded to bfloat16": grad(
          resnet().apply, x.astype(jnp.bfloat16).astype(jnp.float32)),
      "hand-set bfloat16": grad(resnet(jnp.bfloat16).apply, x),
      "jaxamp mixed_bfloat16": grad(amp("mixed_bfloat16"), x),
      # float16 gradients need the loss scale jaxamp's step starts with.
      "jaxamp mixed_float16 (loss x 2^15)": grad(amp("mixed_float16"), x, 2.0**15),
      "hand-set bfloat16, normalize=False": grad(
          resnet(jnp.bfloat16, normalize=False).apply, normalized),
      "jaxamp mixed_bfloat16, normalize=False": grad(amp("mixed_bfloat16", normalize=False),
                                                     normalized),
  }
  pairs = [("jaxamp float32", "float32"), ("float32, input rounded to bfloat16", "float32"), ("hand-set bfloat16", "float32"),
           ("jaxamp mixed_bfloat16", "float32"), ("jaxamp mixed_float16 (loss x 2^15)", "float32"),
           ("jaxamp mixed_bfloat16", "hand-set bfloat16"),
           ("jaxamp mixed_bfloat16, normalize=False", "hand-set bfloat16, normalize=False")]
  rows = []
  for a, b in pairs:
    (la, oa, ga), (lb, ob, gb) = got[a], got[b]
    diffs = [float(jnp.sum((p - q) ** 2)) for p, q in zip(jax.tree.leaves(ga), jax.tree.leaves(gb))]
    norms = [float(jnp.sum(q ** 2)) for q in jax.tree.leaves(gb)]
    rows.append({
        "gradient": a, "compared_with": b, "loss_diff": float(abs(la - lb)),
        "logits_max_diff": float(jnp.max(jnp.abs(oa - ob))),
        "grad_rel_diff": float(np.sqrt(sum(diffs) / sum(norms))),
        "grad_rel_diff_median_param": float(np.median(np.sqrt(np.divide(diffs, norms)))),
        "arrays": len(norms),
    })
  return rows


# --- summaries and the report --------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
  a = np.asarray(values, np.float64)
  return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else float("nan"),
          "min": float(a.min()), "max": float(a.max())}


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
  """``a - b`` per seed: mean, std and the 95 % t interval of the mean."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  out = spread(d)
  half = (float(stats.t.ppf(0.975, len(d) - 1)) * out["std"] / np.sqrt(len(d))
          if len(d) > 1 else float("nan"))
  out.update(lo=out["mean"] - half, hi=out["mean"] + half)
  return out


def figures(runs: Sequence[dict[str, Any]], steps: int) -> dict[str, list[float]]:
  """Per seed: the figures the tables compare."""
  out = {"last": [float(np.mean(r["losses"][-LAST:])) for r in runs],
         "test_loss": [r["test_loss"] for r in runs],
         "test_accuracy": [r["test_accuracy"] for r in runs]}
  if steps >= ISSUE_STEPS:
    out["last_at_40"] = [float(np.mean(r["losses"][ISSUE_STEPS - LAST:ISSUE_STEPS]))
                         for r in runs]
  return out


def _pm(s: dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
  return (f"{s['mean'] * scale:.{digits}f} ± {s['std'] * scale:.{digits}f} "
          f"({s['min'] * scale:.{digits}f} – {s['max'] * scale:.{digits}f})")


def _signed(s: dict[str, float], digits: int = 3, scale: float = 1.0) -> str:
  return (f"{s['mean'] * scale:+.{digits}f} ± {s['std'] * scale:.{digits}f} "
          f"[{s['lo'] * scale:+.{digits}f}, {s['hi'] * scale:+.{digits}f}]")


def _verdict(s: dict[str, float]) -> str:
  if not np.isfinite(s["lo"]):
    return "n/a"
  if s["lo"] <= 0 <= s["hi"]:
    return "0 inside"
  return "higher" if s["lo"] > 0 else "lower"


PAIRS = (("hand-set bfloat16", "float32"), ("jaxamp float32", "float32"),
         ("jaxamp mixed_bfloat16", "hand-set bfloat16"), ("jaxamp mixed_bfloat16", "float32"),
         ("jaxamp mixed_float16", "float32"), ("jaxamp mixed_float16", "hand-set bfloat16"))


def render(results: dict[str, Any]) -> str:
  cfg, machine = results["config"], results["machine"]
  per = {name: figures(runs, cfg["steps"]) for name, runs in results["runs"].items()}
  at40 = cfg["steps"] >= ISSUE_STEPS
  n = len(cfg["seeds"])
  lines = [
      "# Training fidelity over seeds: ResNet-18 on digits",
      "",
      f"Measured by `{machine['command']}` on {machine['date']} ({results['seconds']:.0f} s). "
      "Generated file: rerun the script rather than editing it.",
      "",
      report.machine_line(machine),
      "",
      f"Setup: flaxmodels ResNet-18 (`output='logits'`, random init), Adam {cfg['lr']:g}, "
      f"batch {cfg['batch']}, {cfg['steps']} steps "
      f"({cfg['steps'] * cfg['batch'] / cfg['train_images']:.1f} epochs of "
      f"{cfg['train_images']} training images), seeds {cfg['seeds']}. Digits upsampled to "
      f"{cfg['size']}x{cfg['size']} (bilinear), 3 channels; {cfg['test_images']} held out. "
      "Within a seed every candidate starts from the same variables and sees the same "
      "batches. `benchmarks/fidelity.py`'s docstring has the details.",
      "",
      f"- **last {LAST} losses**: the mean of a run's last {LAST} training losses "
      f"(batch means, training-mode BatchNorm); **at step 40**: of steps 31–40 of the same "
      "run (issue 32's figure: the first 40 steps of a run are a 40-step run).",
      "- **test loss / accuracy**: on the held-out images after the last step, BatchNorm "
      "on its running statistics.",
      f"- Cells: mean ± standard deviation over the {n} seeds (min – max).",
      "- **s/step**: wall time per step, median over seeds, on a machine shared with other "
      "work: what a rerun will take, not a speed comparison (`benchmarks/run.py` is that).",
      "",
      "| candidate | last 10 losses" + (" | at step 40" if at40 else "")
      + " | test loss | test accuracy % | skipped steps | s/step |",
      "| --- | --- |" + (" --- |" if at40 else "") + " --- | --- | --- | --- |",
  ]
  for name, runs in results["runs"].items():
    f = per[name]
    secs = np.median([r["seconds"] / cfg["steps"] for r in runs])
    lines.append(
        f"| {name} | {_pm(spread(f['last']))}"
        + (f" | {_pm(spread(f['last_at_40']))}" if at40 else "")
        + f" | {_pm(spread(f['test_loss']))} | {_pm(spread(f['test_accuracy']), 1, 100)}"
        f" | {sum(r['skipped_steps'] for r in runs)} | {secs:.2f} |")
  lines += [
      "",
      "## Paired differences",
      "",
      "Candidate minus reference, seed by seed (same init, same batches): mean ± standard "
      "deviation [95 % t interval of the mean]. *0 inside*: the interval contains 0, no "
      "difference shown at this number of seeds. With this many intervals about one in "
      "twenty excludes 0 by chance alone.",
      "",
      "| candidate − reference | last 10 losses | " + ("at step 40 | " if at40 else "")
      + "test loss | test accuracy (points) |",
      "| --- | --- | " + ("--- | " if at40 else "") + "--- | --- |",
  ]
  for a, b in PAIRS:
    if a not in per or b not in per:
      continue
    cells = []
    for key, scale in (("last", 1), ("last_at_40", 1), ("test_loss", 1), ("test_accuracy", 100)):
      if key in per[a]:
        d = paired(per[a][key], per[b][key])
        cells.append(f"{_signed(d, 1 if scale == 100 else 3, scale)} {_verdict(d)}")
    lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
  windows = [(a, b) for a, b in ((1, 5), (6, 20), (21, 40), (cfg["steps"] - LAST + 1,
                                                           cfg["steps"])) if b <= cfg["steps"]]
  lines += [
      "",
      "## How fast the runs part",
      "",
      "Mean over seeds and steps of |candidate's training loss − float32's| at the same "
      "step (same init, same batch), per window of steps. Each step's loss is that of "
      "one batch, so a run that has parted from float32's differs by the spread between "
      "batches, not by a worse model.",
      "",
      "| candidate | " + " | ".join(f"steps {a}–{b}" for a, b in windows) + " |",
      "| --- | " + " | ".join("---" for _ in windows) + " |",
  ]
  reference = np.array([r["losses"] for r in results["runs"]["float32"]])
  for name, runs in results["runs"].items():
    if name == "float32":
      continue
    gap = np.abs(np.array([r["losses"] for r in runs]) - reference)
    lines.append(f"| {name} | " + " | ".join(f"{gap[:, a - 1:b].mean():.4f}" for a, b in windows)
                 + " |")
  if results.get("probe"):
    lines += [
        "",
        "## One gradient under each precision",
        "",
        "Seed 0's initial variables and first batch, one forward and backward pass in "
        "training mode: how far each loss, the logits and the gradient move from the "
        "other's. ‖Δg‖/‖g‖ over all parameters together and the median over the "
        f"{results['probe'][0]['arrays']} parameter arrays. The last row runs both bfloat16 models with `normalize=False` "
        "on inputs normalised in float32 beforehand.",
        "",
        "| gradient | compared with | loss Δ | logits max Δ | ‖Δg‖/‖g‖ | median per array |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["probe"]:
      lines.append(f"| {r['gradient']} | {r['compared_with']} | {r['loss_diff']:.2e} | "
                   f"{r['logits_max_diff']:.2e} | {r['grad_rel_diff']:.3f} | "
                   f"{r['grad_rel_diff_median_param']:.3f} |")
  lines += ["", "## Per seed", "",
            "| candidate | " + " | ".join(f"seed {s}" for s in cfg["seeds"]) + " |",
            "| --- | " + " | ".join("---" for _ in cfg["seeds"]) + " |"]
  for name in results["runs"]:
    f = per[name]
    lines.append(f"| {name} | " + " | ".join(
        f"{a:.3f} / {t:.3f} / {100 * c:.1f} %"
        for a, t, c in zip(f["last"], f["test_loss"], f["test_accuracy"])) + " |")
  lines += ["", f"Cells: last {LAST} losses / test loss / test accuracy.", ""]
  return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------


def machine_description(argv: Sequence[str]) -> dict[str, Any]:
  import importlib.metadata  # pylint: disable=g-import-not-at-top

  described = report.machine()
  described["command"] = "python benchmarks/fidelity.py " + " ".join(argv)
  versions = {k: v for k, v in described["versions"].items() if k != "keras"}
  for package in ("flaxmodels", "scikit-learn"):
    versions[package] = importlib.metadata.version(package)
  described["versions"] = versions
  return described


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 (default 5)")
  parser.add_argument("--steps", type=int, default=100, help="steps per run (default 100)")
  parser.add_argument("--out", help="folder for RESULTS.md and results.json")
  parser.add_argument("--no-probe", action="store_true", help="skip the one-gradient probe")
  parser.add_argument("--render", action="store_true",
                      help="measure nothing: redraw --out's RESULTS.md from its results.json")
  args = parser.parse_args(argv)
  if args.render:
    if not args.out:
      parser.error("--render needs --out, the folder holding results.json")
    out = pathlib.Path(args.out)
    text = render(json.loads((out / "results.json").read_text(encoding="utf-8")))
    (out / "RESULTS.md").write_text(text, encoding="utf-8")
    print(text)
    return
  # Speed is not measured here; the warning that float16 is slow on a CPU is noise.
  warnings.filterwarnings("ignore", message=".*no fast float16 path")
  argv = sys.argv[1:] if argv is None else list(argv)
  start = time.perf_counter()
  data = digits()
  x_train = data[0]
  seeds = list(range(args.seeds))
  example = jnp.asarray(x_train[:2])
  init = jax.jit(lambda key: resnet().init(key, example, train=False))
  per_seed = [init(jax.random.key(seed)) for seed in seeds]

  candidates = [plain("float32", resnet()), plain("hand-set bfloat16", resnet(jnp.bfloat16))]
  candidates += [with_jaxamp(p, resnet(), example)
                 for p in ("float32", "mixed_bfloat16", "mixed_float16")]
  runs = {}
  for candidate in candidates:
    print(candidate.name, flush=True)
    runs[candidate.name] = run(candidate, per_seed, seeds, data, args.steps)
  probe = None
  if not args.no_probe:
    first = batches(seeds[0], len(x_train), 1)[0]
    probe = gradient_probe(per_seed[0], x_train[first], data[2][first])
  results = {
      "machine": machine_description(argv),
      "config": {"seeds": seeds, "steps": args.steps, "batch": BATCH, "lr": LR, "size": SIZE,
                 "train_images": len(x_train), "test_images": len(data[1]),
                 "model": "flaxmodels.ResNet18(output='logits', pretrained=None, "
                          "num_classes=10)"},
      "runs": runs, "probe": probe, "seconds": time.perf_counter() - start,
  }
  text = render(results)
  print(text)
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULTS.md").write_text(text, encoding="utf-8")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
  main()
