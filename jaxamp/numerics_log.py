"""The numerics monitor on the host: a log of its records, and the policy they suggest.

:class:`NumericsLog` collects ``metrics['numerics']`` (``make_train_step(...,
numerics=jaxamp.Numerics(every=N))``, see :mod:`jaxamp.numerics`) across steps, with the
loss scale and the skipped steps; ``table()`` ranks the modules by risk, ``plot(path)``
draws them (matplotlib), ``to_csv(path)`` writes every figure.
:func:`suggest_policy` reads a log taken under one policy and returns the per-module
rules (``jaxamp.policy_rules`` / ``jaxamp.set_policy``) that keep in a safer policy the
modules whose values would underflow or saturate a target format, with the reason for
each.

Example (a step's metrics written by hand; the guide "Debugging precision" trains):
  >>> import jaxamp
  >>> from jaxamp import numerics
  >>> stats = dict.fromkeys(numerics.STATS, 0.0) | {'amax': 1e5, 'overflow_float16': 0.5}
  >>> log = jaxamp.NumericsLog()
  >>> log.add(0, {'numerics': {'dense': {'activation': stats}}, 'numerics_recorded': True})
  >>> plan = jaxamp.suggest_policy(log, 'mixed_float16')
  >>> plan.rules
  {'dense': 'float32'}
  >>> plan.reasons['dense']
  "activation amax 1e+05 reaches float16's largest finite value (50.00% of values would be inf)"
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxamp import scaled
from jaxamp.numerics import KINDS as _KINDS
from jaxamp.policy import get_policy

__all__ = ["NumericsLog", "PolicySuggestion", "suggest_policy"]

class NumericsLog:
  """The numerics monitor's records across steps (host values), with the loss scale.

  ``add(step, metrics)`` after each ``train.step`` (the steps that do not record keep
  only their loss scale and skip); the figures of step ``s`` are ``log.records[s]``:
  ``{module path: {kind: {stat: float}}}``.
  """

  def __init__(self):
    self.records: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    self.loss_scale: list[tuple[int, float, bool]] = []  # (step, scale, skipped)

  def add(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Adds one step's ``metrics`` (as ``train.step`` returned them)."""
    if "numerics" not in metrics:
      raise ValueError("NumericsLog.add takes the metrics of a step made with "
                       "make_train_step(..., numerics=jaxamp.Numerics(every=N)); these "
                       f"have no 'numerics' entry (keys: {sorted(metrics)}).")
    host = jax.device_get({k: metrics[k] for k in
                           ("numerics", "numerics_recorded", "loss_scale", "grads_finite")
                           if k in metrics})
    if "loss_scale" in host:
      self.loss_scale.append((int(step), float(host["loss_scale"]),
                              not bool(host.get("grads_finite", True))))
    if bool(host.get("numerics_recorded", True)):
      self.records[int(step)] = jax.tree.map(float, host["numerics"])

  def columns(self) -> set[str]:
    """Every figure's name in the recorded steps (the what-if columns depend on the
    ``Numerics(whatif=...)`` the log was taken with)."""
    return {k for r in self.records.values() for kinds in r.values() for s in kinds.values()
            for k in s}

  @property
  def modules(self) -> list[str]:
    """Every module path recorded, in first-seen order."""
    return list(dict.fromkeys(p for r in self.records.values() for p in r))

  def worst(self) -> dict[str, dict[str, dict[str, float]]]:
    """Per module and kind, each figure's worst over the recorded steps (the largest
    amax and fractions, the non-finite values summed)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for record in self.records.values():
      for path, kinds in record.items():
        for kind, stats in kinds.items():
          held = out.setdefault(path, {}).setdefault(kind, {})
          for stat, value in stats.items():
            if math.isnan(value):
              continue
            if stat == "nonfinite":
              held[stat] = held.get(stat, 0.0) + value
            else:
              held[stat] = max(held.get(stat, -math.inf), value)
    return out

  def risk(self, against: str | None = None) -> list[tuple[str, float, str]]:
    """``(module, score, what)``, riskiest first: the score is the worst overflow plus
    underflow fraction over its kinds, and 1 more with non-finite values; ``what`` names
    the kind and figure behind it. The fractions are the compute dtype's, or those of
    the what-if ``against``: ``'float16'``, ``'bfloat16'``, ``'e4m3'`` / ``'e5m2'``
    (per-tensor FP8, underflow only), or a policy the log was taken with
    ``Numerics(whatif=...)`` for (``'mixed_fp8_block'``)."""
    suffix = _suffix(against, self)
    rows = []
    for path, kinds in self.worst().items():
      best = (0.0, "")
      for kind, s in kinds.items():
        for stat in ("overflow" + suffix, "underflow" + suffix):
          score = s.get(stat, 0.0) + (1.0 if s.get("nonfinite", 0.0) > 0 else 0.0)
          if score > best[0]:
            best = (score, f"{kind} {stat} {s.get(stat, 0.0):.2%}"
                    + (f", {s['nonfinite']:.0f} non-finite" if s.get("nonfinite") else ""))
      rows.append((path, best[0], best[1]))
    return sorted(rows, key=lambda r: -r[1])

  def table(self, top: int = 20, against: str | None = None) -> str:
    """The ``top`` riskiest modules as text: per kind its worst amax, underflow and
    overflow fractions (the compute dtype's, or ``against``'s, as :meth:`risk` takes it)
    and non-finite count."""
    suffix = _suffix(against, self)
    worst = self.worst()
    lines = [f"{'module':<28} {'kind':<10} {'amax':>10} {'underflow':>10} {'overflow':>9} "
             f"{'nonfinite':>9}"]
    for path, _, _ in self.risk(against)[:top]:
      for kind in _KINDS:
        s = worst[path].get(kind)
        if s is None:
          continue
        lines.append(f"{path or '(model)':<28} {kind:<10} {s.get('amax', math.nan):>10.3g} "
                     f"{s.get('underflow' + suffix, 0.0):>10.2%} "
                     f"{s.get('overflow' + suffix, 0.0):>9.2%} "
                     f"{s.get('nonfinite', 0.0):>9.0f}")
    return "\n".join(lines)

  def to_csv(self, path: str) -> None:
    """Writes one row per recorded step, module and kind, one column per figure."""
    stats = sorted({k for r in self.records.values() for kinds in r.values()
                    for s in kinds.values() for k in s})
    with open(path, "w", newline="") as f:
      w = csv.writer(f)
      w.writerow(["step", "module", "kind", *stats])
      for step, record in sorted(self.records.items()):
        for module, kinds in record.items():
          for kind, s in kinds.items():
            w.writerow([step, module, kind, *(s.get(k, "") for k in stats)])

  def plot(self, path: str) -> Any:
    """Draws the module x step heat maps of the underflow and overflow fractions (the
    worst kind of each module, compute dtype) and the loss scale by step, skipped steps
    marked, into ``path`` (matplotlib: ``pip install matplotlib``), and returns the
    (closed) matplotlib ``Figure``: rows of the maps are :attr:`modules`, columns the
    recorded steps in order."""
    try:
      import matplotlib  # pylint: disable=g-import-not-at-top

      matplotlib.use("Agg")
      import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("NumericsLog.plot needs matplotlib: pip install matplotlib "
                        "(or jax-mixed-precision[examples]).") from e
    steps = sorted(self.records)
    modules = self.modules
    grids = {}
    for stat in ("underflow", "overflow"):
      grid = np.full((len(modules), len(steps)), np.nan)
      for j, step in enumerate(steps):
        for i, m in enumerate(modules):
          kinds = self.records[step].get(m, {})
          vals = [s[stat] for s in kinds.values() if not math.isnan(s[stat])]
          grid[i, j] = max(vals) if vals else np.nan
      grids[stat] = grid
    fig, axes = plt.subplots(3, 1, figsize=(8, 3 + 0.5 * len(modules)), squeeze=False)
    for ax, stat in zip(axes[:2, 0], ("underflow", "overflow")):
      im = ax.imshow(grids[stat], aspect="auto", cmap="magma", vmin=0,
                     vmax=max(np.nanmax(grids[stat], initial=0), 1e-9))
      ax.set_yticks(range(len(modules)), [m or "(model)" for m in modules])
      ax.set_xticks(range(len(steps)), [str(s) for s in steps])
      ax.set_title(f"{stat} fraction (compute dtype), worst of activation / cotangent / grad")
      fig.colorbar(im, ax=ax)
    ax = axes[2, 0]
    if self.loss_scale:
      s, scale, skipped = zip(*self.loss_scale)
      ax.semilogy(s, scale, label="loss scale")
      skip = [(x, y) for x, y, k in self.loss_scale if k]
      if skip:
        ax.scatter(*zip(*skip), color="red", marker="x", label="skipped step")
      ax.legend()
    ax.set_xlabel("step")
    ax.set_title("loss scale")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return fig


def _suffix(against: str | None, log: NumericsLog) -> str:
  """The column suffix of ``against``: a floating format, or a what-if policy the log
  recorded (``Numerics(whatif=...)``)."""
  if against is None:
    return ""
  recorded = {k.removeprefix("underflow_") for k in log.columns()
              if k.startswith("underflow_") and not k.endswith("_ls")}
  if against not in recorded:
    raise ValueError(f"against must be None (the compute dtype) or one this log recorded: "
                     f"{sorted(recorded)}; got {against!r} (a what-if policy is recorded "
                     "with jaxamp.Numerics(whatif=(name,))).")
  return "_" + against


class PolicySuggestion(NamedTuple):
  """What :func:`suggest_policy` returns.

  Attributes:
    target: the target policy's name (the model-level policy to train with).
    rules: ``{module path: policy name}``, for ``jaxamp.policy_rules(rules)`` or
      ``jaxamp.set_policy(path, name)`` for each.
    reasons: ``{module path: why}``.
  """

  target: str
  rules: dict[str, str]
  reasons: dict[str, str]


# The record columns a target's compute dtype is judged by: (underflow, overflow).
_COLUMNS = {"float16": ("underflow_float16", "overflow_float16"),
            "bfloat16": ("underflow_bfloat16", "overflow_bfloat16")}
# Per-tensor FP8's what-if: an FP8 layer's input in E4M3, the gradient at its output in
# E5M2, each scaled to its amax.
_FP8_COLUMNS = {"input": "underflow_e4m3", "cotangent": "underflow_e5m2"}


def _fp8_checks(target: str, recipe: Any, log: NumericsLog) -> dict[str, tuple[str, ...]]:
  """The columns an FP8 target's what-if reads per kind: ``(underflow, overflow?)``."""
  if getattr(scaled.format_of(recipe), "whatif", None) is None:  # per-tensor
    return {kind: (col,) for kind, col in _FP8_COLUMNS.items()}
  col = f"underflow_{target}"
  if col not in log.columns():
    raise ValueError(f"suggest_policy(target={target!r}) reads the what-if of {target!r}'s "
                     "scaling, which this log did not record: take it with "
                     f"make_train_step(..., numerics=jaxamp.Numerics(every=N, "
                     f"whatif=({target!r},))).")
  return {kind: (col, f"overflow_{target}") for kind in _FP8_COLUMNS}


