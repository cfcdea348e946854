"""Tests of `autotune/search/`: the search and its stored trials."""
