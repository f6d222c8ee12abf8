#!/usr/bin/env python3
"""Checks the Gateway API custom resources in deploy/kubernetes/ against the
upstream CRD schemas vendored in .ci/schemas/; run by .ci/deploy-check.

    python3 .ci/crd_validate.py [FILE...]     # default: deploy/kubernetes/**/*.yaml
    python3 .ci/crd_validate.py extract CRD.yaml VERSION SOURCE OUT.json
                                              # vendor one version's schema (.ci/schemas/README.md)

Every YAML document whose apiVersion belongs to the Gateway API or the
Inference Extension (gateway.networking.k8s.io, inference.networking.k8s.io
and their x-k8s.io groups) must have a vendored schema for its exact
apiVersion and kind, and is validated against it with `jsonschema`. A
document of those groups without one fails, so no such resource goes
unchecked; other documents (core objects, checked by kubernetes-validate,
and other CRs such as the ServiceMonitor) are passed over.

The CRD's openAPIV3Schema is turned into a JSON Schema the way the API
server reads it:

  * unknown fields fail, as with kubectl's default --validate=strict (the
    API server's strict field validation): every object schema that has
    `properties` and neither `additionalProperties` nor
    `x-kubernetes-preserve-unknown-fields: true` gets
    `additionalProperties: false`;
  * `metadata` (left open in every CRD) gets a small ObjectMeta schema, so
    a misspelled `labels` fails too;
  * `x-kubernetes-int-or-string: true` allows an integer or a string,
    `nullable: true` allows null, `x-kubernetes-list-type: set` means
    unique items;
  * the other `x-kubernetes-*` keys are dropped: CEL rules
    (`x-kubernetes-validations`) are not evaluated, nor the key uniqueness
    of `x-kubernetes-list-type: map`; `format` (int32, date-time) is not
    checked.

Prints one line per resource checked; on an error, the file, the object and
the path of each error, and exits 1. Needs PyYAML and jsonschema.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / ".ci" / "schemas"
MANIFESTS = ROOT / "deploy" / "kubernetes"
# Resources of these API groups must have a vendored schema.
GATEWAY_GROUPS = (
    "gateway.networking.k8s.io",
    "gateway.networking.x-k8s.io",
    "inference.networking.k8s.io",
    "inference.networking.x-k8s.io",
)

# The fields of metav1.ObjectMeta; the API server ignores the read-only ones
# on create, so they are allowed with any value.
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "generateName": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
        "uid": {},
        "resourceVersion": {},
        "generation": {},
        "creationTimestamp": {},
        "deletionTimestamp": {},
        "deletionGracePeriodSeconds": {},
        "managedFields": {},
        "selfLink": {},
    },
    "additionalProperties": False,
}


def sub_schemas(node: dict):
    """The schemas directly inside one schema node, as (container, key) pairs."""
    for name in node.get("properties", {}):
        yield node["properties"], name
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            yield node, key
    for key in ("allOf", "anyOf", "oneOf"):
        for i in range(len(node.get(key, []))):
            yield node[key], i


def to_json_schema(node: dict) -> dict:
    """A Kubernetes structural schema as JSON Schema (see the module's doc);
    changes NODE in place."""
    for container, key in list(sub_schemas(node)):
        container[key] = to_json_schema(container[key])
    ext = {k: node.pop(k) for k in list(node) if k.startswith("x-kubernetes-") or k == "nullable"}
    if ext.get("x-kubernetes-int-or-string"):
        node.pop("type", None)
        node.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if ext.get("x-kubernetes-list-type") == "set":
        node["uniqueItems"] = True
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not ext.get("x-kubernetes-preserve-unknown-fields")
    ):
        node["additionalProperties"] = False
    if ext.get("nullable") and "type" in node:
        node["type"] = [node["type"], "null"]
    return node


def load_schemas() -> dict[tuple[str, str], tuple]:
    from jsonschema import Draft202012Validator

    validators = {}
    for p in sorted(SCHEMAS.glob("*.json")):
        vendored = json.loads(p.read_text())
        schema = to_json_schema(copy.deepcopy(vendored["openAPIV3Schema"]))
        schema["properties"]["metadata"] = OBJECT_META
        Draft202012Validator.check_schema(schema)
        key = (vendored["apiVersion"], vendored["kind"])
        if key in validators:
            sys.exit(f"crd_validate: two schemas in {SCHEMAS} for {key[0]} {key[1]}")
        validators[key] = (Draft202012Validator(schema), p.name, vendored["source"])
    return validators


def path_of(error) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(the object)"


def check(files: list[Path]) -> int:
    validators = load_schemas()
    problems = 0
    checked = others = 0
    for p in files:
        name = str(p.resolve().relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p)
        try:
            docs = list(yaml.safe_load_all(p.read_text()))
        except (OSError, yaml.YAMLError) as e:
            print(f"crd_validate: {name}: cannot read: {e}")
            problems += 1
            continue
        for i, doc in enumerate(docs, 1):
            if not isinstance(doc, dict):
                continue
            api, kind = doc.get("apiVersion", ""), doc.get("kind", "")
            obj = f"{kind}/{(doc.get('metadata') or {}).get('name', '?')}"
            where = f"{name}: {obj} (document {i}, {api})"
            if str(api).split("/")[0] not in GATEWAY_GROUPS:
                others += 1
                continue
            if (api, kind) not in validators:
                print(f"   FAILED {where}: no schema for {api} {kind} in .ci/schemas/ (vendor it: .ci/schemas/README.md)")
                problems += 1
                continue
            validator, schema_file, _ = validators[(api, kind)]
            errors = sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
            if errors:
                print(f"   FAILED {where} against .ci/schemas/{schema_file}:")
                for e in errors:
                    print(f"      at {path_of(e)}: {e.message}")
                problems += 1
            else:
                print(f"   valid {where} against .ci/schemas/{schema_file}")
            checked += 1
    if problems:
        print(f"crd_validate: {problems} problem(s)")
        return 1
    if checked == 0:
        print("crd_validate: no Gateway API resource found to check")
        return 1
    print(f"crd_validate: {checked} custom resource(s) valid ({others} other document(s) passed over)")
    return 0


def strip_descriptions(node: dict) -> dict:
    """NODE without the schemas' descriptions; changes it in place."""
    node.pop("description", None)
    for container, key in list(sub_schemas(node)):
        strip_descriptions(container[key])
    return node


def extract(crd_file: str, version: str, source: str, out_file: str) -> int:
    """Writes one version's openAPIV3Schema of a CRD, descriptions left out."""
    crd = yaml.safe_load(Path(crd_file).read_text())
    spec = crd["spec"]
    found = [v for v in spec["versions"] if v["name"] == version]
    if not found:
        sys.exit(f"crd_validate: {crd_file} has no version {version}")
    schema = strip_descriptions(copy.deepcopy(found[0]["schema"]["openAPIV3Schema"]))
    vendored = {
        "apiVersion": f"{spec['group']}/{version}",
        "kind": spec["names"]["kind"],
        "source": source,
        "openAPIV3Schema": schema,
    }
    Path(out_file).write_text(json.dumps(vendored, indent=1) + "\n")
    print(f"crd_validate: wrote {out_file} ({vendored['apiVersion']} {vendored['kind']})")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["extract"]:
        if len(argv) != 5:
            sys.exit(__doc__)
        return extract(*argv[1:])
    files = [Path(a) for a in argv] or sorted(MANIFESTS.rglob("*.yaml"))
    return check(files)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