def suggest_policy(log: NumericsLog, target: str = "mixed_float16", *,
                   safer: str = "float32", underflow: float = 0.01,
                   kinds: Sequence[str] = _KINDS) -> PolicySuggestion:
  """Per-module rules keeping in ``safer`` the modules whose recorded values would not
  fit ``target``'s formats.

  A module is kept when, at its worst recorded step, any value of a kind in ``kinds``
  reaches the target compute dtype's largest finite value (it would saturate to inf),
  or more than ``underflow`` of its nonzero values fall below its smallest normal
  (a module's input is not judged so: it is another's output); for an FP8 target also
  a layer FP8 runs when more than ``underflow`` of its input or of the gradient at its
  output falls below the FP8 format's smallest normal once scaled (an outlier-heavy
  input), or some of it would saturate: per tensor (``'mixed_fp8'``,
  ``'mixed_fp8_current'``: E4M3 input, E5M2 gradient, each scaled to its amax), or as
  the target's recipe scales them (``'mixed_fp8_block'`` and the others
  :func:`jaxamp.numerics.whatif_policies` lists: the log must be taken with
  ``jaxamp.Numerics(whatif=(target,))``). Gradients and cotangents are judged as the log
  recorded them (times the loss scale of its run), except that for a float16 target a
  log taken without loss scaling (scale 1 throughout: float32, bfloat16) counts only
  the values that stay below the smallest normal times a loss scale of 2**15
  (:data:`jaxamp.numerics.LOSS_SCALE`).

  Args:
    log: a :class:`NumericsLog` (taken under float32, or any wider policy than
      ``target``).
    target: the policy to train with (a name ``jaxamp.get_policy`` takes).
    safer: the policy the risky modules keep.
    underflow: the fraction of nonzero values below the smallest normal tolerated.
    kinds: which records are judged (``'activation'``, ``'cotangent'``, ``'grad'``).

  Returns:
    A :class:`PolicySuggestion`: ``rules`` for ``jaxamp.policy_rules`` and the reason
    per module. The model itself (path ``''``) is named too where its output would not
    fit; give it ``safer`` as the model policy's output, or keep the head that makes it.
  """
  policy = get_policy(target)
  get_policy(safer)
  if not log.records:
    raise ValueError("suggest_policy needs a NumericsLog with recorded steps; add the "
                     "metrics of steps made with make_train_step(..., numerics="
                     "jaxamp.Numerics(every=N)) that recorded (step % N == 0).")
  bad = [k for k in kinds if k not in _KINDS]
  if bad:
    raise ValueError(f"suggest_policy kinds must be among {_KINDS}, got {bad}.")
  compute = np.dtype(policy.compute_dtype).name
  fp8 = {} if policy.fp8 is None else _fp8_checks(target, policy.fp8, log)
  # A log without loss scaling (scale 1) judges gradients and cotangents as a float16
  # run's dynamic loss scale would lift them (numerics.LOSS_SCALE); a log with one, as
  # recorded.
  unscaled = all(scale == 1.0 for _, scale, _ in log.loss_scale)
  if compute not in _COLUMNS and policy.fp8 is None:
    return PolicySuggestion(target, {}, {})  # float32 / float64: nothing to keep
  rules, reasons = {}, {}
  for path, recorded in log.worst().items():
    why = []
    for kind in kinds:
      s = recorded.get(kind)
      if s is None:
        continue
      if compute in _COLUMNS and kind != "input":
        under_col, over_col = _COLUMNS[compute]
        if compute == "float16" and kind != "activation" and unscaled:
          under_col = "underflow_float16_ls"
        if s.get(over_col, 0.0) > 0:
          why.append(f"{kind} amax {s['amax']:.3g} reaches {compute}'s largest finite value "
                     f"({s[over_col]:.2%} of values would be inf)")
        if s.get(under_col, 0.0) > underflow:
          lifted = " even times a loss scale of 2**15" if under_col.endswith("_ls") else ""
          why.append(f"{s[under_col]:.1%} of nonzero {kind} values fall below {compute}'s "
                     f"smallest normal{lifted}")
      # FP8: the layers it runs (those with an input record) by their input and gradient.
      cols = fp8.get(kind, ()) if "input" in recorded else ()
      if cols and s.get(cols[0], 0.0) > underflow:
        scaling = ("E4M3" if cols[0].endswith("e4m3") else "E5M2" if cols[0].endswith("e5m2")
                   else target)
        why.append(f"{s[cols[0]]:.1%} of nonzero {kind} values fall below the smallest "
                   f"normal once scaled ({scaling}{' per tensor' if len(cols) == 1 else ''}"
                   ": outliers)")
      if len(cols) > 1 and s.get(cols[1], 0.0) > 0:
        why.append(f"{s[cols[1]]:.1%} of nonzero {kind} values saturate once scaled "
                   f"({target})")
    if why:
      rules[path] = safer
      reasons[path] = "; ".join(why)
  return PolicySuggestion(target, rules, reasons)
