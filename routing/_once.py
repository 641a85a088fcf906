"""`once`: a property computed on first use and kept, without a lock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class once(Generic[T]):
    """A property computed when first read and then kept in the instance's ``__dict__``.

    What `functools.cached_property` does, without its lock: on Python 3.11
    that lock is one per property, shared by every instance, so the event
    loop reading one geofence's `wkt` waited while the history's writer
    thread computed another's (Python 3.12 dropped the lock for the same
    reason). Two threads reading an unset value at once may both compute it;
    the function must be pure, so either result is the value. Works on
    frozen dataclasses (the value goes into ``__dict__``, past
    ``__setattr__``); not on classes with ``__slots__`` and no ``__dict__``.
    """

    def __init__(self, func: Callable[[Any], T]) -> None:
        self.func = func
        self.name = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> once[T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> T | once[T]:
        if instance is None:
            return self
        value = self.func(instance)
        instance.__dict__[self.name] = value  # read from there from now on: no descriptor call
        return value
