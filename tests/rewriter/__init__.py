"""Tests of `rewriter/`."""
