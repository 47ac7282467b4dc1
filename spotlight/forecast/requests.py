"""S3 requests a run sends, counted from what the code does, and priced (:mod:`spotlight.forecast.prices`).

Two parts:

* **Work**: per stage attempt (post, claim, commit, done marker, the controller's reads), per exploration
  (publish, commit, filter), per item (a claim scans the queue: about half its items' leases listed and
  read, then the lease object and the done marker), per unit (its result object, read back by gather).
  Operation counts from ``docs/store.md`` (a commit of k objects: k + 1 PUT-class + 1 GET; a claim scan
  of n leased items: n + 1 LIST + n GET).
* **Waiting**: every process polls the store while it waits. ``CURRENT`` is the code as it is
  (``docs/cloud.md``, "Waiting is cheap"): a look is one request to a signal object (a GET of a queue's
  ``progress.json``, a GET of the pool's ``board.json``), and a long wait looks every 4 s
  (``spotlight.pool.Pacer``; a real run's waits last minutes); a stage waiter also reads the failure and
  the pool's broken marker every 15 s, an exploration waiter the key that frees the trainers every 15 s,
  and an idle trainer tries a stage that another trainer holds every 15 looks.
  ``BEFORE`` is the code before issue 18 (66d9940): ``queue.status()`` (2n + 1 LIST + n GET for n
  items) twice a second while an exploration is open, and an idle worker listing the queues.
  A worker waits whenever it holds an instance and computes nothing (boots included: an upper bound);
  a busy worker's lease renewals (one per lease_seconds / 3) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from spotlight.forecast.prices import S3_GET_CLASS_USD, S3_PUT_CLASS_USD

#: requests (PUT-class, GET-class) per piece of work
PER_STAGE = (10, 5)  # post (commit: 2 + 1), claim (2 LIST + 1 GET, lease PUT), commit (4 + 1), done, 2 reads
PER_EXPLORATION = (10, 10)  # publish (2 + 1), explore commit (4 + 1), filter commit (3 + 1) and its reads


@dataclass(frozen=True)
class Polling:
    """Requests per second (PUT-class, GET-class) of a waiting process."""

    name: str
    controller_on_stage: tuple[float, float]
    controller_per_open_item: tuple[float, float]  # while an exploration is open: per item of its queue
    controller_on_exploration: tuple[float, float]  # ... plus this
    worker_idle: tuple[float, float]
    trainer_idle: tuple[float, float]

    def controller_exploring(self, items: int) -> tuple[float, float]:
        return (self.controller_on_exploration[0] + items * self.controller_per_open_item[0],
                self.controller_on_exploration[1] + items * self.controller_per_open_item[1])


POLLS_PER_SECOND = 2.0  # BEFORE: pool.default_poll_seconds on S3, 0.5 s
BEFORE = Polling("the polling before issue 18 (0.5 s; queue.status() is O(items))",
                 controller_on_stage=(0.0, POLLS_PER_SECOND + 1.0),  # commit marker HEAD + ~1 pool check/s
                 controller_per_open_item=(2 * POLLS_PER_SECOND, POLLS_PER_SECOND),  # status(): 2n + 1 LIST, n GET
                 controller_on_exploration=(POLLS_PER_SECOND, 2 * POLLS_PER_SECOND + 1.0),  # + join key, marker, pool
                 worker_idle=(POLLS_PER_SECOND, POLLS_PER_SECOND),  # LIST queues, HEAD pool/done.json
                 trainer_idle=(2 * POLLS_PER_SECOND, POLLS_PER_SECOND))  # + LIST the stage queue
LOOKS_PER_SECOND = 0.25  # spotlight.pool.Pacer on S3: a long wait looks every 4 s
CURRENT = Polling("one request a look, a look every 4 s in a long wait (docs/cloud.md)",
                  controller_on_stage=(0.0, LOOKS_PER_SECOND + 2 / 15),  # the signal; failure and broken every 15 s
                  controller_per_open_item=(0.0, 0.0),  # a look is O(1) whatever the queue's size
                  controller_on_exploration=(0.0, LOOKS_PER_SECOND + 1 / 15),  # + the trainers' key every 15 s
                  worker_idle=(0.0, LOOKS_PER_SECOND),  # board.json
                  # + a stage another trainer holds: a try (3 requests) every 15 looks
                  trainer_idle=(0.0, LOOKS_PER_SECOND * (1 + 3 / 15)))
POLLING = {"current": CURRENT, "before": BEFORE}


def work_requests(stages: int, explorations: int, items: int, units: int, queue_items: int) -> tuple[float, float]:
    """(PUT-class, GET-class) requests of the run's committed work."""
    scan = (queue_items / 2 + 1 + 2, queue_items / 2)  # a claim's scan, its lease and the done marker
    return (stages * PER_STAGE[0] + explorations * PER_EXPLORATION[0] + items * scan[0] + units,
            stages * PER_STAGE[1] + explorations * PER_EXPLORATION[1] + items * scan[1] + units)


def usd(requests: tuple[float, float]) -> float:
    return requests[0] * S3_PUT_CLASS_USD + requests[1] * S3_GET_CLASS_USD
