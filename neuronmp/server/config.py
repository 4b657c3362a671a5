"""The model repository: Triton's layout and config fields, read and checked at start.

    DIR/<model>/config.pbtxt | config.json     (optional: derived from the trace if absent)
    DIR/<model>/<version>/model.pt             (a neuronmp.trace saved with torch.jit.save)

Fields read (Triton's names): ``max_batch_size``, ``input`` / ``output`` (``name``,
``data_type``, ``dims``), ``dynamic_batching { max_queue_delay_microseconds,
preferred_batch_size, priority_levels, default_priority_level, default_queue_policy {
max_queue_size, default_timeout_microseconds, allow_timeout_override },
priority_queue_policy { key: LEVEL value { ...the same fields } } }``,
``instance_group [{ count, kind }]`` (count = cores for the model), ``model_warmup``
(any entry: warm every core before ready; neuronmp always warms), ``version_policy``
(latest only), and neuronmp's own ``parameters``: ``{ key: "device_time_us" value: {
string_value: "500,20" } }`` (a latency model, see neuronmp.host.devicetime) and ``{ key:
"batch_buckets" value: { string_value: "1,4,8,16,32" } }`` (the batch sizes the trace has a
graph for, see docs/guides/batch-buckets.md); ``name``, ``platform`` and ``backend`` are
accepted as Triton writes them.  Any other field is refused, as protobuf's text format
refuses it (a typo such as ``max_batch_sise`` would otherwise go unnoticed), and so is a
file that is not UTF-8, nests deeper than ``MAX_DEPTH``, or holds a number of more than
``MAX_DIGITS`` digits.  Anything wrong raises ModelConfigError naming the file, the field
and what is accepted.  Imports no torch.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .errors import ModelConfigError

#: KServe v2 datatype for each config data_type.
DATATYPES = {
    "TYPE_BOOL": "BOOL", "TYPE_UINT8": "UINT8", "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32", "TYPE_UINT64": "UINT64", "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16", "TYPE_FP32": "FP32", "TYPE_FP64": "FP64", "TYPE_BF16": "BF16",
}
MODEL_FILE = "model.pt"
#: Deepest nesting of messages and lists read (Triton's configs need a handful).
MAX_DEPTH = 32
#: Longest number read: int64 has 19 digits.
MAX_DIGITS = 20

# the fields of each message neuronmp reads (model_warmup and version_policy are
# taken whole: neuronmp always warms every core and serves the latest version)
_TOP = ("name", "platform", "backend", "max_batch_size", "input", "output",
        "dynamic_batching", "instance_group", "model_warmup", "version_policy", "parameters")
_TENSOR = ("name", "data_type", "dims")
_BATCHING = ("max_queue_delay_microseconds", "preferred_batch_size", "priority_levels",
             "default_priority_level", "default_queue_policy", "priority_queue_policy",
             "preserve_ordering")
_POLICY = ("max_queue_size", "default_timeout_microseconds", "allow_timeout_override",
           "timeout_action")
_GROUP = ("name", "count", "kind")
_ENTRY = ("key", "value")


@dataclass
class TensorConfig:
    name: str
    datatype: str          # KServe v2 name: FP32, INT64, ...
    dims: Tuple[int, ...]  # without the batch dimension when max_batch_size > 0


@dataclass
class QueuePolicyConfig:
    """Triton's ModelQueuePolicy: the default one, or one priority level's."""

    max_queue_size: Optional[int] = None    # None: no bound (Triton's 0)
    default_timeout_us: int = 0             # 0: no timeout
    allow_timeout_override: bool = True


@dataclass
class ModelConfig:
    name: str
    version: str
    path: str                         # the model.pt to load
    source: str                       # the config file, or "(derived)"
    max_batch_size: Optional[int] = None
    inputs: List[TensorConfig] = field(default_factory=list)
    outputs: List[TensorConfig] = field(default_factory=list)
    max_queue_delay_us: int = 100
    preferred_batch_size: Tuple[int, ...] = ()
    priority_levels: int = 0
    default_priority_level: int = 0
    max_queue_size: Optional[int] = None
    default_timeout_us: int = 0
    allow_timeout_override: bool = True
    priority_queue_policy: Dict[int, QueuePolicyConfig] = field(default_factory=dict)
    count: int = 1
    device_time: Optional[str] = None
    batch_buckets: Optional[Tuple[int, ...]] = None   # neuronmp's: graphs per batch size
    raw: Dict[str, Any] = field(default_factory=dict)


# -- protobuf text format (the subset config.pbtxt files use) ---------------------------

_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{}\[\]:,;<>]|'
                    r'[A-Za-z0-9_.+\-]+')


def parse_pbtxt(text: str, path: str = "config.pbtxt") -> Dict[str, Any]:
    """A dict of the message; a field given more than once becomes a list."""
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            line = text.count("\n", 0, pos) + 1
            raise ModelConfigError(path, f"(syntax, line {line})", text[pos:pos + 20],
                                   "protobuf text format (name: value, name { ... }, [a, b])")
        tok = m.group()
        if tok.strip() and not tok.startswith("#"):
            tokens.append(tok)
        pos = m.end()
    message, _ = _message(tokens, 0, path, top=True)
    return message


def _message(tokens, pos, path, top=False, depth=0):
    if depth > MAX_DEPTH:
        raise ModelConfigError(path, "(syntax)", f"messages nested over {MAX_DEPTH} deep",
                               f"messages and lists nested at most {MAX_DEPTH} deep")
    out: Dict[str, Any] = {}
    while pos < len(tokens):
        tok = tokens[pos]
        if tok in ("}", ">"):
            if top:
                raise ModelConfigError(path, "(syntax)", tok, "balanced { }")
            return out, pos + 1
        if tok in (",", ";"):
            pos += 1
            continue
        name = tok
        pos += 1
        if pos < len(tokens) and tokens[pos] == ":":
            pos += 1
        if pos >= len(tokens):
            raise ModelConfigError(path, name, "(missing)", "a value after the field name")
        value, pos = _value(tokens, pos, path, name, depth)
        if name in out:
            prev = out[name]
            out[name] = (prev if isinstance(prev, list) else [prev]) + \
                (value if isinstance(value, list) else [value])
        else:
            out[name] = value
    if not top:
        raise ModelConfigError(path, "(syntax)", "end of file", "a closing }")
    return out, pos


def _value(tokens, pos, path, name, depth=0):
    tok = tokens[pos]
    if tok in ("{", "<"):
        return _message(tokens, pos + 1, path, depth=depth + 1)
    if tok == "[":
        if depth + 1 > MAX_DEPTH:
            raise ModelConfigError(path, name, f"lists nested over {MAX_DEPTH} deep",
                                   f"messages and lists nested at most {MAX_DEPTH} deep")
        items, pos = [], pos + 1
        while pos < len(tokens) and tokens[pos] != "]":
            if tokens[pos] == ",":
                pos += 1
                continue
            item, pos = _value(tokens, pos, path, name, depth + 1)
            items.append(item)
        return items, pos + 1
    if tok[0] in "\"'":
        try:
            return bytes(tok[1:-1], "utf-8").decode("unicode_escape"), pos + 1
        except UnicodeDecodeError as exc:
            raise ModelConfigError(path, name, tok[:40], f"a string with valid escapes ({exc})"
                                   ) from None
    return _scalar(tok, path, name), pos + 1


def _scalar(tok: str, path: str = "config.pbtxt", name: str = "(value)") -> Any:
    if tok in ("true", "True"):
        return True
    if tok in ("false", "False"):
        return False
    digits = sum(c.isdigit() for c in tok)
    if digits > MAX_DIGITS:
        raise ModelConfigError(path, name, f"a number of {digits} digits",
                               f"numbers of at most {MAX_DIGITS} digits")
    try:
        return int(tok)
    except ValueError:
        pass
    try:
        value = float(tok)
    except ValueError:
        return tok  # an enum name such as TYPE_FP32 or KIND_CPU
    if value != value or value in (float("inf"), float("-inf")):
        raise ModelConfigError(path, name, tok, "a finite number")
    return value


# -- the repository -------------------------------------------------------------------


def load_repository(root: str) -> List[ModelConfig]:
    """Every model of the repository ``root``, checked; ModelConfigError on the first
    problem (the server must not start half-configured)."""
    if not os.path.isdir(root):
        raise ModelConfigError(root, "--model-repository", root, "an existing directory")
    models = []
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if os.path.isdir(folder) and not name.startswith("."):
            models.append(load_model(folder))
    if not models:
        raise ModelConfigError(root, "--model-repository", root,
                               "a directory with at least one <model>/<version>/model.pt")
    return models


def load_model(folder: str) -> ModelConfig:
    name = os.path.basename(folder.rstrip("/"))
    version = _latest_version(folder)
    path = os.path.join(folder, version, MODEL_FILE)
    raw, source = _read_config(folder)
    cfg = ModelConfig(name=name, version=version, path=path, source=source, raw=raw)
    if raw:
        _apply(cfg, raw, source)
    return cfg


def _latest_version(folder: str) -> str:
    versions = [v for v in os.listdir(folder) if v.isascii() and v.isdigit()
                and os.path.isfile(os.path.join(folder, v, MODEL_FILE))]
    if not versions:
        raise ModelConfigError(folder, "version", sorted(os.listdir(folder)),
                               f"at least one <version>/{MODEL_FILE} (a numeric folder holding "
                               "a neuronmp.trace saved with torch.jit.save)")
    return max(versions, key=int)


def _read_config(folder: str) -> Tuple[Dict[str, Any], str]:
    pbtxt = os.path.join(folder, "config.pbtxt")
    js = os.path.join(folder, "config.json")
    if os.path.exists(pbtxt):
        raw = parse_pbtxt(_text(pbtxt), pbtxt)
        _known(pbtxt, "", raw, _TOP)
        return raw, pbtxt
    if os.path.exists(js):
        raw = _json(js, _text(js))
        _known(js, "", raw, _TOP)
        return raw, js
    return {}, "(derived from the trace)"


def _text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ModelConfigError(path, "(file)", exc.strerror, "a readable file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelConfigError(path, "(encoding)", f"byte {data[exc.start]:#04x} at offset "
                               f"{exc.start}", "UTF-8 text") from None


def _json(path: str, text: str) -> Dict[str, Any]:
    def number(kind):
        def parse(tok: str):
            digits = sum(c.isdigit() for c in tok)
            if digits > MAX_DIGITS:
                raise ModelConfigError(path, "(number)", f"a number of {digits} digits",
                                       f"numbers of at most {MAX_DIGITS} digits")
            return kind(tok)
        return parse

    def constant(tok: str):
        raise ModelConfigError(path, "(number)", tok, "a finite number")

    try:
        raw = json.loads(text, parse_int=number(int), parse_float=number(float),
                         parse_constant=constant)
    except RecursionError:
        raise ModelConfigError(path, "(syntax)", "objects and lists nested too deeply",
                               f"a JSON object nested at most {MAX_DEPTH} deep") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(path, "(syntax)", str(exc), "a JSON object") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(path, "(top level)", f"a JSON {type(raw).__name__}",
                               "a JSON object {\"max_batch_size\": ..., ...}")
    if _depth(raw) > MAX_DEPTH:
        raise ModelConfigError(path, "(syntax)", f"objects and lists nested over {MAX_DEPTH} "
                               "deep", f"a JSON object nested at most {MAX_DEPTH} deep")
    return raw


def _depth(value: Any) -> int:
    """How deep ``value`` nests (stops counting past MAX_DEPTH + 1)."""
    level, frontier = 0, [value]
    while frontier and level <= MAX_DEPTH:
        level += 1
        frontier = [v for x in frontier for v in
                    (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())]
    return level if frontier else level - 1


def _known(src: str, where: str, message: Any, fields: Tuple[str, ...]) -> None:
    """Refuse a field of ``message`` that is not one of ``fields`` (as protobuf does)."""
    if not isinstance(message, dict):
        return   # the field's own check says what it must be
    for key in message:
        if key not in fields:
            raise ModelConfigError(src, f"{where}{key}", message[key],
                                   f"the fields {', '.join(fields)}"
                                   f"{' of ' + where.rstrip('.') if where else ''}")


def _apply(cfg: ModelConfig, raw: Dict[str, Any], src: str) -> None:
    if "name" in raw and raw["name"] != cfg.name:
        raise ModelConfigError(src, "name", raw["name"], f"the folder's name '{cfg.name}'")
    if "max_batch_size" in raw:
        cfg.max_batch_size = _int(src, "max_batch_size", raw["max_batch_size"], 0)
    cfg.inputs = [_tensor(src, f"input[{i}]", t) for i, t in enumerate(_list(raw.get("input")))]
    cfg.outputs = [_tensor(src, f"output[{i}]", t)
                   for i, t in enumerate(_list(raw.get("output")))]
    _dynamic_batching(cfg, raw.get("dynamic_batching"), src)
    if cfg.max_batch_size is not None:
        check_preferred(cfg)
    groups = _list(raw.get("instance_group"))
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise ModelConfigError(src, f"instance_group[{i}]", g, "a message { count, kind }")
        _known(src, f"instance_group[{i}].", g, _GROUP)
    if groups:
        cfg.count = sum(_int(src, f"instance_group[{i}].count", g.get("count", 1), 1)
                        for i, g in enumerate(groups))
    for i, p in enumerate(_list(raw.get("parameters"))):
        if "key" in (p if isinstance(p, dict) else {}):   # pbtxt's map entries
            _known(src, f"parameters[{i}].", p, _ENTRY)
    cfg.device_time = _parameter(raw, "device_time_us")
    buckets = _parameter(raw, "batch_buckets")
    if buckets is not None:
        cfg.batch_buckets = _buckets(src, buckets)


def _parameter(raw: Dict[str, Any], key: str) -> Optional[str]:
    """A model parameter's string value: pbtxt's ``parameters { key: K value {
    string_value: V } }`` (a list of key/value entries) or config.json's map form
    ``"parameters": {K: {"string_value": V}}``; None when absent."""
    params = raw.get("parameters")
    if isinstance(params, dict) and key in params:
        value = params[key]
        return value.get("string_value") if isinstance(value, dict) else str(value)
    for p in _list(params):
        if isinstance(p, dict) and p.get("key") == key:
            value = p.get("value", {})
            return value.get("string_value") if isinstance(value, dict) else value
    return None


def _buckets(src: str, value: Any) -> Tuple[int, ...]:
    """``"1,4,8,16,32"`` as batch sizes (their order and the trace are checked when the
    model is loaded, against the trace)."""
    try:
        return tuple(int(part) for part in str(value).split(","))
    except ValueError:
        raise ModelConfigError(src, "parameters.batch_buckets", value,
                               'a comma-separated list of batch sizes such as "1,4,8,16,32"'
                               ) from None


def _dynamic_batching(cfg: ModelConfig, db: Any, src: str) -> None:
    if db is None:
        return
    if not isinstance(db, dict):
        raise ModelConfigError(src, "dynamic_batching", db, "a message { ... }")
    f = "dynamic_batching."
    _known(src, f, db, _BATCHING)
    cfg.max_queue_delay_us = _int(src, f + "max_queue_delay_microseconds",
                                  db.get("max_queue_delay_microseconds", 100), 0)
    cfg.preferred_batch_size = tuple(_int(src, f + "preferred_batch_size", b, 1)
                                     for b in _list(db.get("preferred_batch_size")))
    cfg.priority_levels = _int(src, f + "priority_levels", db.get("priority_levels", 0), 0)
    cfg.default_priority_level = _int(src, f + "default_priority_level",
                                      db.get("default_priority_level", 0), 0)
    levels = cfg.priority_levels
    if levels and not 1 <= cfg.default_priority_level <= levels:   # Triton's rule
        raise ModelConfigError(src, f + "default_priority_level", cfg.default_priority_level,
                               f"1..priority_levels ({levels})")
    if not levels and cfg.default_priority_level:
        raise ModelConfigError(src, f + "default_priority_level", cfg.default_priority_level,
                               "0 (priority_levels is 0)")
    default = _queue_policy(src, f + "default_queue_policy",
                            db.get("default_queue_policy") or {})
    cfg.max_queue_size = default.max_queue_size
    cfg.default_timeout_us = default.default_timeout_us
    cfg.allow_timeout_override = default.allow_timeout_override
    cfg.priority_queue_policy = _level_policies(src, f + "priority_queue_policy",
                                                db.get("priority_queue_policy"), levels)


def _queue_policy(src: str, where: str, policy: Any) -> QueuePolicyConfig:
    if not isinstance(policy, dict):
        raise ModelConfigError(src, where, policy, "a message { max_queue_size ... }")
    q = where + "."
    _known(src, q, policy, _POLICY)
    size = _int(src, q + "max_queue_size", policy.get("max_queue_size", 0), 0)
    action = policy.get("timeout_action", "REJECT")
    if action != "REJECT":
        raise ModelConfigError(src, q + "timeout_action", action,
                               "REJECT (a request past its timeout fails; DELAY is not "
                               "supported)")
    return QueuePolicyConfig(
        size or None,
        _int(src, q + "default_timeout_microseconds",
             policy.get("default_timeout_microseconds", 0), 0),
        bool(policy.get("allow_timeout_override", True)))


def _level_policies(src: str, where: str, raw: Any, levels: int) -> Dict[int, QueuePolicyConfig]:
    """The map field: ``{ key: 1 value { ... } }`` entries in pbtxt, an object keyed by
    level in config.json."""
    if raw is None:
        return {}
    if isinstance(raw, dict) and "key" not in raw:       # JSON's map form
        entries = [{"key": k, "value": v} for k, v in raw.items()]
    else:
        entries = _list(raw)
    out: Dict[int, QueuePolicyConfig] = {}
    for entry in entries:
        if not isinstance(entry, dict) or "key" not in entry:
            raise ModelConfigError(src, where, entry, "entries { key: LEVEL value { ... } }")
        _known(src, where + ".", entry, _ENTRY)
        level = _int(src, where + " key", entry["key"], 1)
        if level > levels:
            raise ModelConfigError(src, where + " key", level,
                                   f"a priority level 1..priority_levels ({levels})")
        out[level] = _queue_policy(src, f"{where}[{level}]", entry.get("value") or {})
    return out


def check_preferred(cfg: ModelConfig) -> None:
    """Triton's rule: every preferred batch size fits max_batch_size (known once the
    config gives it or the trace does)."""
    where = "dynamic_batching.preferred_batch_size"
    if cfg.preferred_batch_size and not cfg.max_batch_size:
        raise ModelConfigError(cfg.source, where, list(cfg.preferred_batch_size),
                               "none: max_batch_size is 0 (the model takes no batch)")
    for size in cfg.preferred_batch_size:
        if size > cfg.max_batch_size:
            raise ModelConfigError(cfg.source, where, size,
                                   f"row counts in 1..max_batch_size ({cfg.max_batch_size})")


def _tensor(src: str, where: str, t: Any) -> TensorConfig:
    if not isinstance(t, dict) or "name" not in t:
        raise ModelConfigError(src, where, t, "a message with name, data_type and dims")
    _known(src, where + ".", t, _TENSOR)
    dtype = t.get("data_type")
    if dtype not in DATATYPES:
        raise ModelConfigError(src, f"{where}.data_type", dtype, ", ".join(DATATYPES))
    dims = tuple(_int(src, f"{where}.dims", d, -1) for d in _list(t.get("dims")))
    if 0 in dims or any(d < -1 for d in dims):
        raise ModelConfigError(src, f"{where}.dims", list(dims), "sizes >= 1 (or -1)")
    return TensorConfig(str(t["name"]), DATATYPES[dtype], dims)


def _list(value: Any) -> List[Any]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _int(src: str, name: str, value: Any, low: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isascii() and \
            value.strip().lstrip("-").isdigit():
        value = int(value)  # config.json writes int64 fields as strings, as protobuf does
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ModelConfigError(src, name, value, f"a whole number >= {low}")
    return value
