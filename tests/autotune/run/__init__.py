"""Tests of `autotune/run/`: the tuning run, the verdict, the target, step-time calibration and its cache, the stage clock."""
