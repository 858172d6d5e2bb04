"""Tolerances for a whole module: first-order rounding-error propagation, derived by a second run.

Every compared tensor ``t`` gets the bound of :mod:`tpsim.props.tolerance`,
``FACTOR * eps(dtype) * sqrt(K + ws) * M_t`` per element. For one linear layer ``M = |x||W|ᵀ + |b|``
is written down by hand; for a module of arbitrary code the harness *computes* ``M`` by running the
dense module a second time, the **magnitude run**: with every parameter ``p`` replaced by ``|p|``,
the input by ``|x|`` and the upstream grad by ``|g|``. Through every linear map (``linear``,
``matmul``, sums, concatenations, views) the absolute-value computation is exactly the ``|W||x|``
product of the derivation, forward and backward, so the grads of the magnitude run are the
magnitudes of the grads (``|g||W|`` for an input grad, ``|g|ᵀ|x|`` for a weight grad). Each ``M`` is
a first-order bound of the error in units of the rounding: the rounding of every result, plus the
errors of its operands propagated through it.

Operations whose absolute-value version is not such a bound are replaced, under a
``TorchFunctionMode``, by one that is. Where the bound needs the *values* — a product, an
activation — the float64 reference run of the same step records them first (:class:`ValueTape`,
in call order), and the magnitude run reads them back (:class:`MagnitudeMode`):

- ``a - b`` becomes ``a + b`` and ``-a`` becomes ``a`` (rounding errors add; cancellation in the
  values does not cancel them); a number ``c`` enters as ``|c|``;
- a product ``a b``: forward ``|a| M_b + M_a |b| + |a b|``; backward ``G |b| + |g| M_b`` for ``a``
  (``G``: the grad's magnitude, ``g``: the reference's grad) — the error of ``b`` moves ``a``'s grad;
- an elementwise activation ``f``: forward ``L M_h + |f(h)|`` (``L = sup|f'|`` bounds the propagated
  error and ``f``'s own evaluation error, which for GELU's ``1 + erf`` scales with ``|h|``), backward
  ``L G + |g| D M_h`` (``D = sup|f''|``: an error in ``h`` moves the derivative) — :data:`ACTIVATIONS`;
- without recorded values (an in-place op, a module that took another path) the rules fall back
  to magnitudes alone: ``M_a M_b`` for a product, the envelope ``|f(0)| + 2 L M`` / ``G (L + D M)``
  for an activation — sound, looser;
- activations with a kink (ReLU and relatives) get ``D = 0`` and are *recorded*: a rounding error
  in ``h`` next to the kink flips ``f'(h)``, an O(1) change no first-order bound covers, so gradients
  through a kink are only compared in float64 cases (where that is astronomically unlikely); see
  :attr:`Magnitudes.kinked`;
- a norm (``layer_norm``, ``rms_norm``: tpsim's LayerNorm/RMSNorm and torch's) needs the values
  too — the reference records each row's ``σ`` (``sqrt(var + eps)``, or the root mean square) and
  ``|x̂|`` (the normalised row) — and is bounded as the derivative of ``x̂ = (x - μ)/σ`` says
  (:func:`_normalised`): forward ``M_x̂ = (M_x + mean M_x + |x̂| mean(|x̂| M_x))/σ + 4|x̂|`` (without the
  ``mean M_x`` term for RMSNorm, which subtracts no mean), then the product with the weight and the
  sum with the bias as above; backward the transposed map, plus the error of ``x`` moving the
  Jacobian; an ``rms_norm`` whose ``eps`` is its dtype's (the default) adds another ``eps`` in the case's
  dtype than in the float64 reference, and that difference is added too; without recorded values it
  raises :class:`UnboundedOp` (``σ`` cannot be bounded from magnitudes);
- the roots a hand-written norm takes (``rsqrt``, ``sqrt``: :data:`ROOTS`), ``v**p`` with
  ``p = ∓1/2``, likewise with the reference's values: forward ``|p| |v|^(p-1) M_v + |v^p|``, backward
  ``G |p| |v|^(p-1) + |g| |p(p-1)| |v|^(p-2) M_v`` (the error of ``v`` moves the derivative);
- anything else that computes floating values (``exp``, ``softmax``, a division by a tensor), and
  any arithmetic on complex values, raises :class:`UnboundedOp` naming it: tpsim refuses to guess a
  tolerance. A rule for it is one
  :func:`register_rule` call (attention's ``scaled_dot_product_attention`` has one, in
  :mod:`tpsim.props.attention.magnitude`).

``K`` is the sum of the reduction lengths the forward performs (the contracted dim of every matmul,
the reduced size of every sum), plus the rows of the batch (parameter grads reduce over them). The
run also counts rounding *stages* (a sum adds one to its deepest operand, a product its operands'
stages and one): reported, as the depth of the computation the bound went through.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tpsim.errors import InvalidArgument

__all__ = [
    "ACTIVATIONS",
    "NORMS",
    "ROOTS",
    "MagnitudeMode",
    "Magnitudes",
    "TapeEntry",
    "UnboundedOp",
    "ValueTape",
    "register_rule",
]


class UnboundedOp(InvalidArgument):
    """The magnitude run met an operation it cannot bound (``op`` names it)."""

    def __init__(self, op: str) -> None:
        super().__init__(
            f"tpsim cannot derive a rounding-error bound through {op}: the module check bounds linear maps, sums, "
            f"products, views, the norms {', '.join(NORMS)}, the roots {', '.join(ROOTS)}, the elementwise activations "
            f"{', '.join(sorted(ACTIVATIONS))} and "
            f"{', '.join(sorted(_RULES)) or 'no other operation'}; add a rule with "
            "tpsim.props.module.magnitude.register_rule, or check the module's parts separately"
        )
        self.op = op


@dataclass(frozen=True)
class Activation:
    """Envelope constants of an elementwise activation: ``lipschitz = sup|f'|``, ``curvature =
    sup|f''|``, ``at_zero = |f(0)|``; ``kink``: ``f'`` jumps somewhere (ReLU)."""

    lipschitz: float
    curvature: float
    at_zero: float = 0.0
    kink: bool = False


