"""What TensorFlow does to a step beyond its graph, as the tool must know it in advance: Grappler's
rewrites, While loops, oneDNN's and XLA's hidden buffers, mixed precision's scratch, arithmetic Grappler removes."""

from rewriter.tf_effects.grappler import (ALWAYS_READY, BYPASS_TYPES, SHAPE_TYPES, Reduced, fixed_grappler_config,
                                          foldable_ops, may_vanish, reduce_step, swap_grappler_config, underlying)
from rewriter.tf_effects.passthrough import passthrough_input, passthrough_ops

__all__ = ["ALWAYS_READY", "BYPASS_TYPES", "fixed_grappler_config", "foldable_ops", "may_vanish",
    "passthrough_input", "passthrough_ops", "reduce_step", "Reduced", "SHAPE_TYPES", "swap_grappler_config",
    "underlying"]
