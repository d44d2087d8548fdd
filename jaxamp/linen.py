"""Per-module mixed precision for unmodified Flax Linen models.

:func:`with_policy` wraps a Linen module so that every submodule runs under the policy
:func:`jaxamp.resolve_policy` gives it: its class and path rules, else the policy of
the module containing it, the top module taking the model-level policy. Nothing in the
model changes, its layers keep ``dtype=None``, and user modules that read a parameter
directly (``x @ self.param('w', ...)``) get the policy too. Inside a module:

- its own parameters are read in its compute dtype; stored parameters, and gradients
  with respect to them, keep the param dtype (float32 under ``mixed_*``);
- floating arguments are cast to the compute dtype and floating results to the output
  dtype; integers (token ids), booleans (masks), PRNG keys and non-arrays pass through.
  Normalization layers compute in float32 (:func:`jaxamp.float32_compute`);
- a ``dtype`` field (every Flax layer's, and a third-party module's that threads
  ``dtype=self.dtype`` down) reads the compute dtype, and a ``param_dtype`` field the
  param dtype, in ``setup()`` as in calls: the policy, not the model's hard-coded
  float32, decides;
- mutable collections such as ``batch_stats`` keep their dtype; only an attention
  layer's decoding ``cache`` holds keys and values in the compute dtype.

Lifted transforms (``nn.scan``, ``nn.remat``, ``nn.vmap``, ``nn.jit``) are followed, and
so is a submodule run through its own ``apply`` (``self.head.apply(...)``, a tied head),
at its path in the model.
The first ``apply`` per input signature warns once if a module computing in half still
runs matmuls in float32 (:mod:`jaxamp.census`). Policies are resolved when ``apply`` is
traced: under ``jax.jit`` the rules in force at the first trace stay baked in. More in
the policies guide (``docs/guides/policies.md``).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> import jaxamp
  >>> model = jaxamp.linen.with_policy(nn.Dense(4), 'mixed_bfloat16')
  >>> variables = model.init(jax.random.key(0), jnp.ones((2, 3)))
  >>> variables['params']['kernel'].dtype
  dtype('float32')
  >>> model.apply(variables, jnp.ones((2, 3))).dtype
  dtype(bfloat16)
  >>> [(path, cls.__name__, p.name) for path, cls, p in
  ...  jaxamp.linen.module_policies(nn.Dense(4), variables, jnp.ones((2, 3)),
  ...                               policy='mixed_bfloat16')]
  [('', 'Dense', 'mixed_bfloat16')]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import flax.core
import flax.linen as nn
import jax
import numpy as np

from jaxamp import _trace
from jaxamp import fp8 as fp8_lib
from jaxamp import fp8_conv_transpose, hf_layers
from jaxamp import gather as gather_lib
from jaxamp import module_call
from jaxamp import residuals as residuals_lib
from jaxamp._flax_compat import (linen_is_bound, linen_is_lifted_body, linen_unbound_method,
                                 set_attr_unchecked, unbox, union_filters)
from jaxamp.casting import (at_least_float32, cast_floating, is_floating_array,
                            is_floating_dtype, read_as)
from jaxamp.census import module_matmuls
from jaxamp.policy import Policy, PolicyLike, get_policy, global_policy
from jaxamp.rules import (NORM_CLASSES, is_named_attention, is_named_norm, not_norms,
                          path_name, resolve_policy, resolve_tree)

__all__ = ["LinenPolicy", "with_policy", "module_policies"]

Path = tuple[str, ...]
_LIBRARY = module_call.Library(keep=lambda x: False)  # Linen modules are no pytrees
_PLAN_CACHE_SIZE = 64
_MISSING = object()


class _Plan(NamedTuple):
  """What an abstract pass learns about a call.

  Attributes:
    modules: ``(path, class)`` of the module instance first run at each path, in order.
    lifted: paths whose module runs as the body of a lifted transform.
    matmuls: paths of the modules that run a matmul or convolution of their own (None
      where the pass was not traced): no norm rule applies to them.
    kernels: the shape of each module's ``kernel`` as its call reads it (inside
      ``nn.scan``, one layer's slice of the stacked kernel).
  """

  modules: tuple[tuple[Path, type], ...]
  lifted: frozenset[Path]
  matmuls: frozenset[Path] | None = None
  kernels: Mapping[Path, tuple[int, ...]] | None = None


# --- which modules run, and under which policy -------------------------------------------


def _module_path(module: nn.Module) -> Path:
  return tuple(str(p) for p in module.path)


def _inside_lifted(path: Path, lifted: frozenset[Path]) -> bool:
  """Whether the module at ``path`` is the body of a lifted transform or runs inside one."""
  return any(path[:len(body)] == body for body in lifted)


class _Places:
  """Where each module that runs sits in the model, applies nested in a call included.

  A module may run another through that one's own ``apply``
  (``self.head.apply({'params': {'kernel': embedding.T}}, x)``: tied LM heads, weight
  norm): Flax binds it as the root of a new scope, path ``()``. Here it takes the path
  it has in the model, its caller's path and its name (``tied/head``), and the modules
  it runs take paths below that, so rules, the summary and FP8 see it as a submodule.
  """

  def __init__(self):
    self.root: nn.Module | None = None  # the model's root: the first module to run
    self.calls: list[Path] = []  # model paths of the module methods running
    self.nested: list[Path] = []  # model paths of the nested applies running
    # The clones nn.map_variables runs of nested roots, by id, each held with its path:
    # a clone freed while its id is a key here would leave the id to the next module
    # allocated there (the summary then gave that module's matmuls to the nested root).
    self.clones: dict[int, tuple[nn.Module, Path]] = {}
    self.cloning: Path | None = None  # a nested root's path, while its clone is made

  def of(self, module: nn.Module) -> tuple[Path, bool]:
    """``module``'s path in the model, and whether it is the root of a nested apply."""
    path = _module_path(module)
    clone = self.clones.get(id(module))
    if self.root is None:
      self.root = module
    elif clone is not None and clone[0] is module:
      return clone[1], False
    elif not path and self.cloning is not None:  # the first module the transform runs
      self.clones[id(module)] = (module, self.cloning)
      return self.cloning, False
    elif not path and module is not self.root and not (
        # The clone a lifted top module (nn.remat(Model)) runs is no nested apply.
        module.name == self.root.name and isinstance(self.root, type(module))):
      caller = self.calls[-1] if self.calls else ()
      return (*caller, module.name or type(module).__name__), True
    return ((*self.nested[-1], *path) if self.nested else path), False

  @contextlib.contextmanager
  def running(self, path: Path, nested: bool) -> Iterator[None]:
    """Marks the module at model path ``path`` as running for a ``with`` block."""
    self.calls.append(path)
    if nested:
      self.nested.append(path)
    try:
      yield
    finally:
      self.calls.pop()
      if nested:
        self.nested.pop()


