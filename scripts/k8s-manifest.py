#!/usr/bin/env python3
"""Reads a Kubernetes manifest of Refit ranks (a headless Service and a StatefulSet, as
examples/kubernetes/cartpole.yaml) without a cluster.

  k8s-manifest.py check MANIFEST.yaml
      checks what the ranks rely on, against the topology file the pods launch (found in
      examples/topologies/ under the name the command gives); prints what it checked
  k8s-manifest.py replicas MANIFEST.yaml
      prints the StatefulSet's replicas
  k8s-manifest.py pod MANIFEST.yaml I
      prints pod I's environment (one NAME=VALUE a line; the token as a placeholder,
      REFIT_TOKEN=<secret>) then a line `--`, then its command, one argument a line

Needs PyYAML (pip install pyyaml) and Python 3.11 (tomllib).
"""
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "default"


def fail(msg):
    sys.exit(f"k8s-manifest: {msg}")


def load(path):
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    kinds = {d.get("kind"): d for d in docs}
    for kind in ("Service", "StatefulSet"):
        if kind not in kinds:
            fail(f"{path}: no {kind}")
    return kinds["Service"], kinds["StatefulSet"]


def container(sts):
    cs = sts["spec"]["template"]["spec"]["containers"]
    if len(cs) != 1:
        fail(f"the StatefulSet has {len(cs)} containers, not one rank's")
    return cs[0]


def topology_of(c):
    """The topology file the command launches: its name under examples/topologies/."""
    cmd = c["command"] + c.get("args", [])
    if cmd[:2] != ["refit", "launch"]:
        fail(f"the container's command {cmd} is not `refit launch FILE`")
    name = Path(cmd[2]).name
    path = ROOT / "examples" / "topologies" / name
    if not path.exists():
        fail(f"the command launches {cmd[2]}, and examples/topologies/{name} does not exist")
    return cmd, path, tomllib.loads(path.read_text())


def env_of(c, pod):
    out = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = str(e["value"])
            continue
        src = e.get("valueFrom", {})
        if "fieldRef" in src:
            field = src["fieldRef"]["fieldPath"]
            out[e["name"]] = {"metadata.name": pod, "metadata.namespace": NAMESPACE}[field]
        elif "secretKeyRef" in src:
            out[e["name"]] = "<secret>"
        else:
            fail(f"env {e['name']}: a source this reader does not know: {src}")
    return out


def check(path):
    svc, sts = load(path)
    c = container(sts)
    cmd, topo_path, topo = topology_of(c)
    svc_name = svc["metadata"]["name"]
    spec = sts["spec"]
    labels = spec["template"]["metadata"]["labels"]
    checks = []

    def need(ok, what):
        if not ok:
            fail(f"{path}: {what}")
        checks.append(what)

    need(svc["spec"].get("clusterIP") == "None", "the Service is headless (clusterIP: None)")
    need(svc["spec"].get("publishNotReadyAddresses") is True,
         "the Service publishes the pods' names before they are Ready")
    need(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()),
         "the Service selects the StatefulSet's pods")
    need(spec.get("serviceName") == svc_name, f"the StatefulSet's serviceName is `{svc_name}`")
    need(spec["selector"]["matchLabels"] == {k: labels[k] for k in spec["selector"]["matchLabels"]},
         "the StatefulSet's selector matches its pods' labels")
    need(spec.get("podManagementPolicy") == "Parallel", "the pods start in parallel")
    hosts = topo.get("host", [])
    need(hosts and all("addr" not in h for h in hosts),
         f"{topo_path.name} leaves every host's address to the pods")
    ranks = sum(p.get("replicas", 1) for p in topo["process"])
    need(spec["replicas"] == len(hosts) == ranks,
         f"one pod per host and per rank ({spec['replicas']} replicas, {len(hosts)} hosts, {ranks} ranks)")
    env = env_of(c, f"{sts['metadata']['name']}-0")
    need(env.get("REFIT_K8S_SERVICE") == svc_name, f"REFIT_K8S_SERVICE names the Service `{svc_name}`")
    need(env.get("REFIT_TOKEN") == "<secret>", "REFIT_TOKEN comes from a Secret")
    need(not ({"RANK", "WORLD_SIZE", "MASTER_ADDR"} & env.keys()),
         "no RANK, WORLD_SIZE or MASTER_ADDR: refit launch takes them from the pod")
    ports = {p.get("port") for p in topo["process"]}
    need(None not in ports, f"every process of {topo_path.name} has a fixed `port`")
    need(all(p.get("bind") == "0.0.0.0" for p in topo["process"]),
         f"every process of {topo_path.name} listens on 0.0.0.0")
    container_ports = {p["containerPort"] for p in c.get("ports", [])}
    svc_ports = {p["port"] for p in svc["spec"].get("ports", [])}
    need(ports <= container_ports and ports <= svc_ports,
         f"the container and the Service name the ranks' ports {sorted(ports)}")
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    vols = {v["name"]: v for v in spec["template"]["spec"].get("volumes", [])}
    shm = [n for n, m in mounts.items() if m == "/dev/shm"]
    need(len(shm) == 1 and vols[shm[0]].get("emptyDir", {}).get("medium") == "Memory"
         and vols[shm[0]]["emptyDir"].get("sizeLimit"),
         "/dev/shm is a memory emptyDir with a sizeLimit")
    cm = [n for n, m in mounts.items() if Path(cmd[2]).parent == Path(m)]
    need(len(cm) == 1 and "configMap" in vols[cm[0]],
         f"the topology file {cmd[2]} comes from a ConfigMap")
    for what in checks:
        print(f"ok: {what}")


def pod(path, index):
    svc, sts = load(path)
    c = container(sts)
    name = f"{sts['metadata']['name']}-{index}"
    env = {"HOSTNAME": name, **env_of(c, name)}
    for k, v in env.items():
        print(f"{k}={v}")
    print("--")
    for arg in c["command"] + c.get("args", []):
        print(arg)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "check":
        check(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "replicas":
        print(load(sys.argv[2])[1]["spec"]["replicas"])
    elif len(sys.argv) == 4 and sys.argv[1] == "pod":
        pod(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)
