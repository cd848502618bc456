"""From command-line words to kernel keys: `precompile`'s cross product and `why`/`show`'s key syntax.

Key syntax (what `kdajit cache ls` prints in its SPEC column, i.e. `key.spec_slug()`):
    akk_inverse.varlen-dense.chunk-64.io_dtype-bf16
    recompute_wu.beta_dtype-bf16.varlen-cu32.head_k-128.head_v-128.chunk-64.output_qg-false.io_dtype-bf16
optionally followed by `@<arch>` (default: --arch, else the current arch); or the key's JSON. A field
with a default (io_dtype: bf16) may be left out.
"""
from __future__ import annotations

import dataclasses
import itertools
import json

from kdajit import env
from kdajit import keys as kkeys
from kdajit.keys import ForwardSpec, KernelConfig, key_from_json

QG_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}
# ForwardSpec.safe_gate: the lower-bound gate's fast path, the any-gate path, or both
GATE_CHOICES = {"safe": (True,), "any": (False,), "both": (True, False)}
_FIELD_CHOICES = {"io_dtype": kkeys.IO_DTYPES, "beta_dtype": kkeys.BETA_DTYPES, "varlen": kkeys.VARLEN_MODES,
                  "chunk": kkeys.CHUNK_SIZES, "arch": kkeys.ARCHS}
_HEAD_DIM_FIELDS = ("head_k", "head_v")


def split_words(values: list[str] | None) -> list[str]:
    """Flatten repeated and comma-separated option values, keeping order, dropping duplicates."""
    out: list[str] = []
    for v in values or []:
        for word in v.split(","):
            word = word.strip()
            if word and word not in out:
                out.append(word)
    return out


def parse_kv(word: str) -> tuple[int, int]:
    """'128' -> (128, 128); '128x64' -> (K=128, V=64)."""
    try:
        if "x" in word:
            k, v = word.lower().split("x", 1)
            return int(k), int(v)
        return int(word), int(word)
    except ValueError:
        raise ValueError(f"--kv {word!r} is not a head dim like 128 or 128x64") from None


def parse_config(word: str, config_type: type = KernelConfig):
    """'warps=4' or 'persistent=true,raster=head' (field=value pairs, ',' or ';' separated) -> an
    instance of `config_type` (a template's config class); 'ref' is its reference configuration."""
    if word in ("ref", "default", ""):
        return config_type()
    fields = {f.name: f for f in dataclasses.fields(config_type)}
    values = {}
    for pair in word.split(";" if ";" in word else ","):
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise ValueError(f"config {word!r}: expected field=value pairs with fields {sorted(fields)} "
                             f"({config_type.__name__})")
        values[name] = _typed(value.strip(), fields[name].type, f"config {name}")
    return config_type(**values)


def config_applies(word: str, config_type: type) -> bool:
    """Whether every field a config word names belongs to `config_type` ('ref' fits every template)."""
    if word in ("ref", "default", ""):
        return True
    names = {pair.partition("=")[0].strip() for pair in word.split(";" if ";" in word else ",")}
    return names <= {f.name for f in dataclasses.fields(config_type)}


def _typed(text: str, type_name, what: str):
    type_name = getattr(type_name, "__name__", str(type_name))
    if type_name == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{what}={text!r} is not an integer") from None
    if type_name == "bool":
        if text.lower() in ("true", "1", "on", "yes"):
            return True
        if text.lower() in ("false", "0", "off", "no"):
            return False
        raise ValueError(f"{what}={text!r} is not a boolean")
    return text


