"""A per-module table of policies and parameter memory, for NNX, Linen and Equinox models.

Example:
  >>> import jaxamp
  >>> from flax import nnx
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
  >>> s = jaxamp.summary(model, policy='mixed_bfloat16')
  >>> [(r.path, r.compute_dtype, r.param_count) for r in s.rows]
  [('', 'bfloat16', 0), ('layers', 'bfloat16', 0), ('layers/0', 'bfloat16', 40), ('layers/1', 'float32', 16)]
  >>> s.total_stored_bytes, s.total_compute_bytes
  (224, 144)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxamp import adapters, scaled
from jaxamp import fp8 as fp8_lib
from jaxamp.adapters import module_params
from jaxamp.casting import is_floating_array
from jaxamp.policy import Policy, PolicyLike
from jaxamp.report import _bytes
from jaxamp.rules import cast_module_params, warn_unmatched_path_rules

__all__ = ["summary", "Summary", "SummaryRow", "cast_module_params", "module_params"]


@dataclasses.dataclass(frozen=True)
class SummaryRow:
  """One module: where it is, what it is, the policy it runs under and its own parameters.

  ``param_count`` and the byte figures count only the parameters the module owns
  directly, not those of its submodules. ``fp8`` is True for a module whose matmul runs
  in FP8 under its policy (:mod:`jaxamp.fp8`); its other operations run in
  ``compute_dtype``. ``scaled_format`` names the scaled format of its matmuls and what
  one scale covers (:func:`jaxamp.scaled.describe`: ``'fp8 e4m3fn, 1x128 act / 128x128
  weight blocks'``): with example inputs, the formats its own matmuls ran in (``'+'``-
  joined, ``''`` for none); without, its policy's, for an FP8 module; else None.
  """

  path: str
  cls: str
  param_dtype: str
  compute_dtype: str
  output_dtype: str
  param_count: int
  stored_bytes: int
  compute_bytes: int
  matmul_dtypes: str | None = None
  matmul_flops: int = 0
  fp8: bool = False
  scaled_format: str | None = None

  @property
  def runs_as_policy(self) -> bool:
    """False when the module's own matmuls ran in a dtype other than its compute dtype.

    Only known when the summary traced the model (:func:`summary` with example inputs).
    """
    if self.fp8:  # the forward pass quantizes both operands to E4M3
      return self.matmul_dtypes in (None, "", "float8_e4m3fn")
    return self.matmul_dtypes in (None, "", self.compute_dtype)


@dataclasses.dataclass(frozen=True)
class Summary:
  """The rows of :func:`summary` with totals; ``str()`` renders a terminal table."""

  rows: tuple[SummaryRow, ...]
  policy: str

  @property
  def checked(self) -> bool:
    """Whether the matmul column comes from tracing the model (example inputs given)."""
    return any(r.matmul_dtypes is not None for r in self.rows)

  @property
  def mismatched(self) -> tuple[str, ...]:
    """Paths of the modules whose matmuls did not run in their policy's compute dtype."""
    return tuple(r.path for r in self.rows if not r.runs_as_policy)

  @property
  def fp8_modules(self) -> tuple[str, ...]:
    """Paths of the modules whose matmuls run in FP8."""
    return tuple(r.path for r in self.rows if r.fp8)

  @property
  def total_params(self) -> int:
    return sum(r.param_count for r in self.rows)

  @property
  def total_stored_bytes(self) -> int:
    """Bytes the parameters take as stored."""
    return sum(r.stored_bytes for r in self.rows)

  @property
  def total_compute_bytes(self) -> int:
    """Bytes the parameters would take stored in each module's compute dtype."""
    return sum(r.compute_bytes for r in self.rows)

  def to_dict(self) -> dict[str, Any]:
    """Plain data (JSON-ready)."""
    return {"policy": self.policy, "rows": [dataclasses.asdict(r) for r in self.rows],
            "total_params": self.total_params, "total_stored_bytes": self.total_stored_bytes,
            "total_compute_bytes": self.total_compute_bytes}

  def table(self) -> str:
    """The summary as a fixed-width table."""
    header = ("path", "class", "params", "compute", "output", "#params", "stored",
              "at compute", "matmuls ran in")
    formats = any(r.scaled_format for r in self.rows)  # a column only where one ran
    if formats:
      header += ("scaled format",)
    body = [((r.path or "(model)"), r.cls, r.param_dtype,
             ("fp8/" if r.fp8 else "") + r.compute_dtype, r.output_dtype,
             f"{r.param_count:,}", _bytes(r.stored_bytes), _bytes(r.compute_bytes),
             ("not traced" if r.matmul_dtypes is None else
              (r.matmul_dtypes + ("" if r.runs_as_policy else "  (!)")) if r.matmul_dtypes
              else "-"), *((r.scaled_format or "-",) if formats else ()))
            for r in self.rows]
    body.append(("total", "", "", "", "", f"{self.total_params:,}",
                 _bytes(self.total_stored_bytes), _bytes(self.total_compute_bytes), "",
                 *(("",) if formats else ())))
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
    numeric = {5, 6, 7}

    def fmt(row: Sequence[str]) -> str:
      return "  ".join(str(c).rjust(w) if i in numeric else str(c).ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    rule = "-" * len(fmt(header))
    return "\n".join([f"policy: {self.policy}", fmt(header), rule, *map(fmt, body[:-1]), rule,
                      fmt(body[-1])])

  def __str__(self) -> str:
    return self.table()


def _tree_order(path: str) -> tuple[tuple[int, int, str], ...]:
  """Sort key putting parents before children and 'layers/2' before 'layers/10'."""
  if not path:
    return ()
  return tuple((0, int(s), "") if s.isdigit() else (1, 0, s) for s in path.split("/"))


def _matmul_columns(census: Any) -> dict[str, tuple[str, int, str]]:
  """``{module path: (operand dtypes of its own matmuls, their FLOPs, the scaled formats
  they ran in)}`` from a census."""
  ops, names, _ = census
  found: dict[str, tuple[set[str], int, set[str]]] = {}
  for op in ops:
    if op.module is None:
      continue
    dtypes, flops, formats = found.setdefault(names[op.module], (set(), 0, set()))
    dtypes.update((op.lhs_dtype, op.rhs_dtype))
    formats.update({op.scaled_format} - {""})
    found[names[op.module]] = (dtypes, flops + op.flops, formats)
  return {path: ("+".join(sorted(dtypes)), flops, "+".join(sorted(formats)))
          for path, (dtypes, flops, formats) in found.items()}


def summary(model: Any, *example_inputs: Any, policy: PolicyLike | None = None,
            **example_kwargs: Any) -> Summary:
  """One row per module: path, class, param/compute/output dtype, parameters and their bytes.

  With example inputs, the model's forward pass is also traced (abstractly, nothing
  runs) under the policies, and each row's ``matmul_dtypes`` says which operand dtypes
  the module's own matmuls and convolutions really had in the program: the policy
  column says what was asked, this one what runs. A module whose code casts to float32
  itself shows ``float32`` there and is listed by :attr:`Summary.mismatched`.

  Args:
    model: an NNX module (or ``jaxamp.nnx.with_policy`` wrapper); a Linen module (its
      variables are shaped abstractly from ``example_inputs``); a Linen
      ``(module, variables)`` pair; or an Equinox module (or ``jaxamp.equinox``
      view; example inputs optional, called as ``model(*example_inputs)``).
    *example_inputs: inputs to trace the model with (arrays or
      ``jax.ShapeDtypeStruct``): required for Linen; for NNX, optional (without them
      the matmul column reads "not traced").
    policy: the model-level policy; None for the global policy (or the wrapper's).
    **example_kwargs: keyword arguments of the traced call (``train=False``; for
      Linen also ``mutable=['batch_stats']``).

  Returns:
    A :class:`Summary`; print it for a table, or read ``.rows`` / ``.to_dict()``.
  """
  library = adapters.library_of(model)
  if library is None:
    raise ValueError(f"summary takes an NNX module, a Linen module, a Linen (module, "
                     f"variables) pair or an Equinox module; got {type(model).__name__}.")
  plan, params, census = library.summary_plan(model, example_inputs, example_kwargs, policy)
  seen: dict[str, tuple[type, Policy]] = {}
  for path, cls, p in plan:
    seen.setdefault(path, (cls, p))
  root = model[0] if isinstance(model, tuple) else model
  warn_unmatched_path_rules(type(root).__name__, list(seen))
  groups = module_params(params, list(seen))
  matmuls = None if census is None else _matmul_columns(census)
  rows = []
  for path in sorted(seen, key=_tree_order):
    cls, p = seen[path]
    leaves = [leaf for _, leaf in groups.get(path, [])]
    count = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    stored = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
    compute = sum(int(np.prod(leaf.shape)) * (p.compute_dtype.itemsize
                                              if is_floating_array(leaf)
                                              else np.dtype(leaf.dtype).itemsize)
                  for leaf in leaves)
    fp8 = fp8_lib.runs_fp8(cls, p)
    if matmuls is None:
      ran, flops, formats = None, 0, scaled.describe(p.fp8) if fp8 else None
    else:
      ran, flops, formats = matmuls.get(path, ("", 0, ""))
    rows.append(SummaryRow(path, cls.__name__, p.param_dtype.name, p.compute_dtype.name,
                           p.output_dtype.name, count, stored, compute, ran, flops, fp8,
                           formats))
  model_policy = next((p for path, _, p in plan if path == ""), None)
  return Summary(tuple(rows), model_policy.name if model_policy else "")