def _recording(root: nn.Module) -> tuple[Callable[..., Any], Callable[[Any], _Plan]]:
  """An interceptor noting each module that runs, and a function returning the plan
  from the call's jaxpr (None where it was not traced).

  Each module call runs under the :func:`jaxamp.census.scope_name` of its number, so
  that the jaxpr tells which modules run matmuls of their own."""
  found: dict[Path, type] = {(): type(root)}
  lifted: set[Path] = set()
  scopes: dict[Path, int] = {}
  kernels: dict[Path, tuple[int, ...]] = {}
  places = _Places()

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if not linen_is_bound(module):
      return next_fun(*args, **kwargs)
    path, nested = places.of(module)
    found.setdefault(path, type(module))
    if linen_is_lifted_body(module):
      lifted.add(path)
    with places.running(path, nested), module_call.census_scope(
        scopes.setdefault(path, len(scopes))):
      out = next_fun(*args, **kwargs)
    if module.has_variable("params", "kernel"):  # (created by the call under init)
      kernels.setdefault(path, np.shape(unbox(module.get_variable("params", "kernel"))))
    return out

  def plan(jaxpr: Any) -> _Plan:
    matmuls = None
    if jaxpr is not None:
      names = sorted(scopes, key=scopes.get)
      matmuls = frozenset(names[op.module] for op in module_matmuls(jaxpr)
                          if op.module is not None)
    return _Plan(tuple(found.items()), frozenset(lifted), matmuls, kernels)

  return intercept, plan


def _resolve(plan: _Plan, model_policy: Policy) -> dict[Path, Policy]:
  """Each module's policy; a module that runs matmuls is no norm."""
  return resolve_tree(plan.modules, model_policy, plan.matmuls)


def _enclosing(policies: Mapping[Path, Policy], path: Path) -> Policy:
  """The policy of the nearest module above ``path`` (the root is always there)."""
  for n in range(len(path) - 1, -1, -1):
    if path[:n] in policies:
      return policies[path[:n]]
  raise KeyError(path)  # unreachable: the root path () is always resolved


