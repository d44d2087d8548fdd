"""Inspection: did the policy reach the matmuls, and what does backward keep?

:func:`precision_report` lowers a function with ``jax.jit(...).lower(...)`` and walks
the StableHLO module through MLIR's Python bindings (ops, attributes and types, never
the printed text). Every ``stablehlo.dot_general`` and ``stablehlo.convolution``
becomes a :class:`MatmulOp` with its operand and result dtypes, shapes, FLOPs and how
many times it runs. It reads the *lowered* module, not the compiled one, because
compilers rewrite precision (XLA on CPU upcasts bfloat16 dots to float32): the
lowered module is what the policy asked for.

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
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import Literal
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from jaxamp import adapters, dtypes, scaled
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
    scaled_format: what the scaled format that ran the op calls it
      (:func:`jaxamp.scaled.describe`: ``'fp8 e4m3fn/e5m2 per-tensor delayed'``,
      ``'fp8 e4m3fn, 1x128 act / 128x128 weight blocks'``), read off the op's location
      (the named scope each format's matmul runs under); ``''`` for an op no format ran.
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
  scaled_format: str = ""

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
    flops_by_format: FLOPs per scaled format (:attr:`MatmulOp.scaled_format`), for
      the ops a scaled format ran.
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
  flops_by_format: dict[str, int] = dataclasses.field(default_factory=dict)

  def table(self) -> str:
    """A terminal table: one row per distinct op, then summary lines."""
    groups: dict[tuple, list[int]] = {}
    formats = any(op.scaled_format for op in self.ops)  # a column only where one ran
    for op in self.ops:
      key = (op.kind, _short(op.lhs_dtype, op.lhs_shape), _short(op.rhs_dtype, op.rhs_shape),
             _short(op.result_dtype, op.result_shape))
      key += (op.scaled_format or "-",) if formats else ()
      count_flops = groups.setdefault(key, [0, 0])
      count_flops[0] += op.multiplicity
      count_flops[1] += op.total_flops
    rows = [("op", "lhs", "rhs", "out", *(("format",) if formats else ()), "count", "FLOPs",
             "share")]
    for key, (count, flops) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
      rows.append((*key, str(count), _human(flops), _percent(flops, self.total_flops)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = (False,) * (5 if formats else 4) + (True, True, True)
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
    for name, flops in sorted(self.flops_by_format.items(), key=lambda kv: -kv[1]):
      lines.append(f"scaled format {name}: {_percent(flops, self.total_flops)} of the "
                   "matmul FLOPs")
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
        "flops_by_format": dict(self.flops_by_format),
    }


def precision_report(fn: Callable[..., Any], *args: Any, backward: bool = False,
                     argnums: int | Sequence[int] = 0, **kwargs: Any) -> PrecisionReport:
  """Reports the dtypes and FLOPs of every matmul ``fn(*args, **kwargs)`` lowers to.

  ``fn`` is lowered with ``jax.jit(fn).lower(*args)`` and the StableHLO module is read.
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
  for library in adapters.libraries():  # a model's functions, sizes: closed over
    fn, args = library.report_args(fn, tuple(args), nums)
  bound = (lambda *a: fn(*a, **kwargs)) if kwargs else fn
  target = jax.value_and_grad(bound, argnums=argnums) if backward else bound
  ops, casts, cast_bytes, unknown_loops = _parse_module(
      _lowered_module(jax.jit(target).lower(*args)))
  residuals = _residuals(bound, args, nums)

  total = sum(op.total_flops for op in ops)
  half = sum(op.total_flops for op in ops if op.is_half)
  fp8 = sum(op.total_flops for op in ops if op.is_fp8)
  by_dtype: dict[tuple[str, str], int] = {}
  by_format: dict[str, int] = {}
  for op in ops:
    key = (op.lhs_dtype, op.rhs_dtype)
    by_dtype[key] = by_dtype.get(key, 0) + op.total_flops
    if op.scaled_format:
      by_format[op.scaled_format] = by_format.get(op.scaled_format, 0) + op.total_flops
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
      fp8_flops=fp8, fp8_share=fp8 / total if total else 0.0, flops_by_format=by_format)


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


# --- the lowered module, walked through MLIR's Python bindings ---------------------------
#
# The report reads the ``ir.Module`` that ``Lowered.compiler_ir('stablehlo')`` returns as
# objects: op names, attributes (StableHLO's dimension numbers and comparison directions
# through the dialect's own attribute classes), operand and result types, block arguments
# and the ops that define values. Nothing depends on how a JAX or MLIR release prints it.
# The bindings are imported from ``jaxlib.mlir``, the package those objects belong to and
# jax itself imports: ``jax.extend.mlir``, the public module, has no ``ir``, and
# ``jax._src.lib.mlir`` only re-exports ``jaxlib.mlir`` under a private name.

