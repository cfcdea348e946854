"""Tests of `simulator/`."""
