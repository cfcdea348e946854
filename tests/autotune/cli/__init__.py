"""Tests of `autotune/cli/`: the command line end to end, its messages and inputs, and many kinds of models through it."""
