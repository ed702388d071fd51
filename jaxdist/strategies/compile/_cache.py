"""The compiled programs: `ProgramCache`, a strategy's (``run``, on-device loops, reduce/gather),
and `StepPrograms`, one ``strategy.jit`` step's (its own `jax.jit` objects, whose C++ dispatch
serves its calls).

`ProgramCache` makes the promises `jax.jit` makes for its own cache:

* weak on user functions: a program calls its user function through a weak reference, so a
  ``lambda`` made fresh in a loop and its programs are freed together;
* bounded: at most ``max_per_function`` programs per function and ``max_functions`` functions held
  strongly (callables that cannot be weakly referenced), least recently used first out;
* loud about waste: when the same call site (the same code object) keeps compiling, one warning says
  why (a new function object every call, a new static value, or new shapes) and what to do. Steps
  report their traces here too (`note_trace`), so it covers every way a strategy compiles.
"""

from __future__ import annotations

import collections
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["ProgramCache", "RecompileWarning", "StepPrograms", "weak_callable"]


class RecompileWarning(UserWarning):
    """The same call site keeps compiling new programs (each compile costs ~100 ms or more)."""


def _site(fn: Any) -> Any:
    """The call site of ``fn``: its code object (one lambda expression in a loop is one site)."""
    func = getattr(fn, "__func__", fn)  # bound methods
    func = getattr(func, "func", func)  # functools.partial
    return getattr(func, "__code__", None) or type(fn)


