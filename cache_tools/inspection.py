"""`kdajit cache ls | show | why | verify`: read-only views of a cache root (verify --fix moves bad entries).

`ls` lists the tuning records after the kernels; `show` takes a record's path too (cache_tools.tuning)."""
from __future__ import annotations

import json
from pathlib import Path

from kdajit import cache_layout, hints
from kdajit.cache import describe
from kdajit.cache_entry import EntryCheck, check_entry, read_json_file
from kdajit.cache_publish import quarantine_entry
from kdajit.cache_toolchain import toolchain_components, toolchain_fingerprint
from kdajit.cache_tools import keyspec, tuning
from kdajit.cache_tools.entries import Entry, existing_root, iter_entries, read_toolchain, select_entries
from kdajit.cache_tools.units import human_size, print_table, short_time


def _toolchain_label(e: Entry) -> str:
    return "current" if e.current else f"stale tc-{e.toolchain[:8]}"


def ls(root: Path, archs: list[str] | None, spec: str | None, toolchain: str, as_json: bool) -> int:
    entries = select_entries(existing_root(root, "ls"), archs, spec, toolchain)
    fp = toolchain_fingerprint()
    record_rows, record_docs = tuning.record_rows(root)
    if as_json:
        print(json.dumps({"root": str(root), "toolchain": fp, "entries": [e.as_json() for e in entries],
                          "tuning_records": record_docs}, indent=1))
        return 0
    rows = [[e.arch, _toolchain_label(e), e.spec if e.meta else f"{e.spec} (no valid meta.json)", e.config,
             human_size(e.size), short_time(e.created), short_time(e.last_used)]
            for e in sorted(entries, key=lambda e: (e.arch, not e.current, e.spec, e.config))]
    if rows:
        print_table(rows, ["ARCH", "TOOLCHAIN", "SPEC", "CONFIG", "SIZE", "CREATED", "LAST USED"])
    total = sum(e.size for e in entries)
    print(f"{len(entries)} entries, {human_size(total)} under {root} (current toolchain tc-{fp})")
    if record_rows:
        print()
        print_table(record_rows, ["ARCH", "TOOLCHAIN", "SPEC", "RECORD", "WINNER", "VS REF", "NOTES"])
        print(f"{len(record_rows)} tuning records (`kdajit cache show <path>` lists every candidate)")
    return 0


def _path_under_root(root: Path, target: str, is_kind) -> str | None:
    """`target` as a relpath under `root` when it names an existing path of that kind (`is_kind`:
    Path.is_dir for entries, Path.is_file for records), else None; ValueError when it lies elsewhere."""
    for candidate in (Path(target), root / target):
        if is_kind(candidate):
            try:
                return candidate.absolute().relative_to(root.absolute()).as_posix()
            except ValueError:
                raise ValueError(f"{target} is not under the cache root {root}") from None
    return None


def _resolve_target(root: Path, target: str, arch: str | None, config) -> tuple[str, object | None]:
    """(relpath, key or None) for a `show`/`why` target: an entry path or a KEY."""
    relpath = _path_under_root(root, target, Path.is_dir)
    if relpath is not None:
        return cache_layout.parse_entry_relpath(relpath).relpath, None
    key = keyspec.parse_key(target, arch=arch, config=config)
    return cache_layout.entry_relpath(key, toolchain_fingerprint()), key


def show(root: Path, target: str, arch: str | None, config, as_json: bool) -> int:
    record = _path_under_root(existing_root(root, "show"), target, Path.is_file)
    if record is not None:
        return tuning.show_record(root, cache_layout.parse_record_relpath(record).relpath, as_json)
    relpath, key = _resolve_target(root, target, arch, config)
    where = cache_layout.parse_entry_relpath(relpath)
    check = check_entry(root, relpath, expect_key=key, expect_fp=where.toolchain)
    doc = {"path": str(root / relpath), "relpath": relpath, "status": check.status, "reason": check.reason,
           "toolchain": where.toolchain, "toolchain_current": where.toolchain == toolchain_fingerprint(),
           "meta": check.meta, "toolchain_components": read_toolchain(root, where.arch, where.toolchain)}
    if check.meta is None and check.status != "missing":
        raw = read_json_file(root / relpath / cache_layout.META)
        doc["meta_raw"] = json.dumps(raw)[:4000] if raw is not None else "(not a small JSON object)"
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"entry:     {doc['path']}")
        print(f"status:    {check.status}" + (f" ({check.reason})" if check.reason else ""))
        print(f"toolchain: tc-{where.toolchain} ({'current' if doc['toolchain_current'] else 'stale'})")
        if check.status == "missing":
            print("not cached; `kdajit cache why` explains what differs from the nearest entries")
        if check.meta:
            print("meta.json:")
            print("  " + json.dumps(check.meta, indent=1, sort_keys=True).replace("\n", "\n  "))
        elif "meta_raw" in doc:
            print("meta.json (unparsed): " + doc["meta_raw"][:400])
    return 0 if check.ok else 1


