"""Attribute validation: an op instance's attributes, checked once, with its tensor formats parsed once."""

from __future__ import annotations

import math
from typing import Any

from trtkv.errors import TrtkvError
from trtkv.formats import MAX_SINK_TOKENS, TensorFormat, get_format, parse_tensor_spec

from .capabilities import op_refusal
from .limits import LIMITS
from .specs import FIX, PARSER_ATTRS, OpSpec, get_op

# format attribute -> the ``which`` it answers to (``Attrs.tensor_format``)
FORMAT_ATTRS = {"tensor_format": "x", "k_format": "k", "v_format": "v"}


def as_tensor_format(spec: str | TensorFormat) -> TensorFormat:
    """The one string -> TensorFormat step for Python callers that may hold a spec string (custom-op arguments)."""
    return spec if isinstance(spec, TensorFormat) else parse_tensor_spec(spec)


class Attrs(dict):
    """Validated attributes of one op instance (a dict in the op's declared attribute order).

    The values are what an ONNX node carries (format attributes are spec strings); the parsed
    ``TensorFormat`` objects travel beside them, parsed once by ``validate_attrs``."""

    op: OpSpec
    formats: dict[str, TensorFormat]

    def tensor_format(self, which: str) -> TensorFormat:
        """The TensorFormat of K ('k'), V ('v') or, for PagedKVSeal, its own format ('x')."""
        return self.formats[which]


def validate_attrs(op: OpSpec | str, raw: dict[str, Any]) -> Attrs:
    """Check and normalize an op's attributes; missing optional ones take their defaults.

    Raises TrtkvError naming the attribute, the bad value and the rule it breaks.
    """
    op = get_op(op) if isinstance(op, str) else op
    known = {a.name for a in op.attrs}
    extra = [k for k in raw if k not in known and k not in PARSER_ATTRS]
    if extra:
        raise TrtkvError(f"{op.name}: unknown attribute(s) {', '.join(sorted(extra))}",
                         f"{op.name} takes {', '.join(a.name for a in op.attrs)}")
    out = Attrs()
    out.op = op
    for a in op.attrs:
        if a.name in raw:
            v = raw[a.name]
        elif a.default is not None:
            v = a.default
        else:
            raise TrtkvError(f"{op.name}: missing attribute {a.name!r} ({a.doc})", FIX)
        if isinstance(v, bytes):
            v = v.decode()
        if isinstance(v, TensorFormat):  # an object from Python code: the node carries its spec string
            v = v.short()
        if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars / 1-element arrays
            v = v.item() if getattr(v, "size", 1) == 1 else v
        try:
            if a.type is int:
                if isinstance(v, float) and not v.is_integer() or isinstance(v, (str, bool)):
                    raise ValueError
                v = int(v)
            elif a.type is float:
                if isinstance(v, (str, bool)):
                    raise ValueError
                v = float(v)
            elif not isinstance(v, str):
                raise ValueError
        except (TypeError, ValueError):
            raise TrtkvError(f"{op.name}: attribute {a.name}={v!r} is not a {a.type.__name__}", FIX) from None
        out[a.name] = v
    out.formats = _check_values(op, out)
    return out


def _bad(op: OpSpec, name: str, value, rule: str) -> TrtkvError:
    return TrtkvError(f"{op.name}: attribute {name}={value!r} {rule}", FIX)


def _check_values(op: OpSpec, a: Attrs) -> dict[str, TensorFormat]:
    """Check every value; returns the parsed tensor formats by ``which``."""
    fmts = {}
    for key in FORMAT_ATTRS:
        if key in a:
            try:
                fmts[key] = parse_tensor_spec(a[key])
            except Exception as exc:  # pydantic ValidationError / ValueError
                msg = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)
                raise _bad(op, key, a[key], f"is not a tensor format spec ({msg})") from None
    d = a.get("head_dim")
    if d is not None and LIMITS.head_dim_problem(d):
        raise _bad(op, "head_dim", d, LIMITS.head_dim_problem(d))
    for key, f in fmts.items():
        if LIMITS.dtype_problem(f.dtype):
            raise _bad(op, key, a[key], LIMITS.dtype_problem(f.dtype))
        if f.mse:
            raise _bad(op, key, a[key], "searches block-channel ranges (mse), which the seal kernel does not implement yet")
        if (why := op_refusal(f)) is not None:  # the capability table: codebooks, outlier lists, pre-RoPE keys
            raise _bad(op, key, a[key], why)
        try:
            f.check_head_dim(d)
        except TrtkvError as exc:
            raise _bad(op, key, a[key], f"does not fit head_dim {d}: {exc.problem}") from None
    kvh = a.get("num_kv_heads")
    if kvh is not None and kvh < 1:
        raise _bad(op, "num_kv_heads", kvh, "must be >= 1")
    qh = a.get("num_q_heads")
    if qh is not None and (qh < 1 or qh % kvh):
        raise _bad(op, "num_q_heads", qh, f"must be a positive multiple of num_kv_heads={kvh}")
    bs = a.get("block_size")
    if bs is not None and LIMITS.block_size_problem(bs):
        raise _bad(op, "block_size", bs, LIMITS.block_size_problem(bs))
    sink = a.get("sink_tokens")
    if sink is not None and not (0 <= sink <= MAX_SINK_TOKENS and (bs is None or sink < bs)):
        raise _bad(op, "sink_tokens", sink, f"must be in [0, {MAX_SINK_TOKENS}] and below block_size")
    ps = a.get("partition_size")
    if ps is not None and LIMITS.partition_problem(ps):
        raise _bad(op, "partition_size", ps, LIMITS.partition_problem(ps))
    s = a.get("sm_scale")
    if s is not None and not (math.isfinite(s) and s > 0):
        raise _bad(op, "sm_scale", s, "must be a finite positive number")
    p = a.get("precision")
    if p is not None and p not in ("ieee", "tf32x3", "tf32"):
        raise _bad(op, "precision", p, "must be one of ieee, tf32x3, tf32")
    return {FORMAT_ATTRS[key]: f for key, f in fmts.items()}


def attrs_for(op: OpSpec | str, fmt, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int | None = None, sm_scale: float | None = None,
              partition_size: int = LIMITS.default_partition, precision: str = "tf32x3", which: str = "k") -> Attrs:
    """Attributes of ``op`` for a KVFormat (or spec string) and model geometry: the builder's shortcut.

    ``block_size`` defaults to the format's own (``block=N``); a format without one takes the cache's."""
    op = get_op(op) if isinstance(op, str) else op
    f = get_format(fmt)
    bs = block_size if block_size is not None else f.block_size
    if bs is None:
        raise TrtkvError(f"format {f.name!r} has no block size of its own", "pass block_size (the cache's block size)")
    if f.block_size is not None and f.block_size != bs:
        raise TrtkvError(f"format {f.name!r} seals blocks of {f.block_size} tokens, not {bs}",
                         f"use block_size={f.block_size}")
    every = dict(
        tensor_format=(f.k if which == "k" else f.v).short(), k_format=f.k.short(), v_format=f.v.short(),
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=bs, sink_tokens=f.sink_tokens,
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        partition_size=partition_size, precision=precision,
    )
    return validate_attrs(op, {a.name: every[a.name] for a in op.attrs})
