"""A fencing token: the identity of one claim, passed explicitly to the writes it fences.

After SkyPilot's ``sky/jobs/fencing.py``: a holder keeps the token of its claim and hands it to
every write that must only happen while the claim is held (``RunStore.commit(..., fence=token)``).
The write calls ``token.check()`` right before its commit point and gives up if the claim is gone.
The token is passed explicitly (an argument, or a store view from ``RunStore.fenced``), never
through a context variable, so it is grep-able and cannot silently fail to cross a thread.

A leaf: no project imports, so the store takes a token without knowing the queue that issued it.
A check is not a lock: a claim can be lost between the check and the write that follows, which is
why the store's commit point (a create-only manifest) is safe against a second writer on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class FencingToken:
    """One claim (``holder`` holds ``resource`` at ``epoch``) and how to verify it is still held.

    ``verify`` raises when the claim is no longer held (``WorkQueue.check_held`` raises
    ``LeaseLostError``); ``lost`` stays True once a check has failed, for every sharer of the token."""

    holder: str
    resource: str
    epoch: int
    verify: Callable[[], None] = field(repr=False)
    lost: bool = False

    def check(self) -> None:
        """Raise if the claim is lost (verified now, not cached: the last check before a commit counts)."""
        try:
            self.verify()
        except Exception:
            self.lost = True
            raise
