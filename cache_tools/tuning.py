"""`kdajit tune` (GPU: fill tuning records) and the tuning-record views of `kdajit cache ls | show`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kdajit import cache_layout, tune_records
from kdajit.cache_toolchain import toolchain_fingerprint
from kdajit.cache_tools.units import print_table


def parse_shape(text: str) -> dict:
    """`BxTxH` (dense) or `H:len,len,...` (packed sequences) -> tune() arguments; ValueError otherwise."""
    try:
        if ":" in text:
            heads, lengths = text.split(":", 1)
            return {"batch": 1, "tokens": 0, "heads": int(heads), "lengths": tuple(int(n) for n in lengths.split(","))}
        batch, tokens, heads = (int(n) for n in text.lower().split("x"))
        return {"batch": batch, "tokens": tokens, "heads": heads, "lengths": None}
    except ValueError:
        raise ValueError(f"--shape {text!r} is not BxTxH (e.g. 2x8192x64) or H:len,len,... (e.g. 64:1000,37,4096)") \
            from None


def _bar(done: int, total: int, what: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<48}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def candidate_rows(record: tune_records.TuningRecord) -> list[list[str]]:
    ref = record.result(record.reference)
    rows = []
    for c in record.candidates:
        speed = f"{ref.ms / c.ms:.3f}x" if ref and ref.ms and c.ms else "-"
        mark = "winner" if c.config == record.winner else "reference" if c.config == record.reference else ""
        rows.append([c.config.slug(), c.guard, f"{c.ms:.4f}" if c.ms is not None else "-", speed, mark,
                     c.detail[:90]])
    return rows


def print_record(record: tune_records.TuningRecord, where: str = "") -> None:
    key = record.key
    print(f"record:  {where or record.key.name()}")
    print(f"spec:    {key.spec.fused_key().spec_slug()} ({key.spec.arch})")
    print(f"gpu:     {key.device}, {key.sms} SMs; bucket tokens<={key.bucket.tokens} heads={key.bucket.heads} "
          f"sequences<={key.bucket.seqs}; timed at {record.shape}")
    speedup = record.speedup
    print(f"winner:  {record.winner.slug()}" + (f", {speedup:.3f}x the reference" if speedup else ""))
    print_table(candidate_rows(record), ["CONFIG", "GUARD", "MS", "VS REF", "", "DETAIL"])


def run_tune(shapes: list[str], betas: list[str], varlen: str, output_qg: bool, force: bool, as_json: bool,
             progress: bool, io_dtype: str = "bf16", head_dims: tuple[int, int] = (128, 128),
             any_gate: bool = False) -> int:
    import kdajit
    from kdajit import env

    if env.cache_mode() != "rw":
        print(f"kdajit: warning: KDAJIT_CACHE={env.cache_mode()}: the records are kept by this process only, not "
              f"stored", file=sys.stderr)

    docs = []
    for beta in betas:
        for text in shapes:
            shape = parse_shape(text)
            mode = varlen if shape["lengths"] is not None else "dense"
            if not as_json:
                print(f"tuning {io_dtype} q/k/v, K = {head_dims[0]}, V = {head_dims[1]}, {beta} beta, {mode}, "
                      f"shape {text}, output_qg={output_qg}, safe_gate={not any_gate}", file=sys.stderr)
            record = kdajit.tune(shape["batch"], shape["tokens"], shape["heads"], beta_dtype=beta,
                                 varlen=mode, lengths=shape["lengths"], head_k=head_dims[0], head_v=head_dims[1],
                                 output_qg=output_qg, io_dtype=io_dtype, safe_gate=not any_gate, force=force,
                                 progress=_bar if progress and not as_json else None)
            docs.append(record.to_json())
            if not as_json:
                print_record(record)
                print()
    if as_json:
        print(json.dumps(docs, indent=1))
    return 0


def record_rows(root: Path) -> tuple[list[list[str]], list[dict]]:
    """(table rows, JSON docs) of every tuning record under `root`; unreadable ones say why."""
    fp = toolchain_fingerprint()
    rows, docs = [], []
    for where in cache_layout.record_paths(root):
        label = "current" if where.toolchain == fp else f"stale tc-{where.toolchain[:8]}"
        try:
            record = tune_records.load_record_file(root, where.relpath)
        except (OSError, ValueError) as e:
            rows.append([where.arch, label, where.spec, where.name, "(unreadable)", "-", str(e)[:60]])
            docs.append({"relpath": where.relpath, "error": str(e)})
            continue
        rejected = sum(c.guard == "mismatch" for c in record.candidates)
        speedup = record.speedup
        rows.append([where.arch, label, where.spec, where.name, record.winner.slug(),
                     f"{speedup:.3f}x" if speedup else "-", f"{rejected} rejected, tuned {record.created_at}"])
        docs.append({"relpath": where.relpath, **record.to_json()})
    return rows, docs


def show_record(root: Path, relpath: str, as_json: bool) -> int:
    record = tune_records.load_record_file(root, relpath)
    if as_json:
        print(json.dumps({"relpath": relpath, **record.to_json()}, indent=1))
    else:
        print_record(record, str(root / relpath))
    return 0


def verify_records(root: Path, archs: list[str] | None, fix: bool) -> list[dict]:
    """`kdajit cache verify`'s results for the tuning records of the current toolchain (a record of another
    toolchain is never read by this installation); with `fix`, a bad record is deleted."""
    fp = toolchain_fingerprint()
    results = []
    for where in cache_layout.record_paths(root):
        if where.toolchain != fp or archs and where.arch not in archs:
            continue
        r = {"relpath": where.relpath, "status": "ok", "reason": "", "moved_to": None}
        try:
            tune_records.load_record_file(root, where.relpath)
        except (OSError, ValueError) as e:
            r.update(status="bad-record", reason=str(e))
            if fix:
                (root / where.relpath).unlink(missing_ok=True)
                r["moved_to"] = "(deleted)"
        results.append(r)
    return results
