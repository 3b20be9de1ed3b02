"""The grammar-engine comparison's cases (bench/grammar_engines.py): the schemas, documents, regex and CFG it
compiles and walks, the invalid documents a faithful mask refuses, and the tokenizers it measures at."""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: the other core is someone else's

import jsonschema  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "services/inference/bundled/zq-python-tiny/tokenizer.json"
TRAINED = ROOT / "bench/out/grammar-engines/bpe-49152.json"
EOS = 0  # "<|endoftext|>" in both tokenizers

log = logging.getLogger("grammar_engines")

# The schemas and documents as JSON text: the format callers send them in, and dense enough to read at a glance.
# Every document is valid for its schema (checked with jsonschema at start) and lists keys in schema order, which
# xgrammar and outlines-core require (llguidance too, with its default options).
SCHEMAS = {
    "tool_call": """{"type": "object", "additionalProperties": false, "required": ["location", "unit"], "properties": {
  "location": {"type": "string", "description": "city and country"},
  "unit": {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]},
  "days": {"type": "integer", "minimum": 1, "maximum": 14}, "include_hourly": {"type": "boolean"},
  "fields": {"type": "array", "items": {"enum": ["temperature", "humidity", "wind", "precipitation", "uv"]}}}}""",
    "invoice": """{"type": "object", "additionalProperties": false,
 "required": ["invoice_id", "issued_at", "customer", "currency", "lines", "total", "paid"], "properties": {
  "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
  "issued_at": {"type": "string", "format": "date-time"},
  "customer": {"type": "object", "additionalProperties": false, "required": ["name", "email"], "properties": {
    "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
    "tax_id": {"type": ["string", "null"]}}},
  "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]},
  "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "additionalProperties": false,
    "required": ["sku", "quantity", "unit_price"], "properties": {
      "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "description": {"type": "string"},
      "quantity": {"type": "integer", "minimum": 1}, "unit_price": {"type": "number", "minimum": 0},
      "discount_pct": {"type": "number", "minimum": 0, "maximum": 100}}}},
  "total": {"type": "number", "minimum": 0}, "paid": {"type": "boolean"}, "notes": {"type": "string"}}}""",
    "issue": """{"type": "object", "additionalProperties": false, "$defs": {
  "user": {"type": "object", "additionalProperties": false, "required": ["login", "id", "type"], "properties": {
    "login": {"type": "string"}, "id": {"type": "integer", "minimum": 1},
    "type": {"enum": ["User", "Bot", "Organization"]}, "site_admin": {"type": "boolean"}}},
  "label": {"type": "object", "additionalProperties": false, "required": ["name", "color"], "properties": {
    "name": {"type": "string"}, "color": {"type": "string", "pattern": "^[0-9a-f]{6}$"}}},
  "time": {"type": "string", "format": "date-time"}},
 "required": ["id", "number", "title", "state", "locked", "user", "labels", "comments", "created_at", "updated_at"],
 "properties": {
  "id": {"type": "integer", "minimum": 1}, "number": {"type": "integer", "minimum": 1}, "node_id": {"type": "string"},
  "title": {"type": "string", "minLength": 1, "maxLength": 256},
  "body": {"anyOf": [{"type": "string"}, {"type": "null"}]},
  "state": {"enum": ["open", "closed"]},
  "state_reason": {"anyOf": [{"enum": ["completed", "not_planned", "reopened"]}, {"type": "null"}]},
  "locked": {"type": "boolean"}, "user": {"$ref": "#/$defs/user"},
  "assignee": {"anyOf": [{"$ref": "#/$defs/user"}, {"type": "null"}]},
  "assignees": {"type": "array", "items": {"$ref": "#/$defs/user"}, "maxItems": 10},
  "labels": {"type": "array", "items": {"$ref": "#/$defs/label"}},
  "milestone": {"anyOf": [{"type": "object", "additionalProperties": false, "required": ["number", "title"],
    "properties": {"number": {"type": "integer"}, "title": {"type": "string"},
                   "due_on": {"anyOf": [{"$ref": "#/$defs/time"}, {"type": "null"}]}}}, {"type": "null"}]},
  "comments": {"type": "integer", "minimum": 0}, "created_at": {"$ref": "#/$defs/time"},
  "updated_at": {"$ref": "#/$defs/time"}, "closed_at": {"anyOf": [{"$ref": "#/$defs/time"}, {"type": "null"}]},
  "author_association": {"enum": ["OWNER", "MEMBER", "COLLABORATOR", "CONTRIBUTOR", "FIRST_TIMER", "NONE"]},
  "html_url": {"type": "string", "pattern": "^https://[a-z0-9.-]+/[^ ]+$"},
  "reactions": {"type": "object", "additionalProperties": false, "required": ["total"], "properties": {
    "total": {"type": "integer", "minimum": 0}, "up": {"type": "integer", "minimum": 0},
    "down": {"type": "integer", "minimum": 0}, "heart": {"type": "integer", "minimum": 0}}},
  "draft": {"type": "boolean"},
  "priority": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 4}, {"enum": ["low", "high"]}]},
  "estimate_hours": {"type": ["number", "null"], "minimum": 0},
  "timeline": {"type": "array", "items": {"oneOf": [
    {"type": "object", "additionalProperties": false, "required": ["event", "label"],
     "properties": {"event": {"const": "labeled"}, "label": {"$ref": "#/$defs/label"}}},
    {"type": "object", "additionalProperties": false, "required": ["event", "body"],
     "properties": {"event": {"const": "commented"}, "actor": {"$ref": "#/$defs/user"}, "body": {"type": "string"}}},
    {"type": "object", "additionalProperties": false, "required": ["event", "at"],
     "properties": {"event": {"const": "closed"}, "at": {"$ref": "#/$defs/time"}}}]}},
  "sub_issues": {"type": "object", "additionalProperties": false, "required": ["total"], "properties": {
    "total": {"type": "integer"}, "completed": {"type": "integer"}, "percent": {"type": "number"}}},
  "active_lock_reason": {"anyOf": [{"enum": ["off-topic", "too heated", "resolved", "spam"]}, {"type": "null"}]},
  "performed_via_app": {"type": "null"}, "score": {"type": "number"}, "is_pinned": {"type": "boolean"},
  "repository": {"type": "string", "pattern": "^[a-z0-9-]+/[a-z0-9._-]+$"}}}""",
}
DOCS = {
    "tool_call": """{"location": "Lisbon, Portugal", "unit": "celsius", "days": 5,
 "fields": ["temperature", "wind"]}""",
    "invoice": """{"invoice_id": "INV-004217", "issued_at": "2026-12-04T09:30:00Z",
 "customer": {"name": "Acme Tooling GmbH", "email": "billing@acme-tooling.example", "tax_id": null}, "currency": "EUR",
 "lines": [{"sku": "BLT-0042", "description": "Hex bolts M8, box of 100", "quantity": 12, "unit_price": 8.5},
  {"sku": "WSH-1100", "quantity": 3, "unit_price": 2.25, "discount_pct": 10},
  {"sku": "DRL-7781", "description": "Cordless drill 18V", "quantity": 1, "unit_price": 129.99}],
 "total": 238.07, "paid": false, "notes": "Net 30; deliver to dock 4."}""",
    "issue": """{"id": 2210045, "number": 31, "node_id": "I_kwDOAbc123",
 "title": "Structured output: choose a grammar engine by measuring",
 "body": "We need JSON Schema, regex and a CFG. Compare the engines on the CPU.", "state": "open",
 "state_reason": null, "locked": false, "user": {"login": "alice", "id": 17, "type": "User"},
 "assignee": {"login": "bob-ops", "id": 4417, "type": "User", "site_admin": false},
 "assignees": [{"login": "bob-ops", "id": 4417, "type": "User", "site_admin": false}],
 "labels": [{"name": "bug", "color": "d73a4a"}, {"name": "structured-output", "color": "0e8a16"}],
 "milestone": {"number": 4, "title": "v0.2", "due_on": "2026-12-20T00:00:00Z"}, "comments": 3,
 "created_at": "2026-12-01T08:00:00Z", "updated_at": "2026-12-04T17:45:10Z", "closed_at": null,
 "author_association": "MEMBER", "html_url": "https://git.example.com/zeroqueue/issues/31",
 "reactions": {"total": 2, "up": 2}, "priority": "high", "estimate_hours": 6.5,
 "timeline": [{"event": "labeled", "label": {"name": "bug", "color": "d73a4a"}},
  {"event": "commented", "actor": {"login": "bob-ops", "id": 4417, "type": "User"}, "body": "llguidance is in."}],
 "sub_issues": {"total": 3, "completed": 1, "percent": 33.3}, "is_pinned": false,
 "repository": "zeroqueue/zeroqueue"}""",
}
REGEX = r"[a-z0-9._+-]{1,64}@[a-z0-9-]{1,63}(\.[a-z0-9-]{1,63}){1,4}"
REGEX_DOC = "ana.silva+billing@mail.example-corp.com"
# no whitespace rule: the walk's document has none, and every engine then builds the same language
LARK_CFG = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | NAME | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
NAME: /[a-z_][a-z0-9_]*/
"""
CFG_DOC = "(12+3.5)*rate-4/(x_1+2)*(7-y)+-(base*1.25)"


def cases() -> dict[str, tuple[str, object, str]]:
    """name -> (kind, source, document text): the 3 schemas, then a regex, a CFG and any JSON object."""
    out = {}
    for name, text in SCHEMAS.items():
        schema, doc = json.loads(text), json.loads(DOCS[name])
        jsonschema.validate(doc, schema, format_checker=jsonschema.FormatChecker())
        out[name] = ("json_schema", schema, json.dumps(doc, separators=(", ", ": ")))  # grammar.py's separators
    out["regex"] = ("regex", REGEX, REGEX_DOC)
    out["cfg"] = ("cfg", LARK_CFG, CFG_DOC)
    out["any_json"] = ("any_json", {"type": "object"}, out["invoice"][2])
    return out


# Invalid documents: (schema, path to the value, the bad value, the keyword it breaks). A faithful engine's mask
# refuses each somewhere; one that lets it through would let a model write output that fails validation.
PROBES = [
    ("tool_call", ("days",), 15, "maximum"),
    ("invoice", ("lines", 0, "quantity"), 0, "minimum"),
    ("invoice", ("lines",), [], "minItems"),
    ("invoice", ("lines", 0, "sku"), "blt-42", "pattern"),
    ("invoice", ("customer", "email"), "billing at acme", "format: email"),
    ("invoice", ("issued_at",), "2026-13-45T25:00:00Z", "format: date-time"),
    ("issue", ("title",), "", "minLength"),
    ("issue", ("priority",), 7, "maximum inside oneOf"),
    ("issue", ("timeline", 0, "event"), "commented", "oneOf: a branch's required key"),
]


def probe_text(schema: str, path: tuple, value) -> str:
    doc = json.loads(DOCS[schema])
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return json.dumps(doc, separators=(", ", ": "))


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (the printable stand-in character of each byte) -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {chr(b): b for b in keep} | {chr(256 + i): b for i, b in enumerate(moved)}


def trained_tokenizer(vocab_size: int = 49152) -> Tokenizer:
    """A byte-level BPE as large as a real model's, trained on the standard library like the bundled one."""
    if TRAINED.exists():
        return Tokenizer.from_file(str(TRAINED))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.rglob("*.py"))]
    log.info("training a %d-token BPE on %d stdlib files (once; cached in %s)", vocab_size, len(texts), TRAINED)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False, initial_alphabet=alphabet
    )
    tok.train_from_iterator(texts, trainer)
    TRAINED.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(TRAINED))
    return tok