def _describe(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    code = _site(fn)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if hasattr(code, "co_filename") else ""
    return f"{name}{where}"


def weak_callable(fn: Callable) -> Callable:
    """``fn`` called through a weak reference (so a cached program does not keep it alive).

    Bound methods are held through `weakref.WeakMethod`; what cannot be weakly referenced, as is.

    Examples:
        >>> def f(x):
        ...     return x + 1
        >>> weak_callable(f)(1)
        2
    """
    try:
        ref = (weakref.WeakMethod(fn) if hasattr(fn, "__self__") and hasattr(fn, "__func__")
               else weakref.ref(fn))
    except TypeError:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        # only reachable if a program outlives its function: a bug, not a user error
        if target is None:
            raise RuntimeError("the function of this compiled program has been garbage-collected")
        return target(*args, **kwargs)

    return call


class ProgramCache:
    """Compiled programs of one strategy, by user function (weakly) and by a hashable key.

    Args:
        max_per_function: programs kept per function (least recently used first out).
        max_functions: strongly held functions kept (for callables that cannot be weakly
            referenced).
        warn_after: compiles at one call site, each for a different reason than a cache hit, before
            the `RecompileWarning`.

    Examples:
        >>> cache = ProgramCache()
        >>> def f(x):
        ...     return x * 2
        >>> program = cache.get(f, ("shape", 3), lambda weak_f: weak_f)
        >>> program(4), cache.get(f, ("shape", 3), lambda weak_f: None) is program
        (8, True)
    """

    def __init__(self, max_per_function: int = 64, max_functions: int = 256, warn_after: int = 8):
        self.max_per_function = max_per_function
        self.max_functions = max_functions
        self.warn_after = warn_after
        self._lock = threading.RLock()
        self._weak: dict[Any, collections.OrderedDict] = {}  # id token -> programs, while fn lives
        self._strong: collections.OrderedDict = collections.OrderedDict()  # fn -> programs, LRU
        self._sites: dict[Any, dict] = {}  # code object -> {"count", "last", "warned"}

    def clear(self) -> None:
        """Drop every cached program."""
        with self._lock:
            self._weak.clear()
            self._strong.clear()

    def __len__(self) -> int:
        """How many programs are cached (over every function still alive)."""
        with self._lock:
            return sum(len(p) for p in (*self._weak.values(), *self._strong.values()))

    def _programs_of(self, fn: Any) -> collections.OrderedDict:
        owner = getattr(fn, "__self__", None) if hasattr(fn, "__func__") else None
        token = (id(owner), id(fn.__func__)) if owner is not None else id(fn)
        programs = self._weak.get(token)
        if programs is not None:
            return programs
        try:
            weakref.finalize(owner if owner is not None else fn, self._weak.pop, token, None)
        except TypeError:  # not weakly referenceable: held strongly, bounded
            programs = self._strong.get(fn)
            if programs is None:
                programs = self._strong[fn] = collections.OrderedDict()
                while len(self._strong) > self.max_functions:
                    self._strong.popitem(last=False)
            self._strong.move_to_end(fn)
            return programs
        programs = self._weak[token] = collections.OrderedDict()
        return programs

    def get(self, fn: Any, key: Hashable, build: Callable[[Callable], Callable], *,
            reason: Any = None) -> Callable:
        """The program for ``(fn, key)``; built with ``build(weak_callable(fn))`` on a miss.

        Args:
            fn: the user function the program runs (None for the strategy's own programs).
            key: everything else the program depends on (structure, shapes, static values).
            build: makes the program from a weakly held ``fn``.
            reason: ``(statics, shapes)`` of this key, to say why a call site recompiles.
        """
        with self._lock:
            programs = self._programs_of(fn if fn is not None else ProgramCache)
            program = programs.get(key)
            if program is not None:
                programs.move_to_end(key)
                return program
        program = build(weak_callable(fn) if fn is not None else None)
        self.put(fn if fn is not None else ProgramCache, key, program)
        if fn is not None:
            self.note_trace(fn, reason if reason is not None else key)
        return program

    def peek(self, fn: Any, key: Hashable) -> Any:
        """The entry cached for ``(fn, key)`` (a program, or what a caller's fast path keeps:
        `strategy.run`'s programs by their arguments' layouts), or None; nothing is built.

        Examples:
            >>> cache = ProgramCache()
            >>> def f(x):
            ...     return x
            >>> cache.peek(f, "k") is None, cache.put(f, "k", abs), cache.peek(f, "k")
            (True, None, <built-in function abs>)
        """
        with self._lock:
            programs = self._programs_of(fn)
            program = programs.get(key)
            if program is not None:
                programs.move_to_end(key)
            return program

    def put(self, fn: Any, key: Hashable, program: Any) -> None:
        """Cache ``program`` for ``(fn, key)`` (a fast-path entry, weak on ``fn`` and bounded)."""
        with self._lock:
            programs = self._programs_of(fn)
            programs[key] = program
            while len(programs) > self.max_per_function:
                programs.popitem(last=False)

    def note_trace(self, fn: Any, signature: Any) -> None:
        """Note that ``fn`` was traced for ``signature`` (``(statics, shapes)``); warn on churn."""
        site = _site(fn)
        with self._lock:
            info = self._sites.setdefault(site, {"count": 0, "last": None, "warned": False})
            last, info["last"] = info["last"], (weakref.ref(fn) if _weakable(fn) else None, id(fn),
                                                signature)
            info["count"] += 1
            if info["warned"] or info["count"] <= self.warn_after or last is None:
                return
            info["warned"] = True
        why = _why(last, fn, signature)
        warnings.warn(f"{_describe(fn)} has been compiled {info['count']} times at the same call "
                      f"site: {why}. Each compile costs ~100 ms or more.", RecompileWarning,
                      stacklevel=4)


def _weakable(fn: Any) -> bool:
    try:
        weakref.ref(fn)
        return True
    except TypeError:
        return False


def _why(last: tuple, fn: Any, signature: Any) -> str:
    last_ref, last_id, last_sig = last
    same_fn = (last_ref() is fn) if last_ref is not None else last_id == id(fn)
    if not same_fn:
        return ("a new function object every call (e.g. a lambda or nested function defined inside "
                "the loop); define the function once, outside the loop, and pass changing values "
                "as arguments")
    if (isinstance(signature, tuple) and isinstance(last_sig, tuple)
            and len(signature) == len(last_sig) == 2):
        if signature[0] != last_sig[0]:
            return (f"a new static (compile-time) value each call (was {last_sig[0]!r}, now "
                    f"{signature[0]!r}); pass values that change as arrays, not Python scalars or "
                    "static arguments")
        return (f"new argument shapes or dtypes (was {last_sig[1]!r}, now {signature[1]!r}); keep "
                "shapes fixed, e.g. pad or drop a ragged last batch")
    return f"a new signature each call (was {last_sig!r}, now {signature!r})"


class StepPrograms:
    """The programs of one ``strategy.jit`` step (`jaxdist.strategies.StrategyFunction`): `jax.jit`
    objects, each keeping JAX's own cache of traces, so what is held here is one object per kind of
    call, not per signature.

    Attributes:
        full: the full path's program by the positions of nnx graph arguments (the layouts are
            decided while it traces).
        families: the express path's programs by static key (graphdef, nnx positions, layout
            provenance).
        express: ``(program, static key)`` by a call's argument types (and, where they cannot tell
            it, the provenance of its layouts): what a steady call runs with one dict lookup.
        misses: how many new signatures each express key refused.

    Examples:
        >>> programs = StepPrograms()
        >>> programs.install(("types",), print, ("static",))
        >>> programs.express[("types",)]
        (<built-in function print>, ('static',))
        >>> for _ in range(StepPrograms.MAX_MISSES):
        ...     programs.missed(("types",))
        >>> ("types",) in programs.express, programs.install(("types",), print, ("static",))
        (False, None)
        >>> ("types",) in programs.express  # a key that keeps missing takes the full path only
        False
        >>> programs.families[("static",)] = print
        >>> programs.install(("other types",), print, ("static",))
        >>> # no dispatch cache to clear: forgotten
        >>> programs.cleared(print), programs.families, programs.express
        (False, {}, {})
    """

    # new signatures an express key may refuse before calls with it take the full path only
    MAX_MISSES = 16

    __slots__ = ("express", "families", "full", "misses")

    def __init__(self) -> None:
        self.full: dict[tuple[int, ...], Callable] = {}
        self.families: dict[tuple, Callable] = {}
        self.express: dict[Any, tuple[Callable, tuple]] = {}
        self.misses: dict[Any, int] = {}

    def install(self, key: Any, program: Callable, static: tuple) -> None:
        """Serve calls with ``key`` by ``program`` (unless it has missed `MAX_MISSES` times)."""
        if self.misses.get(key, 0) < self.MAX_MISSES:
            self.express[key] = program, static

    def missed(self, key: Any) -> None:
        """The express program for ``key`` refused a call: a signature new to it (once the full path
        has traced it, JAX's dispatch serves it, so alternating signatures cost nothing more). After
        `MAX_MISSES` (a step that keeps compiling, which `RecompileWarning` names) calls with
        ``key`` take the full path only."""
        self.misses[key] = misses = self.misses.get(key, 0) + 1
        if misses >= self.MAX_MISSES:
            self.express.pop(key, None)

    def cleared(self, refused: Callable) -> bool:
        """Drop JAX's dispatch entry for the signature ``refused`` (an express program) refused: it
        would send every later call of it to Python. True where JAX has that method; else
        ``refused`` is forgotten, to be built anew (one more trace), and False."""
        clear = getattr(refused, "_clear_cache", None)
        if clear is not None:
            clear()
            return True
        for k in [k for k, program in self.families.items() if program is refused]:
            del self.families[k]
        for k in [k for k, (program, _) in self.express.items() if program is refused]:
            del self.express[k]
        return False
