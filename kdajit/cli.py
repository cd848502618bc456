"""The `kdajit` command (also `python -m kdajit`): precompile, cache inspection, env, demo.

    kdajit precompile [--arch sm_90a,sm_100a] [--beta bf16,fp32] [--varlen dense,cu32,cu64] [--kv 128]
                      [--chunk 32,64] [--qg off|on|both] [--only TEMPLATE,...] [--config warps=4] [-j N]
                      [--dry-run] [--json] [--cache-dir DIR]
    kdajit precompile --key KEY [--key KEY ...]
    kdajit tune --shape 2x8192x64 [--shape 64:1000,37,4096 ...] [--beta bf16,fp32] [--varlen cu32|cu64]
                [--qg off|on] [--force] [--json] [--cache-dir DIR]        (GPU: fills tuning records)
    kdajit cache ls [--arch A] [--spec S] [--stale | --current] [--json]      (kernels, then tuning records)
    kdajit cache show ENTRY_PATH|RECORD_PATH|KEY [--arch A] [--config C] [--json]
    kdajit cache why KEY [--arch A] [--config C] [--limit N] [--json]
    kdajit cache verify [--arch A] [--fix] [--load] [--json]
    kdajit cache prune [--stale] [--older-than 30d] [--max-size 5G] [--staging] [--quarantine] [--dry-run]
    kdajit cache clear [--arch A] [--spec S] --yes
    kdajit cache export OUT.tar[.gz] [--arch A] [--spec S] [--all-toolchains]
    kdajit cache import IN.tar[.gz] --sha256 HEX | --trust-unpinned-bundle [--world-readable]
    kdajit env [--json]
    kdajit demo [--lengths 1,63,700] [--heads 4] [--beta bf16|fp32] [--cache-dir DIR]
    kdajit --version

Every cache verb takes --cache-dir (default: KDAJIT_CACHE_DIR, else the platformdirs user cache
dir). KEY is a spec slug as `kdajit cache ls` prints it (e.g. akk_inverse.varlen-dense.chunk-64),
optionally `@arch`, or a key's JSON. Exit status: 0 success, 1 a failure or a finding (failed
compiles, bad entries, a miss in `why`), 2 a usage error.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kdajit
from kdajit import keys
from kdajit.cache_layout import cache_root
from kdajit.cache_tools import bundle, envinfo, inspection, keyspec, maintenance, precompile, tuning, units

_KEY_HELP = ("KEY: a spec slug as `kdajit cache ls` prints it, optionally @arch, e.g. "
             "akk_inverse.varlen-dense.chunk-64@sm_90a; or a key's JSON")


def _root(args: argparse.Namespace) -> Path:
    if args.cache_dir:
        root = Path(args.cache_dir).expanduser().absolute()
        if root.exists() and not root.is_dir():
            raise ValueError(f"--cache-dir {args.cache_dir}: {root} is a file, not a directory")
        return root
    root = cache_root()
    if root is None:
        raise ValueError("the disk cache is off (KDAJIT_CACHE=off); pass --cache-dir DIR")
    return root


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of worker processes (an integer >= 1)")
    return n


def _config(args: argparse.Namespace) -> str | None:
    return getattr(args, "config", None) or None


def precompile_keys(args: argparse.Namespace, check_supported: bool = True) -> list:
    """The distinct kernel keys that `kdajit precompile` args select; ValueError for a key that no
    template can build (so a bad --config fails here, and in --dry-run, not in every worker)."""
    from kdajit import compiler

    if args.key:
        chosen = [name for name in ("arch", "io", "beta", "varlen", "kv", "chunk", "only", "config")
                  if getattr(args, name)]
        if chosen:
            raise ValueError(f"--key names whole kernels; drop --{', --'.join(chosen)}")
        found = {k.canonical(): k for k in (keyspec.parse_key(w) for w in args.key)}
        selected = list(found.values())
    else:
        selected = _cross_product(args, compiler.current_arch)
    problems = sorted({p for p in map(keyspec.unsupported, selected) if p}) if check_supported else []
    if problems:
        raise ValueError("; ".join(problems))
    return selected


def _cross_product(args: argparse.Namespace, current_arch) -> list:
    archs = keyspec.split_words(args.arch) or [current_arch()]
    kvs = [keyspec.parse_kv(w) for w in keyspec.split_words(args.kv)] or [(d, d) for d in keys.HEAD_DIMS]
    chunks = []
    for w in keyspec.split_words(args.chunk):
        try:
            chunks.append(int(w))
        except ValueError:
            raise ValueError(f"--chunk {w!r} is not an integer") from None
    return keyspec.expand(
        archs=archs,
        betas=keyspec.split_words(args.beta) or list(keys.BETA_DTYPES),
        varlens=keyspec.split_words(args.varlen) or list(keys.VARLEN_MODES),
        kvs=kvs,
        chunks=chunks or list(keys.CHUNK_SIZES),
        qgs=list(keyspec.QG_CHOICES[args.qg]),
        only=keyspec.split_words(args.only) or None,
        configs=list(args.config or []) or None,
        ios=keyspec.split_words(args.io) or list(keys.IO_DTYPES),
        gates=list(keyspec.GATE_CHOICES[args.gate]),
    )


def _cmd_precompile(args: argparse.Namespace) -> int:
    key_list = precompile_keys(args)
    jobs = args.jobs or precompile.default_jobs()  # argparse refuses -j 0
    return precompile.run(key_list, _root(args), jobs, dry_run=args.dry_run, as_json=args.json,
                          progress=not args.no_progress)


def _cmd_tune(args: argparse.Namespace) -> int:
    from kdajit import env

    env.use_cache_dir(str(_root(args)))
    betas = keyspec.split_words(args.beta) or ["bf16"]
    for beta in betas:
        if beta not in keys.BETA_DTYPES:
            raise ValueError(f"--beta {beta!r} is not one of {', '.join(keys.BETA_DTYPES)}")
    head_dims = keyspec.parse_kv(args.kv)
    for name, dim in zip(("K", "V"), head_dims):
        if not keys.head_dim_supported(dim):
            raise ValueError(f"--kv {args.kv!r}: {name}={dim} is not supported; expected {keys.HEAD_DIM_RULE}")
    try:
        return tuning.run_tune(args.shape, betas, args.varlen, args.qg == "on", args.force, args.json,
                               not args.no_progress, args.io, head_dims, args.gate == "any")
    except RuntimeError as e:  # no GPU, a strict-bitwise mismatch: said in one line, not a traceback
        print(f"kdajit: error: {e}", file=sys.stderr)
        return 1


def _toolchain_filter(args: argparse.Namespace) -> str:
    return "stale" if args.stale else "current" if args.current else "all"


def _dispatch_cache(args: argparse.Namespace) -> int:
    root = _root(args)
    archs = keyspec.split_words(getattr(args, "arch", None)) or None
    verb = args.verb
    if verb == "ls":
        return inspection.ls(root, archs, args.spec, _toolchain_filter(args), args.json)
    if verb == "show":
        return inspection.show(root, args.target, args.arch_one, _config(args), args.json)
    if verb == "why":
        return inspection.why(root, args.key, args.arch_one, _config(args), args.json, limit=args.limit)
    if verb == "verify":
        return inspection.verify(root, archs, args.fix, args.load, args.json)
    if verb == "prune":
        if not (args.stale or args.older_than or args.max_size or args.staging or args.quarantine):
            raise ValueError("nothing to prune: pass --stale, --older-than, --max-size, --staging or --quarantine")
        return maintenance.prune(
            root, stale=args.stale, staging=args.staging, quarantine=args.quarantine, dry_run=args.dry_run,
            older_than=units.parse_duration(args.older_than) if args.older_than else None,
            max_size=units.parse_size(args.max_size) if args.max_size else None, as_json=args.json)
    if verb == "clear":
        if not args.yes:
            raise ValueError(f"`kdajit cache clear` deletes entries under {root}; add --yes to confirm")
        return maintenance.clear(root, archs=archs, spec=args.spec, as_json=args.json)
    if verb == "export":
        return bundle.export_bundle(root, Path(args.out), archs=archs, spec=args.spec,
                                    all_toolchains=args.all_toolchains, as_json=args.json)
    if verb == "import":
        return bundle.import_bundle(root, Path(args.bundle), sha256=args.sha256, trust_unpinned=args.trust_unpinned_bundle,
                                    world_readable=args.world_readable, as_json=args.json)
    raise AssertionError(verb)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="cache root (default: KDAJIT_CACHE_DIR, else the user cache dir)")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    parser = argparse.ArgumentParser(prog="kdajit", description="kdajit kernels: precompile, cache tools, env.")
    parser.add_argument("--version", action="version", version=f"kdajit {kdajit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("precompile", parents=[common], help="compile a cross product of specializations",
                       description="Compile every distinct kernel of the cross product into the cache; works "
                                   "without a GPU. Lists are comma-separated or repeated; each defaults to "
                                   "every supported value (--arch: the current arch).")
    p.add_argument("--arch", action="append", help=f"SM archs, of {', '.join(keys.ARCHS)}")
    p.add_argument("--io", action="append", help=f"q/k/v dtypes, of {', '.join(keys.IO_DTYPES)}")
    p.add_argument("--beta", action="append", help=f"beta dtypes, of {', '.join(keys.BETA_DTYPES)}")
    p.add_argument("--varlen", action="append", help=f"varlen modes, of {', '.join(keys.VARLEN_MODES)}")
    p.add_argument("--kv", action="append", help="head dims: K (V=K) or KxV, e.g. 128, 128x64 or 100 "
                   "(default: 64, 128, 256; any multiple of 4 up to 256)")
    p.add_argument("--chunk", action="append", help=f"chunk sizes, of {', '.join(map(str, keys.CHUNK_SIZES))}")
    p.add_argument("--qg", choices=sorted(keyspec.QG_CHOICES), default="both", help="output_qg variants")
    p.add_argument("--gate", choices=sorted(keyspec.GATE_CHOICES), default="both",
                   help="gate paths: safe (safe_gate=True), any (safe_gate=False) or both")
    p.add_argument("--only", action="append", help=f"only these kernels, of {', '.join(keys.KEY_TYPES)}")
    p.add_argument("--config", action="append", help="kernel config as field=value pairs, or 'ref' (default: the "
                                                     "reference configurations and the fused kernel's untuned one)")
    p.add_argument("--key", action="append", help=f"exactly this kernel (repeatable; not with the options above). "
                                                  f"{_KEY_HELP}")
    p.add_argument("-j", "--jobs", type=_jobs, help="worker processes, >= 1 (default: KDAJIT_COMPILE_WORKERS or 2)")
    p.add_argument("--dry-run", action="store_true", help="list the kernels and whether they are present")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_cmd_precompile)

    t = sub.add_parser("tune", parents=[common], help="tune the fused kernel for given shapes (needs a GPU)",
                       description="Guard (bitwise equality with the reference configuration), time and choose "
                                   "among the fused kernel's configurations for each shape, and store the "
                                   "records where `forward` finds them (KDAJIT_AUTOTUNE=cached, the default). "
                                   "See docs/tuning.md.")
    t.add_argument("--shape", action="append", required=True,
                   help="BxTxH (dense, e.g. 2x8192x64) or H:len,len,... (packed sequences); repeatable")
    t.add_argument("--beta", action="append", help=f"beta dtypes, of {', '.join(keys.BETA_DTYPES)} (default bf16)")
    t.add_argument("--varlen", choices=("cu32", "cu64"), default="cu32", help="cu_seqlens dtype of H:len shapes")
    t.add_argument("--qg", choices=("off", "on"), default="off", help="output_qg")
    t.add_argument("--io", choices=keys.IO_DTYPES, default="bf16", help="q/k/v dtype (default bf16)")
    t.add_argument("--kv", default="128", help="head dims: K (V=K) or KxV, e.g. 128, 64x128 or 100 (default 128; "
                   "any multiple of 4 up to 256)")
    t.add_argument("--gate", choices=("safe", "any"), default="safe",
                   help="gate path: safe (safe_gate=True, default) or any (safe_gate=False)")
    t.add_argument("--force", action="store_true", help="re-time every candidate, even ones already recorded")
    t.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    t.set_defaults(func=_cmd_tune)

    c = sub.add_parser("cache", help="inspect and maintain the kernel cache")
    verbs = c.add_subparsers(dest="verb", required=True)
    arch_help = f"only entries of these SM archs (comma-separated or repeated), of {', '.join(keys.ARCHS)}"
    v = verbs.add_parser("ls", parents=[common], help="table of entries")
    v.add_argument("--arch", action="append", help=arch_help)
    v.add_argument("--spec", help="substring of the spec slug")
    group = v.add_mutually_exclusive_group()
    group.add_argument("--stale", action="store_true", help="only entries of other toolchains")
    group.add_argument("--current", action="store_true", help="only entries of this toolchain")
    for name, helptext in (("show", "an entry's metadata and status"), ("why", "why a lookup misses")):
        v = verbs.add_parser(name, parents=[common], help=helptext, description=f"{helptext}. {_KEY_HELP}.")
        v.add_argument("target" if name == "show" else "key",
                       help=f"entry path or KEY ({_KEY_HELP})" if name == "show" else _KEY_HELP)
        v.add_argument("--arch", dest="arch_one", help="arch of KEY (default: the current arch)")
        v.add_argument("--config", help="config of KEY as field=value pairs (default: reference)")
        if name == "why":
            v.add_argument("--limit", type=int, default=3, help="nearest entries to show")
    v = verbs.add_parser("verify", parents=[common], help="re-hash and re-parse every entry")
    v.add_argument("--arch", action="append", help=arch_help)
    v.add_argument("--fix", action="store_true", help="move bad entries to quarantine/")
    v.add_argument("--load", action="store_true", help="also load current-toolchain objects (imports CuTe DSL)")
    v = verbs.add_parser("prune", parents=[common], help="delete stale, old or excess entries")
    v.add_argument("--stale", action="store_true", help="entries of other toolchains and old layouts")
    v.add_argument("--older-than", help="not used for this long: 30d, 12h, 90m")
    v.add_argument("--max-size", help="evict least recently used entries down to this size: 5G, 500M")
    v.add_argument("--staging", action="store_true", help="orphaned staging directories")
    v.add_argument("--quarantine", action="store_true", help="quarantined entries")
    v.add_argument("--dry-run", action="store_true")
    v = verbs.add_parser("clear", parents=[common], help="delete entries (all, or by --arch/--spec)")
    v.add_argument("--arch", action="append")
    v.add_argument("--spec", help="substring of the spec slug")
    v.add_argument("--yes", action="store_true", help="confirm")
    v = verbs.add_parser("export", parents=[common], help="write a relocatable bundle")
    v.add_argument("out", help="bundle path (.tar, or .tar.gz/.tgz to compress)")
    v.add_argument("--arch", action="append")
    v.add_argument("--spec", help="substring of the spec slug")
    v.add_argument("--all-toolchains", action="store_true", help="also entries of other toolchains")
    v = verbs.add_parser("import", parents=[common], help="verify and publish a bundle's entries",
                         description="Import a bundle's kernels. They are native code that runs in every process "
                                     "using this cache, so the bundle must be pinned by the sha256 that "
                                     "`kdajit cache export` printed for it.")
    v.add_argument("bundle")
    pin = v.add_mutually_exclusive_group()
    pin.add_argument("--sha256", help="the bundle's sha256 as printed by `kdajit cache export` (required)")
    pin.add_argument("--trust-unpinned-bundle", action="store_true",
                     help="import without a pinned sha256: the bundle's native code WILL RUN in every process "
                          "using this cache; only for a bundle you built or got over a trusted channel")
    v.add_argument("--world-readable", action="store_true",
                   help="files 0644, dirs 0755 (an image built as one user, run as another)")
    c.set_defaults(func=_dispatch_cache)

    e = sub.add_parser("env", parents=[common], help="paths, arch, toolchain and variables, for bug reports")
    e.set_defaults(func=lambda args: envinfo.run(
        Path(args.cache_dir).absolute() if args.cache_dir else cache_root(), args.json))

    sub.add_parser("demo", help="run the forward once (see `kdajit demo --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from kdajit import demo

        return demo.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kdajit: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kdajit: error: {e}", file=sys.stderr)
        return 1
