"""The commands an SP group's leader broadcasts to its members at each seed boundary.

In their own module, so that a pickled command names the same class in every member, whether the
member runs ``python -m spotlight.sequence_parallel.member`` (its module is then ``__main__``) or was
forked by :mod:`spotlight.sequence_parallel.launch`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RollOut:
    """Roll out seed ``index`` of ``unit`` (``seed`` of ``prompt``) with theta_``policy``, every member together."""

    policy: int
    prompt: str
    seed: int
    unit: str
    index: int


@dataclass(frozen=True)
class Wait:
    """Nothing to claim yet: sleep, then meet at the next seed boundary."""

    seconds: float


@dataclass(frozen=True)
class Regroup:
    """End this generation and form the next (a member leaves, or waiting processes allow a larger degree)."""

    why: str


@dataclass(frozen=True)
class Exit:
    """The run needs no more exploration: every member exits."""


#: the leader's word to the group at each seed boundary (one broadcast object)
Command = RollOut | Wait | Regroup | Exit
