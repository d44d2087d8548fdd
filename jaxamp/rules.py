"""Per-module policy rules: by module class or by path, and how they resolve.

A rule maps a *target* to a *policy*:

- a module **class** (``nnx.Linear``, ``flax.linen.Dense``, your own class): the rule
  applies to that class and its subclasses; the most specific class (nearest in the
  MRO) wins;
- a **path pattern**, a glob over the ``'/'``-joined module path (``'blocks/*/attn'``:
  ``*`` matches one segment or part of one, ``**`` any number of segments, ``?`` one
  character), or a compiled ``re.Pattern`` (``fullmatch``). The most recent path rule
  wins.

A rule's policy is anything :func:`jaxamp.get_policy` accepts, or a callable
``enclosing_policy -> Policy`` such as :func:`float32_compute` (compute in float32, or
the surrounding compute dtype where wider, and return the surrounding compute dtype),
the default rule of the Flax norm classes.
Norm classes that are not Flax's are found by name (:data:`NORM_NAME_PATTERN`:
``BatchNorm``, ``LayerNorm2d``, ``RMSNormGated``; not ``Normalize``) and get the rule
set for :data:`NAMED_NORMS`, :func:`float32_compute` by default. A name alone never
makes a norm: a module that holds submodules (``FlaxWav2Vec2StableLayerNormEncoder``)
or runs a matmul or convolution of its own is not one, and no norm rule (neither
:data:`NAMED_NORMS` nor a :data:`NORM_CLASSES` class's) applies to it
(:func:`not_norms`).

Precedence, first match wins: path rules, then the most specific class rule (the
built-in norm defaults are class rules), then the :data:`NAMED_NORMS` rule for a class
named like a norm, then the policy of the enclosing module (the top model taking the
model-level policy). The policies guide (``docs/guides/policies.md``) has more.

Example:
  >>> import jaxamp
  >>> from flax import nnx
  >>> with jaxamp.policy_rules({'head': 'float32', nnx.Linear: 'mixed_bfloat16'}):
  ...   jaxamp.resolve_policy(nnx.Linear, 'head', jaxamp.get_policy('float32')).name
  ...   jaxamp.resolve_policy(nnx.Linear, 'blocks/0', jaxamp.get_policy('float32')).name
  ...   jaxamp.resolve_policy(nnx.LayerNorm, 'ln', jaxamp.get_policy('mixed_bfloat16')).name
  'float32'
  'mixed_bfloat16'
  'params=float32,compute=float32,output=bfloat16'
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Union

import jax
import numpy as np

from jaxamp import _warn_once
from jaxamp._flax_compat import VARIABLE_VALUE_KEY
from jaxamp.casting import at_least_float32, is_floating_array
from jaxamp.policy import Policy, PolicyLike, get_policy

__all__ = [
    "float32_compute",
    "set_policy",
    "clear_policies",
    "policy_rules",
    "resolve_policy",
    "resolve_tree",
    "not_norms",
    "NORM_CLASSES",
    "NORM_NAME_PATTERN",
    "NAMED_NORMS",
    "is_named_norm",
    "ATTENTION_NAME_PATTERN",
    "is_named_attention",
    "Rule",
]

RuleSpec = Union[PolicyLike, Callable[[Policy], Policy]]


class _NamedNorms:
  """The rule target :data:`NAMED_NORMS`: classes named like a norm that no class rule covers."""

  def __repr__(self) -> str:
    return "jaxamp.rules.NAMED_NORMS"


NAMED_NORMS = _NamedNorms()

Target = Union[type, str, "re.Pattern[str]", _NamedNorms]

# "Norm" not followed by a lowercase letter, or "Normalization": BatchNorm, LayerNorm2d,
# RMSNormGated, BatchNormAct, LayerNormalization; not Normal, Normalize, Normalizer.
NORM_NAME_PATTERN: re.Pattern[str] = re.compile(r"Norm(?![a-z])|Normalization")


def is_named_norm(cls: type) -> bool:
  """Whether ``cls``'s name marks it as a normalization layer (:data:`NORM_NAME_PATTERN`).

  Example:
    >>> from jaxamp.rules import is_named_norm
    >>> class BatchNorm: pass
    >>> class Normalize: pass
    >>> is_named_norm(BatchNorm), is_named_norm(Normalize)
    (True, False)
  """
  return NORM_NAME_PATTERN.search(getattr(cls, "__name__", "")) is not None


# Attention layers, whose decoding cache (Linen's ``cache`` collection, an ``nnx.Cache``)
# takes the keys and values they compute: Flax's MultiHeadAttention,
# MultiHeadDotProductAttention, SelfAttention; Hugging Face's FlaxGPT2Attention, ...
ATTENTION_NAME_PATTERN: re.Pattern[str] = re.compile(r"Attention(?![a-z])")


def is_named_attention(cls: type) -> bool:
  """Whether ``cls`` or a base class is named like an attention layer
  (:data:`ATTENTION_NAME_PATTERN`): its decoding cache is read in the compute dtype.

  Example:
    >>> from jaxamp.rules import is_named_attention
    >>> class FlaxGPT2Attention: pass
    >>> class StreamingMean: pass
    >>> is_named_attention(FlaxGPT2Attention), is_named_attention(StreamingMean)
    (True, False)
  """
  return any(ATTENTION_NAME_PATTERN.search(c.__name__) for c in getattr(cls, "__mro__", ()))


def pure_policy_fn(fn: Callable[[Policy], Policy]) -> Callable[[Policy], Policy]:
  """Marks one of jaxamp's own policy functions as pure: rules giving it may share a
  resolved tree across calls (a user's policy function runs on every resolution)."""
  _PURE_POLICY_FNS.add(fn)
  return fn


_PURE_POLICY_FNS: set[Callable[[Policy], Policy]] = set()


@pure_policy_fn
def float32_compute(enclosing: Policy) -> Policy:
  """Rule for precision-sensitive layers: compute in float32, return the enclosing compute dtype.

  At least float32: an enclosing compute dtype wider than float32 (a ``'float64'``
  policy) is kept, never narrowed. Parameters keep the enclosing param dtype. This is
  the default for normalization layers.

  Example:
    >>> import jaxamp
    >>> jaxamp.float32_compute(jaxamp.get_policy('mixed_float16')).name
    'params=float32,compute=float32,output=float16'
  """
  return Policy(enclosing.param_dtype, at_least_float32(enclosing.compute_dtype),
                enclosing.compute_dtype)


class Rule(NamedTuple):
  """One registered rule: what it targets and the policy (or policy function) it gives."""

  target: Target
  spec: RuleSpec

  def policy(self, enclosing: Policy) -> Policy:
    """The policy this rule gives inside ``enclosing``."""
    if _is_policy_fn(self.spec):
      return get_policy(self.spec(enclosing))
    return get_policy(self.spec)


def _is_policy_fn(spec: Any) -> bool:
  # Dtype classes such as jnp.bfloat16 are callable too; they name a policy.
  return callable(spec) and not isinstance(spec, (Policy, type, str))


def _norm_classes() -> tuple[type, ...]:
  from flax import linen, nnx  # pylint: disable=g-import-not-at-top

  return (nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm,
          linen.BatchNorm, linen.LayerNorm, linen.RMSNorm, linen.GroupNorm)


NORM_CLASSES: tuple[type, ...] = _norm_classes()

_lock = threading.Lock()


def _defaults() -> dict[Any, Rule]:
  rules = {cls: Rule(cls, float32_compute) for cls in NORM_CLASSES}
  rules[NAMED_NORMS] = Rule(NAMED_NORMS, float32_compute)
  return rules


# Insertion order matters for path rules (latest wins); dicts keep it. The process-wide
# rules; a policy_rules block gives its thread a copy of its own (see _scopes).
_rules: dict[Any, Rule] = _defaults()


class _Scopes(threading.local):
  """This thread's stack of policy_rules blocks, each the full rule set in force there."""

  def __init__(self):
    super().__init__()
    self.stack: list[dict[Any, Rule]] = []


_scopes = _Scopes()


@contextlib.contextmanager
def _editing() -> Iterator[dict[Any, Rule]]:
  """The rule set this thread's set_policy/clear_policies edit, held under the lock.

  The innermost policy_rules block's own copy, or the process-wide rules outside one.
  """
  with _lock:
    yield _scopes.stack[-1] if _scopes.stack else _rules


def _current() -> list[Rule]:
  """The rules in force for this thread, in insertion order."""
  with _editing() as rules:
    return list(rules.values())


def asks_for_fp8(model_policy: Policy) -> bool:
  """Whether ``model_policy`` or a rule in force (a policy function evaluated inside
  ``model_policy``) gives some module an FP8 policy."""
  return model_policy.fp8 is not None or any(
      rule.policy(model_policy).fp8 is not None for rule in _current())


_GLOB_TOKENS = re.compile(r"\*\*/|/\*\*$|^\*\*$|\*|\?|/|[^*?/]+")
_GLOB_REGEX = {"**/": "(?:[^/]+/)*", "/**": "(?:/[^/]+)*", "**": ".*", "*": "[^/]*", "?": "[^/]"}


@functools.lru_cache(maxsize=None)
def _glob_to_regex(pattern: str) -> re.Pattern[str]:
  """Translates a path glob: ``*`` and ``?`` stay within a segment, ``**`` spans segments."""
  return re.compile("".join(_GLOB_REGEX.get(tok) or re.escape(tok)
                            for tok in _GLOB_TOKENS.findall(pattern)))


def _check_target(target: Any) -> Any:
  if isinstance(target, (type, _NamedNorms)):
    return target
  if isinstance(target, str):
    if not target.strip("/"):
      raise ValueError("A path pattern must not be empty; use the model-level policy instead.")
    return target.strip("/")
  if isinstance(target, re.Pattern):
    return target
  raise ValueError(f"A policy rule targets a module class, a glob path pattern (str), a "
                   f"compiled regex (re.Pattern) or jaxamp.rules.NAMED_NORMS; got {target!r} of type {type(target).__name__}.")


def _check_spec(spec: Any) -> None:
  if _is_policy_fn(spec):
    return  # a function of the enclosing policy; checked when it is used
  get_policy(spec)  # raises ValueError listing the valid names


def set_policy(target: Target, spec: RuleSpec | None) -> None:
  """Sets (or, with ``spec=None``, removes) the policy rule for ``target``.

  Args:
    target: a module class (covers subclasses; the most specific class wins), a glob
      over ``'/'``-joined module paths (``'blocks/*/attn'``, ``'**/head'``), a compiled
      regex matched with ``fullmatch``, or :data:`NAMED_NORMS` (classes named like a
      norm that no class rule covers).
    spec: anything :func:`jaxamp.get_policy` accepts, a callable
      ``enclosing_policy -> Policy`` (see :func:`float32_compute`), or None to remove.

  Example:
    >>> import jaxamp
    >>> from flax import nnx
    >>> jaxamp.set_policy('head', 'float32')
    >>> jaxamp.resolve_policy(nnx.Linear, 'head', jaxamp.get_policy('mixed_bfloat16')).name
    'float32'
    >>> jaxamp.clear_policies()
  """
  target = _check_target(target)
  if spec is not None:
    _check_spec(spec)
  with _editing() as rules:
    rules.pop(target, None)  # re-setting a path rule makes it the most recent
    if spec is not None:
      rules[target] = Rule(target, spec)


def clear_policies() -> None:
  """Removes every rule set by users and restores the defaults (float32 norms).

  Inside a :func:`policy_rules` block it clears that block's rules (for this thread,
  until the block ends); outside one, the process-wide rules.

  Example:
    >>> import jaxamp
    >>> from flax import nnx
    >>> jaxamp.set_policy(nnx.Linear, 'bfloat16')
    >>> jaxamp.clear_policies()
    >>> jaxamp.resolve_policy(nnx.Linear, 'l', 'float32').name
    'float32'
  """
  with _editing() as rules:
    rules.clear()
    rules.update(_defaults())


@contextlib.contextmanager
def policy_rules(rules: Mapping[Target, RuleSpec | None] | None = None) -> Iterator[None]:
  """Adds ``rules`` for this thread for the duration of a ``with`` block.

  Thread-local, like :func:`jaxamp.policy_scope`: the block sees the rules in force when
  it began plus ``rules``; other threads never see them, and they are gone on exit
  (exceptions included). :func:`set_policy` or :func:`clear_policies` called inside the
  block change the block's rules only, so they are undone on exit too; process-wide
  rules set by another thread while the block runs are not seen inside it.

  Example:
    >>> import jaxamp
    >>> from flax import nnx
    >>> with jaxamp.policy_rules({nnx.LayerNorm: None}):  # norms follow the model
    ...   jaxamp.resolve_policy(nnx.LayerNorm, 'ln', jaxamp.get_policy('bfloat16')).name
    'bfloat16'
  """
  scoped = {_check_target(target): spec for target, spec in (rules or {}).items()}
  for spec in scoped.values():
    if spec is not None:
      _check_spec(spec)
  with _editing() as current:
    block = dict(current)
  for target, spec in scoped.items():
    block.pop(target, None)
    if spec is not None:
      block[target] = Rule(target, spec)
  _scopes.stack.append(block)
  try:
    yield
  finally:
    _scopes.stack.pop()


def snapshot() -> dict[Any, Rule]:
  """The rules in force for this thread now (a copy), for :func:`installed`.

  Example:
    >>> import jaxamp
    >>> from jaxamp.rules import installed, snapshot
    >>> with jaxamp.policy_rules({'head': 'float32'}):
    ...   rules = snapshot()
    >>> with installed(rules):
    ...   jaxamp.resolve_policy(object, 'head', jaxamp.get_policy('bfloat16')).name
    'float32'
  """
  with _editing() as rules:
    return dict(rules)


@contextlib.contextmanager
def installed(rules: Mapping[Any, Rule]) -> Iterator[None]:
  """Makes exactly ``rules`` (a :func:`snapshot`) the rules of this thread for a ``with``
  block, whatever is in force around it; the train step traces under the rules its
  ``init`` saw."""
  _scopes.stack.append(dict(rules))
  try:
    yield
  finally:
    _scopes.stack.pop()


@contextlib.contextmanager
def norm_defaults(spec: RuleSpec | None) -> Iterator[None]:
  """Replaces the default norm rule with ``spec`` for a ``with`` block; user rules stay.

  Every class of :data:`NORM_CLASSES` whose rule is still the default
  (:func:`float32_compute`), and :data:`NAMED_NORMS` if its rule is, gets ``spec``
  instead (None: no rule, the norm follows the enclosing policy); a rule a user set for
  a norm class is kept. Opt levels use it.

  Example:
    >>> import jaxamp
    >>> from flax import nnx
    >>> from jaxamp.rules import norm_defaults
    >>> half = jaxamp.get_policy('float16')
    >>> with jaxamp.policy_rules({nnx.BatchNorm: 'float16'}), norm_defaults(None):
    ...   [jaxamp.resolve_policy(c, 'n', half).name for c in (nnx.LayerNorm, nnx.BatchNorm)]
    ['float16', 'float16']
    >>> jaxamp.resolve_policy(nnx.LayerNorm, 'n', half).name
    'params=float16,compute=float32,output=float16'
  """
  with _editing() as rules:
    defaults = [target for target in (*NORM_CLASSES, NAMED_NORMS)
                if target in rules and rules[target].spec is float32_compute]
  with policy_rules({cls: spec for cls in defaults}):
    yield


def _matches(target: Any, path: str) -> bool:
  if isinstance(target, re.Pattern):
    return target.fullmatch(path) is not None
  return _glob_to_regex(target).fullmatch(path) is not None


def _find_rule(cls: type, path: str, can_be_norm: bool = True) -> Rule | None:
  rules = _current()
  path = path.strip("/")
  path_rules = [r for r in rules if isinstance(r.target, (str, re.Pattern))]
  for rule in reversed(path_rules):  # latest wins
    if path and _matches(rule.target, path):
      return rule
  mro = cls.__mro__
  best, best_rank = None, len(mro)
  for rule in rules:
    if (isinstance(rule.target, type) and rule.target in mro
        and (can_be_norm or rule.target not in NORM_CLASSES)):
      rank = mro.index(rule.target)
      if rank < best_rank:
        best, best_rank = rule, rank
  if best is None and can_be_norm and is_named_norm(cls) and not issubclass(
      cls, NORM_CLASSES):
    # Flax's norms have class rules of their own; one removed means "follow the model".
    return next((r for r in rules if r.target is NAMED_NORMS), None)
  return best


def warn_unmatched_path_rules(model: str, paths: Iterable[str], stacklevel: int = 3) -> None:
  """Warns, once per model and rules, of path rules in force that match none of ``paths``
  (a model's module paths): a typo (``'haed'``), a parameter's path (``'head/kernel'``)
  or a Linen collection name (``'params/head'``) would otherwise change nothing, silently.
  A rule meant for another model warns too: make it in a ``policy_rules`` block around
  this model's use, or ignore the warning."""
  names = [p.strip("/") for p in paths if p.strip("/")]
  unmatched = [rule.target for rule in _current()
               if isinstance(rule.target, (str, re.Pattern))
               and not any(_matches(rule.target, name) for name in names)]
  if not unmatched:
    return
  shown = [t.pattern if isinstance(t, re.Pattern) else t for t in unmatched]
  some = ", ".join(repr(n) for n in names[:8]) + (", ..." if len(names) > 8 else "")
  _warn_once.warn_once(
      ("rules.unmatched", model, tuple(shown)),
      f"jaxamp: the path rule(s) {', '.join(map(repr, shown))} match no module of {model}, "
      f"so they change nothing here. Paths are '/'-joined module paths from the model "
      f"(globs allowed), e.g. {some}; a parameter's own name or a Linen collection is not "
      "part of one.", RuntimeWarning, stacklevel=stacklevel)


def not_norms(paths: Iterable[tuple[Any, ...]],
              matmuls: Iterable[tuple[Any, ...]] | None = None) -> frozenset[tuple[Any, ...]]:
  """The modules of ``paths`` that are no norm, whatever their class or name: those with
  another listed module below them (an encoder, a layer, a conv block), and those that
  run a matmul or convolution of their own. No norm rule applies to them.

  Args:
    paths: module paths as key tuples.
    matmuls: the paths of the modules that run a matmul or convolution of their own (the
      census of a traced call, :mod:`jaxamp.census`), where it is known.

  Example:
    >>> from jaxamp.rules import not_norms
    >>> paths = [(), ('enc',), ('enc', 'ln'), ('enc', 'dense'), ('weight_norm_conv',)]
    >>> sorted(not_norms(paths, matmuls=[('enc', 'dense'), ('weight_norm_conv',)]))
    [(), ('enc',), ('enc', 'dense'), ('weight_norm_conv',)]
  """
  paths = set(paths)
  containers = {path[:n] for path in paths for n in range(len(path)) if path[:n] in paths}
  return frozenset(containers.union(matmuls or ()))


def resolve_tree(modules: Iterable[tuple[tuple[Any, ...], type]], model_policy: PolicyLike,
                 matmuls: Iterable[tuple[Any, ...]] | None = None
                 ) -> dict[tuple[Any, ...], Policy]:
  """Every module's policy, parents first, each inheriting from its nearest listed ancestor.

  Args:
    modules: ``(path, class)`` pairs, paths as key tuples; the root's path is ``()``.
      Ancestors that are not listed (e.g. plain containers) are skipped over.
    model_policy: the policy of the root (the model-level policy).
    matmuls: the paths of the modules that run a matmul or convolution of their own,
      where a census knows them: such a module is no norm (:func:`not_norms`).

  Returns:
    ``{path: policy}`` for every listed module.
  """
  model_policy = get_policy(model_policy)
  modules = tuple(modules)
  matmuls = None if matmuls is None else frozenset(matmuls)
  key = _tree_key(modules, model_policy, matmuls)
  found = None if key is None else _trees.get(key)
  if found is not None:
    return dict(found)
  excluded = not_norms((path for path, _ in modules), matmuls)
  resolved: dict[tuple[Any, ...], Policy] = {}
  for path, cls in sorted(modules, key=lambda entry: len(entry[0])):
    enclosing = next((resolved[path[:n]] for n in range(len(path) - 1, -1, -1)
                      if path[:n] in resolved), model_policy)
    resolved[path] = resolve_policy(cls, path, enclosing, can_be_norm=path not in excluded)
  if key is not None:
    if len(_trees) >= _TREES_SIZE:
      _trees.clear()
    _trees[key] = dict(resolved)
  return resolved


# resolve_tree's answers, by modules, model policy and the rules in force: a wrapped NNX
# model resolves its tree on every call (eagerly, every call is a Python call).
_trees: dict[Any, dict[tuple[Any, ...], Policy]] = {}
_TREES_SIZE = 256


def _tree_key(modules: tuple[Any, ...], model_policy: Policy, matmuls: Any = None) -> Any:
  """The cache key of a resolve_tree call, or None where its answer may not be reused:
  a rule given as a user's policy function (their code runs every time) or a key that
  cannot be hashed."""
  rules = tuple(_current())
  key = (modules, model_policy, rules, matmuls)
  try:
    if any(_is_policy_fn(rule.spec) and rule.spec not in _PURE_POLICY_FNS for rule in rules):
      return None
    hash(key)
  except TypeError:  # a spec (a callable dataclass, say) or a path key that cannot be hashed
    return None
  return key


def path_name(path: tuple[Any, ...]) -> str:
  """``'/'``-joins a pytree key path (dict keys, attribute names, sequence indices)."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        k = getattr(k, attr)
        break
    parts.append(str(k))
  return "/".join(parts)


def resolve_policy(cls: type, path: str | tuple[Any, ...], enclosing: PolicyLike, *,
                   can_be_norm: bool = True) -> Policy:
  """The policy for a module of class ``cls`` at ``path`` inside a module running ``enclosing``.

  Args:
    cls: the module's class.
    path: its path, ``'/'``-joined or as a tuple of keys (``('blocks', 0, 'attn')``).
    enclosing: the policy of the module that contains it (the model-level policy for the
      top module).
    can_be_norm: False for a module known to be no norm, whatever its class or name
      (it holds submodules or runs a matmul: :func:`not_norms`): the norm rules, those
      of :data:`NORM_CLASSES` and :data:`NAMED_NORMS`, pass it over.

  Returns:
    The rule's policy (path rules first, then the most specific class rule), else
    ``enclosing``.

  Example:
    >>> import jaxamp
    >>> class StableLayerNormEncoder: pass
    >>> half = jaxamp.get_policy('mixed_bfloat16')
    >>> jaxamp.resolve_policy(StableLayerNormEncoder, 'encoder', half).compute_dtype.name
    'float32'
    >>> jaxamp.resolve_policy(StableLayerNormEncoder, 'encoder', half,
    ...                       can_be_norm=False).compute_dtype.name
    'bfloat16'
  """
  if not isinstance(path, str):
    path = path_name(path)
  enclosing = get_policy(enclosing)
  rule = _find_rule(cls, path, can_be_norm)
  return enclosing if rule is None else rule.policy(enclosing)


def _owner(path: str, module_paths: Sequence[str]) -> str:
  """The longest module path that contains ``path``."""
  best = ""
  for m in module_paths:
    if (m == "" or path == m or path.startswith(m + "/")) and len(m) > len(best):
      best = m
  return best


def leaf_name(path: Any) -> str:
  """The ``'/'``-joined path of a parameter leaf (an ``nnx.Variable``'s ``value`` key
  dropped), as module paths name it: ``'layers/0/kernel'``."""
  name = path_name(path)
  if name == VARIABLE_VALUE_KEY or name.endswith("/" + VARIABLE_VALUE_KEY):
    name = name[:-len(VARIABLE_VALUE_KEY)].rstrip("/")  # nnx.Variable's own pytree child
  return name


def cast_module_params(params: Any, plan: Sequence[tuple[str, type, Policy]],
                       dtype_of: Callable[[Policy], Any]) -> Any:
  """``params`` with each floating leaf in ``dtype_of(policy)`` of the module owning it.

  Args:
    params: a params pytree (an ``nnx.State`` or Linen ``'params'`` collection).
    plan: ``(path, class, policy)`` per module, as ``jaxamp.nnx.module_policies`` and
      ``jaxamp.linen.module_policies`` return it (a path's first entry counts).
    dtype_of: picks the dtype from the owner's policy, e.g. ``lambda p: p.param_dtype``.

  Returns:
    The same structure; integer, boolean and key leaves untouched.

  Example:
    >>> import jax.numpy as jnp, jaxamp
    >>> from jaxamp.rules import cast_module_params
    >>> params = {'Dense_0': {'kernel': jnp.ones(2)}, 'LayerNorm_0': {'scale': jnp.ones(2)}}
    >>> plan = [('Dense_0', object, jaxamp.get_policy('bfloat16')),
    ...         ('LayerNorm_0', object, jaxamp.get_policy('float32'))]
    >>> cast = cast_module_params(params, plan, lambda p: p.param_dtype)
    >>> cast['Dense_0']['kernel'].dtype, cast['LayerNorm_0']['scale'].dtype
    (dtype(bfloat16), dtype('float32'))
  """
  policies: dict[str, Policy] = {}
  for path, _, policy in plan:
    policies.setdefault(path, policy)
  module_paths = list(policies)

  def cast(path: Any, leaf: Any) -> Any:
    owner = _owner(leaf_name(path), module_paths)
    if owner not in policies or not is_floating_array(leaf):
      return leaf
    dtype = np.dtype(dtype_of(policies[owner]))
    return leaf if leaf.dtype == dtype else leaf.astype(dtype)

  return jax.tree_util.tree_map_with_path(cast, params)
