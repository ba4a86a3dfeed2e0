"""Per-chip detection, install plans and verification (issue 7; not built yet).

Backend detection for `serve --chip` (default: detected) lives with each backend's descriptor
(`flagdeploy.ops.detect_backend`); this package will add the stack resolver and `flagdeploy install`.
"""