def _abstract_plan(fn: Callable[..., Any], root: nn.Module, *trees: Any) -> _Plan:
  """Traces ``fn(*trees)`` (nothing runs) and records the modules that run in it, and
  which of them run matmuls."""
  recorder, plan = _recording(root)
  with nn.intercept_methods(recorder):
    jaxpr = module_call.traced(fn, *trees)
  return plan(jaxpr)


def _apply_plan(module: nn.Module, variables: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> _Plan:
  """The plan of ``module.apply(variables, *args, **kwargs)``.

  The abstract pass runs the module uncast, so a decoding ``cache`` held in a half
  dtype would not take the float32 keys it computes: the pass leaves the cache out and
  lets the module make a fresh one, as on the first decoding step.
  """
  if isinstance(variables, Mapping) and "cache" in variables:
    variables = {k: v for k, v in variables.items() if k != "cache"}
    kwargs = dict(kwargs, mutable=union_filters(kwargs.get("mutable", False), "cache"))
  return _abstract_plan(lambda v, a, k: module.apply(v, *a, **k), module, variables, args,
                        kwargs)


# --- FSDP: parameter slices gathered where they are read -------------------------------------


def _planned(variables: Any) -> Any:
  """``variables`` as the abstract pass sees them (:func:`_apply_plan`): parameter slices
  (FSDP, ``gather='layer'``) as whole parameters, and floating parameters of mixed dtypes
  (gathered at the step's start in each reader's compute dtype, or stored so by rules)
  as float32 (float64 if some are). The pass runs the module uncast, where a bfloat16 carry through a float32
  LayerNorm would come back float32 and fail ``nn.scan``'s carry check."""
  if not isinstance(variables, Mapping) or not isinstance(variables.get("params"), Mapping):
    return variables
  params = variables["params"]
  leaves = jax.tree.leaves(params, is_leaf=gather_lib.is_slice)
  floating = {x.dtype for x in jax.tree.leaves(params) if is_floating_array(x)}
  if len(floating) < 2 and not any(map(gather_lib.is_slice, leaves)):
    return variables
  params = gather_lib.whole(params)
  if len(floating) > 1:
    wide = at_least_float32(*floating)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), wide)
                          if is_floating_dtype(x.dtype) else x, params)
  return {**variables, "params": params}


def _owns_slices(module: nn.Module) -> bool:
  """Whether some parameter directly in ``module``'s scope is a slice read gathered."""
  params = module.variables.get("params", {})
  return isinstance(params, Mapping) and any(map(gather_lib.is_slice, params.values()))


# --- casting ---------------------------------------------------------------------------------


def _cast_module_params(tree: Any, policies: Mapping[Path, Policy],
                        dtype_of: Callable[[Policy], Any], path: Path = (),
                        skip: frozenset[Path] = frozenset()) -> Any:
  """Casts the leaves each module owns (those directly under its path) to its dtype.

  ``tree`` holds one collection of the module at ``path``. Leaves of modules that are
  not in ``policies`` (they did not run) are left alone, and so are the subtrees of
  submodules in ``skip``. Mapping types (``dict``, ``FrozenDict``) are kept.
  """
  if not isinstance(tree, Mapping):
    return tree
  policy = policies.get(path)
  out = {}
  for key, value in tree.items():
    sub = (*path, str(key))
    if isinstance(value, Mapping):
      out[key] = value if sub in skip else _cast_module_params(value, policies, dtype_of,
                                                               sub, skip)
    elif policy is not None and not gather_lib.is_slice(value):  # slices: cast when read
      out[key] = read_as(value, dtype_of(policy))
    else:
      out[key] = value
  return flax.core.freeze(out) if isinstance(tree, flax.core.FrozenDict) else out


def _cast_params(variables: Any, policies: Mapping[Path, Policy],
                 dtype_of: Callable[[Policy], Any], path: Path = (),
                 skip: frozenset[Path] = frozenset(), collection: str = "params") -> Any:
  """``variables`` (collections of the module at ``path``) with ``collection`` cast."""
  if not isinstance(variables, Mapping) or collection not in variables:
    return variables
  out = dict(variables)
  out[collection] = _cast_module_params(variables[collection], policies, dtype_of, path,
                                        skip)
  return flax.core.freeze(out) if isinstance(variables, flax.core.FrozenDict) else out


