"""Which call into a backend's own code a process hosting production's engine is making.

In a KV-A worker, production's engine calls the backend's class (its layers select it,
ask ``get_impl_cls``, build the impl).  When that code hangs, ends the process
(``os._exit``, a crash) or asks for more memory than there is, the fault is the backend's,
not the serving stack's, whichever clause's deployment it happened in.  To tell, the worker
wraps every function the backend's module defines on its classes (:func:`instrument`):
while one runs, its name is in a marker file beside the worker's log (:func:`open_marker`),
which the parent reads when the worker died or did not answer (``workers/handle.py``); an
exception raised through one carries its name (:func:`raised_through`), so an out-of-memory
error it caused says so.  Importing the backend's module is such a call too.

Only this process's copy of the class is wrapped: the class the checking process judges is
never touched.  Stdlib only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

MARKER_SUFFIX = ".backend-call"  # beside a worker's log: the backend call it is making
# Set on an exception raised through a call into the backend's code: that call's name.
RAISED_THROUGH_ATTR = "kvconform_backend_call"
_INSTRUMENTED_ATTR = "__kvconform_instrumented__"

_marker: int | None = None  # the marker file's descriptor in this process
_lock = threading.Lock()
_running: dict[int, list[str]] = {}  # thread id -> the calls it is making, outermost first


def marker_path(log_path: str) -> str:
    """The marker file of the worker whose log is ``log_path``."""
    return log_path + MARKER_SUFFIX


def open_marker(path: str) -> None:
    """Write this process's backend calls to ``path`` from now on (a worker, at start)."""
    global _marker
    _marker = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)


def read_marker(path: str) -> str | None:
    """What the marker at ``path`` says the worker was running, if anything."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace").strip()
    except OSError:
        return None
    return text or None


def _write() -> None:
    if _marker is None:
        return
    calls = [name for names in _running.values() for name in names[-1:]]
    data = "; ".join(calls).encode()
    with contextlib.suppress(OSError):
        os.ftruncate(_marker, 0)
        os.pwrite(_marker, data, 0)


@contextlib.contextmanager
def running(name: str) -> Iterator[None]:
    """The backend's code ``name`` runs in this thread for the block (the marker says so;
    an exception raised through it carries it)."""
    thread = threading.get_ident()
    with _lock:
        _running.setdefault(thread, []).append(name)
        _write()
    try:
        yield
    except BaseException as exc:
        if getattr(exc, RAISED_THROUGH_ATTR, None) is None:
            with contextlib.suppress(Exception):
                setattr(exc, RAISED_THROUGH_ATTR, name)
        raise
    finally:
        with _lock:
            names = _running.get(thread, [])
            if names:
                names.pop()
            if not names:
                _running.pop(thread, None)
            _write()


def raised_through(exc: BaseException | None) -> str | None:
    """The call into the backend's code an exception (or one it was raised from) came
    through, if any."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = getattr(exc, RAISED_THROUGH_ATTR, None)
        if isinstance(name, str):
            return name
        exc = exc.__cause__ or exc.__context__
    return None


def _wrapped(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with running(name):
            return fn(*args, **kwargs)

    return call


def instrument_class(cls: type) -> None:
    """Wrap the functions ``cls`` defines itself (methods, class and static methods) so
    that each call is marked as the backend's (``Class.method()``).  Once per class."""
    if cls.__dict__.get(_INSTRUMENTED_ATTR):
        return
    for attr, value in list(vars(cls).items()):
        if attr.startswith("__") and attr != "__init__":
            continue
        name = f"{cls.__qualname__}.{attr}()"
        if isinstance(value, classmethod):
            setattr(cls, attr, classmethod(_wrapped(value.__func__, name)))
        elif isinstance(value, staticmethod):
            setattr(cls, attr, staticmethod(_wrapped(value.__func__, name)))
        elif inspect.isfunction(value):
            setattr(cls, attr, _wrapped(value, name))
    with contextlib.suppress(TypeError, AttributeError):
        setattr(cls, _INSTRUMENTED_ATTR, True)


def instrument(backend: str, path: str) -> None:
    """The backend ``backend`` (class at dotted ``path``) in this process: its module
    imported (a call into its code, marked as one), and every class that module defines
    instrumented (:func:`instrument_class`): the backend's class, its impl, its builders."""
    module_name = path.rpartition(".")[0]
    if not module_name:
        return
    try:
        with running(f"importing {module_name} (backend {backend})"):
            module = sys.modules.get(module_name) or importlib.import_module(module_name)
    except Exception:  # production imports it too, and reports what it raises
        return
    for value in list(vars(module).values()):
        if isinstance(value, type) and getattr(value, "__module__", None) == module_name:
            instrument_class(value)
