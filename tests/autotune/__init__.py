"""Tests of `autotune/`."""
