"""Tests of the resident state: what it is made of on the testbed, and optimizer slots moved to the host."""
