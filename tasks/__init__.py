"""Prefect tasks: one thin task per stage. All logic lives in ``spotlight.stages``."""
