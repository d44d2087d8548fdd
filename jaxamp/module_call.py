"""What one module call does under a policy, written once for NNX, Linen and Equinox.

A wrapper (:mod:`jaxamp.nnx`, :mod:`jaxamp.linen`, :mod:`jaxamp.equinox`) hooks into its
library's module calls in its own way (a policy-aware subclass, an interceptor) and reads
its parameters in its own way (a Variable hook, ``self.param``, a field read). What it
does with the call is this module's: cast the floating arguments to the compute dtype,
choose how the call runs (recomputed in the backward pass, its parameters gathered again,
or plain), run it under its census scope, and hand the floating outputs over in the
output dtype. So are the cache of policy-aware subclasses, the per-thread call state and
the first-call check that the policy reaches the matmuls.

A wrapper describes its library with a :class:`Library`: which values a cast passes
untouched (modules, Variables, state). The rest it passes per call.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxamp import module_call
  >>> from jaxamp.policy import get_policy
  >>> plain = module_call.Library(keep=lambda x: False)
  >>> out = module_call.call_under(
  ...     plain, get_policy('mixed_bfloat16'), (jnp.ones(2),), {},
  ...     call=lambda args, kwargs: args[0] * 2, recomputed=None)
  >>> out.dtype
  dtype(bfloat16)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxamp import _trace
from jaxamp import fp8 as fp8_lib
from jaxamp import numerics
from jaxamp.casting import cast_leaf, is_floating_array
from jaxamp.census import float32_in_half_modules, scope_name, warn_float32_matmuls
from jaxamp.policy import Policy
from jaxamp.residuals import recompute_all, regather_policy


class Library(NamedTuple):
  """How one library's module calls look to the core.

  Attributes:
    keep: whether a value in a call's arguments or results passes every cast untouched
      (and is not looked into): the library's modules, Variables, state objects.
  """

  keep: Callable[[Any], bool]


# --- the per-thread call state ------------------------------------------------------------


class CallState(threading.local):
  """A library's per-thread call state: models are shared objects, running calls are not.

  Attributes:
    calls: the wrapper calls running, innermost last (what each wrapper keeps of one).
    stack: one entry per module call running, innermost last (its policy, or the dtype
      its fields read as).
    running: ids of the modules whose wrapped method is running (re-entrant calls run
      as they are).
    census: whether a census trace is running (no first-call check inside it).
  """

  def __init__(self):
    super().__init__()
    self.calls: list[Any] = []
    self.stack: list[Any] = []
    self.running: set[int] = set()
    self.census = False


# --- the policy-aware subclasses ----------------------------------------------------------


class PolicyClasses:
  """The cached policy-aware subclasses of one library's module classes.

  ``methods`` is the library's ``POLICY_METHODS`` (read live: an edit is seen by the
  next class made). A policy method ``name`` of an instance asks ``lookup(module)`` what
  it runs under: None runs the user's method ``fn`` as it is, else it returns
  ``run(module, fn, name, found, args, kwargs)``. ``make(base, namespace)`` makes the
  subclass (``type(base)(...)``, or what the library needs for its metaclass).
  """

  def __init__(self, methods: dict[type, tuple[str, ...]], lookup: Callable[[Any], Any],
               run: Callable[..., Any], make: Callable[[type, dict[str, Any]], type]):
    self._policy_methods = methods
    self._lookup = lookup
    self._run = run
    self._make = make
    self._methods: dict[type, tuple[str, ...]] = {}
    self._methods_source: dict[type, tuple[str, ...]] = {}  # what _methods reflects
    self._classes: dict[Hashable, type] = {}
    self._lock = threading.Lock()

  def methods_for(self, cls: type) -> tuple[str, ...]:
    """The policy methods of ``cls``, by its MRO; remembered until ``methods`` changes."""
    if self._policy_methods != self._methods_source:  # a small dict: cheaper than the MRO
      self._methods.clear()
      self._methods_source.clear()
      self._methods_source.update(self._policy_methods)
    found = self._methods.get(cls)
    if found is None:
      found = self._methods[cls] = self._find_methods(cls)
    return found

  def _find_methods(self, cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in cls.__mro__:
      for name in self._policy_methods.get(klass, ()):
        # Look in the class dicts: getattr(cls, '__call__') finds the metaclass's.
        if name not in names and any(name in vars(k) for k in cls.__mro__
                                     if k is not object):
          names.append(name)
    return tuple(names)

  def subclass(self, base: type, attrs: Mapping[str, Any], key: Hashable = None,
               cache: bool = True) -> type:
    """The subclass of ``base`` with its policy methods wrapped and ``attrs`` set;
    cached per ``(base, key)`` (one per ``attrs``' content) unless ``cache`` is off."""
    methods = self.methods_for(base)
    full_key = (base, key, methods)
    if cache:
      found = self._classes.get(full_key)
      if found is not None:
        return found
    with self._lock:
      found = self._classes.get(full_key) if cache else None
      if found is None:
        namespace: dict[str, Any] = {"__module__": base.__module__,
                                     "__qualname__": base.__qualname__,
                                     "__doc__": base.__doc__, **attrs}
        for name in methods:
          namespace[name] = self._policy_method(getattr(base, name), name)
        found = self._make(base, namespace)
        if cache:
          self._classes[full_key] = found
    return found


  def _policy_method(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    lookup, run = self._lookup, self._run

    @functools.wraps(fn)
    def method(module, *args, **kwargs):
      found = lookup(module)
      if found is None:
        return fn(module, *args, **kwargs)
      return run(module, fn, name, found, args, kwargs)

    return method


# --- casting reads and widening outputs ---------------------------------------------------


def _is_plain_array(x: Any) -> bool:
  """A ``jax.Array`` or an array tracer (not a hijax Variable's): a leaf to cast as is."""
  if isinstance(x, jax.core.Tracer):
    return type(x.aval) is jax.core.ShapedArray
  return isinstance(x, jax.Array)


def cast_values(tree: Any, dtype: np.dtype, keep: Callable[[Any], bool]) -> Any:
  """Casts the floating arrays of ``tree`` to ``dtype``; values ``keep`` accepts pass
  untouched."""
  # Most calls pass and return plain arrays: no tree to build.
  if _is_plain_array(tree):
    return cast_leaf(tree, dtype)
  if type(tree) is tuple and all(_is_plain_array(x) for x in tree):
    return tuple(cast_leaf(x, dtype) for x in tree)
  if type(tree) is dict and not tree:
    return tree
  return jax.tree.map(lambda x: x if keep(x) else cast_leaf(x, dtype), tree, is_leaf=keep)


def widens(tree: Any, compute: Any, keep: Callable[[Any], bool] | None = None) -> bool:
  """Whether ``compute`` is wider than some floating array of ``tree``."""
  size = np.dtype(compute).itemsize
  return any(is_floating_array(x) and x.dtype.itemsize < size
             for x in jax.tree.leaves(tree, is_leaf=keep))


# --- recompute, re-gather or plain --------------------------------------------------------


def arrays_of(tree: Any, select: Callable[[Any], bool],
              keep: Callable[[Any], bool] | None = None
              ) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
  """The leaves of ``tree`` that ``select`` picks (what a checkpoint takes as inputs), and
  a function that returns ``tree`` with others in their places."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=keep)
  where = [i for i, x in enumerate(leaves) if select(x)]

  def put_back(arrays: Sequence[Any]) -> Any:
    full = list(leaves)
    for i, x in zip(where, arrays):
      full[i] = x
    return jax.tree.unflatten(treedef, full)

  return [leaves[i] for i in where], put_back


class Remat(NamedTuple):
  """How a call runs under a checkpoint.

  Attributes:
    policy: the ``jax.checkpoint`` policy: :func:`jaxamp.residuals.recompute_all` for a
      norm, :func:`jaxamp.residuals.regather_policy` for a module reading parameter
      slices.
    regather: whether it runs so for its parameter slices (FSDP, gathered where read).
  """

  policy: Callable[..., bool]
  regather: bool


def remat_for(*, norm: bool, recompute_norms: bool, owns_slices: bool, inputs: Any,
              compute: Any, keep: Callable[[Any], bool] | None = None) -> Remat | None:
  """How a module call runs: a norm computing wider than its ``inputs`` recomputed in
  the backward pass (with ``recompute_norms``: reverse mode keeps its narrower input,
  not float32 intermediates); else a module owning parameter slices under its own
  checkpoint, gathered again in the backward pass; else None, plain."""
  if norm and recompute_norms and widens(inputs, compute, keep):
    return Remat(recompute_all, False)
  if owns_slices:
    return Remat(regather_policy(compute), True)
  return None


_NO_SCOPE = contextlib.nullcontext()  # reusable: the hot path makes no context manager


def census_scope(scope: int | None) -> contextlib.AbstractContextManager[Any]:
  """The module call numbered ``scope`` of a census run under its named scope (None:
  no census run)."""
  return _NO_SCOPE if scope is None else jax.named_scope(scope_name(scope))


def call_under(library: Library, policy: Policy, args: tuple[Any, ...],
               kwargs: dict[str, Any], *,
               call: Callable[[tuple[Any, ...], dict[str, Any]], Any],
               recomputed: Callable[[Remat], Any] | None,
               remat: Remat | None = None, scope: int | None = None,
               output_dtype: Any = None, widen: bool = True,
               path: str | Callable[[], str | None] | None = None,
               layer: type | None = None) -> Any:
  """One module call under ``policy``.

  Args:
    library: how the library's values are cast.
    policy: the module's resolved policy.
    args: the call's arguments, as passed.
    kwargs: its keyword arguments.
    call: runs the module on the arguments cast to the compute dtype.
    recomputed: runs the module under the checkpoint ``remat`` says, on the arguments as
      passed (the cast inside the checkpoint).
    remat: :func:`remat_for`'s choice; None runs ``call``.
    scope: the census scope number (None: no census run).
    output_dtype: the dtype floating outputs are handed over in (None: the policy's).
    widen: False hands the outputs back as they came (the library casts them).
    path: the module's path (or a function giving it), which the numerics monitor
      (:mod:`jaxamp.numerics`) records its outputs under; read only while it records.
    layer: the module's class: a layer FP8 can run (:func:`jaxamp.fp8.hooks`) has its
      inputs recorded too.

  Returns:
    The module's output, floating arrays in ``output_dtype``.
  """
  compute = policy.compute_dtype
  with census_scope(scope):
    if remat is not None:
      out = recomputed(remat)
    else:
      out = call(cast_values(args, compute, library.keep),
                 cast_values(kwargs, compute, library.keep))
  if numerics.current() is not None:
    inputs = (args, kwargs) if layer is not None and fp8_lib.hooks(layer) else None
    out = numerics.observe(path, compute, out, library.keep, inputs, layer)
  if not widen:
    return out
  dtype = policy.output_dtype if output_dtype is None else output_dtype
  return cast_values(out, dtype, library.keep)


# --- the census trace ---------------------------------------------------------------------


def traced(fn: Callable[..., Any], *trees: Any) -> Any:
  """The jaxpr of ``fn(*trees)``, traced abstractly (nothing runs; arrays and shape
  structs alike), its array outputs kept. FP8 is suspended: traced inside a train step,
  a census or plan pass must not read (or warn of missing) FP8 state, nor record numerics
  (its modules are copies)."""
  with fp8_lib.suspended(), numerics.suspended():
    return _trace.abstractly(jax.make_jaxpr, _trace.arrays_of(fn), *trees)


# --- the first-call check -----------------------------------------------------------------

_CHECKED_SIZE = 256


def input_signature(leaves: Sequence[Any]) -> tuple[Any, ...]:
  """The shapes and dtypes of a call's input ``leaves``: the first-call check's key."""
  return tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x)))) for x in leaves)


def first_time(checked: set[Any], key: Hashable) -> bool:
  """Whether ``key`` is new to ``checked`` (then remembered; ``checked`` is bounded)."""
  if key in checked:  # first: this runs on every outermost call
    return False
  if len(checked) >= _CHECKED_SIZE:
    checked.clear()
  checked.add(key)
  return True


def warn_float32(model: str, policy: str, compute: Mapping[str, Any],
                 census: Callable[[], tuple[list[Any], list[str]]], stacklevel: int
                 ) -> tuple[list[Any], list[str]] | None:
  """Warns once if a module computing in half by policy leaves matmuls in float32.

  Args:
    model: the model's class name.
    policy: the model-level policy's name.
    compute: each module's compute dtype, by ``'/'``-joined path.
    census: traces the call: ``(ops, names)`` of :func:`jaxamp.census.module_matmuls`.
    stacklevel: what the caller would pass to
      :func:`jaxamp.census.warn_float32_matmuls`.

  Returns:
    The census, or None where nothing computes in half (nothing was traced).
  """
  if all(np.dtype(c).itemsize >= 4 for c in compute.values()):
    return None
  ops, names = census()
  stray, total = float32_in_half_modules(ops, names, compute)
  warn_float32_matmuls(model, policy, stray, total, stacklevel=stacklevel + 1)
  return ops, names