_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}
# MLIR's float type classes, named from jaxamp.dtypes' table: the IEEE-like ones by width,
# the others from their HLO spelling (f8e4m3fn: Float8E4M3FNType); tf32 is no storage type.
_IEEE = {"bfloat16": "BF16Type", "float16": "F16Type", "float32": "F32Type",
         "float64": "F64Type"}
_FLOATS = (*((_IEEE.get(f.name, f"Float{f.hlo[1:].upper()}Type"), f.name)
             for f in dtypes.FORMATS.values()), ("FloatTF32Type", "tf32"))
# Types a jaxlib release lacks are left out rather than failing the import.
_FLOAT_TYPES = tuple((getattr(ir, cls), name) for cls, name in _FLOATS if hasattr(ir, cls))


class _Loop:
  """A ``stablehlo.while`` whose trip count is worked out from its regions."""

  def __init__(self, inits: dict[int, int | None]):
    self.inits = inits  # iter arg position -> constant initial value (None: not constant)
    self.compare: tuple[str, int, int] | None = None  # (direction, counter, limit)
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


@dataclasses.dataclass
class _Body:
  """What one function holds, each entry with the loops around it in that function."""

  ops: list[tuple[MatmulOp, tuple[_Loop, ...]]] = dataclasses.field(default_factory=list)
  casts: list[tuple[tuple[_Loop, ...], int]] = dataclasses.field(default_factory=list)
  calls: list[tuple[str, tuple[_Loop, ...]]] = dataclasses.field(default_factory=list)
  loops: list[_Loop] = dataclasses.field(default_factory=list)


def _lowered_module(lowered: Any) -> ir.Module:
  """The lowered StableHLO module as MLIR objects."""
  module = lowered.compiler_ir("stablehlo")
  if not isinstance(module, ir.Module):  # compiler_ir gives no guarantee on its type
    module = ir.Module.parse(lowered.as_text(), _context())
  return module


def _module_text(lowered: Any) -> str:
  """The lowered StableHLO text, large constants elided: for reading, not for the report."""
  return _lowered_module(lowered).operation.get_asm(large_elements_limit=64,
                                                     enable_debug_info=False)


@functools.cache
def _context() -> ir.Context:
  """An MLIR context that knows every dialect jax lowers to, for modules given as text.

  jax makes one for each lowering; the bindings have no public way to register its
  dialects (``func``, ``stablehlo``, ``chlo``, ``sdy``, ...) in a new one.
  """
  return jax.jit(lambda: 0).lower().compiler_ir("stablehlo").context


def _parse_module(module: ir.Module | str) -> tuple[list[MatmulOp], int, int, int]:
  """(ops with multiplicities, executed float casts, bytes they write, loops with
  unknown trip count) of a lowered module; text is parsed by MLIR's own parser."""
  if isinstance(module, str):
    module = ir.Module.parse(module, _context())
  funcs: dict[str, _Body] = {}
  public: list[str] = []
  for func in _functions(module.operation):
    name = ir.StringAttr(func.attributes["sym_name"]).value
    body = funcs.setdefault(name, _Body())
    visibility = (ir.StringAttr(func.attributes["sym_visibility"]).value
                  if "sym_visibility" in func.attributes else "public")
    if visibility == "public" or name == "main":
      public.append(name)
    for region in func.regions:
      for block in region.blocks:
        _walk(block, body, ())

  counts = _call_counts(funcs, public)
  ops: list[MatmulOp] = []
  casts = cast_bytes = unknown = 0
  for name, body in funcs.items():
    count = counts.get(name, 0)
    if not count:
      continue
    for op, around in body.ops:
      ops.append(op._replace(multiplicity=count * _trips(around), function=name))
    casts += sum(count * _trips(around) for around, _ in body.casts)
    cast_bytes += sum(count * _trips(around) * nbytes for around, nbytes in body.casts)
    unknown += sum(1 for loop in body.loops if loop.trips is None)
  return ops, casts, cast_bytes, unknown


def _functions(op: ir.Operation):
  """The ``func.func`` ops of a module, nested modules included."""
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        child = child.operation
        if child.name == "func.func":
          yield child
        elif child.name == "builtin.module":
          yield from _functions(child)


