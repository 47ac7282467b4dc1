"""Forecast wall-clock and dollars to a held-out reward target by replaying real spot traces (``spotlight simulate``).

The pieces, each pure and in its own module:

* :mod:`~spotlight.forecast.traces`: spot capacity traces (``Trace.from_values`` builds one for tests);
* :mod:`~spotlight.forecast.records`: the only reader of run stores: reward curves per seed, widths;
* :mod:`~spotlight.forecast.curves`: curves, and the stated horizon mapping their iterations to the config's;
* :mod:`~spotlight.forecast.work`: an iteration's work at the real config (the planner's accounting);
* :mod:`~spotlight.forecast.boot`: boot seconds from weight bytes (the memory plan's seam);
* :mod:`~spotlight.forecast.prices`: workers from the placement and the catalog, the controller, S3;
* :mod:`~spotlight.forecast.requests`: the S3 requests a run sends;
* :mod:`~spotlight.forecast.replay`: workers, windows and queues in simulated seconds;
* :mod:`~spotlight.forecast.schedules`: on-demand sync, all-spot sync, sync exploration, Spotlight;
* :mod:`~spotlight.forecast.estimate`: every schedule, seed, zone and offset replayed and billed;
* :mod:`~spotlight.forecast.widths`: exploration width and explorer count as a cost lever;
* :mod:`~spotlight.forecast.report`: tables, assumptions, plot.
"""