def expand(archs: list[str], betas: list[str], varlens: list[str], kvs: list[tuple[int, int]],
           chunks: list[int], qgs: list[bool], only: list[str] | None = None,
           configs: list[str] | None = None, ios: list[str] = ("bf16",), gates: list[bool] = (True,)) -> list:
    """The distinct kernel keys of the cross product of ForwardSpec fields (validated), sorted.

    Keys that do not depend on a field (the inverse has no beta or head dims) appear once. Without
    `configs`, each spec's `kernel_keys` as they are (the reference configurations and the fused kernel's
    untuned one: what `kdajit.forward` runs without tuning). Each config word applies to the templates whose
    config class has its fields; a word that fits no selected template is an error.
    """
    only_set = set(only or kkeys.KEY_TYPES)
    unknown = only_set - set(kkeys.KEY_TYPES)
    if unknown:
        raise ValueError(f"--only {sorted(unknown)}: kernels are {sorted(kkeys.KEY_TYPES)}")
    found, used = {}, set()
    for arch, beta, varlen, (head_k, head_v), chunk, qg, io, gate in itertools.product(archs, betas, varlens, kvs,
                                                                                        chunks, qgs, ios, gates):
        spec = ForwardSpec(beta, varlen, head_k, head_v, chunk, qg, arch, io, gate)
        for key in spec.kernel_keys():
            if key.TEMPLATE not in only_set:
                continue
            if not configs:
                found[key.canonical()] = key
            for word in configs or ():
                if config_applies(word, key.CONFIG):
                    used.add(word)
                    k = dataclasses.replace(key, config=parse_config(word, key.CONFIG))
                    found[k.canonical()] = k
    unused = [w for w in configs or () if w not in used]
    if unused and found:
        raise ValueError(f"--config {unused[0]!r} fits none of the selected kernels ({sorted(only_set)})")
    return sorted(found.values(), key=lambda k: (k.arch, k.TEMPLATE, k.canonical()))


def parse_key(text: str, arch: str | None = None, config: str | None = None):
    """A kernel key from its slug (`<template>.<field>-<value>...[@arch]`) or its JSON; `config` is a
    config word for the key's template (default: its reference configuration)."""
    text = text.strip()
    if text.startswith("{"):
        return key_from_json(json.loads(text))
    if "@" in text:
        text, arch = text.rsplit("@", 1)
    template, *parts = text.split(".")
    if template not in kkeys.KEY_TYPES:
        raise ValueError(f"{template!r} is not a kernel; expected one of {sorted(kkeys.KEY_TYPES)}")
    cls = kkeys.KEY_TYPES[template]
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("arch", "config")}
    values = {}
    for part in parts:
        name, sep, value = part.partition("-")
        if not sep or name not in fields:
            raise ValueError(f"{part!r} in {text!r}: expected <field>-<value> with fields {list(fields)}")
        values[name] = _typed(value, fields[name].type, name)
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{text!r} lacks {missing}; write it as `kdajit cache ls` prints it, e.g. "
                         f"{cls.TEMPLATE}." + ".".join(f"{n}-..." for n in fields))
    if arch is None:
        from kdajit import compiler

        arch = compiler.current_arch()
    return cls(**values, arch=arch, config=parse_config(config or "ref", cls.CONFIG))


def unsupported(key) -> str | None:
    """Why no kernel can be built for `key` (a field out of range, a config its template rejects), or None.

    Asks the template itself (`can_implement`), which imports CuTe DSL once.
    """
    for f in dataclasses.fields(key):
        allowed = _FIELD_CHOICES.get(f.name)
        if allowed is not None and getattr(key, f.name) not in allowed:
            return f"{key.TEMPLATE}: {f.name}={getattr(key, f.name)!r} is not supported; expected one of {allowed}"
        if f.name in _HEAD_DIM_FIELDS and not kkeys.head_dim_supported(getattr(key, f.name)):
            return f"{key.TEMPLATE}: {f.name}={getattr(key, f.name)!r} is not supported; expected {kkeys.HEAD_DIM_RULE}"
    from kdajit import compiler

    env.prepare_cute_dsl(compiler.current_arch())
    cls = compiler.template_class(key)
    if not cls.can_implement(key):
        config = ",".join(f"{k}={v}" for k, v in dataclasses.asdict(key.config).items())
        return f"{key.TEMPLATE} ({cls.__name__}) cannot implement config {config}"
    return None

