"""Inspection: did the policy reach the matmuls, and what does backward keep?

:func:`precision_report` lowers a function with ``jax.jit(...).lower(...)`` and reads
the StableHLO text. Every ``stablehlo.dot_general`` and ``stablehlo.convolution``
becomes a :class:`MatmulOp` with its operand and result dtypes, shapes, FLOPs and how
many times it runs. It reads the *lowered* module, not the compiled one, because
compilers rewrite precision (XLA on CPU upcasts bfloat16 dots to float32): the
lowered text is what the policy asked for.

It also traces ``jax.vjp`` to measure what reverse mode saves between the forward
and the backward pass (the residuals), which is where half-precision activations
save memory.

Example:
  >>> import jax.numpy as jnp
  >>> import jaxamp
  >>> x = jnp.ones((4, 8), jnp.bfloat16)
  >>> w = jnp.ones((8, 16), jnp.bfloat16)
  >>> report = jaxamp.precision_report(lambda x, w: jnp.sin(x @ w).sum(), x, w)
  >>> report.total_flops, report.half_share
  (1024, 1.0)
  >>> print(report)
  op           lhs        rhs         out         count  FLOPs   share
  dot_general  bf16[4,8]  bf16[8,16]  bf16[4,16]      1  1.02K  100.0%
  half-precision share: 100.0% of 1.02K matmul FLOPs (1 ops, 2 casts between float types, 258 B)
  residuals: 128 B activations; 384 B with arguments

The two casts are ``jnp.sum`` accumulating the bfloat16 values in float32: the values
widened (256 B written) and the sum narrowed back (2 B).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import Literal

from jaxamp.census import FP8_DTYPES, HALF_DTYPES

__all__ = ["MatmulOp", "PrecisionReport", "precision_report"]



class MatmulOp(NamedTuple):
  """One ``dot_general`` or ``convolution`` of the lowered module.

  Attributes:
    kind: ``'dot_general'`` or ``'convolution'``.
    lhs_dtype: the left operand's dtype name (``'bfloat16'``, ``'float32'``, ...).
    rhs_dtype: the right operand's (for a convolution, the kernel's) dtype name.
    result_dtype: the result's dtype name.
    lhs_shape: the left operand's shape.
    rhs_shape: the right operand's shape.
    result_shape: the result's shape.
    flops: FLOPs of one execution (a multiply-add counts 2).
    multiplicity: how many times the op runs per call of the function: calls of
      the private function holding it and known loop trip counts multiply it.
    function: name of the StableHLO function the op sits in (``'main'`` or a
      private function emitted for a nested ``jit``, scan body, ...).
  """

  kind: str
  lhs_dtype: str
  rhs_dtype: str
  result_dtype: str
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  result_shape: tuple[int, ...]
  flops: int
  multiplicity: int
  function: str

  @property
  def total_flops(self) -> int:
    """``flops * multiplicity``."""
    return self.flops * self.multiplicity

  @property
  def is_half(self) -> bool:
    """Whether both operands are float16 or bfloat16."""
    return self.lhs_dtype in HALF_DTYPES and self.rhs_dtype in HALF_DTYPES

  @property
  def is_fp8(self) -> bool:
    """Whether both operands are 8-bit floats (E4M3, E5M2: an FP8 policy's matmuls)."""
    return self.lhs_dtype in FP8_DTYPES and self.rhs_dtype in FP8_DTYPES


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
  """What :func:`precision_report` found. ``str(report)`` is a readable table.

  Attributes:
    ops: every matmul and convolution, in module order.
    total_flops: FLOPs of all ops, multiplicities included.
    half_flops: FLOPs of ops whose operands are both float16 or bfloat16.
    half_share: ``half_flops / total_flops``; 0.0 when there is no matmul at all.
    flops_by_dtype: FLOPs per ``(lhs_dtype, rhs_dtype)`` pair.
    casts: executed ``stablehlo.convert`` ops from one floating type to another
      (multiplicities included, like FLOPs).
    cast_bytes: bytes those converts write (their results' sizes, multiplicities
      included): the memory traffic a policy's casts cost before the compiler fuses
      them into neighbouring ops.
    residual_bytes: bytes reverse mode saves between forward and backward, not
      counting buffers that are the function's own arguments (or closed-over
      constants); ``None`` if the function cannot be reverse-differentiated.
    residual_bytes_with_args: the same with saved arguments included.
    residuals: ``(shape, dtype)`` of each residual counted in ``residual_bytes``.
      The accounting is ``jax.ad_checkpoint.saved_residuals``': a buffer saved
      through ``lax.cond`` or ``lax.scan`` counts as produced there, even when it
      is an argument passed through.
    unknown_trip_loops: ``stablehlo.while`` loops whose trip count could not be
      read; the ops inside them are counted once per entry into the loop.
    fp8_flops: FLOPs of ops whose operands are both 8-bit floats (not in ``half_flops``).
    fp8_share: ``fp8_flops / total_flops``.
  """

  ops: list[MatmulOp]
  total_flops: int
  half_flops: int
  half_share: float
  flops_by_dtype: dict[tuple[str, str], int]
  casts: int
  cast_bytes: int
  residual_bytes: int | None
  residual_bytes_with_args: int | None
  residuals: list[tuple[tuple[int, ...], str]] | None
  unknown_trip_loops: int
  fp8_flops: int = 0
  fp8_share: float = 0.0

  def table(self) -> str:
    """A terminal table: one row per distinct op, then summary lines."""
    groups: dict[tuple, list[int]] = {}
    for op in self.ops:
      key = (op.kind, _short(op.lhs_dtype, op.lhs_shape), _short(op.rhs_dtype, op.rhs_shape),
             _short(op.result_dtype, op.result_shape))
      count_flops = groups.setdefault(key, [0, 0])
      count_flops[0] += op.multiplicity
      count_flops[1] += op.total_flops
    rows = [("op", "lhs", "rhs", "out", "count", "FLOPs", "share")]
    for key, (count, flops) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
      rows.append((*key, str(count), _human(flops), _percent(flops, self.total_flops)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = (False, False, False, False, True, True, True)
    lines = []
    for r in rows:
      cells = [c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right)]
      lines.append("  ".join(cells).rstrip())
    n_ops = sum(op.multiplicity for op in self.ops)
    lines.append(f"half-precision share: {_percent(self.half_flops, self.total_flops)} of "
                 f"{_human(self.total_flops)} matmul FLOPs ({n_ops} ops, {self.casts} casts "
                 f"between float types, {_bytes(self.cast_bytes)})")
    if self.fp8_flops:
      lines.append(f"FP8 share: {_percent(self.fp8_flops, self.total_flops)} of the matmul "
                   "FLOPs have 8-bit float operands")
    if self.unknown_trip_loops:
      lines.append(f"note: {self.unknown_trip_loops} loop(s) with unknown trip count; "
                   "their ops are counted once")
    if self.residual_bytes is None:
      lines.append("residuals: n/a (function is not reverse-differentiable)")
    else:
      lines.append(f"residuals: {_bytes(self.residual_bytes)} activations; "
                   f"{_bytes(self.residual_bytes_with_args)} with arguments")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()

  def to_dict(self) -> dict[str, Any]:
    """The report as plain JSON-friendly data (dtype pairs become ``'lhs x rhs'``)."""
    return {
        "ops": [{**op._asdict(), "lhs_shape": list(op.lhs_shape),
                 "rhs_shape": list(op.rhs_shape), "result_shape": list(op.result_shape)}
                for op in self.ops],
        "total_flops": self.total_flops,
        "half_flops": self.half_flops,
        "half_share": self.half_share,
        "flops_by_dtype": {f"{a} x {b}": f for (a, b), f in self.flops_by_dtype.items()},
        "casts": self.casts,
        "cast_bytes": self.cast_bytes,
        "residual_bytes": self.residual_bytes,
        "residual_bytes_with_args": self.residual_bytes_with_args,
        "residuals": None if self.residuals is None else
                     [{"shape": list(s), "dtype": d} for s, d in self.residuals],
        "unknown_trip_loops": self.unknown_trip_loops,
        "fp8_flops": self.fp8_flops,
        "fp8_share": self.fp8_share,
    }


def precision_report(fn: Callable[..., Any], *args: Any, backward: bool = False,
                     argnums: int | Sequence[int] = 0, **kwargs: Any) -> PrecisionReport:
  """Reports the dtypes and FLOPs of every matmul ``fn(*args, **kwargs)`` lowers to.

  ``fn`` is lowered with ``jax.jit(fn).lower(*args)`` and the StableHLO text is parsed.
  Args are pytrees (params dicts, ``nnx.State``, Equinox modules, whose non-array
  leaves are closed over as ``eqx.filter_jit`` does) and are traced; ``kwargs`` are
  closed over as static values (flags such as ``train=False``), so put arrays in
  ``args``. ``fn`` may close over anything.

  Multiplicity: an op inside a private function counts once per ``call`` of it, and
  an op inside a ``stablehlo.while`` loop (``lax.scan``, ``lax.fori_loop`` with
  static bounds) is multiplied by the trip count read from the loop: a counter that
  starts at a constant, steps by a constant and is compared against a constant. A
  loop whose count cannot be read that way (``lax.while_loop``, ``fori_loop`` with
  traced bounds) counts its ops once and is counted in ``unknown_trip_loops``. Both
  branches of a ``lax.cond``/``lax.switch`` are counted.

  FLOPs: ``2 * prod(result) * prod(contracting dims)`` for a dot; for a convolution
  ``2 * prod(result) * prod(kernel) / kernel_output_features``, which also holds for
  grouped convolutions and their gradients.

  Args:
    fn: the function to inspect.
    *args: its positional arguments.
    backward: if True, lower ``jax.value_and_grad(fn, argnums)`` instead, so the
      report covers the forward and the backward pass; ``fn`` must return a scalar.
    argnums: the positional argument(s) to differentiate for ``backward`` and for the
      residuals; the others are treated as constants.
    **kwargs: keyword arguments, passed to ``fn`` as static values.

  Returns:
    A :class:`PrecisionReport`.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxamp
    >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 16))
    >>> bf16 = lambda x, w: (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).sum()
    >>> r = jaxamp.precision_report(bf16, x, w, backward=True, argnums=(0, 1))
    >>> [(op.lhs_dtype, op.rhs_dtype) for op in r.ops]
    [('bfloat16', 'bfloat16'), ('bfloat16', 'bfloat16'), ('bfloat16', 'bfloat16')]
    >>> r.half_share, r.total_flops
    (1.0, 3072)
    >>> jaxamp.precision_report(lambda x, w: x @ w, x, w).half_share
    0.0
  """
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  for i in nums:
    if not -len(args) <= i < len(args):
      raise ValueError(f"argnums {argnums!r} out of range for {len(args)} positional args.")
  if "equinox" in sys.modules:  # a model can be an eqx.Module only once it is imported
    from jaxamp import equinox as amp_eqx  # pylint: disable=g-import-not-at-top

    if amp_eqx.holds_modules(args):
      fn, args = amp_eqx.arrays_only(fn, args, nums)  # functions, sizes: closed over
  bound = (lambda *a: fn(*a, **kwargs)) if kwargs else fn
  target = jax.value_and_grad(bound, argnums=argnums) if backward else bound
  ops, casts, cast_bytes, unknown_loops = _parse_module(
      _module_text(jax.jit(target).lower(*args)))
  residuals = _residuals(bound, args, nums)

  total = sum(op.total_flops for op in ops)
  half = sum(op.total_flops for op in ops if op.is_half)
  fp8 = sum(op.total_flops for op in ops if op.is_fp8)
  by_dtype: dict[tuple[str, str], int] = {}
  for op in ops:
    key = (op.lhs_dtype, op.rhs_dtype)
    by_dtype[key] = by_dtype.get(key, 0) + op.total_flops
  if residuals is None:
    saved, with_args, shapes = None, None, None
  else:
    activations, arguments = residuals
    saved = sum(_nbytes(s, d) for s, d in activations)
    with_args = saved + sum(_nbytes(s, d) for s, d in arguments)
    shapes = [(s, _dtype_name(d)) for s, d in activations]
  return PrecisionReport(
      ops=ops, total_flops=total, half_flops=half, half_share=half / total if total else 0.0,
      flops_by_dtype=by_dtype, casts=casts, cast_bytes=cast_bytes, residual_bytes=saved,
      residual_bytes_with_args=with_args, residuals=shapes, unknown_trip_loops=unknown_loops,
      fp8_flops=fp8, fp8_share=fp8 / total if total else 0.0)


def _module_text(lowered: Any) -> str:
  """The lowered StableHLO text, with large constants (closed-over weights) elided."""
  try:
    module = lowered.compiler_ir("stablehlo")
    return module.operation.get_asm(large_elements_limit=64, enable_debug_info=False)
  except (AttributeError, TypeError):  # compiler_ir gives no guarantee on its type
    return lowered.as_text()


# --- residuals ------------------------------------------------------------------------


def _residuals(fn: Callable[..., Any], args: Sequence[Any], nums: tuple[int, ...]):
  """(activations, arguments): ``(shape, dtype)`` of what ``jax.vjp`` saves, or None."""
  leaves, treedef = jax.tree.flatten(list(args))

  def vjp_fn(*flat):
    full = jax.tree.unflatten(treedef, flat)

    def partial_fn(*diff):
      call = list(full)
      for i, d in zip(nums, diff):
        call[i] = d
      return fn(*call)

    return jax.vjp(partial_fn, *(full[i] for i in nums))[1]

  try:
    closed = jax.make_jaxpr(vjp_fn)(*leaves)
  except Exception as e:  # pylint: disable=broad-except
    # The lowering already succeeded, so this is a reverse-mode limitation (a
    # primitive with no differentiation rule, a custom_vjp forward that fails):
    # the matmul part of the report still stands.
    warnings.warn(f"jaxamp.precision_report: residuals not computed, jax.vjp failed: {e}",
                  RuntimeWarning, stacklevel=3)
    return None
  jaxpr = closed.jaxpr
  given = set(jaxpr.invars) | set(jaxpr.constvars)
  activations, arguments, seen = [], [], set()
  for v in jaxpr.outvars:
    if isinstance(v, Literal) or v in seen:
      continue  # literals are folded into the backward pass, not stored
    seen.add(v)
    entry = (tuple(v.aval.shape), v.aval.dtype)
    (arguments if v in given else activations).append(entry)
  return activations, arguments


def _dtype_name(dtype: Any) -> str:
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(dtype)  # extended dtypes such as PRNG keys


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
  return math.prod(shape) * dtype.itemsize


# --- StableHLO text parsing -------------------------------------------------------------

_NAME = r'@("(?:[^"\\]|\\.)*"|[\w.$\-]+)'
_FUNC = re.compile(r"\bfunc\.func\s+(?:\w+\s+)?" + _NAME)
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call\s+" + _NAME + r"|\bdecomposition\s*=\s*" + _NAME)
_DEF = re.compile(r"^\s*(%[\w$.\-]+)(?::\d+)?\s*=\s*\"?([\w.]+)\"?(.*)$")
_STRING = re.compile(r'(?<!@)"(?:[^"\\]|\\.)*"')  # keeps quoted @"symbol" names
_WHILE_ARGS = re.compile(r"stablehlo\.while\((.*?)\)\s*:")
_CONSTANT = re.compile(r"^\s*dense<(-?\d+)>\s*:\s*tensor<[su]?i\d+>")
_COMPARE = re.compile(r"^\s*(\w+),\s*(%[\w$.\-#]+),\s*(%[\w$.\-#]+)")
_BINARY = re.compile(r"^\s*(%[\w$.\-#]+),\s*(%[\w$.\-#]+)\s*:")
_RETURN = re.compile(r"^\s*stablehlo\.return\s+([^:]*)")
_CONTRACT = re.compile(
    r"(?:\bcontracting_dims\s*=|\blhs_contracting_dimensions\s*=)\s*\[([\d,\s]*)\]")
_KERNEL_DIMS = re.compile(r"\]\s*x\s*\[([^\]]*)\]")
_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
           "i1": "bool", "complex<f32>": "complex64", "complex<f64>": "complex128",
           "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2",
           "f8E4M3FNUZ": "float8_e4m3fnuz", "f8E5M2FNUZ": "float8_e5m2fnuz"}


class _Loop:
  """A ``stablehlo.while`` whose trip count is worked out from its regions."""

  def __init__(self, inits: dict[str, int | None]):
    self.inits = inits  # iter arg name -> constant initial value (None: not constant)
    self.order = list(inits)
    self.regions = 0
    self.compare: tuple[str, str, int] | None = None  # (direction, counter, limit)
    self.step: int | None = None

  @property
  def trips(self) -> int | None:
    if self.compare is None or self.step is None:
      return None
    direction, counter, limit = self.compare
    start, step = self.inits.get(counter), self.step
    if start is None or step == 0:
      return None
    span = limit - start
    if direction == "LT" and step > 0:
      return max(0, -(-span // step))
    if direction == "LE" and step > 0:
      return max(0, span // step + 1)
    if direction == "GT" and step < 0:
      return max(0, -(span // -step))
    if direction == "GE" and step < 0:
      return max(0, -span // -step + 1)
    if direction == "NE" and span % step == 0 and span // step >= 0:
      return span // step
    return None


class _Frame:
  def __init__(self, kind: str, loop: _Loop | None = None):
    self.kind = kind  # 'module', 'func', 'cond', 'body' or 'region'
    self.loop = loop
    self.defs: dict[str, tuple[str, str]] = {}  # %name -> (op name, rest of line)
    self.pending: _Loop | None = None  # a while op whose regions come next


_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _parse_module(text: str) -> tuple[list[MatmulOp], int, int, int]:
  """(ops with multiplicities, executed float casts, bytes they write, loops with
  unknown trip count)."""
  # Per function: matmul entries, casts and calls, each with its enclosing loops.
  funcs: dict[str, dict[str, list]] = {}
  public: list[str] = []
  stack: list[_Frame] = []
  current: dict[str, list] | None = None

  def lookup(name: str) -> tuple[str, str] | None:
    for frame in reversed(stack):
      if name in frame.defs:
        return frame.defs[name]
      if frame.kind == "func":
        break  # functions are isolated from above
    return None

  def constant(name: str) -> int | None:
    found = lookup(name)
    if found is None or found[0] != "stablehlo.constant":
      return None
    m = _CONSTANT.match(found[1])
    return int(m.group(1)) if m else None

  def loops() -> tuple[_Loop, ...]:
    return tuple(f.loop for f in stack if f.loop is not None)

  for raw in text.splitlines():
    code = _STRING.sub('""', raw)
    opens, closes = 0, 0
    for ch in code:
      if ch == "{":
        opens += 1
      elif ch == "}":
        if opens:
          opens -= 1
        else:
          closes += 1
    del stack[max(0, len(stack) - closes):]

    func = _FUNC.search(code)
    if func:
      name = func.group(1)
      current = funcs.setdefault(name, {"ops": [], "casts": [], "calls": [], "loops": []})
      if re.search(r"\bfunc\.func\s+public\b", code) or name == "main":
        public.append(name)
    elif current is not None and stack:
      _parse_line(raw, code, stack, current, loops(), lookup, constant)

    for _ in range(opens):
      parent = stack[-1] if stack else None
      loop = parent.pending if parent is not None and not func else None
      if loop is not None:
        # The first two regions after a while op are its condition and its body.
        loop.regions += 1
        if loop.regions == 2:
          parent.pending = None
        stack.append(_Frame("cond" if loop.regions == 1 else "body", loop))
      else:
        stack.append(_Frame("func" if func else "module" if not stack else "region"))

  counts = _call_counts(funcs, public)
  ops: list[MatmulOp] = []
  casts = cast_bytes = unknown = 0
  for name, body in funcs.items():
    count = counts.get(name, 0)
    if not count:
      continue
    for op, around in body["ops"]:
      ops.append(op._replace(multiplicity=count * _trips(around), function=name.strip('"')))
    casts += sum(count * _trips(around) for around, _ in body["casts"])
    cast_bytes += sum(count * _trips(around) * nbytes for around, nbytes in body["casts"])
    unknown += sum(1 for loop in body["loops"] if loop.trips is None)
  return ops, casts, cast_bytes, unknown


def _parse_line(raw: str, code: str, stack: list[_Frame], current: dict[str, list],
                around: tuple[_Loop, ...], lookup, constant) -> None:
  """Records what one line of a function body holds: a def, calls, a loop, an op."""
  frame = stack[-1]
  m = _DEF.match(code)
  if m:
    frame.defs[m.group(1)] = (m.group(2), m.group(3))
  stripped = code.strip()
  if frame.kind in ("cond", "body") and stripped.startswith("stablehlo.return"):
    _close_region(frame, _RETURN.match(stripped).group(1), lookup, constant)
  for call in _CALL.finditer(code):
    current["calls"].append((call.group(1) or call.group(2), around))
  if re.search(r"\bstablehlo\.while\b", code):
    args = _WHILE_ARGS.search(code)
    inits: dict[str, int | None] = {}
    if args:
      for pair in args.group(1).split(","):
        lhs, _, rhs = pair.partition("=")
        inits[lhs.strip()] = constant(rhs.strip())
    frame.pending = _Loop(inits)
    current["loops"].append(frame.pending)
  elif re.search(r"\bstablehlo\.(dot_general|convolution)\b", code):
    op = _matmul(raw)
    if op is not None:
      current["ops"].append((op, around))
  elif re.search(r"\bstablehlo\.convert\b", code):
    types = _signature(raw)
    if types and len(types[0]) == 1 and _is_float(types[0][0][1]) and _is_float(types[1][1]):
      shape, dtype = types[1]
      nbytes = math.prod(shape) * _itemsize(dtype) if min(shape, default=0) >= 0 else 0
      current["casts"].append((around, nbytes))


def _close_region(frame: _Frame, returned: str, lookup, constant) -> None:
  """Reads a loop's condition or its counter step from the region's return."""
  loop = frame.loop
  values = [v.strip() for v in returned.split(",") if v.strip()]
  if frame.kind == "cond":
    found = lookup(values[0]) if len(values) == 1 else None
    m = _COMPARE.match(found[1]) if found and found[0] == "stablehlo.compare" else None
    if m is None:
      return
    direction, a, b = m.groups()
    if a in loop.inits and constant(b) is not None:
      loop.compare = (direction, a, constant(b))
    elif b in loop.inits and constant(a) is not None:
      loop.compare = (_FLIP.get(direction, direction), b, constant(a))
    return
  if loop.compare is None or loop.compare[1] not in loop.order:
    return
  index = loop.order.index(loop.compare[1])
  if index >= len(values):
    return
  counter = loop.compare[1]
  found = lookup(values[index])
  m = _BINARY.match(found[1]) if found else None
  if m is None:
    return
  a, b = m.groups()
  if found[0] == "stablehlo.add":
    if a == counter and constant(b) is not None:
      loop.step = constant(b)
    elif b == counter and constant(a) is not None:
      loop.step = constant(a)
  elif found[0] == "stablehlo.subtract" and a == counter and constant(b) is not None:
    loop.step = -constant(b)


def _trips(loops: tuple[_Loop, ...]) -> int:
  n = 1
  for loop in loops:
    trips = loop.trips
    n *= 1 if trips is None else trips
  return n


def _call_counts(funcs: dict[str, dict[str, list]], public: list[str]) -> dict[str, int]:
  """How often each function runs when the entry function runs once."""
  entry = "main" if "main" in funcs else (public[0] if public else next(iter(funcs), None))
  callers: dict[str, list[tuple[str, int]]] = {}
  for name, body in funcs.items():
    for callee, around in body["calls"]:
      callers.setdefault(callee, []).append((name, _trips(around)))
  counts: dict[str, int] = {}

  def count(name: str, active: frozenset) -> int:
    if name in counts:
      return counts[name]
    if name == entry:
      return 1
    if name in active:  # recursion cannot be counted statically
      return 0
    n = sum(count(c, active | {name}) * m for c, m in callers.get(name, []))
    counts[name] = n
    return n

  return {name: count(name, frozenset()) for name in funcs}


def _split_top(s: str) -> list[str]:
  """Splits on commas outside any brackets."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(s):
    if ch in "<([{":
      depth += 1
    elif ch in ">)]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(s[start:i])
      start = i + 1
  parts.append(s[start:])
  return [p.strip() for p in parts if p.strip()]


def _tensor(t: str) -> tuple[tuple[int, ...], str] | None:
  """``'tensor<4x8xbf16>'`` -> ``((4, 8), 'bfloat16')``; dynamic dims become -1."""
  t = t.strip()
  if not (t.startswith("tensor<") and t.endswith(">")):
    return None
  inner = _split_top(t[len("tensor<"):-1])[0]
  m = re.match(r"^((?:(?:\d+|\?)x)*)(.+)$", inner)
  dims = tuple(-1 if d == "?" else int(d) for d in m.group(1).split("x") if d)
  return dims, _mlir_dtype(m.group(2))


def _mlir_dtype(t: str) -> str:
  if t in _DTYPES:
    return _DTYPES[t]
  m = re.fullmatch(r"(u?)i(\d+)", t) or re.fullmatch(r"(s)i(\d+)", t)
  if m:
    return f"{'uint' if m.group(1) == 'u' else 'int'}{m.group(2)}"
  m = re.fullmatch(r"f(\d+)(E\d+M\d+\w*)", t)
  if m:  # f8E4M3FN -> float8_e4m3fn, as ml_dtypes names them
    return f"float{m.group(1)}_{m.group(2).lower()}"
  return t


def _itemsize(dtype: str) -> int:
  try:
    return jax.numpy.dtype(dtype).itemsize
  except TypeError:  # 'tf32' and types numpy has no name for
    return 4


def _is_float(dtype: str) -> bool:
  return dtype.startswith(("float", "bfloat")) or dtype == "tf32"


def _signature(line: str):
  """The trailing ``: (in types) -> out type`` of an op line, parsed."""
  line = re.sub(r"\s+loc\(.*\)\s*$", "", line.rstrip())
  arrow = line.rfind("->")
  if arrow < 0:
    return None
  close = line.rfind(")", 0, arrow)
  depth, i = 0, close
  while i >= 0:
    depth += {")": 1, "(": -1}.get(line[i], 0)
    if depth == 0:
      break
    i -= 1
  if i < 0:
    return None
  ins = [_tensor(t) for t in _split_top(line[i + 1:close])]
  out = _split_top(line[arrow + 2:].strip().strip("()"))
  result = _tensor(out[0]) if out else None
  if result is None or any(t is None for t in ins):
    return None
  return ins, result


def _matmul(line: str) -> MatmulOp | None:
  types = _signature(line)
  if types is None or len(types[0]) < 2:
    return None
  (lhs_shape, lhs), (rhs_shape, rhs) = types[0][:2]
  out_shape, out = types[1]
  if "stablehlo.dot_general" in line:
    kind = "dot_general"
    m = _CONTRACT.search(line)
    dims = [int(d) for d in m.group(1).split(",") if d.strip()] if m else []
    reduced = math.prod(lhs_shape[d] for d in dims)
  else:
    kind = "convolution"
    m = _KERNEL_DIMS.search(line)
    labels = [d.strip() for d in m.group(1).split(",")] if m else []
    if "o" in labels and len(labels) == len(rhs_shape):
      out_features = rhs_shape[labels.index("o")]
    else:
      out_features = rhs_shape[-1]  # HWIO, jax's usual kernel layout
    reduced = math.prod(rhs_shape) // max(out_features, 1)
  flops = 2 * math.prod(out_shape) * reduced
  if any(d < 0 for d in (*lhs_shape, *rhs_shape, *out_shape)):
    flops = 0  # dynamic shapes: unknown
  return MatmulOp(kind, lhs, rhs, out, lhs_shape, rhs_shape, out_shape, flops, 1, "")


# --- formatting ---------------------------------------------------------------------------

_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64",
          "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _short(dtype: str, shape: tuple[int, ...]) -> str:
  return f"{_SHORT.get(dtype, dtype)}[{','.join(map(str, shape))}]"


def _human(n: float) -> str:
  """Three significant digits with a K/M/G/T/P suffix: 1024 -> '1.02K'."""
  for unit in ("", "K", "M", "G", "T"):
    if abs(n) < 999.5:
      break
    n /= 1000
  else:
    unit = "P"
  if not unit:
    return str(int(n))
  return f"{n:.{max(0, 2 - int(math.log10(max(abs(n), 1))))}f}{unit}"


def _percent(part: float, whole: float) -> str:
  return f"{100 * part / whole:.1f}%" if whole else "0.0%"


def _bytes(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)
