"""Watching a served model: cheap per-image statistics (`imagestats`) and two-sample drift
tests between a reference sample and a window of served traffic (`drift`); reference
statistics per model version, the label-free accuracy estimate and alert rules build on them.

Pure library code: no CLI, no server, no state on disk. `monitor` sits above `serve` and
`eval` in the package layering and may import from them, never the other way round.
"""
