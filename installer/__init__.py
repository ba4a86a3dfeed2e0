"""Getting a chip's stack right: detect the host, resolve a compatible set, install, verify, diagnose, deploy.

`detect` (the host, from sysfs, version files and vendor tools; every reader takes a root directory so
that tests run on recorded systems), `matrix` (chip family x engine -> pinned versions, as data with a
source per row), `install` (the plan, two-phase pip, the environment file, verification), `doctor`
(findings with their fix), `deploy` (docker / compose / Kubernetes artefacts from a profile).
"""
