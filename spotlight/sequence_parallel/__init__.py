"""Elastic sequence parallelism: one high-resolution rollout shared by several GPUs, regrouped in memory.

- :mod:`.context`: diffusers' context parallelism (Ulysses / ring) switched on and off on a policy's
  transformer, and which degrees diffusers accepts for its heads and sequence lengths.
- :mod:`.rendezvous`: generations of a group agreed through the run store (who is in, who leads).
- :mod:`.weights`: a policy built on ``meta`` from configs, filled by a peer over the process group.
- :mod:`.member`: the persistent process per GPU: joins generations, rolls out seeds from the work
  queue, commits each finished seed, regroups on SIGTERM, a dead peer or a newcomer.

docs/sequence_parallel.md has the protocol, the measurements and what runs where.
"""