def _compute_dtype(policy: Policy) -> Any:
  return policy.compute_dtype


def _cast_variables(variables: Any, modules: Sequence[tuple[Path, type]],
                    policies: Mapping[Path, Policy], param_dtype: Callable[[Policy], Any],
                    skip: frozenset[Path] = frozenset()) -> Any:
  """Parameters to ``param_dtype`` and attention's decoding ``cache`` to the compute dtype.

  ``cache`` is Flax's collection for autoregressive decoding (``decode=True``
  attention): an attention layer (:func:`jaxamp.rules.is_named_attention`) stores keys
  and values it computes there and updates them in place, so its cache must have its
  compute dtype. Any other module's ``cache`` entries (a running sum, a recurrent state)
  keep their dtype: in half precision a float32 one would accumulate in half.
  """
  variables = _cast_params(variables, policies, param_dtype, skip=skip)
  attention = {path: policies[path] for path, cls in modules
               if path in policies and is_named_attention(cls)}
  return _cast_params(variables, attention, _compute_dtype, skip=skip, collection="cache")


def _cast_like(x: Any, like: Any) -> Any:
  if is_floating_array(x) and is_floating_array(like) and x.dtype != like.dtype:
    return x.astype(like.dtype)
  return x


def _restore(new: Any, passed: Any, old: Any) -> Any:
  """The state a call returned, in the dtypes it came in with.

  ``apply`` passed ``passed`` (``old`` with cast parameters) to the module, which
  returned ``new``. A leaf the call did not change goes back to its ``old`` value (no
  lossy round trip through the half dtype); other floating leaves take ``old``'s dtype;
  leaves that are new (sown intermediates) stay as they are.
  """
  if isinstance(new, Mapping) and isinstance(old, Mapping):
    passed = passed if isinstance(passed, Mapping) else {}
    out = {k: _restore(v, passed.get(k), old[k]) if k in old else v for k, v in new.items()}
    return flax.core.freeze(out) if isinstance(new, flax.core.FrozenDict) else out
  return old if new is passed else _cast_like(new, old)


def _same_layout(a: Any, b: Any) -> bool:
  """Whether pytrees ``a`` and ``b`` have one structure and equal leaf shapes."""
  a_leaves, a_def = jax.tree.flatten(a)
  b_leaves, b_def = jax.tree.flatten(b)
  return a_def == b_def and all(
      getattr(x, "shape", None) == getattr(y, "shape", None) for x, y in zip(a_leaves, b_leaves))


def _is_norm(cls: type) -> bool:
  """A normalization layer: one of Flax's, or a class named like one."""
  return issubclass(cls, NORM_CLASSES) or is_named_norm(cls)


def _dtype_fields(module: nn.Module, policy: Policy) -> dict[str, Any]:
  """The ``dtype`` / ``param_dtype`` fields of ``module`` that ``policy`` replaces.

  A field is replaced when the module declares it and holds None or a floating dtype
  (``'float32'`` strings included) other than the policy's.
  """
  declared = getattr(type(module), "__dataclass_fields__", {})
  out = {}
  for name, dtype in (("dtype", policy.compute_dtype), ("param_dtype", policy.param_dtype)):
    value = vars(module).get(name, _MISSING)
    if name in declared and (value is None or is_floating_dtype(value)):
      if value is None or np.dtype(value) != dtype:
        out[name] = dtype
  return out


@contextlib.contextmanager
def _fields_set(module: nn.Module, fields: Mapping[str, Any]) -> Iterator[None]:
  """``module``'s dataclass fields set to ``fields`` for a ``with`` block."""
  old = {name: vars(module)[name] for name in fields}
  for name, value in fields.items():
    set_attr_unchecked(module, name, value)  # Linen modules are frozen dataclasses
  try:
    yield
  finally:
    for name, value in old.items():
      set_attr_unchecked(module, name, value)


