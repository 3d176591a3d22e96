"""Hyperparameter search over train specs, on Optuna (`visionloop tune`).

`spec` validates the tune spec and imports no Optuna; `space` turns it into Optuna's
suggestions, samplers and pruners; `study` keeps the study in the control plane's database;
`tuner` runs it, every trial a queue job.
"""

from visionloop.tune.spec import TuneSpec, load_tune_spec, validate_tune_spec

__all__ = ["TuneSpec", "load_tune_spec", "validate_tune_spec"]
