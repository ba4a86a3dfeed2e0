"""Deployment manifests (issue 7): the rendered docker/compose/k8s files give the container every Ascend device
node and driver mount, the right GPU request, nothing for CPU, and probes that never kill a loading server."""

from __future__ import annotations

import shlex

import pytest
import yaml

from flagdeploy.planner.profile import Profile
from installer.deploy import PLACEHOLDER_IMAGE, render, write

ASCEND_MOUNTS = ["/usr/local/Ascend/driver/lib64", "/usr/local/Ascend/driver/version.info", "/usr/local/bin/npu-smi",
                 "/etc/ascend_install.info", "/usr/local/dcmi"]
ASCEND_FIXED = ["/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]
CACHE = "/data/models"


def ascend() -> Profile:
    return Profile(model="glm-5.3-flash", chip="ascend910c", tp=8, devices=8, max_model_len=32768, port=8100)


def h200() -> Profile:
    return Profile(model="Qwen/Qwen3-32B", chip="h200", tp=2, dp=2, devices=4, port=8000)


def cpu() -> Profile:
    return Profile(model="smollm2-135m-instruct", chip="cpu", port=8000)


def docker_argv(profile: Profile) -> list[str]:
    script = render("docker", profile, cache_dir=CACHE)["run.sh"]
    runs = [line for line in script.replace("\\\n", " ").splitlines() if "docker run" in line]
    assert len(runs) == 1
    argv = shlex.split(runs[0])
    return argv[argv.index("docker"):]


def pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def k8s_docs(profile: Profile, **kw) -> dict[str, dict]:
    docs = list(yaml.safe_load_all(render("k8s", profile, **kw)["deployment.yaml"]))
    return {d["kind"]: d for d in docs}


def test_docker_ascend_has_every_device_node_and_driver_mount():
    argv = docker_argv(ascend())
    devices = pairs(argv, "--device")
    assert devices == [f"/dev/davinci{i}" for i in range(8)] + ASCEND_FIXED
    volumes = pairs(argv, "-v")
    for m in ASCEND_MOUNTS:
        assert f"{m}:{m}:ro" in volumes
    assert f"{CACHE}:/home/flagdeploy/.cache/flagdeploy" in volumes
    assert "$HERE/profile.yaml:/etc/flagdeploy/profile.yaml:ro" in volumes
    assert pairs(argv, "-p") == ["8100:8100"]
    assert int(pairs(argv, "--shm-size")[0].rstrip("g")) >= 16
    assert "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in pairs(argv, "-e")
    i = argv.index(PLACEHOLDER_IMAGE)
    assert argv[i + 1:i + 5] == ["flagdeploy", "serve", "--profile", "/etc/flagdeploy/profile.yaml"]


def test_docker_nvidia_and_cpu():
    argv = docker_argv(h200())
    assert pairs(argv, "--gpus") == ["4"] and not pairs(argv, "--device")
    argv = docker_argv(cpu())
    assert not pairs(argv, "--gpus") and not pairs(argv, "--device")
    assert not any("Ascend" in v for v in pairs(argv, "-v"))


def test_render_ships_the_profile():
    for kind in ("docker", "compose", "k8s"):
        files = render(kind, ascend())
        assert Profile(**yaml.safe_load(files["profile.yaml"])["profile"]) == ascend()


def test_compose_ascend_devices_mounts_and_command():
    doc = yaml.safe_load(render("compose", ascend(), cache_dir=CACHE)["compose.yaml"])
    (svc,) = doc["services"].values()
    assert svc["devices"] == [f"{d}:{d}" for d in [f"/dev/davinci{i}" for i in range(8)] + ASCEND_FIXED]
    for m in ASCEND_MOUNTS:
        assert f"{m}:{m}:ro" in svc["volumes"]
    assert f"{CACHE}:/home/flagdeploy/.cache/flagdeploy" in svc["volumes"]
    assert "./profile.yaml:/etc/flagdeploy/profile.yaml:ro" in svc["volumes"]
    assert svc["ports"] == ["8100:8100"] and svc["shm_size"] == "16g"
    assert svc["command"][:4] == ["flagdeploy", "serve", "--profile", "/etc/flagdeploy/profile.yaml"]


def test_compose_nvidia_and_cpu():
    (svc,) = yaml.safe_load(render("compose", h200())["compose.yaml"])["services"].values()
    (req,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert req["driver"] == "nvidia" and req["count"] == 4 and "devices" not in svc
    (svc,) = yaml.safe_load(render("compose", cpu())["compose.yaml"])["services"].values()
    assert "devices" not in svc and "deploy" not in svc


@pytest.mark.parametrize("make,resource,count", [(ascend, "huawei.com/Ascend910", 8), (h200, "nvidia.com/gpu", 4),
                                                 (cpu, None, 0)])
def test_k8s_deployment_and_service(make, resource, count):
    profile = make()
    docs = k8s_docs(profile, image="registry.example/flagdeploy@sha256:abc")
    dep, svc, cm = docs["Deployment"], docs["Service"], docs["ConfigMap"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry.example/flagdeploy@sha256:abc"
    start = c["startupProbe"]
    assert start["httpGet"]["path"] == "/ready"
    assert start["failureThreshold"] * start["periodSeconds"] >= 30 * 60
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["initialDelaySeconds"] >= 30
    limits = c.get("resources", {}).get("limits", {})
    assert limits == ({resource: count} if resource else {})
    # The profile travels in a ConfigMap mounted where the serve command reads it.
    assert c["command"][:4] == ["flagdeploy", "serve", "--profile", "/etc/flagdeploy/profile.yaml"]
    assert Profile(**yaml.safe_load(cm["data"]["profile.yaml"])["profile"]) == profile
    (vol,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    assert {"name": vol["name"], "mountPath": "/etc/flagdeploy", "readOnly": True} in c["volumeMounts"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["port"] == profile.port
    assert c["ports"][0]["containerPort"] == profile.port
    paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(ASCEND_MOUNTS) <= paths if resource == "huawei.com/Ascend910" else not set(ASCEND_MOUNTS) & paths


def test_k8s_default_image_is_a_digest_placeholder():
    (c,) = k8s_docs(cpu())["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["image"] == PLACEHOLDER_IMAGE and "@sha256:" in c["image"]


def test_write_is_atomic_and_refuses_to_overwrite(tmp_path):
    paths = write("docker", ascend(), tmp_path)
    assert sorted(p.name for p in paths) == ["profile.yaml", "run.sh"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.yaml", "run.sh"]  # no temp files left
    before = (tmp_path / "run.sh").read_text()
    with pytest.raises(FileExistsError):
        write("docker", h200(), tmp_path)
    assert (tmp_path / "run.sh").read_text() == before
    write("docker", h200(), tmp_path, overwrite=True)
    assert "--gpus 4" in (tmp_path / "run.sh").read_text()


def test_rejects_unknown_kind_and_too_many_devices():
    with pytest.raises(ValueError, match="docker"):
        render("helm", cpu())
    with pytest.raises(ValueError, match="tp\\*dp\\*pp"):
        render("docker", Profile(model="m", chip="h200", tp=16))
