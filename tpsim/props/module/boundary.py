"""Sublayer boundaries: what goes in and out of every sublayer of a module, forward and backward.

A *sublayer* is a submodule that owns parameters directly (``fc1``, ``fc2``, ``attn.qkv``, a norm);
its dotted name is the same in the dense module and on every rank. A sublayer that returns a tuple,
a list or a dict (Megatron's ``(output, bias)``) is recorded by its first floating tensor. :class:`Capture` records, on one
step, each sublayer's input (its first positional tensor), its output, the grad of its output and
the grad of its input, in the order they happen. The hooks change nothing numerically: the input
and the output pass through an identity autograd function (a copy, so a module that modifies its
output in place still works) whose backward records the grad it carries.

The harness captures the dense reference, the magnitude run and every rank the same way, and
:mod:`tpsim.props.module.checks` walks the events in the reference's order to find the first
boundary where the ranks' tensors no longer assemble to the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tpsim.props.module.dtensors import is_dtensor

__all__ = ["Capture", "sublayers"]


def sublayers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(dotted name, submodule)`` of every submodule that owns parameters directly (the root
    module itself excluded), in registration order."""
    return [
        (name, sub)
        for name, sub in module.named_modules()
        if name and any(True for _ in sub.parameters(recurse=False))
    ]


class _Tap(torch.autograd.Function):
    """Identity (a copy) forward; backward records the grad it passes on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, capture: Capture, key: tuple[str, str]) -> torch.Tensor:
        ctx.capture, ctx.key = capture, key
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.capture.record(ctx.key, grad)
        return grad, None, None


def _first_tensor(output: Any, path: tuple[Any, ...] = ()) -> tuple[tuple[Any, ...], torch.Tensor] | None:
    """The sublayer's output tensor and where it sits: the output itself, or the first floating tensor
    of a tuple, list or dict (Megatron's ``(output, bias)``, a Hugging Face ``(hidden, weights)``, a
    ``{"hidden_states": ...}``), searched depth first."""
    if isinstance(output, torch.Tensor):
        return (path, output) if output.is_floating_point() or not path else None
    items: Any = output.items() if isinstance(output, dict) else enumerate(output) if isinstance(
        output, (tuple, list)) else ()
    for key, value in items:
        found = _first_tensor(value, (*path, key))
        if found is not None:
            return found
    return None


def _replace(output: Any, path: tuple[Any, ...], tensor: torch.Tensor) -> Any:
    """``output`` with the tensor at ``path`` replaced (containers rebuilt, their type kept)."""
    if not path:
        return tensor
    key, rest = path[0], path[1:]
    if isinstance(output, dict):
        out = dict(output) if type(output) is dict else output.__class__(output)
        out[key] = _replace(output[key], rest, tensor)
        return out
    items = list(output)
    items[key] = _replace(items[key], rest, tensor)
    if isinstance(output, tuple):
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    return items


@dataclass
class Capture:
    """The tensors at every sublayer boundary of one step, and the order they were seen in.

    ``tensors[(name, kind)]`` with ``kind`` one of ``in``, ``out``, ``gout`` (the grad of the
    output), ``gin`` (the grad of the input); ``events`` lists the keys in time order (the first
    time each was seen: a sublayer called twice keeps its first call)."""

    tensors: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)
    active: bool = True
    _handles: list[Any] = field(default_factory=list)

    def record(self, key: tuple[str, str], t: Any) -> None:
        if not self.active or key in self.tensors or not isinstance(t, torch.Tensor):
            return
        # A DTensor boundary (a plan's sublayer) is recorded as this rank's local piece in its
        # placement, as a hand-written layer's boundary is.
        self.tensors[key] = (t.to_local() if is_dtensor(t) else t).detach().clone()
        self.events.append(key)

    def install(self, module: nn.Module) -> Capture:
        """Hook every sublayer of ``module``; returns ``self``."""
        for name, sub in sublayers(module):
            self._handles.append(sub.register_forward_pre_hook(self._pre(name)))
            self._handles.append(sub.register_forward_hook(self._post(name)))
        return self

    def remove(self) -> None:
        """Remove the hooks (the recorded tensors stay)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.active = False

    def _pre(self, name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> Any:
            if not self.active or not args or not isinstance(args[0], torch.Tensor) or (name, "in") in self.tensors:
                return None
            x = args[0]
            self.record((name, "in"), x)
            if not (x.requires_grad and x.is_floating_point()):
                return None
            return (_Tap.apply(x, self, (name, "gin")), *args[1:])

        return hook

    def _post(self, name: str) -> Any:
        def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
            if not self.active or (name, "out") in self.tensors:
                return None
            found = _first_tensor(output)
            if found is None:
                return None
            path, tensor = found
            self.record((name, "out"), tensor)
            if not (tensor.requires_grad and tensor.is_floating_point()):
                return None
            return _replace(output, path, _Tap.apply(tensor, self, (name, "gout")))

        return hook

    def as_payload(self) -> dict[str, Any]:
        """Picklable form (tensors by ``"name|kind"``), for results sent back from worker processes."""
        return {"tensors": {f"{n}|{k}": t for (n, k), t in self.tensors.items()},
                "events": [f"{n}|{k}" for n, k in self.events]}

    @staticmethod
    def from_payload(data: dict[str, Any]) -> Capture:
        """Inverse of :meth:`as_payload`."""
        def key(text: str) -> tuple[str, str]:
            name, _, kind = text.rpartition("|")
            return name, kind

        capture = Capture(active=False)
        capture.tensors = {key(k): v for k, v in data.get("tensors", {}).items()}
        capture.events = [key(k) for k in data.get("events", [])]
        return capture