# -- why ---------------------------------------------------------------------------------------
_WEIGHTS = {"template": 100, "arch": 10, "spec": 5, "config": 3, "toolchain": 1}


def _diff_components(theirs: dict | None, ours: dict) -> dict:
    """What differs between two toolchain component dicts (None: the entry recorded none)."""
    if theirs is None:
        return {"toolchain.json": "missing in the entry's toolchain directory"}
    out = {}
    for name in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(name), ours.get(name)
        if a == b:
            continue
        if name == "kernel_src" and isinstance(a, dict) and isinstance(b, dict):
            out[name] = {f: ("changed" if f in a and f in b else "added" if f in b else "removed")
                         for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)}
        elif name == "dsl_stack" and isinstance(a, list) and isinstance(b, list):
            out[name] = {"entry": sorted(set(a) - set(b)), "now": sorted(set(b) - set(a))}
        else:
            out[name] = {"entry": a, "now": b}
    return out


def _differences(entry: Entry, key, fp: str, components: dict, tc_cache: dict) -> list[dict]:
    diffs = []
    meta_key = entry.meta.get("key") if entry.meta else None
    if not isinstance(meta_key, dict):
        return [{"part": "meta", "entry": "unreadable meta.json", "now": None}]
    wanted = key.to_json()
    if meta_key.get("template") != wanted["template"]:
        diffs.append({"part": "template", "entry": meta_key.get("template"), "now": wanted["template"]})
    if meta_key.get("arch") != wanted["arch"]:
        diffs.append({"part": "arch", "entry": meta_key.get("arch"), "now": wanted["arch"]})
    for name in sorted(set(meta_key) | set(wanted)):
        if name in ("template", "arch", "config"):
            continue
        if meta_key.get(name) != wanted.get(name):
            diffs.append({"part": "spec", "field": name, "entry": meta_key.get(name), "now": wanted.get(name)})
    their_cfg, our_cfg = meta_key.get("config"), wanted["config"]
    if not isinstance(their_cfg, dict):
        their_cfg = {"(unreadable)": their_cfg}
    for name in sorted(set(their_cfg) | set(our_cfg)):
        if their_cfg.get(name) != our_cfg.get(name):
            diffs.append({"part": "config", "field": name, "entry": their_cfg.get(name), "now": our_cfg.get(name)})
    if entry.toolchain != fp:
        tc = (entry.arch, entry.toolchain)
        if tc not in tc_cache:
            tc_cache[tc] = read_toolchain(entry.root, *tc)
        diffs.append({"part": "toolchain", "entry": f"tc-{entry.toolchain}", "now": f"tc-{fp}",
                      "components": _diff_components(tc_cache[tc], components)})
    return diffs


def _format_diff(d: dict) -> str:
    if d["part"] == "toolchain":
        bits = []
        for name, change in d["components"].items():
            if name == "kernel_src":
                bits.append("kernel sources " + ", ".join(f"{f} {c}" for f, c in change.items()))
            elif name == "dsl_stack":
                bits.append(f"dsl stack {' '.join(change['entry']) or '-'} -> {' '.join(change['now']) or '-'}")
            elif isinstance(change, dict):
                bits.append(f"{name} {change['entry']!r} -> {change['now']!r}")
            else:
                bits.append(f"{name}: {change}")
        return f"toolchain {d['entry']} -> {d['now']} ({'; '.join(bits) or 'components equal'})"
    label = d["part"] + (f".{d['field']}" if "field" in d else "")
    return f"{label}: entry has {d['entry']!r}, lookup wants {d['now']!r}"