#: Activations by function name (``F.gelu``, ``torch.sigmoid``, ``Tensor.silu`` ... all match).
#: Constants measured on a fine float64 grid and rounded up (tests/test_modules_magnitude.py checks them).
ACTIVATIONS: dict[str, Activation] = {
    "gelu": Activation(1.13, 0.8),
    "silu": Activation(1.1, 0.5),
    "sigmoid": Activation(0.25, 0.097, 0.5),
    "tanh": Activation(1.0, 0.77),
    "softplus": Activation(1.0, 0.25, 0.7),
    "mish": Activation(1.09, 0.65),
    "elu": Activation(1.0, 1.0),
    "celu": Activation(1.0, 1.0),
    "selu": Activation(1.76, 1.76),
    "logsigmoid": Activation(1.0, 0.25, 0.7),
    "hardswish": Activation(1.5, 0.34, 0.0, kink=True),
    "relu": Activation(1.0, 0.0, 0.0, kink=True),
    "relu6": Activation(1.0, 0.0, 0.0, kink=True),
    "leaky_relu": Activation(1.0, 0.0, 0.0, kink=True),
    "hardtanh": Activation(1.0, 0.0, 0.0, kink=True),
    "hardsigmoid": Activation(1.0 / 6.0, 0.0, 0.5, kink=True),
}

# Value-agnostic on magnitudes: views, copies, selections, concatenations, factories, metadata.
_STRUCTURAL = frozenset("""
    view view_as reshape reshape_as flatten unflatten squeeze unsqueeze transpose t permute movedim moveaxis
    swapaxes swapdims contiguous clone detach detach_ expand expand_as repeat repeat_interleave narrow select
    index_select gather take_along_dim getitem setitem chunk split split_with_sizes tensor_split unbind cat concat
    concatenate stack hstack vstack dstack flip fliplr flipud roll to type type_as float double half bfloat16 cpu
    masked_select where zeros_like ones_like empty_like full_like new_zeros new_ones new_empty new_full new_tensor
    zeros ones empty full arange linspace tensor as_tensor copy fill zero requires_grad retain_grad register_hook
    backward size dim numel stride is_contiguous data_ptr element_size get set item tolist max min amax amin
    maximum minimum fmax fmin identity unfold diagonal diag tril triu masked_fill broadcast_to atleast_1d
    atleast_2d atleast_3d squeeze_copy view_copy expand_copy permute_copy unsqueeze_copy apply
""".split())
# Monotone on non-negative inputs, no value change beyond a sum: one more rounding stage.
_SUMS = frozenset("add sum mean nansum nanmean cumsum".split())
# Bilinear maps: the contracted length is a reduction; the stages of both operands add.
_CONTRACTIONS = frozenset("linear matmul mm bmm mv dot vdot inner outer ger addmm addmv addbmm baddbmm einsum "
                          "tensordot".split())
_DROPOUTS = frozenset("dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout".split())
#: Norms over the last dims, by function name: whether they subtract the mean (LayerNorm) or not (RMSNorm).
NORMS = {"layer_norm": True, "rms_norm": False}
#: Roots, by function name: the exponent ``p`` of ``v**p``.
ROOTS = {"rsqrt": -0.5, "sqrt": 0.5}