def _walk(block: ir.Block, body: _Body, around: tuple[_Loop, ...]) -> None:
  """Records the calls, loops, matmuls and float casts of a block and its regions."""
  for op in block.operations:
    op = op.operation
    name = op.name
    if name == "stablehlo.composite" and _composite_name(op) == "xla.scaled_dot":
      # A block-scaled product (jax.lax.scaled_dot, MXFP8): one matmul of its FP8
      # operands, whatever its decomposition (an emulation where there is no MX
      # hardware) does inside.
      matmul = _matmul(op)
      if matmul is not None:
        body.ops.append((matmul, around))
      continue
    for key in ("callee", "decomposition"):  # func.call; stablehlo.composite
      symbol = op.attributes[key] if key in op.attributes else None
      if isinstance(symbol, ir.FlatSymbolRefAttr):
        body.calls.append((symbol.value, around))
    inner = around
    if name == "stablehlo.while":
      loop = _loop(op)
      body.loops.append(loop)
      inner = (*around, loop)
    elif name in ("stablehlo.dot_general", "stablehlo.convolution"):
      matmul = _matmul(op)
      if matmul is not None:
        body.ops.append((matmul, around))
    elif name == "stablehlo.convert":
      source, result = _tensor(op.operands[0].type), _tensor(op.results[0].type)
      if (source and result and _is_float(source[1]) and _is_float(result[1])
          and source[1] != result[1]):  # jax emits float32 -> float32 converts too
        shape, dtype = result
        nbytes = math.prod(shape) * _itemsize(dtype) if min(shape, default=0) >= 0 else 0
        body.casts.append((around, nbytes))
    for region in op.regions:
      for inner_block in region.blocks:
        _walk(inner_block, body, inner)


def _composite_name(op: ir.Operation) -> str:
  """A ``stablehlo.composite``'s name (``'xla.scaled_dot'``)."""
  return ir.StringAttr(op.attributes["name"]).value if "name" in op.attributes else ""


def _contracting(op: ir.Operation) -> tuple[int, ...]:
  """The lhs contracting dimensions of a ``dot_general``, or of a ``scaled_dot``
  composite (its ``dimension_numbers`` attribute: ``[[lhs_c, rhs_c], [lhs_b, rhs_b]]``)."""
  if op.name == "stablehlo.dot_general":
    return tuple(hlo.DotDimensionNumbers(
        op.attributes["dot_dimension_numbers"]).lhs_contracting_dimensions)
  dims = ir.DictAttr(op.attributes["composite_attributes"])["dimension_numbers"]
  lhs_contracting = ir.ArrayAttr(ir.ArrayAttr(ir.ArrayAttr(dims)[0])[0])
  return tuple(ir.IntegerAttr(d).value for d in lhs_contracting)


def _loop(op: ir.Operation) -> _Loop:
  """A while loop's counter: its initial value, its bound and its step, where constant.

  The condition must return ``compare(counter, constant)`` (either order) and the body
  must return ``counter + constant`` or ``counter - constant`` in the counter's place.
  """
  loop = _Loop({i: _constant(v) for i, v in enumerate(op.operands)})
  cond, body = (region.blocks[0] for region in op.regions)
  condition = _returned(cond)
  compare = _defining(condition[0]) if len(condition) == 1 else None
  if compare is None or compare.name != "stablehlo.compare":
    return loop
  direction = hlo.ComparisonDirectionAttr(compare.attributes["comparison_direction"]).value
  a, b = compare.operands
  if _argument(a, cond) is not None and _constant(b) is not None:
    loop.compare = (direction, _argument(a, cond), _constant(b))
  elif _argument(b, cond) is not None and _constant(a) is not None:
    loop.compare = (_FLIP.get(direction, direction), _argument(b, cond), _constant(a))
  else:
    return loop
  counter = loop.compare[1]
  returned = _returned(body)
  update = _defining(returned[counter]) if counter < len(returned) else None
  if update is None or len(update.operands) != 2:
    return loop
  a, b = update.operands
  if update.name == "stablehlo.add":
    if _argument(a, body) == counter and _constant(b) is not None:
      loop.step = _constant(b)
    elif _argument(b, body) == counter and _constant(a) is not None:
      loop.step = _constant(a)
  elif update.name == "stablehlo.subtract":
    if _argument(a, body) == counter and _constant(b) is not None:
      loop.step = -_constant(b)
  return loop


def _returned(block: ir.Block) -> list[ir.Value]:
  """The values a region's block returns (its terminator's operands)."""
  ops = block.operations
  return list(ops[len(ops) - 1].operation.operands) if len(ops) else []


def _defining(value: ir.Value) -> ir.Operation | None:
  """The op that produced ``value``; None for a block argument."""
  return value.owner.operation if isinstance(value, ir.OpResult) else None


def _argument(value: ir.Value, block: ir.Block) -> int | None:
  """``value``'s position among ``block``'s arguments, if it is one of them."""
  if isinstance(value, ir.BlockArgument) and value.owner == block:
    return value.arg_number
  return None


