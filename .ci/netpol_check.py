"""The rendered gateway overlay (kubectl kustomize output on stdin) lets the
gateway reach the DP group's pod: a NetworkPolicy rule selecting the pods of
the HTTPRoute's Gateway admits the InferencePool's target ports (the engine)
and its endpoint picker's port (dpcoord). Prints one line; exit 1 if not."""

import sys

import yaml

docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
kinds = {}
for d in docs:
    kinds.setdefault(d["kind"], []).append(d)
gateway = kinds["HTTPRoute"][0]["spec"]["parentRefs"][0]["name"]
pool = kinds["InferencePool"][0]["spec"]
wanted = {p["number"] for p in pool["targetPorts"]} | {pool["endpointPickerRef"]["port"]["number"]}
admitted = set()
for policy in kinds.get("NetworkPolicy", []):
    for rule in policy["spec"].get("ingress", []):
        sources = [f.get("podSelector", {}).get("matchLabels", {}) for f in rule.get("from", [])]
        if any(gateway in labels.values() for labels in sources):
            admitted |= {p["port"] for p in rule.get("ports", [])}
missing = sorted(wanted - admitted)
if missing:
    print(f"the pods of Gateway {gateway} are not admitted to ports {missing} by any NetworkPolicy")
    sys.exit(1)
print(f"the pods of Gateway {gateway} are admitted to ports {sorted(wanted)} (engine and picker)")