def _casting(policies: dict[Path, Policy], lifted: frozenset[Path],
             scopes: dict[Path, int] | None = None, recompute_norms: bool = False,
             not_norm: frozenset[Path] = frozenset()) -> Callable[..., Any]:
  """The interceptor applying each module's policy to its arguments and results.

  ``policies`` gains an entry for any module the abstract pass did not see. The
  parameters of the bodies of lifted transforms (``lifted``) are cast here, inside the
  transform, rather than before ``apply``: ``nn.remat`` then recomputes the cast in the
  backward pass instead of keeping a half-precision copy of the parameters; so are those
  a nested apply passes its module (:class:`_Places`). ``setup`` runs with the module's
  ``dtype`` fields set as its calls do, so what it derives from them (Hugging Face's
  float32 attention softmax) follows the policy. With ``scopes`` (filled as modules
  run), each module call runs under the :func:`jaxamp.census.scope_name` of its number
  there, for the census. With ``recompute_norms``, norms (not the modules of
  ``not_norm``: :func:`jaxamp.rules.not_norms`) that compute wider than their inputs run
  under ``nn.remat``.
  """
  running: list[nn.Module] = []
  mapping: set[Path] = set()  # lifted bodies whose parameters are being cast
  places = _Places()

  def recomputed(module, path, context, args, kwargs, compute,
                 policy=residuals_lib.recompute_all, tie=False):
    # The module runs under nn.remat with the cast to ``compute`` inside it: reverse mode
    # keeps the narrower input, not float32 intermediates (a norm), and recomputes the
    # rest as ``policy`` says. With ``tie`` (it reads parameter slices) its gathers wait
    # for what gather.tie_for says (its inputs, or the previous reading module's), and
    # the policy has them gathered again in the backward pass.
    arrays, put_back = module_call.arrays_of((args, kwargs), is_floating_array)
    ties = gather_lib.tie_for(arrays) if tie else []

    def body(clone, *inputs):
      a, k = cast_floating(put_back(inputs[:len(arrays)]), compute)
      with gather_lib.reading(compute, list(inputs[len(arrays):]) if tie else None):
        return linen_unbound_method(context)(clone, *a, **k)

    mapping.add(path)  # the clone nn.remat runs is already cast
    try:
      return nn.remat(body, policy=policy)(module, *arrays, *ties)
    finally:
      mapping.discard(path)

  def call(next_fun, module, path, nested, context, args, kwargs):
    if path not in lifted and not nested:
      return next_fun(*args, **kwargs)
    cast_in = lambda cols: _cast_params(cols, policies, _compute_dtype, path, lifted)
    # map_variables needs the method unbound, to call it on the clone it binds to the
    # cast parameters.
    method = nn.map_variables(linen_unbound_method(context), "params", trans_in_fn=cast_in)
    mapping.add(path)
    if nested:
      places.cloning = path
    try:
      return method(module, *args, **kwargs)
    finally:
      mapping.discard(path)
      places.cloning = None

  def policy_of(module, path):
    policy = policies.get(path)
    if policy is None:  # not seen by the abstract pass (data-dependent structure)
      policy = policies[path] = resolve_policy(type(module), path, _enclosing(policies, path))
    return policy

  def scoped(path):
    return module_call.census_scope(
        None if scopes is None else scopes.setdefault(path, len(scopes)))

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if not linen_is_bound(module):
      return next_fun(*args, **kwargs)
    if running and running[-1] is module:
      return next_fun(*args, **kwargs)  # a module calling its own method: already cast
    path, nested = places.of(module)
    if context.method_name == "setup":
      policy = policy_of(module, path)
      with _fields_set(module, _dtype_fields(module, policy)), \
          places.running(path, nested), scoped(path), gather_lib.reading(policy.compute_dtype):
        return next_fun(*args, **kwargs)
    if path in mapping:
      places.cloning = None
      with places.running(path, False):
        return next_fun(*args, **kwargs)  # the clone map_variables runs: already cast
    policy = policy_of(module, path)
    compute = policy.compute_dtype
    running.append(module)
    try:
      with contextlib.ExitStack() as stack:
        fields = _dtype_fields(module, policy)
        if policy.fp8 is not None:  # FP8 matmuls: jaxamp.fp8
          fields = {**fields, **fp8_lib.linen_fields(module, path, policy,
                                                     _inside_lifted(path, lifted))}
          if context.method_name == "__call__":  # Hugging Face's FlaxConv1D
            next_fun = hf_layers.fp8_call(module, path, policy, next_fun,
                                          _inside_lifted(path, lifted))
            next_fun = fp8_conv_transpose.linen_call(module, path, policy, next_fun,
                                                     _inside_lifted(path, lifted))
        stack.enter_context(_fields_set(module, fields))
        stack.enter_context(places.running(path, nested))
        stack.enter_context(scoped(path))
        stack.enter_context(gather_lib.reading(compute))  # its parameter slices, if any
        plain = path not in lifted and not nested and not module.is_initializing()
        owns = plain and _owns_slices(module)  # FSDP, gather='layer'
        remat = module_call.remat_for(
            norm=plain and _is_norm(type(module)) and path not in not_norm,
            recompute_norms=recompute_norms, owns_slices=owns, inputs=(args, kwargs),
            compute=compute)
        out = module_call.call_under(
            _LIBRARY, policy, args, kwargs,
            call=lambda a, k: call(next_fun, module, path, nested, context, a, k),
            recomputed=lambda r: recomputed(module, path, context, args, kwargs, compute,
                                            r.policy, tie=owns),
            remat=remat, widen=False,  # an nn.scan carry goes back as it came, below
            path=lambda: "/".join(map(str, path)),
            layer=type(module) if context.method_name == "__call__" else None)
    finally:
      running.pop()
    if (args and linen_is_lifted_body(module) and type(out) is tuple and out
        and _same_layout(out[0], args[0])):
      # An nn.scan body: the carry goes back in the dtypes it came in with.
      carry = jax.tree.map(_cast_like, out[0], args[0])
      return (carry, *cast_floating(out[1:], policy.output_dtype))
    return cast_floating(out, policy.output_dtype)

  return intercept