def _constant(value: ir.Value) -> int | None:
  """The integer a scalar ``stablehlo.constant`` holds (not a boolean), else None."""
  op = _defining(value)
  if op is None or op.name != "stablehlo.constant":
    return None
  attr, kind = op.attributes["value"], value.type
  if not (isinstance(kind, ir.RankedTensorType) and kind.rank == 0
          and isinstance(kind.element_type, ir.IntegerType) and kind.element_type.width > 1
          and isinstance(attr, ir.DenseIntElementsAttr)):
    return None
  return ir.IntegerAttr(attr.get_splat_value()).value


def _trips(loops: tuple[_Loop, ...]) -> int:
  n = 1
  for loop in loops:
    trips = loop.trips
    n *= 1 if trips is None else trips
  return n


def _call_counts(funcs: dict[str, _Body], public: list[str]) -> dict[str, int]:
  """How often each function runs when the entry function runs once."""
  entry = "main" if "main" in funcs else (public[0] if public else next(iter(funcs), None))
  callers: dict[str, list[tuple[str, int]]] = {}
  for name, body in funcs.items():
    for callee, around in body.calls:
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


def _tensor(t: ir.Type | str) -> tuple[tuple[int, ...], str] | None:
  """A ranked tensor type's ``(shape, dtype name)``; dynamic dims become -1.

  ``_tensor('tensor<?x8xbf16>') == ((-1, 8), 'bfloat16')``: text is parsed by MLIR.
  """
  if isinstance(t, str):
    t = ir.Type.parse(t, _context())
  if not isinstance(t, ir.RankedTensorType):
    return None
  dims = tuple(-1 if t.is_dynamic_dim(i) else d for i, d in enumerate(t.shape))
  return dims, _mlir_dtype(t.element_type)


def _mlir_dtype(t: ir.Type | str) -> str:
  """An MLIR element type's dtype name, as numpy and ml_dtypes spell it (``bf16``:
  ``'bfloat16'``, ``ui8``: ``'uint8'``); unknown types keep their MLIR spelling."""
  if isinstance(t, str):
    t = ir.Type.parse(t, _context())
  for cls, name in _FLOAT_TYPES:
    if isinstance(t, cls):
      return name
  if isinstance(t, ir.IntegerType):
    return "bool" if t.width == 1 else f"{'uint' if t.is_unsigned else 'int'}{t.width}"
  if isinstance(t, ir.ComplexType):
    part = _mlir_dtype(t.element_type)
    if part in ("float32", "float64"):
      return f"complex{2 * int(part[len('float'):])}"
  return str(t)


def _itemsize(dtype: str) -> int:
  return dtypes.itemsize(dtype)


def _is_float(dtype: str) -> bool:
  return dtype.startswith(("float", "bfloat")) or dtype == "tf32"


def _matmul(op: ir.Operation) -> MatmulOp | None:
  """A ``dot_general``, ``scaled_dot`` composite or ``convolution`` op as a
  :class:`MatmulOp` run once."""
  if len(op.operands) < 2:
    return None
  lhs, rhs, out = (_tensor(v.type) for v in (*op.operands[:2], op.results[0]))
  if lhs is None or rhs is None or out is None:
    return None
  (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype), (out_shape, out_dtype) = lhs, rhs, out
  if op.name in ("stablehlo.dot_general", "stablehlo.composite"):
    kind = "dot_general"
    reduced = math.prod(lhs_shape[d] for d in _contracting(op))
  else:
    kind = "convolution"
    dims = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    out_features = rhs_shape[dims.kernel_output_feature_dimension]
    reduced = math.prod(rhs_shape) // max(out_features, 1)
  flops = 2 * math.prod(out_shape) * reduced
  if any(d < 0 for d in (*lhs_shape, *rhs_shape, *out_shape)):
    flops = 0  # dynamic shapes: unknown
  return MatmulOp(kind, lhs_dtype, rhs_dtype, out_dtype, lhs_shape, rhs_shape, out_shape,
                  flops, 1, "", scaled.described_in(_location_name(op.location)))


def _location_name(loc: ir.Location) -> str:
  """The name of an op's location (jax's name stack), through the bindings' location
  classes: a ``NameLoc``'s name, a ``FusedLoc``'s parts' names joined; ``''`` else."""
  try:
    return ir.NameLoc(loc).name_str
  except ValueError:
    pass
  try:
    return "/".join(filter(None, map(_location_name, ir.FusedLoc(loc).locations)))
  except ValueError:
    return ""


# --- formatting ---------------------------------------------------------------------------

def _short(dtype: str, shape: tuple[int, ...]) -> str:
  fmt = dtypes.FORMATS.get(dtype)
  return f"{fmt.short if fmt else dtype}[{','.join(map(str, shape))}]"


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
