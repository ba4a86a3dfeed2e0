"""FP8 → INT8 / BF16 per-layer conversion for chips without FP8 matrix units (issue 4; not built yet).

The runtime side already exists: weight bundles in `flagdeploy.ops.weights` and the W4A16 / W8A16
ops; this package will hold the streaming converter and its policies.
"""