# --- plan cache keys ---------------------------------------------------------------------------


# --- the wrapper ----------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class LinenPolicy:
  """A Linen module whose submodules each run under their resolved policy.

  Made by :func:`with_policy`. ``init`` and ``apply`` take and return what the module's
  own ``init`` and ``apply`` do.

  Attributes:
    module: the wrapped Linen module, unchanged.
    policy: the model-level policy (:func:`with_policy` without one takes
      :func:`jaxamp.global_policy` when it wraps the module).
    recompute_norms: whether norms that compute wider than their inputs are recomputed
      in the backward pass (off by default).
    half_residuals: whether ``apply`` runs under :func:`jaxamp.half_residuals` when a
      module computes in half precision (on by default).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jaxamp
    >>> model = jaxamp.linen.with_policy(nn.BatchNorm(use_running_average=False),
    ...                                  'mixed_bfloat16')
    >>> x = jnp.ones((4, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> y, state = model.apply(variables, x, mutable=['batch_stats'])
    >>> y.dtype, state['batch_stats']['mean'].dtype
    (dtype(bfloat16), dtype('float32'))
  """

  module: nn.Module
  policy: Policy
  recompute_norms: bool = False
  half_residuals: bool = True
  _plans: collections.OrderedDict = dataclasses.field(
      default_factory=collections.OrderedDict, repr=False)
  _checked: set = dataclasses.field(default_factory=set, repr=False)

  def model_policy(self) -> Policy:
    """The model-level policy."""
    return self.policy

  def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
    """Like ``module.init``; parameters come back in each module's param dtype.

    The forward pass run by ``init`` is the module's own, uncast: only shapes come out
    of it, and parameters whose initializer follows the input dtype start in float32.

    Args:
      rngs: a PRNG key or a dict of them, as for ``module.init``.
      *args: the module's arguments.
      **kwargs: its keyword arguments and ``init``'s (``method``, ``mutable``, ...).

    Returns:
      The variables, with ``params`` in the param dtype of the module owning them and
      the decoding ``cache`` in its compute dtype.
    """
    recorder, plan = _recording(self.module)
    with nn.intercept_methods(recorder):
      variables = self.module.init(rngs, *args, **kwargs)
    found = plan(None)  # not traced: a module holding others is no norm (not_norms)
    return _cast_variables(variables, found.modules, _resolve(found, self.model_policy()),
                           lambda p: p.param_dtype)

  def apply(self, variables: Any, *args: Any, rngs: Any = None,
            method: Callable[..., Any] | str | None = None, mutable: Any = False,
            **kwargs: Any) -> Any:
    """Like ``module.apply``, with every submodule under its resolved policy.

    Args:
      variables: the variables, as ``init`` returns them.
      *args: the method's arguments.
      rngs: PRNG keys for the call (``{'dropout': key}``), as for ``module.apply``.
      method: the method to call (name or function); ``__call__`` by default.
      mutable: the collections the call may update, as for ``module.apply``.
      **kwargs: the method's keyword arguments.

    Returns:
      The output, or ``(output, updated_state)`` when ``mutable`` is set, as Linen
      does. Updated floating state keeps the dtype it was passed in with.
    """
    call_kwargs = dict(kwargs, rngs=rngs, method=method, mutable=mutable)
    planned = _planned(variables)
    key = _trace.signature(planned, args, call_kwargs)
    plan = self._plan(key, planned, args, call_kwargs)
    if key is None or key not in self._checked:
      self._check(plan, planned, args, call_kwargs)
      if key is not None:
        self._checked.add(key)
    return self._run(plan, variables, args, call_kwargs)

  def _run(self, plan: _Plan, variables: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
           scopes: dict[Path, int] | None = None) -> Any:
    """``apply`` with its plan; with ``scopes``, each module call under a census scope."""
    policies = _resolve(plan, self.model_policy())
    excluded = not_norms((path for path, _ in plan.modules), plan.matmuls)

    def run(variables, args, kwargs):
      # The casts inside: under half_residuals, the backward pass recasts a parameter
      # from its float32 value rather than keeping its half-precision copy.
      cast = _cast_variables(variables, plan.modules, policies, _compute_dtype,
                             skip=plan.lifted)
      with nn.intercept_methods(_casting(policies, plan.lifted, scopes,
                                         self.recompute_norms, excluded)):
        result = self.module.apply(cast, *args, **kwargs)
      if kwargs.get("mutable", False) is False:
        return result
      out, state = result
      return out, _restore(state, cast, variables)

    if (scopes is None and self.half_residuals
        and residuals_lib.computes_in_half(policies.values())):
      run = residuals_lib.half_residuals(run)
    return run(variables, args, kwargs)

  def matmul_census(self, variables: Any, *args: Any, **kwargs: Any
                    ) -> tuple[list[Any], list[str], dict[str, Policy]]:
    """Which module each matmul of ``apply(variables, *args, **kwargs)`` runs in, and how.

    Nothing is computed: the call is traced abstractly (``jax.make_jaxpr``).

    Returns:
      ``(ops, modules, policies)``: the :func:`jaxamp.census.module_matmuls` census of
      the forward pass, the ``'/'``-joined module path of each scope number, and each
      module's resolved policy by path.
    """
    key = _trace.signature(variables, args, kwargs)
    return self._census(self._plan(key, variables, args, kwargs), variables, args, kwargs)

  def _census(self, plan: _Plan, variables: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[list[Any], list[str], dict[str, Policy]]:
    scopes: dict[Path, int] = {}
    jaxpr = module_call.traced(lambda v, a, k: self._run(plan, v, a, k, scopes), variables,
                               args, kwargs)
    names = [path_name(path) for path in sorted(scopes, key=scopes.get)]
    policies = _resolve(plan, self.model_policy())
    return (module_matmuls(jaxpr), names,
            {path_name(path): policy for path, policy in policies.items()})

  def _check(self, plan: _Plan, variables: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> None:
    """Warns once if a module computing in half by policy leaves matmuls in float32."""
    policies = _resolve(plan, self.model_policy())
    module_call.warn_float32(
        type(self.module).__name__, self.policy.name,
        {path_name(path): p.compute_dtype for path, p in policies.items()},
        lambda: self._census(plan, variables, args, kwargs)[:2], stacklevel=4)

  def _plan(self, key: Hashable | None, variables: Any, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> _Plan:
    """:func:`_apply_plan`, cached per input signature ``key``."""
    if key is not None and key in self._plans:
      self._plans.move_to_end(key)
      return self._plans[key]
    plan = _apply_plan(self.module, variables, args, kwargs)
    if key is not None:
      self._plans[key] = plan
      if len(self._plans) > _PLAN_CACHE_SIZE:
        self._plans.popitem(last=False)
    return plan


def with_policy(module: nn.Module, policy: PolicyLike | None = None, *,
                recompute_norms: bool = False, half_residuals: bool = True) -> LinenPolicy:
  """Wraps an unmodified Linen ``module`` to run each submodule under its policy.

  Args:
    module: any Linen module; its layers may keep ``dtype=None``.
    policy: the model-level policy (anything :func:`jaxamp.get_policy` accepts). None
      takes :func:`jaxamp.global_policy` now, once: later ``set_global_policy`` calls
      and scopes do not change the wrapper, eager or jitted. Rules set with
      :func:`jaxamp.set_policy` / :func:`jaxamp.policy_rules` refine it per module.
    recompute_norms: run norms that compute wider than their inputs (the float32
      default inside a half-precision model) under ``nn.remat``: the backward pass
      recomputes their statistics too. ``half_residuals`` already keeps a norm's
      half-precision input and statistics, not its float32 intermediates, so this
      saves only the statistics: off by default.
    half_residuals: when a module computes in half precision, ``apply`` runs under
      :func:`jaxamp.half_residuals`: reverse mode saves half-precision values and
      statistics and recomputes float32 elementwise work (float32 norms' insides,
      parameter casts) in the backward pass, with the same gradients. On by default;
      False keeps what plain reverse mode saves.

  Returns:
    A :class:`LinenPolicy` with Linen's ``init(rngs, *args, **kwargs)`` and
    ``apply(variables, *args, rngs=None, method=None, mutable=False, **kwargs)``.
    Create it once and reuse it: it caches what it learns about the model per input
    shapes.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jaxamp
    >>> class Model(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(2)(nn.LayerNorm()(nn.Dense(4)(x)))
    >>> model = jaxamp.linen.with_policy(Model(), 'mixed_float16')
    >>> x = jnp.ones((1, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> grads = jax.grad(lambda v: model.apply(v, x).sum())(variables)
    >>> grads['params']['Dense_0']['kernel'].dtype, model.apply(variables, x).dtype
    (dtype('float32'), dtype('float16'))
  """
  if not isinstance(module, nn.Module):
    raise TypeError(f"jaxamp.linen.with_policy wraps a flax.linen.Module, got "
                    f"{type(module).__name__}; for an NNX module use jaxamp.nnx.with_policy.")
  # Resolved now, not per call: a jitted apply would otherwise freeze whatever policy
  # was in force at its trace and silently ignore a later set_global_policy.
  return LinenPolicy(module, global_policy() if policy is None else get_policy(policy),
                     bool(recompute_norms), bool(half_residuals))


def module_policies(module: nn.Module, variables: Any, *args: Any,
                    policy: PolicyLike | None = None,
                    **kwargs: Any) -> list[tuple[str, type, Policy]]:
  """The modules that run for these inputs, each with its resolved policy.

  Nothing is computed: the call is evaluated abstractly.

  Args:
    module: a Linen module.
    variables: its variables, to inspect ``apply``; or None to inspect ``init``
      (``kwargs`` may then hold ``rngs``, else ``jax.random.key(0)`` is used).
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    policy: the model-level policy; None for :func:`jaxamp.global_policy`.
    **kwargs: passed to ``apply`` (``method``, ``mutable``, ``rngs`` ...) or ``init``.

  Returns:
    ``(path, class, policy)`` for each module that runs, one entry per path (a module
    called twice, or the clone a lifted transform runs, counts once), in the order they
    first run; paths are ``'/'``-joined and the top module's is ``''``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jaxamp
    >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm()])
    >>> x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    >>> for path, cls, p in jaxamp.linen.module_policies(model, None, x,
    ...                                                  policy='mixed_float16'):
    ...   print(repr(path), cls.__name__, p.name)
    '' Sequential mixed_float16
    'layers_0' Dense mixed_float16
    'layers_1' LayerNorm params=float32,compute=float32,output=float16
  """
  return module_plan(module, variables, *args, policy=policy, **kwargs)[0]


def module_plan(module: nn.Module, variables: Any, *args: Any,
                policy: PolicyLike | None = None,
                **kwargs: Any) -> tuple[list[tuple[str, type, Policy]], frozenset[str],
                                        dict[str, tuple[int, ...]]]:
  """:func:`module_policies`' rows, the paths of the modules that run inside a lifted
  transform (``nn.scan``, ``nn.vmap``, ``nn.remat``: the body and what it calls), and the
  shape of the ``kernel`` each of those reads (one layer's, inside ``nn.scan``)."""
  model_policy = global_policy() if policy is None else get_policy(policy)
  if variables is None:
    rngs = kwargs.pop("rngs", None)
    rngs = jax.random.key(0) if rngs is None else rngs
    plan = _abstract_plan(lambda r, a, k: module.init(r, *a, **k), module, rngs, args, kwargs)
  else:
    plan = _apply_plan(module, variables, args, kwargs)
  policies = _resolve(plan, model_policy)
  inside = frozenset(path_name(path) for path, _ in plan.modules
                     if _inside_lifted(path, plan.lifted))
  kernels = {path_name(path): shape for path, shape in (plan.kernels or {}).items()
             if path_name(path) in inside}
  return ([(path_name(path), cls, policies[path]) for path, cls in plan.modules], inside,
          kernels)
