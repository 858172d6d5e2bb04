"""Capture what checked code prints to stdout, so a machine-readable report stays the only thing there.

``tpsim check --report json`` promises exactly one JSON document on stdout, but the layer under
test may ``print()`` (or write from native code, or from a worker process that inherited the
checker's stdout). :class:`StdoutCapture` redirects both levels for the duration of a check:

- file descriptor 1 goes to a temporary file, so native writes, C ``printf`` and child processes
  started during the capture land there instead of on the terminal or pipe;
- ``sys.stdout`` is replaced by a stream that tags every Python-level write with the rank of the
  calling thread when it runs inside an in-process world (``rank 0``, ``rank 1``, ...), and with
  ``process`` otherwise.

Output is kept per *example*: :meth:`StdoutCapture.next_example` closes the current segment and
files it under that example's key, so a failure can carry the output of the run that produced it
(:meth:`StdoutCapture.output_for`). Each stream is kept to its last :data:`KEEP_CHARS` characters.

Writes that arrive after the capture ends (a worker process flushing late) go to the temporary
file, never to the real stdout: the descriptor they hold is the temporary one.
"""

from __future__ import annotations

import ctypes
import io
import os
import sys
import tempfile
import threading
from typing import Any, TextIO

__all__ = ["KEEP_CHARS", "StdoutCapture"]

#: Characters of output kept per stream and example (the tail: the last lines explain a failure).
KEEP_CHARS = 4000
#: The key of output written while no example was running (e.g. while the target was imported).
OUTSIDE = "outside any example"


def _flush_c_stdio() -> None:
    # Native code's stdout buffer would otherwise be flushed after fd 1 is restored (at exit,
    # say) and land in the middle of, or after, the JSON report.
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _rank_label() -> str:
    """``rank N`` inside a rank of a running in-process world; ``process`` anywhere else."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return f"rank {dist.get_rank()}"
    except Exception:  # noqa: BLE001 - a label is never worth failing a write for
        pass
    return "process"


class _TaggingStream(io.TextIOBase):
    """``sys.stdout`` during a capture: text goes to the owner's buffers, tagged by rank."""

    def __init__(self, owner: StdoutCapture) -> None:
        super().__init__()
        self._owner = owner

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._owner._add(_rank_label(), text)
        return len(text)

    def write_labelled(self, label: str, text: str) -> None:
        """Text a rank wrote elsewhere (an isolated worker process), filed under that rank's label."""
        self._owner._add(label, text)

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


class StdoutCapture:
    """A context manager capturing stdout at the descriptor and the ``sys.stdout`` level.

    ::

        with StdoutCapture() as capture:
            for case in cases:
                capture.next_example(key_of(case))
                run(case)
        capture.output_for(key_of(case))   # {"rank 1": "...", "process": "..."}
        capture.outside()                  # what was printed outside any example
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[str, str] = {}
        self._key: str = OUTSIDE
        self._segments: dict[str, dict[str, str]] = {}
        self._file: Any = None
        self._saved_fd: int | None = None
        self._saved_stdout: TextIO | None = None
        self._offset = 0

    # --- context manager ---------------------------------------------------------------------------

    def __enter__(self) -> StdoutCapture:
        sys.stdout.flush()
        _flush_c_stdio()
        self._file = tempfile.TemporaryFile()
        self._saved_fd = os.dup(1)
        os.dup2(self._file.fileno(), 1)
        self._saved_stdout = sys.stdout
        sys.stdout = _TaggingStream(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def terminal(self, stream: TextIO) -> TextIO:
        """``stream``, writing past the capture: a stream on file descriptor 1 (which the capture
        diverts) is replaced by one on the saved descriptor, so a text report still reaches the
        terminal or pipe while the checked code's output is captured. Closed by :meth:`close`."""
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return stream  # not a descriptor (a test's in-memory stream): the capture never touched it
        if fd != 1 or self._saved_fd is None:
            return stream
        stream.flush()
        encoding = getattr(stream, "encoding", None) or "utf-8"
        self._terminal = os.fdopen(os.dup(self._saved_fd), "w", encoding=encoding, buffering=1)
        return self._terminal

    def close(self) -> None:
        """Restore stdout (idempotent); the output captured so far stays readable."""
        if self._saved_fd is None:
            return
        if getattr(self, "_terminal", None) is not None:
            self._terminal.close()
            self._terminal = None
        _flush_c_stdio()
        self._finish_segment()
        sys.stdout = self._saved_stdout  # type: ignore[assignment]
        os.dup2(self._saved_fd, 1)
        os.close(self._saved_fd)
        self._saved_fd = None
        self._file.close()

    # --- segments ----------------------------------------------------------------------------------

    def _add(self, label: str, text: str) -> None:
        with self._lock:
            kept = self._current.get(label, "") + text
            self._current[label] = kept[-KEEP_CHARS:]

    def _drain_descriptor(self) -> None:
        # Native and child-process output written to fd 1 since the last drain.
        _flush_c_stdio()
        self._file.seek(self._offset)
        data = self._file.read()
        self._offset += len(data)
        if data:
            self._add("process", data.decode("utf-8", errors="replace"))

    def _finish_segment(self) -> None:
        self._drain_descriptor()
        with self._lock:
            kept = {label: text for label, text in self._current.items() if text}
            self._current = {}
            if kept:
                merged = self._segments.setdefault(self._key, {}) if self._key == OUTSIDE else {}
                for label, text in kept.items():
                    merged[label] = (merged.get(label, "") + text)[-KEEP_CHARS:]
                self._segments[self._key] = merged
            elif self._key != OUTSIDE:
                # The latest run of an example decides: an example that printed before and not now
                # keeps no stale output.
                self._segments.pop(self._key, None)

    def next_example(self, key: str) -> None:
        """Close the running segment; output from now on belongs to the example ``key``."""
        if self._saved_fd is None:
            return
        self._finish_segment()
        self._key = key

    def end_example(self) -> None:
        """Close the running segment; output from now on is outside any example."""
        self.next_example(OUTSIDE)

    def output_for(self, key: str) -> dict[str, str]:
        """What the latest run of the example ``key`` printed, by ``rank N`` / ``process``."""
        return dict(self._segments.get(key, {}))

    def outside(self) -> dict[str, str]:
        """What was printed while no example was running."""
        return dict(self._segments.get(OUTSIDE, {}))
