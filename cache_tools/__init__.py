"""Tools over the kdajit kernel cache, behind the `kdajit` command (`kdajit.cli`).

- `entries`: the (unverified) entries found under a cache root, for listings and filters
- `units`: sizes, durations and times as the verbs print and parse them
- `keyspec`: command-line words to kernel keys (precompile's cross product, `why`'s key syntax)
- `precompile`: compiling keys into the cache with a pool of GPU-blind worker processes
- `inspection`: `cache ls | show | why | verify`
- `maintenance`: `cache prune | clear` (and safe removal)
- `bundle`: `cache export | import`
- `envinfo`: `kdajit env`
"""
