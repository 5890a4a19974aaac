"""The planning layer: decides what the runtime runs, and predicts how fast it runs.

A cluster cost model (``cluster``), the greedy and in-order planners (``greedy``, ``schedule``), the
plan replayer (``replay``), the algorithms we compare with (``baselines``) and their shared costs
(``costs``), the automatic shape choice (``autoshape``) and the calibration against published
measurements (``calibration``). Imports the runtime's plan language, never the executor's state.
"""
