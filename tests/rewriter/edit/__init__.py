"""Tests of `rewriter/edit/`: the step's GraphDef edited, here its ops split along the batch."""