#: Extra rules: name -> ``rule(func, args, kwargs, mode) -> result`` (see :func:`register_rule`).
_RULES: dict[str, Callable[..., Any]] = {}
#: Modules whose ``register()`` adds rules of their own (attention's ``scaled_dot_product_attention``
#: lives with the attention family); imported when the first magnitude run starts, so that this
#: module imports none of them.
RULE_MODULES = ["tpsim.props.attention.magnitude"]
_registered: set[str] = set()


def _register_rule_modules() -> None:
    for name in RULE_MODULES:
        if name not in _registered:
            _registered.add(name)
            importlib.import_module(name).register()


def register_rule(name: str, rule: Callable[..., Any]) -> None:
    """Bound the operation called ``name`` (``func.__name__`` without underscores around it) with
    ``rule(func, args, kwargs, mode)``, which must return a result whose values are upper bounds of
    the op's output magnitudes and whose autograd backward bounds its grad magnitudes (call
    ``mode.stages_of`` / ``mode.mark`` to count rounding stages, ``mode.reduce`` for reductions)."""
    if not isinstance(name, str) or not callable(rule):
        raise InvalidArgument(f"register_rule({name!r}, {rule!r}): expected a name and a callable")
    _RULES[name] = rule


class _Envelope(torch.autograd.Function):
    """Forward ``at_zero + 2 L m``; backward ``g (L + D m)`` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, m: torch.Tensor, lipschitz: float, curvature: float, at_zero: float) -> torch.Tensor:
        ctx.save_for_backward(m)
        ctx.constants = (lipschitz, curvature)
        return m * (2.0 * lipschitz) + at_zero

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (m,) = ctx.saved_tensors
        lipschitz, curvature = ctx.constants
        return grad * (lipschitz + curvature * m), None, None, None


def _name(func: Any) -> tuple[str, bool]:
    """``(name, in_place)``: ``Tensor.__rsub__`` -> ``rsub``, ``Tensor.mul_`` -> ``mul`` in place."""
    raw = getattr(func, "__name__", "") or ""
    if raw.startswith("__") and raw.endswith("__"):
        raw = raw[2:-2]
        if raw.startswith("i") and raw[1:] in ("add", "sub", "mul", "truediv", "div"):
            return raw[1:], True
        return raw, False
    in_place = raw.endswith("_") and not raw.startswith("_")
    return raw.rstrip("_").lstrip("_"), in_place


def _public_name(func: Any, name: str) -> str:
    """``torch.exp`` / ``Tensor.exp`` / ``torch.nn.functional.softmax`` for the function ``func``."""
    qualname = getattr(func, "__qualname__", name) or name
    owner = qualname.rpartition(".")[0]
    if owner in ("_VariableFunctionsClass", ""):
        module = getattr(func, "__module__", None) or "torch"
        return f"{'torch' if module.startswith('torch._C') or owner else module}.{name}"
    if owner in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    return qualname


def _is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class Magnitudes:
    """What one magnitude run measured: the reduction length ``K`` of the forward, the rounding
    ``stages`` of its deepest result, and the kinked activations it went through."""

    reduction: int = 0
    stages: int = 0
    kinked: set[str] = field(default_factory=set)


@dataclass
class TapeEntry:
    """What the float64 reference run saw at one product of two tensors, one activation, root or norm:
    the values the magnitude run's rule for it needs (product: ``|s|, |t|, |s t|``; activation, root:
    ``|h|, |f(h)|``; norm: ``|x̂|``, each row's ``σ``, ``|w|``) and, recorded in backward, ``|g|``,
    the absolute upstream grad at its output (None when none flowed)."""

    kind: str
    shapes: tuple[tuple[int, ...], ...]
    values: tuple[torch.Tensor, ...]
    grad: torch.Tensor | None = None


class _GradTap(torch.autograd.Function):
    """Identity (a copy) forward; backward records ``|grad|`` in its :class:`TapeEntry`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, entry: TapeEntry) -> torch.Tensor:
        ctx.entry = entry
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.entry.grad = grad.detach().abs()
        return grad, None


