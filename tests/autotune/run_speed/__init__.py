"""The tool's own time: the stage clock, the search's stored trials, the calibration cache."""
