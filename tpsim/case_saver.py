"""Saving each failure's minimal case for ``tpsim check`` and ``tpsim zoo`` (:class:`CaseSaver`)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

__all__ = ["CaseSaver"]


class CaseSaver:
    """Saves each failure's minimal case; never raises, so a found failure is never lost to a disk.

    Tries ``--cases-dir`` first; when that cannot be written (no permission, read-only, a path
    too long, disk full) the case goes to a private temporary directory, made once per command,
    and :meth:`save` returns the note that says so. When even that fails the note says why and
    the failure is still reported, its minimal case described in full.
    """

    def __init__(self, cases_dir: str, backend: str, argv: Sequence[str]) -> None:
        self.cases_dir = cases_dir
        self.backend = backend
        self.command = "tpsim " + " ".join(shlex.quote(a) for a in argv)
        self._fallback: str | None = None

    def _save_to(self, failure: Any, variant: Any, directory: str) -> None:
        from tpsim.props.case import save_failure
        from tpsim.session import saved

        saved(save_failure(failure, variant, directory, backend=self.backend, command=self.command))

    def save(self, failure: Any, variant: Any) -> str | None:
        """Save ``failure``'s case (sets ``failure.case_file``); return a note when it is not
        where ``--cases-dir`` says, else None."""
        try:
            self._save_to(failure, variant, self.cases_dir)
            return None
        except Exception as err:  # noqa: BLE001 - any reason to fail to save must not lose the report
            reason = _os_reason(err)
        try:
            if self._fallback is None:
                import tempfile

                self._fallback = tempfile.mkdtemp(prefix="tpsim-cases-")
            self._save_to(failure, variant, self._fallback)
        except Exception as err2:  # noqa: BLE001
            failure.case_file = None
            return (f"the case file could not be saved in --cases-dir {self.cases_dir!r} ({reason}) nor in a "
                    f"temporary directory ({_os_reason(err2)}); the minimal case above is the whole example")
        return f"--cases-dir {self.cases_dir!r} cannot be written ({reason}); saved in {self._fallback} instead"


def _os_reason(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return f"{type(err).__name__}: {err}"