def why(root: Path, target: str, arch: str | None, config, as_json: bool, limit: int = 3) -> int:
    """Explain a lookup: hit, present-but-rejected (and why), or miss with the nearest entries."""
    key = keyspec.parse_key(target, arch=arch, config=config)
    existing_root(root, "why")
    fp = toolchain_fingerprint()
    relpath = cache_layout.entry_relpath(key, fp)
    check = check_entry(root, relpath, expect_key=key, expect_fp=fp)
    doc = {"key": key.to_json(), "spec": key.spec_slug(), "relpath": relpath, "root": str(root),
           "toolchain": fp, "status": {"ok": "hit", "missing": "miss"}.get(check.status, "rejected"),
           "reason": check.reason, "nearest": []}
    unsupported = keyspec.unsupported(key)
    if unsupported:
        doc["status"], doc["reason"] = "unsupported", unsupported
    elif check.status == "missing":
        components = toolchain_components()
        tc_cache: dict = {}
        scored = []
        for e in iter_entries(root, fp):
            diffs = _differences(e, key, fp, components, tc_cache)
            score = sum(_WEIGHTS.get(d["part"], 50) for d in diffs)
            scored.append((score, e.relpath, diffs))
        scored.sort(key=lambda t: (t[0], t[1]))
        doc["nearest"] = [{"relpath": r, "score": s, "differences": d} for s, r, d in scored[:limit]]
        doc["fix"] = hints.precompile_command([key], root)
    if as_json:
        print(json.dumps(doc, indent=1))
        return 0 if check.ok else 1
    print(f"lookup:    {describe(key)}")
    print(f"entry:     {root / relpath}")
    if unsupported:
        print(f"result:    unsupported: {unsupported}; no kernel can be built for this key")
        return 1
    if check.ok:
        print("result:    hit (the entry verifies; a process with this environment loads it)")
        return 0
    if check.status != "missing":
        print(f"result:    present but rejected: {check.status} ({check.reason}); the runtime moves it to "
              f"quarantine and rebuilds it")
        return 1
    print("result:    miss (no entry at that path)")
    if not doc["nearest"]:
        print(f"nearest:   none; the cache under {root} is empty")
    for n in doc["nearest"]:
        print(f"nearest:   {n['relpath']}")
        for d in n["differences"] or [{"part": "none"}]:
            print("           - " + (_format_diff(d) if d["part"] != "none" else "no difference in the key"))
    print(f"fix:       {doc['fix']}")
    return 1


# -- verify ------------------------------------------------------------------------------------
def verify(root: Path, archs: list[str] | None, fix: bool, load: bool, as_json: bool) -> int:
    """Re-hash and re-parse every entry (each against its own toolchain) and every tuning record of the
    current toolchain; --fix quarantines bad entries and deletes bad records (data, not code)."""
    results = []
    for e in select_entries(existing_root(root, "verify"), archs):
        check = check_entry(root, e.relpath, expect_fp=e.toolchain)
        if not e.current and (check.status == "foreign" or check.reason.startswith("meta.json: unknown key")):
            # Another kdajit version's entry: its keys may not parse or map the same way here. It is
            # unreachable from this version (and the version that owns it verifies it at load).
            check = EntryCheck("unknown", f"another kdajit version's entry? {check.reason}", check.meta)
        if check.ok and load and e.current:
            check = _try_load(check)
        r = {"relpath": e.relpath, "status": check.status, "reason": check.reason, "moved_to": None}
        if check.bad and fix:
            moved = quarantine_entry(root, e.relpath, f"verify: {check.status}: {check.reason}")
            r["moved_to"] = str(moved) if moved else None
        results.append(r)
    results += tuning.verify_records(root, archs, fix)
    bad = [r for r in results if r["status"] not in ("ok", "unknown")]
    remaining = [r for r in bad if not r["moved_to"]]
    if as_json:
        print(json.dumps({"root": str(root), "checked": len(results), "ok": len(results) - len(bad),
                          "bad": len(bad), "fixed": len(bad) - len(remaining), "entries": results}, indent=1))
    else:
        for r in bad:
            where = f" -> moved to {r['moved_to']}" if r["moved_to"] else ""
            print(f"{r['status'].upper():10} {r['relpath']}: {r['reason']}{where}")
        print(f"verify: {len(results)} entries, {len(results) - len(bad)} ok, {len(bad)} bad"
              + (f", {len(bad) - len(remaining)} moved to quarantine" if fix else
                 (" (run with --fix to move them aside)" if bad else "")))
    return 1 if remaining else 0


def _try_load(check: EntryCheck) -> EntryCheck:
    """`check`, or "corrupt" when its verified object does not load."""
    from kdajit.cache_load import load_verified

    try:
        load_verified(check.artifact)
        return check
    except Exception as exc:  # noqa: BLE001 - reported
        return EntryCheck("corrupt", f"load_module failed: {type(exc).__name__}: {exc}", check.meta)
