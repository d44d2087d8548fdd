"""Which module each matmul ran in, and in which dtypes: the census behind the adapters'
float32 warning and the matmul column of :func:`jaxamp.summary`.

The Flax adapters can run a model with every module call under a ``jax.named_scope``
naming the module (:func:`scope_name`). :func:`module_matmuls` walks the jaxpr of such
a run (nested jaxprs of ``jit``, ``scan``, ``cond``, ``remat`` and custom derivatives
included) and gives every ``dot_general`` and convolution to the innermost module
scope it ran under, with its operand dtypes and FLOPs: what the lowered program
:func:`jaxamp.precision_report` reads computes, before a compiler upcasts anything
(an op with one half and one float32 operand, as below, is lowered as a float32 one;
neither counts as half precision).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxamp.census import module_matmuls, scope_name
  >>> def f(x, w):
  ...   with jax.named_scope(scope_name(0)):
  ...     return x @ w
  >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4)))
  >>> module_matmuls(jaxpr)
  [ModuleMatmul(module=0, kind='dot_general', lhs_dtype='bfloat16', rhs_dtype='float32', flops=48, batched=False, scaled_format='')]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxamp import _warn_once, dtypes, scaled

__all__ = ["ModuleMatmul", "module_matmuls", "scope_name", "float32_in_half_modules",
           "warn_float32_matmuls", "HALF_DTYPES", "FP8_DTYPES"]

# The dtype names of half-precision and FP8 operands (jaxamp.dtypes' table).
HALF_DTYPES = dtypes.HALF
FP8_DTYPES = dtypes.FP8
_SCOPE = "jaxamp_module_"
_SCOPE_RE = re.compile(re.escape(_SCOPE) + r"(\d+)")


def scope_name(index: int) -> str:
  """The ``jax.named_scope`` name marking the calls of module number ``index``."""
  return f"{_SCOPE}{index}"


class ModuleMatmul(NamedTuple):
  """One matmul or convolution and the module (scope number) it ran in.

  Attributes:
    module: the :func:`scope_name` number of the innermost module scope around the op,
      or None when it ran outside every module.
    kind: ``'dot_general'`` or ``'convolution'``.
    lhs_dtype: the left operand's dtype name.
    rhs_dtype: the right operand's (a convolution's kernel's) dtype name.
    flops: FLOPs per call of the function, loop trip counts included (a multiply-add
      counts 2).
    batched: whether a ``dot_general`` has batch dimensions: a product of two
      activations (attention scores and their weighted values, per example and head);
      a layer's product with its kernel has none.
    scaled_format: what the scaled format that ran the op calls it
      (:func:`jaxamp.scaled.describe`, ``'fp8 e4m3fn, 1x128 act / 128x128 weight
      blocks'``); ``''`` for an op no format ran.
  """

  module: int | None
  kind: str
  lhs_dtype: str
  rhs_dtype: str
  flops: int
  batched: bool = False
  scaled_format: str = ""

  @property
  def is_half(self) -> bool:
    """Whether both operands are float16 or bfloat16 (or 8-bit floats: FP8 matmuls)."""
    low = HALF_DTYPES | FP8_DTYPES
    return self.lhs_dtype in low and self.rhs_dtype in low


def _sub_jaxprs(params: dict[str, Any]) -> Iterator[Any]:
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      jaxpr = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
      if hasattr(jaxpr, "eqns"):
        yield jaxpr


def _flops(eqn: Any) -> tuple[str, int, bool] | None:
  name = eqn.primitive.name
  if name not in ("dot_general", "scaled_dot", "conv_general_dilated"):
    return None
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  out = eqn.outvars[0].aval
  if name in ("dot_general", "scaled_dot"):  # scaled_dot: a block-scaled product (MXFP8)
    (contract, _), (batch, _) = eqn.params["dimension_numbers"]
    return ("dot_general", 2 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in contract),
            bool(len(batch)))
  if name == "conv_general_dilated":
    out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    return ("convolution",
            2 * math.prod(out.shape) * math.prod(rhs.shape) // max(out_features, 1), False)
  return None


def _walk(jaxpr: Any, stack: str, times: int, found: list[ModuleMatmul]) -> None:
  for eqn in jaxpr.eqns:
    here = f"{stack}/{eqn.source_info.name_stack}"
    op = _flops(eqn)
    if op is not None:
      scopes = _SCOPE_RE.findall(here)
      lhs, rhs = (np.dtype(v.aval.dtype).name for v in eqn.invars[:2])
      found.append(ModuleMatmul(int(scopes[-1]) if scopes else None, op[0], lhs, rhs,
                                op[1] * times, op[2], scaled.described_in(here)))
    trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for sub in _sub_jaxprs(eqn.params):
      _walk(sub, here, times * int(trips), found)


def module_matmuls(closed_jaxpr: Any) -> list[ModuleMatmul]:
  """Every matmul and convolution of ``closed_jaxpr`` with the module scope it ran in.

  Args:
    closed_jaxpr: what ``jax.make_jaxpr`` returns for a run under module scopes.

  Returns:
    One :class:`ModuleMatmul` per op, in program order; ops in a ``scan`` body count
    once per iteration, those in a ``while`` loop once.
  """
  found: list[ModuleMatmul] = []
  _walk(closed_jaxpr.jaxpr, "", 1, found)
  return found


def float32_in_half_modules(ops: Sequence[ModuleMatmul], modules: Sequence[str],
                            compute: Mapping[str, Any]) -> tuple[dict[str, int], int]:
  """The FLOPs that stayed out of half precision in modules whose policy computes in half.

  Args:
    ops: the census (:func:`module_matmuls`).
    modules: module names (``'/'``-joined paths) by scope number.
    compute: each module's compute dtype (by name).

  Returns:
    ``({module: flops}, total_flops)``: the modules computing in float16 or bfloat16 by
    policy whose own matmuls (not their submodules') ran with a wider operand, and the
    FLOPs of every matmul of the census.
  """
  stray: dict[str, int] = {}
  for op in ops:
    if op.module is None or op.is_half:
      continue
    name = modules[op.module]
    if np.dtype(compute[name]).name in HALF_DTYPES:
      stray[name] = stray.get(name, 0) + op.flops
  return stray, sum(op.flops for op in ops)


def warn_float32_matmuls(model: str, policy: str, stray: Mapping[str, int], total: int,
                         stacklevel: int = 3) -> None:
  """Warns, once per model class and policy, that matmuls stayed in float32.

  Args:
    model: the model's class name.
    policy: the model-level policy's name.
    stray: ``{module: flops}`` from :func:`float32_in_half_modules`; no warning if empty.
    total: all matmul FLOPs of the call.
    stacklevel: as for ``warnings.warn`` (see :func:`jaxamp._warn_once.warn_once`).
  """
  if not stray:
    return
  flops = sum(stray.values())
  worst = sorted(stray, key=lambda name: -stray[name])
  shown = ", ".join(repr(name or "(model)") for name in worst[:8])
  more = f" and {len(worst) - 8} more" if len(worst) > 8 else ""
  _warn_once.warn_once(
      ("census.float32_matmuls", model, policy, tuple(sorted(stray))),
      f"jaxamp: under policy {policy!r}, {100 * flops / max(total, 1):.1f}% of the matmul "
      f"FLOPs of {model} still run in float32, in modules that compute in half precision "
      f"by policy: {shown}{more}. Their code casts to float32 itself (a hard-coded dtype "
      f"jaxamp cannot reach, e.g. x.astype(jnp.float32) inside a function). Use "
      f"jaxamp.autocast(fn, policy), or make_train_step(..., opt_level='O1'), which decides "
      f"precision per operation; or, if float32 is wanted there, say so with "
      f"jaxamp.set_policy(<path or class>, 'float32').", RuntimeWarning, stacklevel=stacklevel)
