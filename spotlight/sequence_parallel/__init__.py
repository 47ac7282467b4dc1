"""Elastic sequence parallelism: one high-resolution rollout shared by several GPUs, regrouped in memory.

- :mod:`.context`: diffusers' context parallelism (Ulysses / ring) switched on and off on a policy's
  transformer, and which degrees diffusers accepts for its heads and sequence lengths.
- :mod:`.rendezvous`: generations of a group agreed through the run store (who is in, who leads).
- :mod:`.weights`: a policy built on ``meta`` from configs, filled by a peer over the process group.
- :mod:`.member`: the persistent process per GPU of an explorer: joins generations, rolls out the seeds
  of the run's exploration units, commits each finished seed, records each unit's rewards as a plain
  explorer does, regroups on SIGTERM, a dead peer or a newcomer.
- :mod:`.commands`: what the leader broadcasts to the group at each seed boundary.
- :mod:`.launch`: one machine's members, forked after importing the model stack once (the explorer
  process of the local pool and of sky/explorer.yaml when ``placement.sequence_parallel.degree`` > 1).

docs/sequence_parallel.md has the protocol, the measurements and what runs where.
"""