class ValueTape(TorchFunctionMode):
    """Around the float64 reference run of one step: records a :class:`TapeEntry` for every product
    of two tensors and every activation, in call order, for the magnitude run of the same step
    (its value-aware rules, see :class:`MagnitudeMode`). It changes no value."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[TapeEntry] = []
        #: The activations with a kink the run went through (ReLU, clamp): known even when the
        #: magnitude run is not made (see :mod:`tpsim.props.module.twin`).
        self.kinked: set[str] = set()
        #: The narrowest floating dtype an operation cast a wider tensor down to (Llama's RMSNorm
        #: computes in float32 whatever its input), or None: the module then rounds to that dtype
        #: in every case, and a case of a wider dtype is judged at this one.
        self.narrowed: torch.dtype | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name, in_place = _name(func)
        in_place = in_place or bool(kwargs.get("inplace"))
        if (name in ACTIVATIONS and ACTIVATIONS[name].kink) or name in ("clamp", "clip", "clamp_min", "clamp_max"):
            self.kinked.add(name)
        out = func(*args, **kwargs)
        if in_place or not (isinstance(out, torch.Tensor) and out.is_floating_point()):
            return out
        self._note_narrowing(out.dtype, args, kwargs)
        if name in ACTIVATIONS and isinstance(args[0], torch.Tensor):
            entry = TapeEntry("activation", (tuple(args[0].shape),), (args[0].detach().abs(), out.detach().abs()))
        elif name in NORMS and isinstance(args[0], torch.Tensor):
            entry = TapeEntry("norm", (tuple(args[0].shape),), _norm_values(name, args, kwargs))
        elif name in ROOTS and isinstance(args[0], torch.Tensor):
            entry = TapeEntry("root", (tuple(args[0].shape),), (args[0].detach().abs(), out.detach().abs()))
        elif (name in ("mul", "multiply", "rmul") and len(args) >= 2 and isinstance(args[0], torch.Tensor)
              and isinstance(args[1], torch.Tensor)):
            a, b = args[0], args[1]
            # a factor may be a mask (bool or int): its magnitude in the product's dtype
            a, b = (t if t.is_floating_point() else t.to(out.dtype) for t in (a, b))
            entry = TapeEntry("product", (tuple(a.shape), tuple(b.shape)),
                              (a.detach().abs(), b.detach().abs(), out.detach().abs()))
        else:
            return out
        self.entries.append(entry)
        return _GradTap.apply(out, entry) if out.requires_grad else out


    def _note_narrowing(self, out: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        unit = torch.finfo
        widest = min((unit(a.dtype).eps for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor) and a.is_floating_point()), default=None)
        if widest is not None and unit(out).eps > widest and (
                self.narrowed is None or unit(out).eps > unit(self.narrowed).eps):
            self.narrowed = out


class _Source(torch.autograd.Function):
    """Identity on ``out`` forward; backward also hands each listed input its source term: the part
    of its grad's magnitude that comes from the error of the *other* factors (``|g| E``), which the
    magnitudes' own chain rule does not produce."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *pairs: torch.Tensor) -> torch.Tensor:
        ctx.sources = pairs[len(pairs) // 2:]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *ctx.sources, *([None] * len(ctx.sources)))


class MagnitudeMode(TorchFunctionMode):
    """The magnitude run's rules (see the module docstring). Use as a context manager around the
    forward of the dense module on absolute values; ``measured`` holds what it counted."""

    def __init__(self, tape: list[TapeEntry] | None = None) -> None:
        super().__init__()
        _register_rule_modules()
        self.measured = Magnitudes()
        self._deepest = 0
        self._tape = list(tape) if tape is not None else None
        self._position = 0

    def _entry(self, kind: str, shapes: tuple[tuple[int, ...], ...]) -> TapeEntry | None:
        """The reference's entry for the next product/activation; None (and the conservative rules
        from here on) when there is no tape or the module took another path than the reference."""
        if self._tape is None or self._position >= len(self._tape):
            self._tape = None
            return None
        entry = self._tape[self._position]
        if entry.kind != kind or entry.shapes != shapes:
            self._tape = None
            return None
        self._position += 1
        return entry

    # -- stage bookkeeping -------------------------------------------------------------------------
    def stages_of(self, x: Any) -> int:
        """The rounding stages behind tensor ``x`` (unknown provenance: the deepest seen so far)."""
        if isinstance(x, torch.Tensor):
            return int(getattr(x, "_tpsim_stages", self._deepest))
        return 0

    def mark(self, result: Any, stages: int) -> Any:
        """Record ``stages`` on every tensor of ``result``; returns ``result``."""
        for t in _tensors(result):
            try:
                t._tpsim_stages = stages  # type: ignore[attr-defined]
            except (AttributeError, RuntimeError):
                pass
        self._deepest = max(self._deepest, stages)
        self.measured.stages = max(self.measured.stages, stages)
        return result

    def reduce(self, length: int) -> None:
        """Count a reduction of ``length`` terms."""
        self.measured.reduction += max(int(length), 0)

    # -- dispatch ----------------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name, in_place = _name(func)
        if any(isinstance(a, complex) or (isinstance(a, torch.Tensor) and a.is_complex())
               for a in (*args, *kwargs.values(), *_tensors(list(args)))):
            raise UnboundedOp(f"{_public_name(func, name)} on complex values")
        tensors = [t for t in _tensors(list(args) + list(kwargs.values())) if _is_float_tensor(t)]
        deepest = max((self.stages_of(t) for t in tensors), default=0)
        if name in _RULES:
            return _RULES[name](func, args, kwargs, self)
        if name in ACTIVATIONS:
            return self._activation(name, in_place, args, kwargs, deepest)
        if name in NORMS:
            return self._norm(name, args, kwargs, deepest)
        if name in ROOTS:
            return self._root(name, in_place, args, deepest)
        if name in ("sub", "subtract", "rsub"):
            return self.mark(self._difference(func, name, in_place, args, kwargs), deepest + 1)
        if name in ("neg", "negative", "abs", "absolute", "positive", "pos"):
            x = args[0]
            return x if in_place else self.mark(x.clone(), deepest)
        if name in ("mul", "multiply", "rmul"):
            return self._product(func, args, kwargs, deepest, in_place)
        if name in ("div", "divide", "true_divide", "truediv", "rtruediv", "rdiv"):
            return self._quotient(func, name, args, kwargs, deepest)
        if name in ("pow", "rpow"):
            return self._power(func, name, args, kwargs, deepest)
        if name in _SUMS or name == "radd":
            return self.mark(self._sum(func, name, args, kwargs), deepest + 1)
        if name in _CONTRACTIONS:
            return self._contraction(func, name, args, kwargs, tensors)
        if name in _DROPOUTS:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p:
                raise UnboundedOp(f"{name} (training=True, p={p}): random; check the module in eval mode")
            return args[0]
        if name in ("clamp", "clip", "clamp_min", "clamp_max"):
            bounds = [abs(float(v)) for v in (*args[1:], *kwargs.values()) if _number(v)]
            spec = Activation(1.0, 0.0, max(bounds, default=0.0), kink=True)
            return self._envelope(name, spec, 1.0, 0.0, in_place, args, kwargs, deepest)
        if name in ("masked_fill", "where", "fill"):
            # A number filled in (a mask value, -inf) enters as its magnitude.
            args = tuple(abs(a) if _number(a) else a for a in args)
        result = func(*args, **kwargs)
        if name in _STRUCTURAL or not any(_is_float_tensor(t) for t in _tensors(result)):
            return self.mark(result, deepest) if tensors else result
        raise UnboundedOp(_public_name(func, name))

    # -- rules -------------------------------------------------------------------------------------
    def _activation(self, name: str, in_place: bool, args: tuple[Any, ...], kwargs: dict[str, Any],
                    deepest: int) -> torch.Tensor:
        spec = ACTIVATIONS[name]
        lipschitz, curvature = spec.lipschitz, spec.curvature
        if name == "leaky_relu":
            slope = kwargs.get("negative_slope", args[1] if len(args) > 1 and _number(args[1]) else 0.01)
            lipschitz = max(1.0, abs(float(slope)))
        elif name in ("elu", "celu"):
            alpha = abs(float(kwargs.get("alpha", args[1] if len(args) > 1 and _number(args[1]) else 1.0)))
            lipschitz, curvature = max(1.0, alpha), max(alpha, 1.0 / alpha if alpha else 0.0)
        elif name == "softplus":
            beta = abs(float(kwargs.get("beta", args[1] if len(args) > 1 and _number(args[1]) else 1.0)))
            curvature = 0.25 * beta
        return self._envelope(name, spec, lipschitz, curvature, in_place, args, kwargs, deepest)

    def _envelope(self, name: str, spec: Activation, lipschitz: float, curvature: float, in_place: bool,
                  args: tuple[Any, ...], kwargs: dict[str, Any], deepest: int) -> torch.Tensor:
        x = args[0]
        if spec.kink:
            self.measured.kinked.add(name)
        in_place = in_place or bool(kwargs.get("inplace"))
        entry = None if in_place or name not in ACTIVATIONS else self._entry("activation", (tuple(x.shape),))
        if entry is not None:
            # With the reference's values: L M_h + |f(h)| — L = sup|f'| bounds both the propagated
            # error |f'(h)| E_h and the evaluation error of f itself (GELU's 1 + erf cancels for
            # negative h, so its rounding scales with |h|, not with |f(h)|) — and backward
            # L G + |g| D M_h: the derivative's own evaluation error and, through D = sup|f''|, the
            # error of h moving it, times the reference's grad |g| instead of its magnitude.
            value = entry.values[1].to(x.dtype)
            out = x * lipschitz + value
            if entry.grad is not None and curvature:
                out = _Source.apply(out, x, entry.grad.to(x.dtype) * (curvature * x.detach()))
            return self.mark(out, deepest + 1)
        out = _Envelope.apply(x, lipschitz, curvature, spec.at_zero)
        if in_place:
            x.copy_(out)
            out = x
        return self.mark(out, deepest + 1)

    def _norm(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], deepest: int) -> torch.Tensor:
        """A norm over the last dims (see the module docstring and :func:`_normalised`)."""
        x, shape, weight, bias, _ = _norm_args(name, args, kwargs)
        entry = self._entry("norm", (tuple(x.shape),))
        if entry is None:
            raise UnboundedOp(f"{name} on a path the reference run did not take (a norm's bound needs its values)")
        xhat, sigma, w, dtype_eps = (v.to(x.dtype) for v in entry.values)
        n = math.prod(shape)
        self.reduce(2 * n if NORMS[name] else n)  # the mean and the variance, or the mean square
        g = None if entry.grad is None else entry.grad.to(x.dtype)
        m_xhat = _normalised(x, xhat, sigma, len(shape), NORMS[name], None if g is None else g * w,
                             bool(dtype_eps))
        m_w = weight if weight is not None else torch.zeros((), dtype=x.dtype)
        # The product with the weight (|x̂| M_w + M_x̂ |w| + |x̂ w|, backward G |w| + |g| M_w and
        # G |x̂| + |g| M_x̂), then the bias.
        out = xhat * m_w + m_xhat * w + xhat * w
        if g is not None:
            sources = [(m_xhat, g * m_w)] + ([(weight, (g * m_xhat).sum_to_size(weight.shape))] if weight is not None else [])
            out = _Source.apply(out, *(t for t, _ in sources), *(src for _, src in sources))
        if bias is not None:
            out = out + bias
        return self.mark(out, deepest + 4)

    def _root(self, name: str, in_place: bool, args: tuple[Any, ...], deepest: int) -> torch.Tensor:
        """``rsqrt`` / ``sqrt`` with the reference's values (see the module docstring)."""
        x = args[0]
        entry = None if in_place else self._entry("root", (tuple(x.shape),))
        if entry is None:
            raise UnboundedOp(f"{name} without the reference run's values (in place, or on another path)")
        p = ROOTS[name]
        v, value = (t.to(x.dtype) for t in entry.values)
        slope = abs(p) * v.pow(p - 1.0)  # |f'(v)|
        out = x * slope + value
        if entry.grad is not None:
            curvature = abs(p * (p - 1.0)) * v.pow(p - 2.0)  # |f''(v)|
            out = _Source.apply(out, x, entry.grad.to(x.dtype) * curvature * x.detach())
        return self.mark(out, deepest + 1)

    def _difference(self, func: Any, name: str, in_place: bool, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> torch.Tensor:
        a, b = args[0], args[1]
        alpha = abs(kwargs.pop("alpha", 1))
        b = abs(b) if _number(b) else b
        a = abs(a) if _number(a) else a
        if in_place:
            return a.add_(b, alpha=alpha)
        return torch.add(a, b, alpha=alpha) if isinstance(a, torch.Tensor) else torch.add(b, a, alpha=alpha)

    def _sum(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in ("add", "radd"):
            args = tuple(abs(a) if _number(a) else a for a in args)
            if "alpha" in kwargs:
                kwargs["alpha"] = abs(kwargs["alpha"])
            return func(*args, **kwargs)
        x = args[0]
        result = func(*args, **kwargs)
        if isinstance(x, torch.Tensor) and isinstance(result, torch.Tensor):
            if name == "cumsum":
                dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
                self.reduce(x.shape[dim] if x.dim() else 1)
            else:
                self.reduce(x.numel() // max(result.numel(), 1))
        return result

    def _product(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], deepest: int,
                 in_place: bool = False) -> torch.Tensor:
        a, b = args[0], args[1]
        if _number(a) or _number(b):
            args = tuple(abs(v) if _number(v) else v for v in args)
            return self.mark(func(*args, **kwargs), deepest)
        stages = self.stages_of(a) + self.stages_of(b) + 1
        entry = None if in_place else self._entry("product", (tuple(a.shape), tuple(b.shape)))
        if entry is None:
            # Magnitudes alone: M_a M_b bounds |a| E_b + |b| E_a and the product itself.
            return self.mark(func(*args, **kwargs), stages)
        # First-order error of a product with the reference's values: |a| M_b + M_a |b| + |a b|;
        # backward G |b| + |g| M_b for a (and the same for b).
        va, vb, value = (v.to(a.dtype) for v in entry.values)
        out = va * b + a * vb + value
        if entry.grad is not None:
            g = entry.grad.to(a.dtype)
            out = _Source.apply(out, a, b, (g * b.detach()).sum_to_size(a.shape), (g * a.detach()).sum_to_size(b.shape))
        return self.mark(out, stages)

    def _quotient(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  deepest: int) -> torch.Tensor:
        a, b = args[0], args[1]
        if name in ("div", "divide", "true_divide", "truediv") and isinstance(a, torch.Tensor) and _number(b) and b:
            if kwargs.get("rounding_mode") is not None:
                raise UnboundedOp(f"{name}(rounding_mode={kwargs['rounding_mode']!r})")
            return self.mark(func(a, abs(b), **kwargs), deepest + 1)
        raise UnboundedOp(f"{name} by a tensor")

    def _power(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
               deepest: int) -> torch.Tensor:
        a, b = args[0], args[1]
        if name == "pow" and isinstance(a, torch.Tensor) and _number(b) and b >= 1:
            # x**p as a product of p factors: p * stages + 1.
            return self.mark(func(a, b, **kwargs), int(math.ceil(b)) * self.stages_of(a) + 1)
        raise UnboundedOp(f"{name} with exponent {b!r}")

    def _contraction(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                     tensors: list[torch.Tensor]) -> Any:
        args = tuple(abs(v) if _number(v) else v for v in args)
        for key in ("alpha", "beta"):
            if key in kwargs and _number(kwargs[key]):
                kwargs[key] = abs(kwargs[key])
        result = func(*args, **kwargs)
        self.reduce(_contracted(name, args, result))
        operands = [t for t in tensors]
        if name in ("linear", "addmm", "addmv", "addbmm", "baddbmm"):
            # The bias (or the added matrix) is summed once more after the contraction.
            product = self.stages_of(operands[0]) + self.stages_of(operands[1] if len(operands) > 1 else None) + 1
            extra = [self.stages_of(t) for t in operands[2:]] if name == "linear" else [self.stages_of(operands[0])]
            stages = max([product, *extra]) + (1 if len(operands) > 2 else 0)
        else:
            stages = sum(self.stages_of(t) for t in operands) + 1
        return self.mark(result, stages)


def _einsum_sizes(equation: str, operands: list[torch.Tensor]) -> tuple[dict[str, int], str]:
    """Letter -> size of an einsum equation's operands, and its output letters."""
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    sizes: dict[str, int] = {}
    specs = inputs.split(",")
    for spec, t in zip(specs, operands, strict=False):
        head, _, tail = spec.partition("...")
        shape = list(t.shape)
        for letter, n in zip(head, shape, strict=False):
            sizes[letter] = int(n)
        for letter, n in zip(reversed(tail), reversed(shape), strict=False):
            sizes[letter] = int(n)
    if not arrow:  # implicit output: the letters that appear once, in order
        letters = "".join(specs).replace(".", "")
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return sizes, output


def _contracted(name: str, args: tuple[Any, ...], result: Any) -> int:
    """The number of terms each output element of a contraction sums."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or not isinstance(result, torch.Tensor) or name in ("outer", "ger"):
        return 1
    if name == "einsum" and isinstance(args[0], str):
        operands = tensors if len(args) > 2 or not isinstance(args[1], (list, tuple)) else list(args[1])
        sizes, output = _einsum_sizes(args[0], operands)
        total = 1
        for letter, n in sizes.items():
            if letter not in output:
                total *= n
        return total
    if name == "tensordot" and len(tensors) >= 2:
        # numel(a) * numel(b) = numel(out) * K**2 (each contracted dim appears in both operands).
        return max(1, int(round(math.sqrt(tensors[0].numel() * tensors[1].numel() / max(result.numel(), 1)))))
    if name in ("addmm", "addmv", "addbmm", "baddbmm"):
        mat = tensors[1] if len(tensors) > 1 else tensors[0]
        return int(mat.shape[-1]) if mat.dim() else 1
    first = tensors[0]
    return int(first.shape[-1]) if first.dim() else 1



def _norm_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[int, ...], Any, Any, float]:
    """``(input, normalized_shape, weight, bias, eps)`` of a ``layer_norm`` / ``rms_norm`` call."""
    names = ("input", "normalized_shape", "weight", "bias", "eps") if NORMS[name] else (
        "input", "normalized_shape", "weight", "eps")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    x = bound["input"]
    shape = bound["normalized_shape"]
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    eps = bound.get("eps")
    if eps is None:  # the defaults: layer_norm's 1e-5, rms_norm's the input dtype's epsilon
        eps = 1e-5 if NORMS[name] else torch.finfo(x.dtype).eps
    return x, shape, bound.get("weight"), bound.get("bias"), float(eps)


def _eps_of_dtype(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the norm's ``eps`` is its dtype's epsilon (``rms_norm`` without one): the float64
    reference then adds another ``eps`` than the case's dtype does."""
    if NORMS[name]:
        return False
    return (kwargs["eps"] if "eps" in kwargs else args[3] if len(args) > 3 else None) is None


def _norm_values(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """What the reference run records of a norm: ``|x̂|``, each row's ``σ`` (keepdim), ``|w|`` (ones
    without a weight), and 1 when its ``eps`` is the dtype's (:func:`_eps_of_dtype`), else 0."""
    x, shape, weight, _, eps = _norm_args(name, args, kwargs)
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    with torch.no_grad():
        v = x.detach()
        if NORMS[name]:
            centred = v - v.mean(dims, keepdim=True)
            sigma = (centred.pow(2).mean(dims, keepdim=True) + eps).sqrt()
        else:
            centred = v
            sigma = (v.pow(2).mean(dims, keepdim=True) + eps).sqrt()
        w = torch.ones(shape, dtype=v.dtype) if weight is None else weight.detach().abs()
        dtype_eps = torch.tensor(float(_eps_of_dtype(name, args, kwargs)), dtype=v.dtype)
        return (centred / sigma).abs(), sigma, w, dtype_eps


def _normalised(m_x: torch.Tensor, xhat: torch.Tensor, sigma: torch.Tensor, ndims: int, centred: bool,
                g_hat: torch.Tensor | None, dtype_eps: bool = False) -> torch.Tensor:
    """The magnitude of ``x̂ = (x - μ)/σ`` (``centred``; else ``x/σ``) over the last ``ndims`` dims, from the
    input's magnitude ``m_x``, the reference's ``|x̂|`` and ``σ``:

    - the Jacobian is ``(I - 11ᵀ/N - x̂x̂ᵀ/N)/σ`` (without ``11ᵀ/N`` uncentred), so an error ``e`` of ``x``
      moves ``x̂`` by at most ``(e + mean e + |x̂| mean(|x̂| e))/σ``: with ``e = M_x`` (``>= |x|``: the
      roundings of the mean and of ``x - μ`` are inside it too); the roundings of the variance, the
      square root and the division add ``|x̂|`` each, and one more for the tails: ``4|x̂|``;
    - backward, autograd gives the transposed map of ``G`` (the map is symmetric), the bound of the
      true backward's terms; the error of ``x`` also moves the Jacobian applied to the reference's
      grad ``ĝ`` at ``x̂`` (``g_hat``): by ``|dx| mean(|x̂| M_x)/σ`` through ``σ`` and by
      ``(M_x̂ mean(|ĝ||x̂|) + |x̂| mean(|ĝ| M_x̂))/σ`` through ``x̂`` — added as a source term;
    - ``dtype_eps``: the norm adds its dtype's epsilon to ``σ²`` (``rms_norm`` without an ``eps``), so
      the case's dtype computes ``σ`` larger than the float64 reference by ``eps(dtype)/(2σ)``: ``x̂``
      (and the backward's ``1/σ``) differ by ``1/(2σ²)`` in units of ``eps(dtype)``, the unit every
      magnitude is multiplied by."""
    dims = tuple(range(m_x.dim() - ndims, m_x.dim()))

    def mean(t: torch.Tensor) -> torch.Tensor:
        return t.mean(dims, keepdim=True)

    spread = m_x + (mean(m_x) if centred else 0.0) + xhat * mean(xhat * m_x)
    other_eps = 0.5 / sigma.square() if dtype_eps else 0.0
    m_xhat = spread / sigma + (4.0 + other_eps) * xhat
    if g_hat is None:
        return m_xhat
    with torch.no_grad():
        moved = mean(xhat * m_x) / sigma + other_eps  # the relative error of σ
        dx = (g_hat + (mean(g_hat) if centred else 0.0) + xhat * mean(g_hat * xhat)) / sigma
        m = m_xhat.detach()
        source = dx * moved + (m * mean(g_hat * xhat) + xhat * mean(g_hat * m)) / sigma
    return _Source.apply(m_xhat, m_x, source)
