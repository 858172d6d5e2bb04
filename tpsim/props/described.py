"""A target as the judge knows it: resolved in a worker process, described as plain data.

``tpsim check`` and ``tpsim replay`` judge in a process that never imports the checked code (the
session worker, :mod:`tpsim.session`). :func:`describe_target` has the target imported and resolved
by the isolated worker instead (in its main thread, :func:`tpsim.comm.isolate.call`), where what
the target does at import is its own: ``SystemExit``, ``KeyboardInterrupt`` or ``os._exit`` while it
is imported are a usage error naming what it did (:func:`importing`), and a hostile metaclass or
property is the target's error, never tpsim's. What comes back is plain data
(:mod:`tpsim.comm.plain`): each variant with its builders, forwards and classes as
:class:`~tpsim.comm.plain.Foreign` stand-ins, which the families' judging hooks never call. Ranks
resolve the variant again from its target (:func:`tpsim.props.launch.variant_of`).

What the judge needs of the checked code's own functions is computed in the worker: a module
variant's ``size_strategy`` (a user's Hypothesis strategy of size tuples) becomes a
:class:`~tpsim.module_variant.SizeCatalog` of the tuples it draws for every tp size the check can
draw, and its dense parameters' names are read once (what properties apply to it).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tpsim.errors import InvalidArgument

__all__ = ["DESCRIBE_TIMEOUT", "describe_target", "importing"]

#: Seconds the worker may take to import and resolve a target (Megatron-core takes seconds per
#: process, many on a loaded machine).
DESCRIBE_TIMEOUT = 300.0


def _tp_sizes(world_sizes: Sequence[int], tp_sizes: Sequence[int] | None) -> tuple[int, ...]:
    """Every tp size a check over ``world_sizes`` can draw (the divisors of each, or ``tp_sizes``)."""
    if tp_sizes:
        return tuple(sorted({int(t) for t in tp_sizes}))
    return tuple(sorted({t for w in world_sizes for t in range(1, int(w) + 1) if int(w) % t == 0}))


def describe_target(target: str, options: Mapping[str, Any], *, world_sizes: Sequence[int],
                    tp_sizes: Sequence[int] | None = None,
                    timeout: float = DESCRIBE_TIMEOUT) -> tuple[list[Any], str | None]:
    """The variants ``target`` resolves to with ``options`` (:func:`tpsim.target.resolve_target`), as
    plain data, resolved in the isolated worker process, and the file of the target's module (None
    when it has none). Raises :class:`tpsim.target.TargetError` (a usage error) for what the target
    did while it was imported, and what resolving it raised."""
    from tpsim._target_files import TargetError
    from tpsim.comm import isolate
    from tpsim.props.launch import remember

    items = tuple(sorted((k, v) for k, v in options.items() if v is not None))
    try:
        variants, origin = isolate.call(_described, target, items, _tp_sizes(world_sizes, tp_sizes), timeout=timeout)
    except isolate.WorkerEnded as ended:
        if ended.said:
            raise TargetError(f"the target module called {ended.what} while being imported") from None
        raise TargetError(f"the process importing the target ended: {ended.what} while it was imported "
                          "and resolved") from None
    except TimeoutError:
        raise TargetError(f"importing and resolving the target took longer than {timeout:.0f} s") from None
    return remember(list(variants)), origin


def _described(target: str, options: tuple[tuple[str, Any], ...],
               tp_sizes: tuple[int, ...]) -> tuple[list[Any], str | None]:
    """In the worker: import and resolve ``target``, and make each variant's own strategies data."""
    import sys

    from tpsim.target import resolve_target

    with importing():
        variants = resolve_target(target, **dict(options))
        module_part = target.partition(":")[0]
        from tpsim._target_files import is_target_path, module_name_of_path

        name = module_name_of_path(module_part) if is_target_path(module_part) else module_part
        origin = getattr(sys.modules.get(name), "__file__", None)
        return [_for_judge(v, tp_sizes) for v in variants], origin if isinstance(origin, str) else None


def _for_judge(variant: Any, tp_sizes: tuple[int, ...]) -> Any:
    from tpsim.module_variant import ModuleVariant, SizeCatalog
    from tpsim.props.family import family_of

    if isinstance(variant, ModuleVariant) and variant.size_strategy is not None and not isinstance(
            variant.size_strategy, SizeCatalog):
        variant = variant.replace(size_strategy=SizeCatalog.drawn(variant, tuple(sorted({1, *tp_sizes}))))
    return family_of(variant).prepared(variant)


# --- the import guard ---------------------------------------------------------------------------------


def _frames_outside_tpsim(tb: Any) -> bool:
    """Whether the innermost frame of ``tb`` is outside tpsim (the error came from the target's code)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return False
    return not os.path.abspath(last.tb_frame.f_code.co_filename).startswith(root)


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Import and resolve a target: what its code does there is the target's, not tpsim's.

    ``SystemExit`` or ``KeyboardInterrupt`` raised by the target, and an exception raised by the
    target's own code while it is resolved (a hostile metaclass, a property), become
    :class:`tpsim.target.TargetError` (exit 2, the message says what it did). ``os._exit`` is told to
    the caller before it ends the process (:func:`tpsim.comm.isolate.last_words`); afterwards the
    working directory and the SIGINT/SIGCHLD handlers are as before.
    """
    from tpsim._target_files import TargetError
    from tpsim.comm import isolate
    from tpsim.session import raised_at, safe_text

    cwd = os.getcwd()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGCHLD)}
    real_exit = os._exit

    def recording_exit(code: int) -> None:
        isolate.last_words(f"os._exit({code!r})")
        real_exit(code)

    os._exit = recording_exit
    try:
        yield
    except SystemExit as exc:
        raise TargetError(f"the target module raised SystemExit({safe_text(exc.code, 200)}) while being "
                          "imported") from None
    except KeyboardInterrupt:
        raise TargetError("the target module raised KeyboardInterrupt while being imported") from None
    except InvalidArgument:
        raise
    except RecursionError as exc:
        raise TargetError(f"resolving the target hit Python's recursion limit ({safe_text(exc, 300)})") from None
    except Exception as exc:
        if not _frames_outside_tpsim(exc.__traceback__):
            raise
        raise TargetError(f"the target's code raised {type(exc).__name__}{raised_at(exc)} while it was resolved: "
                          f"{safe_text(exc, 2000)}") from None
    finally:
        os._exit = real_exit
        with contextlib.suppress(OSError):
            if os.getcwd() != cwd:
                os.chdir(cwd)
        for sig, handler in handlers.items():
            with contextlib.suppress(ValueError, TypeError, OSError):
                if signal.getsignal(sig) is not handler:
                    signal.signal(sig, handler)
